"""Folders and files written whole or not at all: a crash leaves the old one or the new one, never half of either.

Everything is written into `.tmp-<name>-<pid>/` beside the final folder, fsynced, then renamed to
its name in one step (`atomic_dir`). Replacing a folder that exists swaps the two atomically (Linux
`renameat2(RENAME_EXCHANGE)`), falling back to rename-aside-then-rename where that is not
supported. A writer killed mid-write leaves at worst a `.tmp-*` folder, which
`remove_dead_tmp_dirs` deletes once the pid that wrote it is gone (pids are per machine: on a
filesystem shared between machines a live writer elsewhere could look dead). Used by the
checkpoints (`saccade.trainer.checkpoint.saving`) and the engine and export weights
(`saccade.trainer.checkpoint.engine_weights`).

A file is rewritten the same way (`write_file_atomically`: a temp file beside it, fsynced, renamed
over it): how a resumed run's JSONL journals drop their later steps (`saccade.journal`). The
fsync helpers here are the package's only ones.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

_TMP_RE = re.compile(r"^\.tmp-.*-(\d+)$")


def remove_dead_tmp_dirs(folder: Path, name: str | None = None) -> list[Path]:
    """Delete the `.tmp-*-<pid>` folders in `folder` whose writer is gone: what a save or an
    export killed mid-write leaves behind. `name`: only the temp folders of `folder/name` (in a
    folder that is not ours, leave everything else alone). Returns what was removed."""
    removed = []
    for p in Path(folder).iterdir() if Path(folder).is_dir() else ():
        m = _TMP_RE.match(p.name)
        if name is not None and not (m and p.name == f".tmp-{name}-{m.group(1)}"):
            continue
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def remove_dir(p: Path) -> None:
    # Rename first (atomic), so a crash mid-delete never leaves a half-deleted step_* dir.
    trash = p.with_name(f".tmp-del-{p.name}-{os.getpid()}")
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fresh_tmp(final: Path) -> Path:
    """An empty `.tmp-<name>-<pid>` folder beside `final` (the pid lets a later save tell a dead one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


@contextmanager
def atomic_dir(final: Path):
    """A fresh `.tmp-<name>-<pid>` folder beside `final` to write into. On a clean exit it is
    fsynced and published as `final` in one step; on any error it is removed, and `final`
    is left as it was."""
    tmp = fresh_tmp(final)
    try:
        yield tmp
        fsync_tree(tmp)
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing an existing `final` atomically where possible."""
    if not final.exists():
        os.replace(tmp, final)
    else:
        if _exchange(tmp, final):
            old = tmp  # now holds the previous contents
        else:
            old = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    fsync_file(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace `path`'s contents with `data` in one step: written to `NAME.tmp` beside it,
    fsynced, renamed over it, and the rename made durable; a write that fails removes `NAME.tmp`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: no half-written NAME.tmp is left beside it
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in `folder` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def list_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for p in list_files(root):
        fsync_file(p)
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_file(d)
    fsync_file(root)
