"""`saccade demo video` (saccade.tools.demo_video): every stage runs on clips, the control on the
reversed twin, and the figures and the bars are reported; the long run of docs/video.md is not here."""

from __future__ import annotations

import json

import pytest
from test_demo import FAST

from saccade.data.clip_sets import write_clip_sets
from saccade.tools.demo_video import video_verdict

pytestmark = pytest.mark.slow


def test_the_video_demo_runs_every_stage_and_says_it_missed_when_it_did_not_learn(tmp_path):
    from saccade.cli import main

    run = tmp_path / "run"
    write_clip_sets(run / "data", train_rows=16, test_rows=8)  # found there: not written again at full size
    out = tmp_path / "demo.json"
    rc = main(["demo", "video", "--json", str(out), "--log.dir", str(run), "--trainer.torch_threads", "1",
               "--probe-steps", "2", *FAST])
    assert rc == 1  # two GRPO steps cannot reach 0.9
    result = json.loads(out.read_text())
    for key in ("accuracy_before", "accuracy_after", "accuracy_after_on_reversed_clips", "control_accuracy_after",
                "control_accuracy_on_real_clips", "visual_gain_after", "control_visual_gain", "probe_accuracy",
                "probe_blank_accuracy", "probe_reversed_accuracy", "minutes"):
        assert isinstance(result[key], float), key
    assert result["chance"] == result["control_chance"] == 0.5 and result["task"] == "video"
    assert result["dataset"] == str(run / "data" / "order") and result["eval_size"] == 3
    for part in ("sft", "grpo", "control", "probe-images", "probe-blank", "probe-reversed"):
        assert (run / part / "metrics.jsonl").is_file(), part
    assert "order-reversed" in (run / "control" / "config.toml").read_text()
    assert "order-reversed" not in (run / "grpo" / "config.toml").read_text()


def test_the_bar_also_holds_the_reversed_clips_at_chance():
    met = {"accuracy_before": 0.5, "accuracy_after": 0.95, "control_accuracy_after": 0.5, "visual_gain_after": 0.45,
           "control_visual_gain": 0.0, "chance": 0.5, "control_chance": 0.5, "minutes": 8.0,
           "probe_accuracy": 1.0, "probe_blank_accuracy": 0.5, "probe_reversed_accuracy": 0.52}
    assert video_verdict(met) == []
    (miss,) = video_verdict({**met, "probe_reversed_accuracy": 0.9})
    assert "without the order" in miss
