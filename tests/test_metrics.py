"""MetricsLogger: fsync'd JSONL lines, NaN -> null, torn-line tolerance, resume truncation, and
optional W&B / TensorBoard mirrors that degrade to a warning when not installed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from saccade import metrics as metrics_mod
from saccade.metrics import METRICS_FILE, MetricsLogger, format_step, read_metrics, to_scalar

SRC = Path(__file__).resolve().parents[1] / "src"


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_log_writes_json_lines_with_converted_values(tmp_path):
    with MetricsLogger(tmp_path) as lg:
        rec = lg.log(
            1,
            {
                "reward_mean": torch.tensor(0.5),
                "kl": torch.tensor([0.25], dtype=torch.bfloat16),
                "acc": np.float32(0.75),
                "np0d": np.array(2.5),
                "tokens": torch.tensor(7),
                "n": 3,
                "flag": True,
                "loss": float("nan"),
                "ratio": torch.tensor(float("inf")),
                "missing": None,
            },
        )
        lg.log(2, {"loss": 1.5, "reward_mean": torch.tensor(float("nan"), requires_grad=True)})
        lg.log(2, {"accuracy": 0.5}, phase="eval")

    lines = _lines(tmp_path)
    assert len(lines) == 3
    first = lines[0]
    assert set(first) >= {"step", "phase", "time", "elapsed_s"}
    assert first["step"] == 1 and first["phase"] == "train"
    assert abs(first["time"] - __import__("time").time()) < 60 and first["elapsed_s"] >= 0
    assert first["reward_mean"] == 0.5 and isinstance(first["reward_mean"], float)
    assert first["kl"] == 0.25 and first["acc"] == 0.75 and first["np0d"] == 2.5
    assert first["tokens"] == 7 and isinstance(first["tokens"], int)
    assert first["n"] == 3 and first["flag"] == 1
    assert first["loss"] is None and first["ratio"] is None and first["missing"] is None
    assert rec == first  # log returns the record as written
    assert lines[1]["reward_mean"] is None and lines[1]["loss"] == 1.5
    assert lines[2]["phase"] == "eval" and lines[2]["accuracy"] == 0.5
    assert lines[0]["time"] <= lines[1]["time"] and lines[0]["elapsed_s"] <= lines[1]["elapsed_s"]
    # Strict JSON: no NaN/Infinity tokens anywhere.
    text = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert lg.nonfinite_counts == {"loss": 1, "ratio": 1, "reward_mean": 1}
    assert lg.nonfinite_total == 3


def test_every_line_is_fsynced(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(metrics_mod.os, "fsync", lambda fd: (calls.append(fd), real(fd))[1])
    lg = MetricsLogger(tmp_path)
    for s in range(5):
        lg.log(s, {"x": s})
        assert len(read_metrics(tmp_path)) == s + 1  # visible before close
    assert len(calls) == 5
    lg.close()
    lg.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        lg.log(6, {"x": 1})


def test_lines_survive_a_killed_process(tmp_path):
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(SRC)!r})
        from saccade.metrics import MetricsLogger
        lg = MetricsLogger({str(tmp_path)!r})
        for s in range(1, 6):
            lg.log(s, {{"reward_mean": s / 10}})
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit, no buffer flush
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], timeout=60)
    assert proc.returncode != 0
    recs = read_metrics(tmp_path / METRICS_FILE)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    assert recs[-1]["reward_mean"] == 0.5


def test_read_metrics_tolerates_a_torn_last_line(tmp_path):
    path = tmp_path / METRICS_FILE
    good = [{"step": 1, "phase": "train", "x": 1.0}, {"step": 2, "phase": "eval", "x": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in good) + '{"step": 3, "phase": "tr')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a torn last line is expected after a kill: no warning
        assert read_metrics(path) == good
    assert read_metrics(tmp_path) == good  # a run directory works too
    assert read_metrics(path, phase="eval") == good[1:]

    # A corrupt line in the middle is skipped with a warning.
    path.write_text(json.dumps(good[0]) + "\n{garbage\n" + json.dumps(good[1]) + "\n")
    with pytest.warns(RuntimeWarning, match="unreadable line"):
        assert read_metrics(path) == good


def test_resume_truncates_ghost_steps(tmp_path):
    with MetricsLogger(tmp_path) as lg:
        for s in range(1, 11):
            lg.log(s, {"x": s})
        lg.log(10, {"acc": 0.5}, phase="eval")
    last_elapsed = _lines(tmp_path)[5]["elapsed_s"]

    # The checkpoint was at step 6: steps 7..10 (and the eval at 10) are ghosts.
    with MetricsLogger(tmp_path, resume=True) as lg:
        assert lg.truncate_after(6) == 5
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5, 6]
        for s in (7, 8):
            lg.log(s, {"x": s})
    recs = read_metrics(tmp_path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert recs[6]["elapsed_s"] >= last_elapsed  # elapsed time carries on across the resume
    assert not (tmp_path / (METRICS_FILE + ".tmp")).exists()

    # resume_step= at construction does the same.
    with MetricsLogger(tmp_path, resume=True, resume_step=7) as lg:
        lg.log(8, {"x": 80})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)][-2:] == [(7, 7), (8, 80)]


def test_resume_repairs_a_torn_tail_before_appending(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text(json.dumps({"step": 1, "phase": "train", "x": 1}) + "\n" + '{"step": 2, "ph')
    with MetricsLogger(tmp_path, resume=True) as lg:
        lg.log(2, {"x": 2})
    lines = path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]  # no line glued to the torn one


def test_fresh_run_sets_an_old_file_aside(tmp_path):
    with MetricsLogger(tmp_path) as lg:
        lg.log(1, {"x": 1})
    with pytest.warns(RuntimeWarning, match=r"metrics\.jsonl\.1"):
        with MetricsLogger(tmp_path) as lg:
            lg.log(1, {"x": 2})
    assert [r["x"] for r in read_metrics(tmp_path)] == [2]
    assert [r["x"] for r in read_metrics(tmp_path / "metrics.jsonl.1")] == [1]


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="scalar"):
        to_scalar(torch.zeros(3), "v")
    with pytest.raises(TypeError, match="'name'"):
        to_scalar("hello", "name")
    assert to_scalar(np.int64(4)) == 4 and isinstance(to_scalar(np.int64(4)), int)
    assert math.isnan(to_scalar(np.float64("nan")))


def test_reserved_metric_names_are_refused(tmp_path):
    with MetricsLogger(tmp_path) as lg:
        with pytest.raises(ValueError, match="reserved"):
            lg.log(1, {"step": 3})


def test_wandb_not_installed_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.warns(RuntimeWarning, match="pip install wandb"):
        lg = MetricsLogger(tmp_path, wandb=True, wandb_project="p")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, at construction; logging stays quiet
        lg.log(1, {"x": 1.0})
        lg.log(2, {"x": 2.0})
    lg.close()
    assert not lg.wandb_active
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0, 2.0]


def test_tensorboard_not_installed_warns_and_continues(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.warns(RuntimeWarning, match="pip install tensorboard"):
        lg = MetricsLogger(tmp_path, tensorboard=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lg.log(1, {"x": 1.0})
    lg.close()
    assert not lg.tensorboard_active
    assert read_metrics(tmp_path)[0]["x"] == 1.0


class _FakeWandbRun:
    def __init__(self, calls):
        self.id = "run123"
        self.calls = calls

    def log(self, data, step):
        self.calls.append(("log", dict(data), step))

    def finish(self):
        self.calls.append(("finish",))


def _fake_wandb(calls):
    mod = types.ModuleType("wandb")

    def init(**kwargs):
        calls.append(("init", kwargs))
        return _FakeWandbRun(calls)

    mod.init = init
    return mod


def test_wandb_mirror_gets_phase_tagged_finite_values(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(calls))
    with MetricsLogger(tmp_path, wandb=True, wandb_project="proj", config={"lr": 1e-6}) as lg:
        assert lg.wandb_active
        lg.log(1, {"reward_mean": torch.tensor(0.5), "loss": float("nan")})
        lg.log(1, {"accuracy": 0.25, "eval/reward_mean": 0.1}, phase="eval")
    init = calls[0]
    assert init[0] == "init" and init[1]["project"] == "proj" and init[1]["config"] == {"lr": 1e-6}
    assert calls[1] == ("log", {"train/reward_mean": 0.5}, 1)  # NaN is not forwarded
    assert calls[2] == ("log", {"eval/accuracy": 0.25, "eval/reward_mean": 0.1}, 1)
    assert calls[-1] == ("finish",)
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == "run123"

    # A resumed run goes on with the same W&B run.
    calls.clear()
    with MetricsLogger(tmp_path, wandb=True, resume=True):
        pass
    assert calls[0][1]["id"] == "run123" and calls[0][1]["resume"] == "allow"


def test_a_failing_mirror_is_dropped_and_jsonl_goes_on(tmp_path, monkeypatch):
    calls: list = []
    fake = _fake_wandb(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    lg = MetricsLogger(tmp_path, wandb=True)

    def boom(data, step):
        raise ConnectionError("offline")

    lg._wandb_run.log = boom
    with pytest.warns(RuntimeWarning, match="wandb logging failed"):
        lg.log(1, {"x": 1})
    lg.log(2, {"x": 2})
    lg.close()
    assert not lg.wandb_active
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_tensorboardx_fallback_writer(tmp_path, monkeypatch):
    scalars: list = []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            scalars.append(("init", log_dir, purge_step))

        def add_scalar(self, tag, value, step, walltime=None):
            scalars.append((tag, value, step))

        def add_text(self, *a):
            pass

        def flush(self):
            pass

        def close(self):
            scalars.append(("close",))

    mod = types.ModuleType("tensorboardX")
    mod.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", mod)
    with MetricsLogger(tmp_path, tensorboard=True, config={"a": 1}) as lg:
        assert lg.tensorboard_active
        lg.log(3, {"kl": torch.tensor(0.125), "bad": float("inf")})
        lg.truncate_after(2)  # reopens the writer purging the steps after 2
    assert scalars[0] == ("init", str(tmp_path / "tensorboard"), None)
    assert ("train/kl", 0.125, 3) in scalars
    assert not any(s[0] == "train/bad" for s in scalars)
    assert ("init", str(tmp_path / "tensorboard"), 3) in scalars
    assert scalars[-1] == ("close",)


def test_real_tensorboard_writes_events_that_read_back(tmp_path):
    """The real writer (tensorboard is a dev dependency): the scalars read back, phase-tagged,
    at their steps; a non-finite value is not mirrored; a resume purges the steps after it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, tensorboard=True) as lg:
        assert lg.tensorboard_active
        lg.log(1, {"reward_mean": 0.5, "loss": float("nan")})
        lg.log(2, {"reward_mean": 0.75})
        lg.log(2, {"accuracy": 0.25}, phase="eval")

    def scalars() -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(tmp_path / "tensorboard"))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    assert scalars() == {"train/reward_mean": [(1, 0.5), (2, 0.75)], "eval/accuracy": [(2, 0.25)]}
    with MetricsLogger(tmp_path, tensorboard=True, resume=True) as lg:
        lg.truncate_after(1)
        lg.log(2, {"reward_mean": 0.125})
    assert scalars()["train/reward_mean"] == [(1, 0.5), (2, 0.125)]


