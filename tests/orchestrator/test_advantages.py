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
    adv = group_advantages([[1.0, 2.0, 3.0, 6.0]], scale_by_std=False)
    assert adv[0].tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_zero_variance_group_gives_exact_zeros_and_is_flagged(scale_by_std):
    # 0.1 * 3 / 3 is not exactly 0.1 in float32: a naive (r - mean) / (std + eps) gives noise here
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, scale_by_std=scale_by_std)
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
