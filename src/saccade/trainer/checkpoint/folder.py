"""What a checkpoint folder holds, and which of a run's step folders count.

The file names of both layouts (docs/checkpoints.md), the `COMPLETE` manifest written last and
checked on every read, the newest complete step (`latest_checkpoint`), the pruning of older ones,
and the record that readers loading no model use (`checkpoint_record`). No torch here.
"""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from saccade.atomic import fsync_tree, list_files, remove_dead_tmp_dirs, remove_dir

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "COMPLETE"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
DCP_DIR = "dcp"  # torch.distributed.checkpoint folder of a sharded save
DCP_METADATA = DCP_DIR + "/.metadata"
FORMAT_VERSION = 1  # the plain layout
DCP_FORMAT_VERSION = 2  # the sharded layout (state.json "checkpoint": {"format": 2, "layout": "dcp", ...})

STALLED_DIR = "checkpoints-stalled"  # a stalled run's checkpoints, set aside (set_aside_checkpoints)
PREVIOUS_DIR = "checkpoints-previous"  # an earlier run's, moved aside by a start with --fresh

_STEP_RE = re.compile(r"^step_(\d+)$")


def crc32(path: Path) -> str:
    """A file's CRC-32, as 8 hex digits: read at disk speed, and enough to tell a file changed
    since the save (a flipped bit, a same-size overwrite) from one intact."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def write_manifest(tmp: Path, step: int) -> None:
    fsync_tree(tmp)  # everything is on disk before COMPLETE says so
    files = sorted(list_files(tmp))
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files},
                "crc32": {str(p.relative_to(tmp)): crc32(p) for p in files}}
    (tmp / COMPLETE).write_text(json.dumps(manifest, indent=2) + "\n")


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete `step_*` directory with the highest step, or None."""
    complete = complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete `step_*` directory, oldest first."""
    return [(s, p) for s, p in step_dirs(Path(run_dir) / CHECKPOINTS_DIR) if (p / COMPLETE).is_file()]


def checkpoint_before(run_dir: Path, step: int) -> tuple[int, Path] | None:
    """(step, folder) of the newest complete checkpoint saved before `step`, or None."""
    older = [(s, p) for s, p in complete_checkpoints(run_dir) if s < step]
    return older[-1] if older else None


def set_aside_checkpoints(run_dir: Path, from_step: int) -> list[Path]:
    """Move the step folders of `from_step` and later (complete or not) into `run_dir/STALLED_DIR`,
    where neither --resume nor pruning looks, and return where they went. A stalled run's
    (saccade.loops.stall): kept for a person to look at, never resumed from by accident."""
    moved = []
    for s, p in step_dirs(Path(run_dir) / CHECKPOINTS_DIR):
        if s < from_step:
            continue
        aside = Path(run_dir) / STALLED_DIR / p.name
        n = 1
        while aside.exists():  # a second stall over the same steps (after a --resume) keeps both
            aside = aside.with_name(f"{p.name}.{n}")
            n += 1
        aside.parent.mkdir(parents=True, exist_ok=True)
        p.rename(aside)
        moved.append(aside)
    return moved


def start_afresh(run_dir: Path, *, fresh: bool, stamp: str) -> list[Path]:
    """A new run (no --resume) in `run_dir`: refused while the folder holds another run's step
    folders, complete or not, which the new run would write over one by one (and a later
    --resume would load the old run's newer steps); with `fresh` they are moved to
    `run_dir/PREVIOUS_DIR/stamp/` first. Returns where they went."""
    found = step_dirs(Path(run_dir) / CHECKPOINTS_DIR)
    if not found:
        return []
    names = ", ".join(p.name for _, p in found[-3:]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
    if not fresh:
        raise ValueError(f"{run_dir} holds another run's checkpoints ({names}): go on with that run with --resume, "
                         f"start this one in another folder (--log.dir), or pass --fresh to move them to "
                         f"{Path(run_dir) / PREVIOUS_DIR / stamp}/ first")
    aside = Path(run_dir) / PREVIOUS_DIR / stamp
    aside.mkdir(parents=True, exist_ok=True)
    moved = []
    for _, p in found:
        p.rename(aside / p.name)
        moved.append(aside / p.name)
    return moved


def check_same_base(path: Path, model_path: str) -> None:
    """A ValueError when checkpoint `path` was trained from another base model than `model_path`
    (its state.json's base_model_path; checkpoints that did not record it pass), saying both."""
    try:
        saved = json.loads((path / STATE_FILE).read_text()).get("checkpoint", {}).get("base_model_path")
    except (OSError, ValueError):
        return  # an unreadable checkpoint: its load says what is wrong, and the one before it is tried
    if saved is None or _same_path(saved, model_path):
        return
    raise ValueError(f"--resume: {path} was trained from base model {saved}, but this config's model is "
                     f"{model_path}: resume with --model.path {saved}, or start a new run in another folder")


def _same_path(a: str, b: str) -> bool:
    """Two model names or folders are the same: equal, or the same folder on this machine."""
    if a == b:
        return True
    try:
        return Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def check_complete(path: Path, *, contents: bool = False) -> dict:
    """The manifest of a complete checkpoint folder, its files all there at their saved sizes;
    with `contents`, also their saved CRC-32s (checkpoints from before they were recorded: sizes
    only). ValueError, saying what is wrong, otherwise."""
    if not path.is_dir():
        raise ValueError(f"no checkpoint directory at {path}")
    if not (path / COMPLETE).is_file():
        raise ValueError(f"{path} has no {COMPLETE} marker: an unfinished save, or not a checkpoint")
    try:
        manifest = json.loads((path / COMPLETE).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}/{COMPLETE} is not a checkpoint manifest: {e}") from e
    missing = [f for f in files if not (path / f).is_file()] + [STATE_FILE] * (STATE_FILE not in files)
    if missing:
        raise ValueError(f"checkpoint {path} is missing files: {missing}")
    truncated = [f for f, size in files.items() if (path / f).stat().st_size != size]
    if truncated:
        raise ValueError(f"checkpoint {path} has files whose size changed since the save: {truncated}")
    if contents:
        changed = [f for f, saved in manifest.get("crc32", {}).items() if crc32(path / f) != saved]
        if changed:
            raise ValueError(f"checkpoint {path} has files whose contents changed since the save (CRC-32): {changed}")
    return manifest


def checkpoint_record(path: Path | str) -> dict:
    """What a complete checkpoint folder holds, for readers that load no model (`saccade export`):
    its `state.json` "checkpoint" record with `kind` ("lora" or "full"), `layout` ("plain" or
    "dcp") and `base_model_path` (None when the save did not know it) always present.
    ValueError for a folder that is not a complete checkpoint."""
    path = Path(path)
    manifest = check_complete(path)
    info = json.loads((path / STATE_FILE).read_text()).get("checkpoint", {})
    kind = info.get("kind") or ("lora" if (path / ADAPTER_DIR).is_dir() else "full")
    layout = "dcp" if DCP_METADATA in manifest["files"] else "plain"
    return {**info, "kind": kind, "layout": layout, "base_model_path": info.get("base_model_path")}


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


def prune(root: Path, saved_step: int, keep_last: int) -> None:
    """Delete step dirs older than the newest `keep_last` (the one just saved counts), and dead `.tmp-*`.

    Steps newer than the one just saved (a run resumed from an earlier checkpoint) are left alone.
    """
    older = [(s, p) for s, p in step_dirs(root) if s < saved_step]
    complete_older = [p for _, p in older if (p / COMPLETE).is_file()]
    keep = set(complete_older[max(0, len(complete_older) - (keep_last - 1)) :]) if keep_last > 1 else set()
    for _, p in older:  # incomplete older step dirs are garbage too
        if p not in keep:
            remove_dir(p)
    remove_dead_tmp_dirs(root)
