"""`saccade demo --seeds`: each seed run in turn in its own folder, every seed reported with
the worst, the JSON's list, and a miss by any seed failing the command. The runner here is a
function of the seed (the real demos take minutes a seed; tests/tools/test_demo.py runs the real one)."""

from __future__ import annotations

import argparse
import json

import pytest

from saccade.cli.demos import Demo, parse_seeds, run_and_report, seed_table
from saccade.tools.demo import load_demo_config, verdict


def test_seeds_parse_and_bad_lists_are_refused_with_an_example():
    assert parse_seeds("0,1,2,3") == [0, 1, 2, 3]
    assert parse_seeds("7") == [7]
    for bad in ("0,x", "", "1,1"):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            parse_seeds(bad)


def figures(cfg) -> dict:
    """A shapes demo's figures that depend on the seed: seed 2 does not learn."""
    seed = cfg.trainer.seed
    return {"accuracy_before": 0.33, "accuracy_after": 0.5 if seed == 2 else 0.95 - 0.01 * seed,
            "control_accuracy_after": 0.34, "visual_gain_after": 0.6, "control_visual_gain": 0.0, "chance": 1 / 3,
            "minutes": 1.0, "run_dir": str(cfg.run_dir)}


SHAPES = Demo(lambda overrides, path: load_demo_config(overrides, path), figures, lambda r: "", verdict, "ok",
              ("accuracy_after", "accuracy_before", "control_accuracy_after"))


def args_for(tmp_path, seeds):
    return argparse.Namespace(overrides=["--log.dir", str(tmp_path / "run")], config=None, seeds=seeds,
                              dry_run=False, engine="embedded", json=str(tmp_path / "demo.json"))


def test_every_seed_runs_in_its_own_folder_and_a_miss_by_one_fails_the_demo(tmp_path, capsys):
    assert run_and_report(args_for(tmp_path, [0, 1, 2, 3]), SHAPES) == 1
    out = capsys.readouterr().out
    entries = json.loads((tmp_path / "demo.json").read_text())["seeds"]
    assert [e["seed"] for e in entries] == [0, 1, 2, 3]
    assert [e["run_dir"] for e in entries] == [str(tmp_path / "run" / f"seed{s}") for s in range(4)]
    assert all(e["server_start_minutes"] == 0.0 for e in entries)
    assert "worst seed: 2 (accuracy_after 0.500)" in out
    assert "seed 2: accuracy_after 0.50 < 0.9" in out and "seed 1:" not in out.split("missed its bar")[1]
    assert [line.split()[-1] for line in out.splitlines() if line[:4].strip().isdigit()] == ["met", "met", "MISSED", "met"]


def test_seeds_that_all_meet_the_bar_pass_and_one_seed_keeps_todays_json(tmp_path, capsys):
    assert run_and_report(args_for(tmp_path, [0, 1]), SHAPES) == 0
    assert "every seed: 0, 1" in capsys.readouterr().out
    assert run_and_report(args_for(tmp_path, None), SHAPES) == 0
    single = json.loads((tmp_path / "demo.json").read_text())
    assert "seeds" not in single and single["run_dir"] == str(tmp_path / "run")  # no seed folder


def test_the_table_names_the_worst_seed_by_the_first_column():
    rows = [{"seed": 0, "accuracy_after": 0.9, "accuracy_before": 0.3, "control_accuracy_after": 0.3, "minutes": 1.0,
             "chance": 1 / 3, "visual_gain_after": 0.6, "control_visual_gain": 0.0},
            {"seed": 5, "accuracy_after": 0.8, "accuracy_before": 0.3, "control_accuracy_after": 0.3, "minutes": 1.0,
             "chance": 1 / 3, "visual_gain_after": 0.5, "control_visual_gain": 0.0}]
    assert seed_table(rows, SHAPES).splitlines()[-1] == "worst seed: 5 (accuracy_after 0.800)"