def test_format_step():
    rec = {"step": 12, "phase": "train", "time": 1.0, "elapsed_s": 2.0, "reward_mean": torch.tensor(0.53125),
           "reward_std": 0.2109, "reward": 9.0, "loss": -0.0123456, "kl": 0.00012345, "completion_len_mean": 143.25,
           "weird": 1.0}
    line = format_step(rec)
    assert line.startswith("step 12 | reward 0.5312 ± 0.2109")
    assert "loss -0.01235" in line and "kl 1.234e-04" in line and "len 143.2" in line
    assert "weird" not in line and "reward 9" not in line and "\n" not in line
    assert format_step({"step": 3, "phase": "eval", "eval/accuracy": 0.5}) == "step 3 [eval] | eval_acc 0.5"
    assert format_step({"step": 1, "a": 1, "b": None}) == "step 1 | a 1 | b nan"  # fallback: first metrics
    assert format_step({"x": 1.23456, "y": 2}, keys=["y", "x", "z"]) == "y 2 | x 1.235"


def test_format_step_shows_a_stall_and_a_rollback():
    """The progress line says when the stall watch (saccade.loops.stall) sees a stalled run, and where
    a rollback went; a run that has not stalled shows nothing of it."""
    calm = {"step": 4, "reward_mean": 0.5, "stalled": 0.0, "no_signal_steps": 2.0, "truncated_steps": 0.0}
    assert format_step(calm) == "step 4 | reward 0.5"
    stalled = {**calm, "stalled": 1.0, "no_signal_steps": 20.0, "truncated_steps": 21.0}
    assert format_step(stalled) == "step 4 | reward 0.5 | STALLED: no signal 20 steps, cut 21 steps"
    rolled = {**stalled, "rollback_to_step": 0.0, "rollback_lr": 0.00025}
    assert format_step(rolled).endswith(
        "| STALLED: no signal 20 steps, cut 21 steps | rolled back to step 0, lr 2.500e-04")
    assert format_step(stalled, keys=["reward_mean"]) == "step 4 | reward_mean 0.5"
