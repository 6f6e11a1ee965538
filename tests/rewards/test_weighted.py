"""Reward functions from the config (saccade.rewards.weighted): built-ins and a user's own functions
in a real temporary module, their parts, async ones scored together, timeouts, failures counted and logged
once, and bad names refused when the config loads."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import pytest

from saccade.config import RunConfig, load_config
from saccade.data.questions import VQASample
from saccade.rewards.weighted import Rewards, metric_name
from saccade.run.tasks import check_user_code

USER_MODULE = '''
import asyncio
import time

# Functions run in worker processes: what a test checks comes back as a part of their value.
in_flight = {"now": 0, "most": 0}


def short(completion, sample):
    return float(len(completion) <= len(sample.answer) + 2)


def shaped(completion, *, sample, messages):
    return {"exact": float(completion == sample.answer), "brief": 0.25 * (len(completion) < 10)}


def saw(completion, *, messages):
    return float(messages == [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]}])


def everything(completion, **kwargs):
    return float(sorted(kwargs) == ["messages", "sample"])


def broken(completion, sample):
    raise RuntimeError("the judge is down")


def not_a_number(completion):
    return "high"


def nan(completion):
    return float("nan")


async def judge(completion, *, sample):
    # Every answer of the batch (six) must be in flight at once before any returns: run one
    # after another, the first would wait for the others until the timeout.
    in_flight["now"] += 1
    in_flight["most"] = max(in_flight["most"], in_flight["now"])
    for _ in range(2000):
        if in_flight["most"] >= 6:
            break
        await asyncio.sleep(0.001)
    in_flight["now"] -= 1
    return {"agrees": float(sample.answer in completion), "together": in_flight["most"]}


async def hangs(completion):
    await asyncio.sleep(3600)


def blocks(completion):
    time.sleep(60)
    return 1.0


def needs_more(completion, sample, rubric):
    return 0.0


def takes_nothing():
    return 0.0
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A real module of reward functions, importable as `user_rewards` for this test."""
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "user_rewards", raising=False)
    import user_rewards

    return user_rewards


def _question(answer="red", choices=("red", "green", "blue")) -> VQASample:
    return VQASample(sample_id="q1", images=[], question="What color is the shape?", answer=answer,
                     choices=list(choices), answer_type="multi_choice")


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "What color is the shape?"}]}]


def score(rewards: Rewards, *texts: str, sample=None) -> list[tuple[float, dict]]:
    """The answers scored together on one event loop, as a rollout step scores them."""
    sample = sample or _question()

    async def all_of_them():
        return await asyncio.gather(*(rewards.score(t, sample=sample, messages=MESSAGES) for t in texts))
    return list(asyncio.run(all_of_them()))


@pytest.mark.parametrize(
    ("text", "weights", "total", "values"),
    [
        ("red", {"correct": 1.0}, 1.0, {"correct": 1.0}),
        ("blue", {"correct": 1.0, "format": 0.25}, 0.25, {"correct": 0.0, "format": 1.0}),
        ("red", {"correct": 2.0, "format": 0.5}, 2.5, {"correct": 1.0, "format": 1.0}),
        ("purple", {"correct": 1.0, "format": 0.5}, 0.0, {"correct": 0.0, "format": 0.0}),  # not an option
        ("\\boxed{red}", {"boxed_format": 1.0}, 1.0, {"boxed_format": 1.0}),
    ],
)
def test_built_ins_weighted_by_hand(text, weights, total, values):
    [(got_total, got)] = score(Rewards(weights), text)
    assert got_total == total
    assert got == {**{f"reward_{k}": v for k, v in values.items()}, "reward_errors": 0.0, "reward_timeouts": 0.0}


def test_a_user_function_by_import_path_its_parts_summed(user, make_rewards):
    rewards = make_rewards({"correct": 1.0, "user_rewards:shaped": 2.0, "user_rewards:short": 0.5,
                            "user_rewards:everything": 1.0, "user_rewards:saw": 1.0})
    [(total, values)] = score(rewards, "red")
    assert values["reward_shaped_exact"] == 1.0 and values["reward_shaped_brief"] == 0.25
    assert values["reward_shaped"] == 1.25  # the function's value: the sum of its parts
    assert values["reward_short"] == 1.0 and values["reward_everything"] == 1.0  # both keywords with **kwargs
    assert values["reward_saw"] == 1.0  # the prompt's messages, as a keyword
    assert total == 1.0 + 2.0 * 1.25 + 0.5 * 1.0 + 1.0 + 1.0


