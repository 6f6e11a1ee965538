"""The data-set demo's probe and verdict (`saccade.tools.demo_probe`)."""

from __future__ import annotations

import pytest

from saccade.tools.demo import verdict
from saccade.tools.demo_probe import LEARNED, NOT_GROUNDED, NOT_LEARNED, accuracy_bar, is_grounded, probe_verdict


def figures(**changed) -> dict:
    base = {"chance": 0.125, "accuracy_before": 0.125, "accuracy_after": 0.98, "control_accuracy_after": 0.125,
            "visual_gain_after": 0.85, "control_visual_gain": 0.0, "minutes": 5.0, "minutes_bar": 13,
            "probe_accuracy": 1.0, "probe_blank_accuracy": 0.125, "grpo_steps": 400}
    return base | changed


def test_the_three_verdicts():
    assert probe_verdict(figures())[0] == LEARNED
    # The pictures carry nothing: the probe is at chance with them, or no better than without.
    kind, why = probe_verdict(figures(accuracy_after=0.13, visual_gain_after=0.0, probe_accuracy=0.14))
    assert kind == NOT_GROUNDED and "0.140" in why
    assert probe_verdict(figures(accuracy_after=0.5, probe_accuracy=0.6, probe_blank_accuracy=0.55))[0] == NOT_GROUNDED
    # The probe reads them, GRPO did not: which lever, from where GRPO stopped.
    kind, why = probe_verdict(figures(accuracy_after=0.125, visual_gain_after=0.0))
    assert kind == NOT_LEARNED and "group_size" in why
    kind, why = probe_verdict(figures(accuracy_after=0.6, visual_gain_after=0.45))
    assert kind == NOT_LEARNED and "--trainer.steps 800" in why
    # A tower that keeps 70% of the answers: GRPO within 0.05 of it has learned what there is.
    assert probe_verdict(figures(accuracy_after=0.67, visual_gain_after=0.5, probe_accuracy=0.7))[0] == LEARNED


def test_the_bars_follow_a_grounded_probe_only():
    assert accuracy_bar(None) == 0.9 and accuracy_bar(1.0) == 0.9 and accuracy_bar(0.7) == pytest.approx(0.65)
    assert is_grounded(0.5, 0.125, 0.125) and not is_grounded(0.2, 0.125, 0.125) and not is_grounded(0.6, 0.55, 0.125)
    assert verdict(figures()) == []
    assert verdict(figures(accuracy_after=0.67, visual_gain_after=0.5, probe_accuracy=0.7)) == []
    # Not grounded: the 0.9 bar stands, so the demo fails (and its verdict says why).
    missed = verdict(figures(accuracy_after=0.13, visual_gain_after=0.0, probe_accuracy=0.14))
    assert any("accuracy_after" in m for m in missed)
    assert verdict(figures(minutes=14.0)) == ["minutes 14.0 > 13"]
    # Two options: the gain's bar is the accuracy bar's gain over chance, 0.4.
    assert verdict(figures(chance=0.5, accuracy_before=0.5, control_accuracy_after=0.5, accuracy_after=0.92,
                           visual_gain_after=0.42, probe_blank_accuracy=0.5)) == []


@pytest.mark.slow
def test_the_probe_fits_with_and_without_pictures_and_gives_the_model_back(tmp_path):
    """Two SFT steps each way on a tiny 3-option data set: both fits run and log, the figures are
    there, and the model's weights are the ones it started from."""
    import torch

    from saccade.data.choices_example import COLUMNS_JSON
    from saccade.data.choices_sets import ChoiceSet, write_choice_set
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config
    from saccade.tools.demo import load_demo_config
    from saccade.tools.demo_probe import run_probe, snapshot_trainable

    folder = write_choice_set(tmp_path / "d", ChoiceSet("color", 3), train_rows=12, test_rows=3)
    cfg = load_demo_config(["--task.kind", "dataset", "--task.dataset", str(folder), "--task.columns", COLUMNS_JSON,
                            "--log.dir", str(tmp_path / "run"), "--sft.batch_size", "4", "--eval.prompts", "3",
                            "--sampling.max_tokens", "3", "--trainer.torch_threads", "1"])
    setup = build_setup(cfg, cfg.run_dir)
    before = snapshot_trainable(setup.model)
    held_out = task_from_config(cfg).eval_samples(3)
    figures = run_probe(cfg, setup, held_out, steps=2, progress=False)
    assert set(figures) == {"probe_accuracy", "probe_visual_gain", "probe_blank_accuracy", "probe_steps"}
    assert all(0.0 <= figures[k] <= 1.0 for k in ("probe_accuracy", "probe_blank_accuracy"))
    for name in ("probe-images", "probe-blank"):
        assert (tmp_path / "run" / name / "metrics.jsonl").is_file()
    assert "blank_images = true" in (tmp_path / "run" / "probe-blank" / "config.toml").read_text()
    after = snapshot_trainable(setup.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_probe_that_finds_nothing_stops_the_demo_with_its_verdict():
    """GRPO skipped: the verdict from the probe alone, and the bar missed, saying why."""
    from saccade.cli.demos import shapes_report

    result = {"chance": 0.25, "probe_accuracy": 0.25, "probe_blank_accuracy": 0.25, "probe_steps": 100,
              "grpo_skipped": True, "minutes": 3.0, "dataset": "d", "eval_size": 64, "run_dir": "r"}
    result["verdict"], result["verdict_reason"] = probe_verdict(result)
    assert result["verdict"] == NOT_GROUNDED
    assert verdict(result) == [f"the probe found no answer in the pictures: {NOT_GROUNDED}"]
    assert "GRPO and its control skipped" in shapes_report(result) and NOT_GROUNDED in shapes_report(result)
