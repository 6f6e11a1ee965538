"""The pure parts of `saccade bench kill`: reading a run's metrics file the way a resumed run
must leave it, and comparing two runs' figures. (The bench itself is run, not tested: it takes
minutes; tests/test_kills.py kills real runs at chosen instants.)"""

from __future__ import annotations

import json

from saccade.tools.bench.kill import compare_metrics, folder_after_kill, kills_inside_a_write, metrics_lines


def _write(path, records, tail=b""):
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + tail)


def test_metrics_lines_reports_a_torn_line_and_a_step_logged_twice(tmp_path):
    rows = [{"step": 1, "phase": "train", "loss": 0.5}, {"step": 2, "phase": "train", "loss": 0.4}]
    _write(tmp_path / "metrics.jsonl", rows)
    assert metrics_lines(tmp_path) == (rows, [])

    _write(tmp_path / "metrics.jsonl", [*rows, rows[1]], tail=b'{"step": 3, "pha')
    records, problems = metrics_lines(tmp_path)
    assert len(records) == 3
    assert problems == ["the last line is torn", "line 4 does not parse", "logged twice: [(2, 'train')]"]


def test_compare_metrics_ignores_wall_clock_and_finds_a_changed_figure():
    a = [{"step": 1, "phase": "train", "loss": 0.5, "step_s": 1.0, "rss_mb": 900.0}]
    b = [{"step": 1, "phase": "train", "loss": 0.5, "step_s": 9.0, "rss_mb": 100.0}]
    assert compare_metrics(a, b)["n_differences"] == 0
    c = [{"step": 1, "phase": "train", "loss": 0.5001, "step_s": 1.0}]
    out = compare_metrics(c, b)
    assert out["n_differences"] == 1 and abs(out["largest_difference"] - 1e-4) < 1e-9
    assert compare_metrics(a, [])["differences"] == ["the steps logged differ"]


def test_folder_after_kill_sees_a_half_written_checkpoint_and_a_torn_line(tmp_path):
    (tmp_path / "checkpoints" / ".tmp-step_000003-12345").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"st')
    found = folder_after_kill(tmp_path)
    assert found == {"checkpoint_step": None, "half_written_folders": [".tmp-step_000003-12345"],
                     "torn_metrics_line": True}


def test_a_half_written_folder_found_again_after_the_next_kill_counts_once():
    events = [{"half_written_folders": []}, {"half_written_folders": [".tmp-step_000010-1"]},
              {"half_written_folders": [".tmp-step_000010-1"]}, {"half_written_folders": [".tmp-step_000018-2"]}]
    assert kills_inside_a_write(events) == 2
