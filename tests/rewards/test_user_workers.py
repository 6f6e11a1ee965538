"""A user's reward functions in worker processes (saccade.rewards.user_workers), seen through
`Rewards.score` as a rollout step calls it: a call past its limit is cut and its process killed
(what it started too), a blocked async loop is told from a slow call and killed, a worker that
dies fails one call, nothing accumulates over many overruns, the workers end with `close()` and
with their process. The functions are tests/reward_helpers.py's; each returns its worker's pid."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

from reward_helpers import alive, worker_pids
from saccade.data.questions import VQASample
from saccade.rewards import user_workers
from saccade.rewards.user_workers import SYNC_WORKERS
from saccade.rewards.weighted import Rewards

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SLACK_S = 1.0  # past a call's limit, on a loaded 2-core machine


def score(rewards: Rewards, *texts: str, sample=None) -> list[dict]:
    """The answers' values, scored together on one event loop, as a rollout step scores them."""
    async def all_of_them():
        return await asyncio.gather(*(rewards.score(t, sample=sample, messages=[]) for t in texts))
    return [values for _, values in asyncio.run(all_of_them())]


def eventually(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def timed(rewards: Rewards, *texts: str) -> tuple[list[dict], float]:
    start = time.perf_counter()
    values = score(rewards, *texts)
    return values, time.perf_counter() - start


def test_an_overrunning_sync_call_is_cut_and_its_worker_killed(make_rewards):
    r = make_rewards({"reward_helpers:pid": 1.0}, timeout_s=0.5)
    [warm] = score(r, "warm")  # the pool's first worker starts (not counted in a call's limit)
    first = int(warm["reward_pid"])
    assert worker_pids() == {first}
    [cut], took = timed(r, "sleep")  # served by that same worker
    assert cut["reward_timeouts"] == 1 and cut["reward_pid"] == 0 and took < 0.5 + SLACK_S
    assert not alive(first) and worker_pids() == set()  # killed and reaped before the call returned
    [after] = score(r, "after")
    assert after["reward_timeouts"] == 0 and int(after["reward_pid"]) not in (0, first)  # a fresh worker


def test_overrunning_calls_leave_no_thread_or_process_behind(make_rewards):
    # Threads are told by identity, not counted: threads of earlier tests on this pytest worker (tqdm's
    # monitor, an unclosed client's loop) may end meanwhile, which a count would take for ours ending.
    before = set(threading.enumerate())

    def ours() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before]

    r = make_rewards({"reward_helpers:pid": 1.0}, timeout_s=0.3)
    results = score(r, *["sleep"] * 10) + score(r, *["sleep"] * 10)  # 20 overruns, 10 at once
    assert [v["reward_timeouts"] for v in results] == [1.0] * 20
    assert worker_pids() == set()  # every worker that overran is gone
    # The workers' loop thread; each live child adds a reaper thread (asyncio's, on 3.11) until it is reaped.
    assert eventually(lambda: len(ours()) <= 1, 2.0), ours()
    assert len({int(v["reward_pid"]) for v in score(r, *["x"] * 12)}) <= SYNC_WORKERS  # bounded pool
    assert len(worker_pids()) <= SYNC_WORKERS and len(ours()) <= 1 + SYNC_WORKERS
    r.close()
    assert worker_pids() == set()
    assert eventually(lambda: ours() == [], 2.0), ours()


def test_what_an_overrunning_call_started_is_killed_with_it(make_rewards, tmp_path):
    r = make_rewards({"reward_helpers:spawns": 1.0}, timeout_s=1.0)
    [cut] = score(r, str(tmp_path / "pid"))
    assert cut["reward_timeouts"] == 1
    started = int((tmp_path / "pid").read_text())
    assert eventually(lambda: not alive(started), 2.0)  # the worker's whole process group was killed


@pytest.mark.parametrize(("how", "said"), [("exit", "exit code 1"), ("segfault", "killed by SIGSEGV")])
def test_a_worker_that_dies_fails_its_call_and_the_next_call_works(make_rewards, caplog, how, said):
    r = make_rewards({"reward_helpers:pid": 1.0}, timeout_s=30)
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        [died] = score(r, how)
    assert died["reward_errors"] == 1 and died["reward_timeouts"] == 0
    [record] = caplog.records
    assert f"its worker process died during the call ({said})" in str(record.exc_info[1])
    [after] = score(r, "after")
    assert after["reward_errors"] == 0 and after["reward_pid"] > 0


