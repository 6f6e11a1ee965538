"""Every shipped reward, extractor and grader bounded (saccade.rewards.bounded): run in a killable
child, each call cut at its limit, also off the main thread where the rollout loop scores (issue
58: OpenMMReasoner's grader ran math-verify on the rollout thread with no limit)."""

from __future__ import annotations

import ast
import sys
import threading
import time
from pathlib import Path

import pytest

from saccade.rewards import Scorer, bounded
from saccade.rewards.bounded import ScoringTimeout, ScoringWorker, worker
from saccade.rewards.protocols import EXTRACTORS, GRADERS

SRC = Path(__file__).parents[2] / "src" / "saccade"
TOWER = "$9^{9^{9^{9}}}$"


def in_a_thread(fn, limit_s: float):
    """fn() on a thread, as the rollout loop calls scoring; (its result or exception, seconds)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as err:  # noqa: BLE001 - handed back to the test
            out["value"] = err

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"still running after {limit_s} s"
    return out["value"], time.monotonic() - start


def test_a_power_tower_scores_0_within_the_limit_off_the_main_thread_and_scoring_goes_on():
    """`$9^{9^{9^{9}}}$` makes sympy compute for minutes holding the GIL (measured before the
    worker: a thread scoring it had not returned after 60 s, and starved the process); on the
    rollout thread, as every real run scores, it now scores 0 within the 5 s limit, by saccade's
    grader and by OpenMMReasoner's (measured before: 4 s quiet, 14 s under load, unbounded)."""
    for reply, sample in ((TOWER, {"answer": "3"}),
                          (f"<answer>{TOWER}</answer>", {"answer": "3", "scorer": Scorer("answer_tag", "openmmreasoner")})):
        worker().warm()  # the child's start (sympy's import) is never part of a call's limit
        cuts = worker().timeouts
        value, seconds = in_a_thread(lambda r=reply, s=sample: bounded.correct(r, s), 30)
        assert value == 0.0
        assert seconds < 5.0 + 3.0, seconds  # the limit, and the kill (measured about 5.1 s)
        assert worker().timeouts == cuts + 1
    # the next comparison gets a new child, and is right
    assert bounded.correct(r"$\frac{1}{2}$", {"answer": "0.5"}) == 1.0
    assert bounded.correct(r"$2\sqrt{3}$", {"answer": r"\sqrt{12}"}) == 1.0
    assert bounded.correct("<answer>0.5</answer>",
                                  {"answer": r"\frac{1}{2}", "scorer": Scorer("answer_tag", "openmmreasoner")}) == 1.0


def hanging_worker(monkeypatch, mode: str) -> ScoringWorker:
    """The process's scoring worker replaced by one whose child never returns (`mode`: what hangs,
    tests/rewards/hanging_bounded_child.py)."""
    child = Path(__file__).parent / "hanging_bounded_child.py"
    hanging = ScoringWorker(timeout_s=1.0, command=[sys.executable, str(child), mode])
    monkeypatch.setattr(bounded, "_worker", hanging)
    return hanging


def cut_at_the_limit(worker_: ScoringWorker, calls: dict) -> None:
    """Each call, from a thread, is cut at the worker's limit: it reached the child, which was killed."""
    for what, call in calls.items():
        worker_.warm()  # the child's start never counts against a call
        cuts = worker_.timeouts
        value, seconds = in_a_thread(call, worker_.timeout_s + 3.0)  # the limit, and the kill
        assert worker_.timeouts == cuts + 1, what
        assert isinstance(value, ScoringTimeout) or value in (0.0, "", False), (what, value)
    worker_.close()


def rewards_timeouts(sample: dict) -> float:
    """How many of a run's built-in rewards timed out on one answer (0.0 when none did)."""
    import asyncio

    from saccade.rewards.weighted import Rewards

    rewards = Rewards({"correct": 1.0})
    _, values = asyncio.run(rewards.score("2", sample=sample, messages=[]))
    return 0.0 if values["reward_timeouts"] == 1.0 else values["reward_timeouts"] + 1.0


def test_every_call_the_library_makes_into_scoring_reaches_the_child_and_is_cut(monkeypatch):
    judged = Scorer("mathvista", "mathvista", judge_url="http://127.0.0.1:9/v1")
    sample = {"answer": "2", "choices": ["1", "2"]}
    calls = {
        "the run's rewards (saccade.rewards.weighted.Rewards, as the rollout scores)": lambda: rewards_timeouts(sample),
        "reward format": lambda: bounded.reward("format", "\\boxed{2}", sample),
        "correct (an environment's)": lambda: bounded.correct("2", sample),
        "correct with a judge": lambda: bounded.reward("correct", "2", {**sample, "scorer": judged}),
        "extracted_answer": lambda: bounded.extracted_answer("2", sample),
        "extracted_answer with a judge": lambda: bounded.extracted_answer("2", {**sample, "scorer": judged}),
        "score": lambda: bounded.score("2", "2"),
        "math_equal": lambda: bounded.math_equal("2", "2"),
    }
    cut_at_the_limit(hanging_worker(monkeypatch, "ops"), calls)


