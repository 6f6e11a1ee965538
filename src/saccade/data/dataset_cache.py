"""Where `datasets` keeps its Arrow copy of a local data set: one folder per resolved path and
per state of the files, never shared by two folders that merely have the same name.

`datasets` caches a local folder under ``<cache>/<folder name>/<config>/<version>/<hash>``, and
when the folder's README.md names each config's files, the hash covers those file *patterns*
only: not the folder's path, not the files' contents (datasets 5.2, `LocalDatasetModuleFactory`
hashes the unresolved patterns and `create_config_id` keeps the config's bare name). So
``run1/data`` and ``run2/data`` shared one entry and the second read the first's rows, in the
same process and in every later one; a file rewritten in place was served stale as well. The
split names `get_dataset_split_names` reports come out of the same entry.

The cure is the documented knob: every local source (folder, file or glob) is read through its
own ``cache_dir``, a folder under the `datasets` cache named by a key of its resolved path and
each file's (relative path, size, mtime_ns). Another folder, an edited file, an added or removed
file: another key, a fresh conversion. A hub id keeps `datasets`' own cache (keyed by repository
and revision), and its call is made exactly as before.

What a stat cannot tell apart: a file rewritten with other bytes of the same size within one
tick of the filesystem's clock (a few milliseconds), or given back its old mtime on purpose
(``touch -d``). Hashing every byte would catch those, at the cost of reading the whole data set
(gigabytes of images) at every start. Each new key is converted once; old entries stay on disk
until removed (``<cache>/saccade-local``).
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path

__all__ = ["LOCAL_CACHE_FOLDER", "cache_options", "local_cache_dir", "source_files", "source_key"]

LOCAL_CACHE_FOLDER = "saccade-local"  # under the `datasets` cache (HF_DATASETS_CACHE)
GLOB_CHARACTERS = ("*", "?", "[")


def is_local_source(source: str) -> bool:
    """Whether `datasets` reads `source` from this machine: a folder (its own test, `isdir`),
    a data file, or a glob of them. Anything else is a hub id."""
    return os.path.isdir(source) or os.path.isfile(source) or any(c in source for c in GLOB_CHARACTERS)


def source_files(source: str) -> list[Path]:
    """Every file `datasets` may read for `source`, resolved: all the files below a folder (its
    README.md and data files, whichever configs name them; hidden names skipped, as `datasets`
    skips them), the file itself, or the files a glob matches."""
    if not os.path.isdir(source):
        return sorted(Path(p).resolve() for p in glob.glob(os.path.expanduser(source), recursive=True)
                      if os.path.isfile(p))
    files: list[Path] = []
    seen: set[Path] = set()  # folders by their real path: a symlink loop is walked once
    folders = [Path(source).resolve()]
    while folders:
        folder = folders.pop()
        if folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        for entry in os.scandir(folder):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():  # a symlinked folder is followed: its files are the data set's too
                folders.append(Path(entry.path))
            elif entry.is_file():
                files.append(Path(entry.path))
    return sorted(files)


def source_key(source: str) -> str:
    """A key of `source`'s resolved path and of each file's (path, size, mtime_ns): equal for
    the same files in the same state, different for another folder or any edit."""
    root = Path(os.path.expanduser(source)).resolve()
    digest = hashlib.sha256(str(root).encode())
    for path in source_files(source):
        stat = path.stat()
        digest.update(f"\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def local_cache_dir(source: str, cache_root: str | Path) -> Path | None:
    """The cache folder `datasets` should use for `source` (`cache_root`: the `datasets` cache):
    ``<cache_root>/saccade-local/<name>-<key>``; None for a hub id."""
    if not is_local_source(source):
        return None
    name = Path(source.split("*", 1)[0]).name or "data"  # the readable part; the key tells them apart
    return Path(cache_root) / LOCAL_CACHE_FOLDER / f"{name}-{source_key(source)}"


def cache_options(source: str) -> dict[str, str]:
    """The keyword arguments that give a local `source` its own cache, for `load_dataset` and
    `get_dataset_split_names` alike; none for a hub id, whose call stays as `datasets` has it."""
    import datasets

    folder = local_cache_dir(source, datasets.config.HF_DATASETS_CACHE)
    return {} if folder is None else {"cache_dir": str(folder)}
