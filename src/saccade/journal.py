"""A run folder's JSONL journal: one JSON object a line, each line appended in one write,
flushed and fsync'd, so a run killed at any moment loses at most the line being written.

The run's record files are journals: metrics.jsonl and samples.jsonl (`saccade.metrics`),
skipped.jsonl (`saccade.data.rows`). Each writer says what it does at the start:

- a fresh run sets an earlier run's file aside as `NAME.1` (`.2`, ...): `set_aside`;
- a resumed run cuts a half-written last line (`repair`), then drops the lines of the steps
  after the checkpoint it restarts from (`truncate_after`), so the file has no line twice and
  none of a step that was never saved; the rewrite is atomic (a temp file, fsync'd, renamed).

Every line holds its `step` (the number metrics.jsonl gives it), which is what truncation reads.
A torn last line is what a kill leaves; `read_jsonl` skips it silently, and any other
unreadable line with a warning.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import IO, Any

from saccade.atomic import write_file_atomically


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL file, in file order. A truncated last line (a kill mid-write) is
    skipped silently; an unreadable line elsewhere is skipped with a warning."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    records: list[dict[str, Any]] = []
    for i, raw in enumerate(lines):
        raw = raw.strip()
        if not raw:
            continue
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if i != len(lines) - 1:  # the last piece has no newline after it: a torn write
                warnings.warn(f"{path}:{i + 1}: skipping an unreadable line ({e})", RuntimeWarning, stacklevel=3)
            continue
        records.append(record)
    return records


class Journal:
    """Appends JSON lines to `path` (opened at the first `append`, or by `open`), each one
    flushed and fsync'd. `ensure_ascii`: escape non-ASCII characters (json.dumps's option);
    NaN and infinity are refused (JSON has none: write null)."""

    def __init__(self, path: str | os.PathLike, *, ensure_ascii: bool = True) -> None:
        self.path = Path(path)
        self.ensure_ascii = ensure_ascii
        self._file: IO[bytes] | None = None

    def line(self, record: dict[str, Any]) -> bytes:
        return json.dumps(record, ensure_ascii=self.ensure_ascii, allow_nan=False).encode() + b"\n"

    # -- at the start of a run -------------------------------------------------------------------

    def set_aside(self) -> Path | None:
        """Move a previous run's non-empty file to the first free `NAME.N`; where it went, or
        None when there was nothing to move."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return None
        n = 1
        while (kept := self.path.with_name(f"{self.path.name}.{n}")).exists():
            n += 1
        os.replace(self.path, kept)
        return kept

    def repair(self) -> None:
        """Cut a half-written last line (no trailing newline), so that appending does not glue
        the next record onto it."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if not data or data.endswith(b"\n"):
            return
        cut = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
        with open(self.path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())

    def truncate_after(self, step: int) -> tuple[list[dict[str, Any]], int]:
        """Drop every record with a numeric step > `step` (and a torn last line), rewriting the
        file atomically; the records kept and how many were dropped. A file that is not there
        stays absent. An open journal appends to the rewritten file afterwards."""
        if not self.path.exists():
            return [], 0
        was_open = self._file is not None
        self.close()
        records = read_jsonl(self.path)
        kept = [r for r in records if not (isinstance(r.get("step"), (int, float)) and r["step"] > step)]
        write_file_atomically(self.path, b"".join(self.line(r) for r in kept))
        if was_open:
            self.open()
        return kept, len(records) - len(kept)

    # -- appending ------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the file now (appending to what is there), before the first line."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: a write that fails (a full disk) leaves nothing behind in a buffer for
            # close() to fail on again, masking the error the run reported.
            self._file = open(self.path, "ab", buffering=0)

    def append(self, record: dict[str, Any]) -> None:
        """One JSON line written and fsync'd: a kill leaves at most this line torn (`repair`)."""
        self.open()
        assert self._file is not None
        rest = memoryview(self.line(record))
        while rest:  # a raw write may take part of it
            rest = rest[self._file.write(rest):]
        os.fsync(self._file.fileno())

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
