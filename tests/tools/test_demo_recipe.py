"""The data-set demo's recipe rule (`saccade.tools.demo_recipe`): a pure function of the number of
options and rows, applied to the keys the command line left alone."""

from __future__ import annotations

import pytest

from saccade.tools.demo import load_demo_config
from saccade.tools.demo_recipe import (apply_recipe, dataset_recipe, demo_minutes, group_size_for, minutes_bar,
                                       overridden_keys)


def test_the_group_holds_a_right_answer_at_the_warm_start():
    assert [group_size_for(k) for k in (2, 3, 4, 5, 6, 7, 8, 9, 10)] == [8, 8, 8, 12, 16, 16, 20, 20, 24]
    for k in range(2, 11):
        assert (1 - 1 / k) ** group_size_for(k) <= 0.11
    with pytest.raises(ValueError, match="at least 2 options"):
        group_size_for(1)


def test_the_recipe_matches_the_tuned_ones_at_3_and_4_options_and_grows_with_k():
    three, four, eight = dataset_recipe(3, 512), dataset_recipe(4, 512), dataset_recipe(8, 4000)
    assert (three.group_size, three.prompts_per_step, three.steps, three.temperature, three.lr_decay) == \
        (8, 32, 150, 1.0, "constant")  # demo.toml's
    assert (four.group_size, four.prompts_per_step, four.steps, four.temperature, four.lr_decay) == \
        (8, 32, 200, 1.3, "linear")  # docs/demo.md's tuned data-set recipe
    assert (eight.group_size, eight.prompts_per_step, eight.steps, eight.probe_steps) == (20, 16, 600, 200)
    assert [dataset_recipe(k, 4000).steps for k in (7, 8, 10)] == [350, 600, 750]  # 75 an option from 8 on
    assert dataset_recipe(8, 10).prompts_per_step == 10  # no more prompts than rows


def test_keys_the_user_set_are_kept():
    overrides = ["--trainer.steps", "99", "--trainer.lr_decay.kind=cosine", "--task.kind", "dataset"]
    named = overridden_keys(overrides)
    cfg = load_demo_config(["--trainer.steps", "99", "--trainer.lr_decay.kind=cosine"])
    out, kept = apply_recipe(cfg, dataset_recipe(8, 4000), named)
    assert kept == ["trainer.steps", "trainer.lr_decay"]
    assert (out.trainer.steps, out.trainer.lr_decay.kind) == (99, "cosine")
    assert (out.rollout.group_size, out.rollout.prompts_per_step, out.sampling.temperature) == (20, 16, 1.3)
    out, kept = apply_recipe(load_demo_config(), dataset_recipe(8, 4000), set())
    assert kept == [] and out.trainer.lr_decay.kind == "linear" and out.trainer.steps == 600


def test_the_estimate_and_the_time_bar():
    shapes = demo_minutes(steps=150, prompts_per_step=32, group_size=8, sft_steps=30, probe_steps=0)
    assert 2.0 < shapes < 3.0  # the shapes demo's 2.5 minutes on a quiet 2-core CPU
    assert minutes_bar(3.0, 10.0) == 10.0 and minutes_bar(9.0, 10.0) == 14


def test_the_estimate_counts_the_probe_at_every_size_tried_and_the_chosen_sizes_tokens():
    from saccade.tools.demo_recipe import FIXED_TOKENS, GRPO_STEP_S_PER_256, SFT_STEP_S, token_scale

    assert token_scale(4) == 1.0 and token_scale(64) == (FIXED_TOKENS + 64) / (FIXED_TOKENS + 4)
    eight = dict(steps=400, prompts_per_step=16, group_size=20, sft_steps=30, probe_steps=200)
    own = demo_minutes(**eight)  # 64 px: the probe's two fits, every stage at 4 tokens a picture
    assert demo_minutes(**eight, image_tokens=4, probe_tokens=[4, 4]) == own
    # Grounded only at 256 px: a blank fit at 64 px, the pictures at 64, 128 and 256, then every stage at 64 tokens.
    at_256 = demo_minutes(**eight, image_tokens=64, probe_tokens=[4, 4, 16, 64])
    grpo = 2 * 400 * GRPO_STEP_S_PER_256 * 16 * 20 / 256 * token_scale(64)
    warm = 30 * SFT_STEP_S * token_scale(64)
    probe = 200 * SFT_STEP_S * (1 + 1 + token_scale(16) + token_scale(64))
    assert at_256 == pytest.approx((grpo + warm + probe) / 60)
    assert at_256 > demo_minutes(**eight, image_tokens=64, probe_tokens=[64, 64]) > own  # the smaller probes count


def test_the_estimate_up_front_for_each_size_the_probe_may_take():
    from saccade.tools.demo_recipe import describe_recipe, estimate_minutes, size_estimates

    cfg, _ = apply_recipe(load_demo_config(), dataset_recipe(8, 4000), set())
    tokens = {64: 4.0, 128: 16.0, 256: 64.0}
    sizes = size_estimates(cfg, probe_steps=200, sides=[64, 128, 256], tokens=tokens)
    assert [s for s, _ in sizes] == [64, 128, 256]
    assert sizes[0][1] == pytest.approx(estimate_minutes(cfg, probe_steps=200))  # its own size: as before
    assert sizes[2][1] == pytest.approx(estimate_minutes(cfg, probe_steps=200, image_tokens=64,
                                                         probe_tokens=[4, 4, 16, 64]))
    assert sizes[0][1] < sizes[1][1] < sizes[2][1]
    text = describe_recipe(cfg, dataset_recipe(8, 4000), [], floor=10.0, sizes=sizes, tokens=tokens)
    assert f"own, 64 px (4 image tokens a picture): {sizes[0][1]:.1f}" in text
    assert f"256 px (64 image tokens a picture): {sizes[2][1]:.1f} (time bar {minutes_bar(sizes[2][1], 10.0):g})" in text
