"""The GPU figures carried from lease to lease: one JSON in the repository, and the table of
docs/gpu-runs.md written from it.

A GPU machine is lent for 15 minutes at a time, a fresh one each time, and a lease's command
returns only what it wrote under its output folder. So the figures of every lease are merged
here (`saccade bench gpu --record DIR`, on the machine that keeps the repository), each stage's
record with the device, date, commit and command that made it; the next lease's
`saccade bench gpu --lease` reads the file and starts with the stages it lacks. Five leases,
whenever they come, together cover every stage.

Merging keeps one record per stage: an `ok` record replaces any earlier one; a failed or
timed-out record replaces only a record that was not `ok` (a stage that once passed keeps its
figures, the later failure is kept beside them as `last_failure`, and the table shows both).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LEASE_SETTINGS = {"device": "cuda", "quick": False}  # what a lease's results are; --quick or a CPU's are not
DOC_BEGIN = "<!-- gpu-results: written by `saccade bench gpu --record DIR`, from docs/gpu-results.json; do not edit -->"
DOC_END = "<!-- end of gpu-results -->"


def empty(settings: dict[str, Any]) -> dict[str, Any]:
    return {"settings": dict(settings), "stages": {}}


def load(path: str | Path, *, settings: dict[str, Any] = LEASE_SETTINGS) -> dict[str, Any]:
    """The carried results at `path` (none yet: an empty record of `settings`)."""
    path = Path(path)
    if not path.exists():
        return empty(settings)
    data = json.loads(path.read_text())
    if set(data) != {"settings", "stages"} or not isinstance(data["stages"], dict):
        raise ValueError(f"{path} is not a bench-gpu results file (keys settings, stages)")
    return data


def save(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def is_done(record: dict[str, Any] | None) -> bool:
    """A stage a lease need not run again: it ran to its end and its check (if any) held."""
    return record is not None and record.get("status") == "ok" and record.get("check") != "failed"


def merge(carried: dict[str, Any], lease: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`carried` with a lease's records merged in (module docstring); the stages that changed.
    Refuses results of other settings than the carried file's (a --quick or CPU run is not a
    GPU figure)."""
    if lease.get("settings") != carried["settings"]:
        raise ValueError(f"the lease's results are of {lease.get('settings')}, the carried file's of "
                         f"{carried['settings']}: only `saccade bench gpu --lease` on a GPU is recorded there")
    out = {"settings": carried["settings"], "stages": dict(carried["stages"])}
    changed = []
    for name, record in lease["stages"].items():
        old = out["stages"].get(name)
        if record.get("finished") and old is not None and old.get("finished") == record.get("finished"):
            continue  # merged before
        if record.get("status") == "ok" or not (old and old.get("status") == "ok"):
            out["stages"][name] = record
        else:
            out["stages"][name] = {**old, "last_failure": {k: record.get(k) for k in
                                                           ("status", "error", "finished", "machine", "command")}}
        changed.append(name)
    return out, changed


def rewrite_doc(doc: str | Path, table: str) -> bool:
    """Put `table` between the markers in `doc`; whether the file changed. The markers must be
    there once each (the page says where the table goes)."""
    doc = Path(doc)
    text = doc.read_text()
    if text.count(DOC_BEGIN) != 1 or text.count(DOC_END) != 1:
        raise ValueError(f"{doc} must hold the lines {DOC_BEGIN!r} and {DOC_END!r} once each")
    head, rest = text.split(DOC_BEGIN)
    _, tail = rest.split(DOC_END)
    new = f"{head}{DOC_BEGIN}\n{table.rstrip()}\n{DOC_END}{tail}"
    if new != text:
        doc.write_text(new)
    return new != text
