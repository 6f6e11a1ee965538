"""The demo's pieces, and the whole demo on a budget too small to learn (its failure path)."""

from __future__ import annotations

import json

import pytest
import torch

from saccade.tools.demo import demo_config_path, load_demo_config, restore_trainable, snapshot_trainable, verdict

# Enough steps for every stage to run, far too few to learn.
FAST = [
    "--sft.steps", "2", "--sft.batch_size", "4",
    "--trainer.steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
    "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "3", "--loss.max_completion_tokens", "3",
    "--eval.prompts", "3", "--eval.every_steps", "1",
]


def passing(**changes):
    result = {"accuracy_before": 0.35, "accuracy_after": 0.95, "control_accuracy_after": 0.30,
              "visual_gain_after": 0.62, "control_visual_gain": 0.02, "chance": 1 / 3, "minutes": 4.0}
    return {**result, **changes}


def test_the_demo_config_ships_inside_the_package():
    assert demo_config_path().is_file()
    cfg = load_demo_config(["--trainer.steps", "3"])
    assert cfg.trainer.steps == 3 and cfg.model.path == "tiny" and not cfg.task.blank_images


def test_verdict_passes_a_demo_that_met_the_bar():
    assert verdict(passing()) == []


@pytest.mark.parametrize(
    ("changes", "missed"),
    [
        ({"accuracy_after": 0.89}, "accuracy_after"),
        ({"accuracy_before": 0.5}, "accuracy_before"),
        ({"control_accuracy_after": 0.7}, "control_accuracy_after"),
        ({"control_accuracy_after": 0.2}, "control_accuracy_after"),
        ({"minutes": 10.5}, "minutes"),
        ({"visual_gain_after": 0.45}, "visual_gain_after"),
        ({"control_visual_gain": 0.15}, "control_visual_gain"),
        ({"control_visual_gain": -0.15}, "control_visual_gain"),
    ],
)
def test_verdict_names_what_missed_the_bar(changes, missed):
    misses = verdict(passing(**changes))
    assert len(misses) == 1 and misses[0].startswith(missed)


def test_restore_puts_the_trainable_weights_back():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model[1].weight.requires_grad_(False)
    saved = snapshot_trainable(model)
    assert set(saved) == {"0.weight", "0.bias", "1.bias"}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    restore_trainable(model, saved)
    for name, value in model.state_dict().items():
        expected = before[name] if name in saved else before[name] + 1.0
        assert torch.equal(value, expected), name


@pytest.mark.slow
def test_the_demo_runs_every_stage_and_fails_loudly_when_it_does_not_learn(tmp_path):
    from saccade.cli import main

    out = tmp_path / "demo.json"
    rc = main(["demo", "--json", str(out), "--log.dir", str(tmp_path / "run"), *FAST])
    assert rc == 1  # two GRPO steps cannot reach 0.9: the demo must say it missed its bar
    result = json.loads(out.read_text())
    for key in ("accuracy_before", "accuracy_after", "control_accuracy_after", "control_accuracy_on_real_images",
                "visual_gain_before", "visual_gain_after", "control_visual_gain", "chance", "minutes"):
        assert isinstance(result[key], float), key
    assert result["chance"] == pytest.approx(1 / 3)
    # The control's visual gain: its accuracy on the real images minus on the blank ones it trained on.
    assert result["control_visual_gain"] == result["control_accuracy_on_real_images"] - result["control_accuracy_after"]
    for part in ("sft", "grpo", "control"):
        assert (tmp_path / "run" / part / "metrics.jsonl").is_file(), part
    for part in ("grpo", "control"):
        assert (tmp_path / "run" / part / "plots" / "overview.png").is_file(), part
        assert (tmp_path / "run" / part / "checkpoints" / "step_000002" / "COMPLETE").is_file(), part
    # Each run folder records the config it ran with: only the control's images were blank.
    assert "blank_images = false" in (tmp_path / "run" / "grpo" / "config.toml").read_text()
    assert "blank_images = true" in (tmp_path / "run" / "control" / "config.toml").read_text()


def test_the_warm_start_is_resolved_where_a_run_starts(monkeypatch, tmp_path):
    """`resolve_warm_start` hands a folder down in place of "tiny-warm" and leaves any other model
    alone; `saccade serve tiny-warm` resolves it in the CLI, before the server (which never trains)."""
    import saccade.tools.demo as demo
    from saccade import cli

    folder = tmp_path / "warm"
    monkeypatch.setattr(demo, "warm_model_path", lambda: folder)  # the real one trains for minutes
    warm = demo.resolve_warm_start(demo.load_demo_config(["--model.path", "tiny-warm"]))
    assert warm.model.path == str(folder)
    other = demo.load_demo_config(["--model.path", "tiny"])
    assert demo.resolve_warm_start(other) is other
    assert demo.resolve_model_name("tiny-warm") == str(folder)

    served = []
    monkeypatch.setattr("saccade.serving.server.main", lambda argv: served.append(argv) or 0)
    assert cli.cmd_serve(["tiny-warm", "--port", "8000"]) == 0
    assert served == [[str(folder), "--port", "8000"]]
