"""Children that end with the process that started them (saccade.parent_death), on real
processes: a parent started here starts its children, is SIGKILLed (nothing of its own runs
after that: no atexit, no finally), and its children must be gone within seconds. The whole
`saccade bench async` so: tests/tools/bench/test_async_rollouts.py (long: a vLLM server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from saccade.tools.bench import rl_command, rl_death_signal
from saccade.tools.launcher.supervisor import alive, start_time

SLEEPER = "import time; time.sleep(600)"
# A child that ignores SIGTERM, as `saccade rl` defers it (it finishes its step first).
DEFERS_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
                 "time.sleep(600)"
GONE_WITHIN_S = 5.0


def children_of_a_killed_parent(code: str) -> tuple[list[tuple[int, int]], float]:
    """Run `code` in a parent process; it prints its children's pids, one line each, then the
    line 'started'. SIGKILL it; the children as (pid, start time), and how long they took to end
    after the kill (they are SIGKILLed here, and the test fails, past GONE_WITHIN_S)."""
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    children: list[tuple[int, int]] = []
    try:
        for line in parent.stdout:
            if line.strip() == "started":
                break
            pid = int(line)
            children.append((pid, start_time(pid)))
        assert children and all(alive(pid) for pid, _ in children), children
        parent.kill()
        parent.wait(timeout=10)
        killed = time.perf_counter()
        while any(running(child) for child in children) and time.perf_counter() - killed < GONE_WITHIN_S:
            time.sleep(0.02)
        return children, time.perf_counter() - killed
    finally:
        for child in children:
            if running(child):
                os.kill(child[0], signal.SIGKILL)


def running(child: tuple[int, int]) -> bool:
    """The same process (pid and start time: pids are reused) still runs."""
    pid, started = child
    return start_time(pid) == started and alive(pid)


def test_children_started_by_start_child_and_run_child_end_with_their_killed_parent():
    # run_child waits for its child, which says its own pid and that all have started.
    last = "import os, time; print(os.getpid()); print('started', flush=True); time.sleep(600)"
    code = (f"import signal, subprocess, sys; from saccade.parent_death import run_child, start_child\n"
            f"a = start_child([sys.executable, '-c', {SLEEPER!r}])\n"
            f"b = start_child([sys.executable, '-c', {DEFERS_SIGTERM!r}], death_signal=signal.SIGKILL, "
            f"stdout=subprocess.PIPE, text=True)\n"
            f"b.stdout.readline()\n"
            f"print(a.pid); print(b.pid, flush=True)\n"
            f"run_child([sys.executable, '-c', {last!r}])\n")
    children, took = children_of_a_killed_parent(code)
    assert len(children) == 3 and not any(running(c) for c in children), f"still running {took:.1f} s after the kill"
    print(f"all three gone {took:.2f} s after the parent's SIGKILL")


def test_a_server_process_ends_with_the_bench_or_demo_that_started_it(tmp_path):
    """`ServerProcess.start`, as `served` runs it for `saccade bench async`, `bench kill`, `bench
    engine-parity` and `saccade demo --engine vllm`; the server's command is a stand-in (its
    start, not vLLM, is under test; a real server's SIGTERM ends its engine processes too: the
    long bench test)."""
    code = (f"import sys, time; from saccade.serving.launch import ServerProcess\n"
            f"server = ServerProcess('tiny', log_path={str(tmp_path / 'serve.log')!r})\n"
            f"server.cmd = [sys.executable, '-c', {SLEEPER!r}]\n"
            f"server.start(); print(server.proc.pid, flush=True); print('started', flush=True); time.sleep(600)\n")
    children, took = children_of_a_killed_parent(code)
    assert not any(running(c) for c in children), f"the server still runs {took:.1f} s after its starter's SIGKILL"


def test_a_benchs_saccade_rl_is_killed_and_torchrun_asked_to_end_its_ranks():
    # SIGTERM would have `saccade rl` finish its step first, with its server gone with the bench.
    assert rl_death_signal(rl_command("run.toml", 1)) == signal.SIGKILL
    # torchrun forwards SIGTERM to its ranks (in sessions of their own); a SIGKILL would orphan them.
    assert rl_death_signal(rl_command("run.toml", 2)) == signal.SIGTERM


def test_a_child_runs_on_the_cores_it_is_given_and_on_all_without():
    from saccade.parent_death import start_child

    ours = sorted(os.sched_getaffinity(0))
    say_cores = "import os; print(sorted(os.sched_getaffinity(0)))"
    for cores, expected in (([ours[0]], [ours[0]]), (None, ours), ([], ours)):
        child = start_child([sys.executable, "-c", say_cores], cores=cores, stdout=subprocess.PIPE, text=True)
        assert child.communicate(timeout=30)[0].strip() == str(expected), cores
