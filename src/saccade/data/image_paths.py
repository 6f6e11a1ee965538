"""Which image files a data set's rows may name: those below the data set's own folder (or
`task.image_root`), symlinks resolved, and none for a hub data set. Otherwise a row could have
the trainer open any file it can read (`/etc/passwd`, a key, another user's data) and show it
to the model, and to samples.jsonl. A refused row is skipped as `image_outside_dataset` and
counted like every broken row (saccade.data.rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from saccade.data.rows import RowSkipped

MAX_DICT_DEPTH = 4  # as saccade.data.images unwraps them


def local_file_of(value: Any) -> str | None:
    """The local file an image reference would open (a path, a file:// URL, a datasets Image
    dict without bytes), or None for inline images (bytes, data: URLs, PIL) and remote URLs."""
    for _ in range(MAX_DICT_DEPTH):  # the dict layouts load_image unwraps, in its order
        if not isinstance(value, dict):
            break
        if "bytes" in value or "path" in value:
            if value.get("bytes") is not None:
                return None
            value = value.get("path")
        else:
            value = next((value[k] for k in ("url", "image_url", "image") if k in value), None)
    if not isinstance(value, str | Path):
        return None
    text = str(value)
    head = text[:16].lower()
    if head.startswith("file:"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(text).path)
    if head.startswith("data:") or "://" in text:
        return None
    return text


def check_image_location(value: Any, root: Path | None, where: str) -> None:
    """A row may name image files below its data set's folder (or task.image_root) only, symlinks
    resolved: a hub data set's row (root None) none at all. Otherwise a row could have the
    trainer open any file it can read, and show it to the model (and to samples.jsonl)."""
    path = local_file_of(value)
    if path is None:
        return
    real = Path(path).resolve()  # as load_image opens it: relative to the working folder
    if root is None or not real.is_relative_to(root.resolve()):
        where_from = "a hub data set's row names a local file" if root is None else "outside the data set's folder"
        raise RowSkipped("image_outside_dataset", f"{where}: {path[:120]!r} is {where_from}; image files are read "
                         "only from below the data set's own folder or task.image_root")