def test_a_blocking_async_function_is_cut_and_a_fresh_worker_takes_the_next_calls(make_rewards, caplog,
                                                                                   monkeypatch):
    monkeypatch.setattr(user_workers, "CANCEL_GRACE_S", 0.5)
    r = make_rewards({"reward_helpers:async_pid": 1.0}, timeout_s=0.5)
    [warm] = score(r, "warm")
    first = int(warm["reward_async_pid"])
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        [cut], took = timed(r, "block")  # time.sleep inside async def: the worker's loop stops
        assert cut["reward_timeouts"] == 1 and took < 0.5 + SLACK_S
        assert eventually(lambda: not alive(first), 0.5 + SLACK_S)  # no answer to the cancel: killed
        [after] = score(r, "after")
    assert after["reward_timeouts"] == 0 and int(after["reward_async_pid"]) not in (0, first)
    blocked = [rec.getMessage() for rec in caplog.records if "blocks its event loop" in rec.getMessage()]
    assert len(blocked) == 1 and "'reward_helpers:async_pid'" in blocked[0]


def test_a_slow_async_call_is_cancelled_and_its_worker_lives_on(make_rewards, caplog, monkeypatch):
    monkeypatch.setattr(user_workers, "CANCEL_GRACE_S", 0.5)
    r = make_rewards({"reward_helpers:async_pid": 1.0}, timeout_s=0.5)
    [warm] = score(r, "warm")
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        [cut], took = timed(r, "slow")  # awaits: its loop runs, and answers the cancel
        time.sleep(0.5 + 0.5)
        [after] = score(r, "after")
    assert cut["reward_timeouts"] == 1 and took < 0.5 + SLACK_S
    assert after["reward_async_pid"] == warm["reward_async_pid"]  # the same worker
    assert not [rec for rec in caplog.records if "blocks its event loop" in rec.getMessage()]


def test_what_cannot_cross_to_a_worker_is_an_error_that_says_so(make_rewards, caplog, monkeypatch):
    made = types.ModuleType("made_at_run_time")  # importable here, not in a fresh process
    exec("def f(completion):\n    return 1.0\n", made.__dict__)
    monkeypatch.setitem(sys.modules, "made_at_run_time", made)
    r = make_rewards({"reward_helpers:takes_sample": 1.0, "reward_helpers:returns_generator": 1.0,
                      "made_at_run_time:f": 1.0})
    sample = VQASample("q1", [], "Which?", "red", None, "free_form", metadata={"lock": threading.Lock()})
    with caplog.at_level(logging.WARNING, logger="saccade.scoring"):
        [values] = score(r, "red", sample=sample)
        [again] = score(r, "red", sample=sample)
    assert values["reward_errors"] == again["reward_errors"] == 3
    said = {rec.getMessage().split("'")[1]: str(rec.exc_info[1]) for rec in caplog.records}
    assert "cannot be sent to its worker process (they do not pickle" in said["reward_helpers:takes_sample"]
    assert "returned generator, not a float" in said["reward_helpers:returns_generator"]
    assert "could not import it" in said["made_at_run_time:f"] and "fresh Python process" in said["made_at_run_time:f"]


def test_close_with_calls_in_flight_ends_them(make_rewards):
    """The run's end while another thread still scores: its calls end (scored 0), none waits forever."""
    r = make_rewards({"reward_helpers:pid": 1.0, "reward_helpers:async_pid": 1.0}, timeout_s=600)
    scored: list[dict] = []
    scoring = threading.Thread(target=lambda: scored.extend(score(r, "sleep", "slow")))
    scoring.start()
    assert eventually(lambda: len(worker_pids()) == 3, 30.0)  # two sync workers, one async
    time.sleep(0.3)
    r.close()
    scoring.join(5.0)
    assert not scoring.is_alive() and worker_pids() == set()
    # "sleep": the sync call's worker killed under it (an error); "slow": the async one's (cut, as a timeout).
    assert [(v["reward_errors"], v["reward_timeouts"]) for v in scored] == [(1.0, 0.0), (0.0, 1.0)]


PARENT = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from saccade.rewards.weighted import Rewards

rewards = Rewards({{"reward_helpers:pid": 1.0}}, timeout_s=600)

async def main():
    _, values = await rewards.score("warm", sample=None, messages=[])
    print(int(values["reward_pid"]), flush=True)
    await rewards.score("sleep", sample=None, messages=[])  # the same worker, busy for 600 s

asyncio.run(main())
"""


def test_workers_die_with_their_process():
    """A busy worker (not reading its pipe) dies with a parent killed by SIGKILL: PR_SET_PDEATHSIG."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PARENT.format(tests=str(Path(__file__).parents[1])))],
                              stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.5)  # the "sleep" call reaches the worker
        assert alive(worker)
    finally:
        parent.kill()
        parent.wait()
    assert eventually(lambda: not alive(worker), 5.0)