def test_async_functions_score_a_batch_together(user, make_rewards):
    rewards = make_rewards({"user_rewards:judge": 1.0}, timeout_s=30)
    results = score(rewards, *["red", "blue"] * 3)
    assert [v["reward_judge_together"] for _, v in results] == [6.0] * 6  # all six were being judged at once
    assert [v["reward_judge_agrees"] for _, v in results] == [1.0, 0.0] * 3
    assert all(v["reward_timeouts"] == 0 for _, v in results)


def test_timeouts_score_zero_count_and_log_once(user, make_rewards, caplog):
    rewards = make_rewards({"correct": 1.0, "user_rewards:hangs": 1.0, "user_rewards:blocks": 1.0},
                           timeout_s=0.2)
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        results = score(rewards, "red", "red", "blue")
    # The other functions still count: correct is 1 for the right answers.
    assert [total for total, _ in results] == [1.0, 1.0, 0.0]
    assert all(v["reward_timeouts"] == 2 and v["reward_hangs"] == 0 and v["reward_blocks"] == 0 for _, v in results)
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 2 and all("reward_timeout_s = 0.2" in m for m in logged)  # once per function


def test_failures_score_zero_count_and_log_one_traceback(user, make_rewards, caplog):
    rewards = make_rewards({"correct": 1.0, "user_rewards:broken": 1.0, "user_rewards:not_a_number": 1.0,
                            "user_rewards:nan": 1.0})
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        results = score(rewards, "red", "green") + score(rewards, "blue")  # two steps
    assert [total for total, _ in results] == [1.0, 0.0, 0.0]
    assert all(v["reward_errors"] == 3 and v["reward_timeouts"] == 0 for _, v in results)
    by_function = {r.getMessage().split("'")[1]: r for r in caplog.records}
    assert len(caplog.records) == 3 == len(by_function)  # one record per function, over both steps
    assert "the judge is down" in str(by_function["user_rewards:broken"].exc_info[1])
    assert "not a float" in str(by_function["user_rewards:not_a_number"].exc_info[1])
    assert "not a finite number" in str(by_function["user_rewards:nan"].exc_info[1])


def test_metric_names():
    assert metric_name("correct") == "correct"
    assert metric_name("my_pkg.rewards:length_penalty") == "length_penalty"


# --- refused when the config loads ----------------------------------------------------------


def _check(*overrides):
    """Load the config and resolve its reward functions, as the entry points do before a run."""
    check_user_code(load_config(RunConfig, None, list(overrides)))


@pytest.mark.parametrize(("weights", "message"), [
    ('{"corect": 1}', "unknown reward function 'corect'; built-in: correct, format, boxed_format"),
    ('{"no_such_module:f": 1}', "'no_such_module:f': no module named 'no_such_module' on sys.path.*PYTHONPATH=."),
    ('{"user_rewards:shapd": 1}', "'user_rewards:shapd': 'user_rewards' has no attribute 'shapd'; it has .*shaped"),
    ('{"user_rewards:in_flight": 1}', "'user_rewards:in_flight' is a dict, not a function"),
    ('{"user_rewards:needs_more": 1}', "'user_rewards:needs_more' needs arguments saccade does not pass \\(rubric\\)"),
    ('{"user_rewards:takes_nothing": 1}', "'user_rewards:takes_nothing' takes no completion argument"),
    ('{"correct": 1, "format": 1, "os:sep": 1}', "'os:sep' is a str"),
])
def test_bad_reward_names_are_refused_before_the_run(user, weights, message):
    with pytest.raises(ValueError, match=f"^rollout.reward_weights: {message}"):
        _check("--rollout.reward_weights", weights)


def test_two_functions_of_one_name_are_refused(user, tmp_path):
    (tmp_path / "other_rewards.py").write_text("def short(completion):\n    return 1.0\n"
                                               "def mean(completion):\n    return 1.0\n")
    with pytest.raises(ValueError, match="'user_rewards:short' and 'other_rewards:short' would both be logged "
                                         "as reward_short"):
        _check("--rollout.reward_weights", '{"user_rewards:short": 1, "other_rewards:short": 1}')
    with pytest.raises(ValueError, match="reward_mean, a metric saccade already writes"):
        _check("--rollout.reward_weights", '{"other_rewards:mean": 1}')


def test_a_user_function_in_a_toml_config(user, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[rollout]\nreward_weights = { correct = 1.0, "user_rewards:shaped" = 0.5 }\n'
                    'reward_timeout_s = 5\n')
    cfg = load_config(RunConfig, path, [])
    assert cfg.rollout.reward_weights == {"correct": 1.0, "user_rewards:shaped": 0.5}
    assert cfg.rollout.reward_timeout_s == 5.0
