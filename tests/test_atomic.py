"""Folders written whole or not at all (`saccade.atomic`), without a checkpoint around them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import saccade.atomic
from saccade.atomic import atomic_dir, remove_dead_tmp_dirs, write_file_atomically


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("exchange", [True, False])
def test_a_folder_appears_whole_and_replaces_the_old_one_whole(exchange, tmp_path, monkeypatch):
    if not exchange:  # the fallback for filesystems without renameat2(RENAME_EXCHANGE)
        monkeypatch.setattr(saccade.atomic, "_exchange", lambda a, b: False)
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        assert not final.exists()  # nothing under the name until the folder is complete
        (tmp / "a.txt").write_text("one")
    assert sorted(p.name for p in final.iterdir()) == ["a.txt"]
    with atomic_dir(final) as tmp:
        (tmp / "b.txt").write_text("two")
        assert (final / "a.txt").read_text() == "one"  # the old folder stays readable meanwhile
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or set-aside folder left


def test_a_write_that_fails_leaves_the_old_folder_and_no_temp_folder(tmp_path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(OSError, match="disk full"), atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("half")
        raise OSError("disk full")
    assert (final / "a.txt").read_text() == "one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_file_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "pids.json"
    write_file_atomically(path, b"old")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_file_atomically(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["pids.json"]


def test_only_the_temp_folders_of_dead_writers_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    for name in (f".tmp-out-{dead}", f".tmp-out-{alive}", f".tmp-other-{dead}", "out", ".tmp-no-pid"):
        (tmp_path / name).mkdir()
    # Asked about one name only: another name's dead folder is left alone (a folder not ours).
    assert remove_dead_tmp_dirs(tmp_path, "out") == [tmp_path / f".tmp-out-{dead}"]
    assert remove_dead_tmp_dirs(tmp_path) == [tmp_path / f".tmp-other-{dead}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-no-pid", f".tmp-out-{alive}", "out"]
