"""Group advantages, the zero-variance filter and reward combination, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from saccade.orchestrator.advantages import group_advantages, zero_variance_groups


def test_group_advantages_by_hand():
    rewards = [
        [1.0, 0.0, 0.0, 1.0],  # mean 0.5; centered +-0.5; sample var = 4 * 0.25 / 3 = 1/3
        [1.0, 2.0, 3.0, 6.0],  # mean 3; centered -2, -1, 0, 3; sample var = (4 + 1 + 0 + 9) / 3 = 14/3
    ]
    adv = group_advantages(rewards, eps=0.0)
    s0, s1 = math.sqrt(1 / 3), math.sqrt(14 / 3)
    assert adv.shape == (2, 4)
    assert adv[0].tolist() == pytest.approx([0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0])  # +-0.866025
    assert adv[1].tolist() == pytest.approx([-2 / s1, -1 / s1, 0.0, 3 / s1])


def test_eps_is_added_to_the_std():
    adv = group_advantages(torch.tensor([[1.0, 2.0, 3.0]]), eps=0.5)  # centered -1, 0, 1; sample std 1
    assert adv[0].tolist() == pytest.approx([-1 / 1.5, 0.0, 1 / 1.5])


def test_without_std_scaling_only_the_mean_is_removed():
    adv = group_advantages([[1.0, 2.0, 3.0, 6.0]], scaling="none")
    assert adv[0].tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])


def test_rloo_subtracts_the_mean_of_the_other_rewards_by_hand():
    # [1, 2, 3, 6]: the others' sums 11, 10, 9, 6 over G - 1 = 3 -> baselines 11/3, 10/3, 3, 2
    adv = group_advantages([[1.0, 2.0, 3.0, 6.0], [1.0, 0.0, 0.0, 0.0]], baseline="rloo", scaling="none")
    assert adv[0].tolist() == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 0.0, 4.0])  # -8/3, -4/3, 0, 4
    assert adv[1].tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # = the group mean's advantage times G / (G - 1) = 4/3; scaled by the same group std
    mean_adv = group_advantages([[1.0, 2.0, 3.0, 6.0]], eps=0.0)
    loo_adv = group_advantages([[1.0, 2.0, 3.0, 6.0]], baseline="rloo", eps=0.0)
    assert loo_adv[0].tolist() == pytest.approx([4 / 3 * a for a in mean_adv[0].tolist()])
    assert loo_adv[0].tolist() == pytest.approx([-8 / 3 / math.sqrt(14 / 3), -4 / 3 / math.sqrt(14 / 3), 0.0,
                                                 4 / math.sqrt(14 / 3)])


def test_batch_scaling_divides_every_group_by_the_whole_steps_std_by_hand():
    rewards = [[1.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 6.0]]
    # the 8 rewards: mean 14/8 = 1.75; squared deviations 0.5625 * 2 + 3.0625 * 2 + 0.5625 + 0.0625 + 1.5625
    # + 18.0625 = 27.5; sample var 27.5 / 7, std 1.982062
    std = math.sqrt(27.5 / 7)
    adv = group_advantages(rewards, scaling="batch", eps=0.0)
    assert adv[0].tolist() == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std])
    assert adv[1].tolist() == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std])
    # against the group std: the near-flat group is no longer blown up to the other's scale
    grouped = group_advantages(rewards, eps=0.0)
    assert abs(adv[0, 0].item()) < abs(grouped[0, 0].item())


@pytest.mark.parametrize("baseline", ["group_mean", "rloo"])
@pytest.mark.parametrize("scaling", ["group", "batch", "none"])
def test_zero_variance_group_gives_exact_zeros_and_is_flagged(baseline, scaling):
    # 0.1 * 3 / 3 is not exactly 0.1 in float32: a naive (r - mean) / (std + eps) gives noise here
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, baseline=baseline, scaling=scaling)
    assert torch.isfinite(adv).all()
    assert adv[0].tolist() == [0.0, 0.0, 0.0]
    assert adv[2].tolist() == [0.0, 0.0, 0.0]
    assert adv[1].abs().sum() > 0
    assert zero_variance_groups(rewards).tolist() == [True, False, True]


def test_groups_of_one_are_zero_variance():
    adv = group_advantages([[0.7], [0.2]])
    assert adv.tolist() == [[0.0], [0.0]]
    assert zero_variance_groups([[0.7], [0.2]]).tolist() == [True, True]


def test_integer_rewards_are_accepted():
    adv = group_advantages(torch.tensor([[0, 1]]))
    assert adv.dtype.is_floating_point
    assert adv[0].tolist() == pytest.approx([-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], rel=1e-5)


@pytest.mark.parametrize(
    "rewards, match",
    [
        ([[1.0, 2.0], [1.0]], "same size"),
        ([1.0, 2.0], "num_groups"),
        ([[1.0, float("nan")]], "finite"),
        ([[1.0, 2.0], [float("inf"), 0.0]], r"groups \[1\]"),
    ],
)
def test_bad_rewards_are_value_errors(rewards, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards)


def test_unknown_baseline_or_scaling_is_a_value_error():
    with pytest.raises(ValueError, match="baseline must be one of"):
        group_advantages([[0.0, 1.0]], baseline="loo")
    with pytest.raises(ValueError, match="scaling must be one of"):
        group_advantages([[0.0, 1.0]], scaling="global")
