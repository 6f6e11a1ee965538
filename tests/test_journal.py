"""saccade.journal: a run folder's JSONL files, one fsync'd line per record, cut back to a step on resume."""

from __future__ import annotations

import json
import os
import warnings

import pytest

import saccade.journal as journal_mod
from saccade.journal import Journal, read_jsonl


def lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def test_each_record_is_one_line_flushed_and_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(journal_mod.os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    with Journal(tmp_path / "run" / "x.jsonl") as journal:
        assert not journal.path.exists()  # opened at the first record
        for step in (1, 2, 3):
            journal.append({"step": step, "x": step / 2})
            assert len(read_jsonl(journal.path)) == step  # readable before close
    assert len(synced) == 3
    assert lines(journal.path) == [json.dumps({"step": s, "x": s / 2}) for s in (1, 2, 3)]


def test_open_creates_the_file_before_any_record(tmp_path):
    journal = Journal(tmp_path / "x.jsonl")
    journal.open()
    assert journal.path.read_bytes() == b""
    journal.close()


def test_ascii_or_not_and_never_nan(tmp_path):
    ascii_only, plain = Journal(tmp_path / "a.jsonl"), Journal(tmp_path / "b.jsonl", ensure_ascii=False)
    for journal in (ascii_only, plain):
        journal.append({"step": 1, "detail": "größer"})
        journal.close()
    assert lines(ascii_only.path) == ['{"step": 1, "detail": "gr\\u00f6\\u00dfer"}']
    assert lines(plain.path) == ['{"step": 1, "detail": "größer"}']
    with pytest.raises(ValueError):  # JSON has no NaN: the writer writes null
        ascii_only.append({"step": 2, "x": float("nan")})


def test_repair_cuts_a_torn_last_line_and_leaves_whole_ones(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n{"step": 3, "x": 0.')
    journal = Journal(path)
    journal.repair()
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    journal.repair()  # whole lines: nothing to cut
    assert path.read_bytes() == b'{"step": 1}\n{"step": 2}\n'
    path.write_bytes(b'{"ste')  # no whole line at all
    journal.repair()
    assert path.read_bytes() == b""
    Journal(tmp_path / "absent.jsonl").repair()
    assert not (tmp_path / "absent.jsonl").exists()


def test_truncate_after_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    journal = Journal(tmp_path / "x.jsonl")
    for step in (1, 2, 2, 3, 4):
        journal.append({"step": step})
    journal.append({"note": "no step: kept"})
    with open(journal.path, "ab") as f:
        f.write(b'{"step": 5, "x"')  # a kill mid-line
    kept, dropped = journal.truncate_after(2)
    assert [r.get("step") for r in kept] == [1, 2, 2, None] and dropped == 2
    journal.append({"step": 3})  # an open journal appends to the rewritten file
    journal.close()
    assert [r.get("step") for r in read_jsonl(journal.path)] == [1, 2, 2, None, 3]
    assert not journal.path.with_name("x.jsonl.tmp").exists()
    absent = Journal(tmp_path / "absent.jsonl")
    assert absent.truncate_after(3) == ([], 0) and not absent.path.exists()


def test_set_aside_moves_an_earlier_runs_file_to_the_first_free_number(tmp_path):
    journal = Journal(tmp_path / "x.jsonl")
    assert journal.set_aside() is None  # nothing there
    journal.path.write_text("")
    assert journal.set_aside() is None and journal.path.exists()  # empty: nothing to keep
    for n in (1, 2):
        journal.path.write_text(f'{{"run": {n}}}\n')
        assert journal.set_aside() == tmp_path / f"x.jsonl.{n}"
    assert not journal.path.exists() and read_jsonl(tmp_path / "x.jsonl.2") == [{"run": 2}]


def test_read_jsonl_skips_a_torn_last_line_silently_and_a_broken_one_loudly(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "x": 0.')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what a kill leaves: no warning
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{garbage\n[1, 2]\n{"step": 2}\n')
    with pytest.warns(RuntimeWarning, match="unreadable line") as caught:
        assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    assert len(caught) == 2  # the broken line, and a line that is not an object
