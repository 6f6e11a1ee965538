"""bench async's figures and report: pure functions on made-up runs (the runs themselves are
`saccade bench async`, minutes each)."""

from saccade.tools.bench.async_rollouts import (
    format_async_report, learning_by_seed, level_ratios, longest_zero_reward_run,
)


def test_longest_zero_reward_run_counts_consecutive_zero_steps_only():
    assert longest_zero_reward_run([]) == 0
    assert longest_zero_reward_run([0.3, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.5]) == 3
    assert longest_zero_reward_run([0.01, 0.02]) == 0


def run(seed, level, accuracy, step_s, zeros=0, world=1):
    return {"seed": seed, "world_size": world, "max_async_level": level, "steps": 150, "step_s": step_s,
            "trainer_idle_frac": 0.5, "engine_idle_frac": 0.2, "policy_lag_mean": float(level),
            "mismatch_abs_lag0_max": 3e-7, "accuracy_after": accuracy, "zero_reward_steps_max": zeros}


RUNS = [run(0, 0, 0.969, 2.0), run(0, 1, 1.000, 1.0), run(1, 0, 1.000, 2.0), run(1, 1, 0.344, 3.0, zeros=57)]


def test_learning_is_judged_per_seed_against_that_seeds_level_0():
    rows = {row["seed"]: row for row in learning_by_seed(RUNS)}
    assert rows[0]["gap"] == 1.000 - 0.969 and rows[0]["learned_as_level0"]
    assert rows[1]["gap"] == 0.344 - 1.000 and not rows[1]["learned_as_level0"]
    assert rows[1]["zero_reward_steps_max"] == [0, 57]
    # Just inside and just outside the 0.05 bar.
    assert learning_by_seed([run(2, 0, 0.95, 1), run(2, 1, 0.90, 1)])[0]["learned_as_level0"]
    assert not learning_by_seed([run(2, 0, 0.95, 1), run(2, 1, 0.89, 1)])[0]["learned_as_level0"]
    # A seed with one level only is not judged.
    assert learning_by_seed([run(3, 1, 1.0, 1)]) == []


def test_the_speed_ratio_is_over_every_seeds_runs():
    # level 0: (2 + 2) / 2 = 2 s/step; level 1: (1 + 3) / 2 = 2 s/step.
    assert level_ratios(RUNS) == {"1": 1.0}


def test_the_report_names_each_seeds_verdict():
    result = {"runs": RUNS, "server_cores": [0], "trainer_cores": [1], "prompts_per_step": 32, "group_size": 8,
              "steps_per_s_ratio": level_ratios(RUNS), "learning": learning_by_seed(RUNS)}
    report = format_async_report(result)
    assert "seed 0, world 1: held-out level 0 0.969, level 1 1.000 (+0.031: learned as level 0)" in report
    assert "seed 1, world 1: held-out level 0 1.000, level 1 0.344 (-0.656: NOT within 0.05 of level 0); " \
           "longest run of reward-0 steps 0 and 57" in report