def test_every_grader_is_cut_at_the_limit_when_math_verify_and_sympy_never_return(monkeypatch):
    """The graders that call math-verify or sympy, each given a reply that reaches that call."""
    replies = {"saccade": ("x+1", "1+x"), "openmmreasoner": ("\\frac{1}{2}", "0.5"), "mathruler": ("x+1", "1+x")}
    assert set(replies) | {"mathvista"} == set(GRADERS)  # mathvista's grader calls neither
    calls = {grader: (lambda g=grader, r=reply: bounded.reward(
        "correct", f"<answer>{r[0]}</answer> \\boxed{{{r[0]}}}", {"answer": r[1], "scorer": Scorer("answer_tag", g)}))
        for grader, reply in replies.items()}
    cut_at_the_limit(hanging_worker(monkeypatch, "math"), calls)


def test_without_math_verify_the_child_starts_and_scores_what_needs_no_math(monkeypatch):
    """The GPU machines' Python has no math-verify (docs/gpu-runs.md): the lease's RL stage scored
    every answer 0 when the child required it to start (found by scripts/gpu-device-check.sh)."""
    no_math = "import sys; sys.modules['math_verify'] = None; from saccade.rewards.bounded_child import serve; serve()"
    worker_ = ScoringWorker(command=[sys.executable, "-c", no_math])
    monkeypatch.setattr(bounded, "_worker", worker_)
    try:
        assert bounded.correct("The answer is blue.", {"answer": "blue", "choices": ["red", "blue"]}) == 1.0
        assert bounded.reward("format", "blue", {"choices": ["red", "blue"]}) == 1.0
        with pytest.raises(RuntimeError, match="math_verify"):  # a comparison that needs it says so
            bounded.reward("correct", "$\\frac{1}{2}$", {"answer": "0.5"})
    finally:
        worker_.close()


def test_a_child_that_cannot_start_is_an_error_that_says_so_not_a_timeout():
    broken = ScoringWorker(timeout_s=1.0, command=[sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready"):
        broken.call("reward", "correct", "2", {"answer": "2"})
    assert broken.timeouts == 0


def test_a_scorer_that_raises_in_the_child_says_so_with_its_traceback():
    with pytest.raises(RuntimeError, match="KeyError"):
        worker().call("reward", "no-such-reward", "x", {})


BOUNDED_ONLY = {"score", "grade", "correct_reward", "extract_answer", "extracted_answer", "math_equal"}
UNBOUNDED = ("saccade.rewards", "saccade.rewards.builtin", "saccade.rewards.protocols")  # and the modules themselves
UNBOUNDED_HOMES = {"__init__.py", "builtin.py", "protocols.py", "bounded.py", "bounded_child.py"}  # in rewards/
PROTOCOL_NAMES = {"EXTRACTORS", "GRADERS"}  # the protocols' names, no scoring: the config's choices


def test_the_library_scores_only_through_the_bounded_calls():
    """No module but the scorers' own homes imports an unbounded scoring function: a new caller on
    the rollout thread goes through saccade.rewards.bounded or this test goes red."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name in UNBOUNDED_HOMES and path.parent == SRC / "rewards":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in UNBOUNDED:
                imported = {alias.name for alias in node.names}
                names = imported & (BOUNDED_ONLY | {"builtin", "protocols"})
                if node.module == "saccade.rewards.protocols":
                    names = imported - PROTOCOL_NAMES
                if names:
                    offenders.append(f"{path.relative_to(SRC)}: from {node.module} import {sorted(names)}")
    assert offenders == [], offenders


def test_the_child_outlives_the_thread_that_started_it_and_dies_with_its_process():
    """The rollout loop's threads come and go: the child must not end with the one that happened
    to start it, and a run SIGKILLed while the child is stuck in a call (a power tower, a scorer
    that never returns) must not leave it running."""
    import os
    import subprocess

    hanging = Path(__file__).parent / "hanging_bounded_child.py"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, threading, time\n"
        "from saccade.rewards.bounded import ScoringWorker\n"
        f"w = ScoringWorker(timeout_s=600, command=[sys.executable, {str(hanging)!r}, 'ops'])\n"
        "t = threading.Thread(target=w.warm); t.start(); t.join()\n"
        "print(w.proc.pid, flush=True)\n"
        "threading.Thread(target=lambda: w.call('math_equal', '3', '3', None), daemon=True).start()\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)

    def alive(pid: int) -> bool:
        try:
            return open(f"/proc/{pid}/stat").read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)
        assert alive(child)  # its starting thread has ended, the child has not: it is stuck in the call
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not alive(child)
    finally:
        if alive(child):
            os.kill(child, 9)
