"""The launcher's supervisor (saccade.tools.launcher.supervisor) on real processes: a small HTTP server
in a server's place and a script in the trainer's (tests/tools/launcher/health_server.py and
steps_trainer.py), so that restarts, interrupts and the final sweep are checked in seconds. The
same with vLLM servers and `saccade rl`: tests/tools/launcher/test_launch_vllm.py."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from saccade.tools.launcher.plan import Process
from saccade.tools.launcher import supervisor
from saccade.tools.launcher.ports import url_port
from saccade.tools.launcher.supervisor import (ENDED_FILE, LAUNCH_DIR, Child, Log, RestartBudget, alive, look_after,
                                               process_tree, restart_delay, supervise, write_or_warn)
from saccade.serving.launch import free_port

HERE = Path(__file__).parent


def processes(run: Path, *, trainer_args: tuple[str, ...] = (), server_args: tuple[str, ...] = ()):
    port = free_port()
    server = Process("server 0", (sys.executable, str(HERE / "health_server.py"), str(port), *server_args),
                     {"SACCADE_TEST": "1"}, f"http://127.0.0.1:{port}")
    trainer = Process("trainer", (sys.executable, str(HERE / "steps_trainer.py"), str(run), *trainer_args))
    return [server, trainer]


def wait_for(condition, timeout_s: float = 60.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


def pids(run: Path) -> dict[str, int]:
    path = run / LAUNCH_DIR / "pids.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def answers(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def in_thread(action, run_dir: Path) -> threading.Thread:
    """`action` on a thread beside the supervisor; if it fails, the trainer is told to finish, so
    that the supervisor returns and the test reports the failure."""
    errors: list[BaseException] = []

    def run():
        try:
            action()
        except BaseException as err:  # noqa: BLE001 - re-raised by the test after supervise returns
            errors.append(err)
            (run_dir / "finish").touch()

    thread = threading.Thread(target=run, daemon=True)
    thread.errors = errors
    thread.start()
    return thread


def test_a_killed_server_is_started_again_and_everything_stops_when_the_trainer_ends(tmp_path):
    plan = processes(tmp_path)
    url = plan[0].url
    seen: list[int] = []

    def kill_the_server_then_finish():
        wait_for(lambda: "trainer" in pids(tmp_path) and (tmp_path / "grandchild.pid").exists())
        first = pids(tmp_path)["server 0"]
        seen.extend(process_tree(pids(tmp_path)["trainer"]))
        os.killpg(first, signal.SIGKILL)
        wait_for(lambda: pids(tmp_path)["server 0"] != first and answers(url))  # started again, on its port
        seen.append(pids(tmp_path)["server 0"])
        (tmp_path / "finish").touch()

    out = io.StringIO()
    helper = in_thread(kill_the_server_then_finish, tmp_path)
    code = supervise(plan, urls=[url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60, resume_hint="-",
                     log=Log(out))
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert code == 0
    log = out.getvalue()
    assert f"[launch] {url} answers" in log and "[server 0] listening on" in log and "[trainer] step 1" in log
    assert "[launch] server 0 exited with -9: starting it again in 2 s (1 of 3)" in log
    assert "[launch] the trainer finished; every process started here has stopped" in log
    # each process's own log, restarts appended
    assert (tmp_path / LAUNCH_DIR / "server-0.log").read_text().count("listening on") == 2
    # nothing left: the trainer's child in a session of its own (as torchrun's workers) included
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert grandchild in seen
    assert not [p for p in seen if alive(p)]
    assert not answers(url)


def test_ctrl_c_asks_the_trainer_to_stop_then_stops_the_servers(tmp_path):
    plan = processes(tmp_path)

    def interrupt_once_running():
        wait_for(lambda: "step 3" in (tmp_path / LAUNCH_DIR / "trainer.log").read_text()
                 if (tmp_path / LAUNCH_DIR / "trainer.log").exists() else False)
        os.kill(os.getpid(), signal.SIGINT)

    out = io.StringIO()
    helper = in_thread(interrupt_once_running, tmp_path)
    start = time.time()
    code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                     resume_hint="saccade launch run.toml --resume", log=Log(out))
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert code == 130 and time.time() - start < 30
    log = out.getvalue()
    assert "[launch] stopping: the trainer saves a checkpoint after the step under way" in log
    assert "[trainer] stopped on request" in log  # it saw the STOP file
    assert "[launch] stopped on request, with a checkpoint; go on with: saccade launch run.toml --resume" in log
    assert not alive(int((tmp_path / "grandchild.pid").read_text()))


def test_a_second_ctrl_c_stops_everything_at_once(tmp_path):
    plan = processes(tmp_path, trainer_args=("--ignore-stop",))  # a trainer in a step that does not end

    def interrupt_twice():
        wait_for(lambda: (tmp_path / "grandchild.pid").exists() and "trainer" in pids(tmp_path))
        os.kill(os.getpid(), signal.SIGINT)
        wait_for(lambda: (tmp_path / "STOP").exists())
        os.kill(os.getpid(), signal.SIGINT)

    out = io.StringIO()
    helper = in_thread(interrupt_twice, tmp_path)
    code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                     resume_hint="-", log=Log(out))
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert code == 130 and "[launch] stopping at once" in out.getvalue()
    assert "with a checkpoint; go on" not in out.getvalue()  # none was saved
    assert "[launch] stopped at once; go on from the run's last checkpoint with: -" in out.getvalue()
    assert not alive(int((tmp_path / "grandchild.pid").read_text()))
    assert not alive(pids(tmp_path)["trainer"]) and not alive(pids(tmp_path)["server 0"])


def test_a_server_that_cannot_start_ends_the_launch_with_its_log(tmp_path):
    plan = processes(tmp_path, server_args=("--fail",))
    out = io.StringIO()
    code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                     resume_hint="-", log=Log(out))
    assert code == 1
    log = out.getvalue()
    assert "[launch] error: server 0 exited with 3 before it answered" in log and "cannot start: --fail" in log
    assert "trainer" not in pids(tmp_path)  # never started


def test_a_node_without_trainer_ranks_serves_until_the_trainers_node_has_ended(tmp_path):
    server = processes(tmp_path)[0]

    def end_the_run():
        wait_for(lambda: answers(server.url))
        time.sleep(1.0)
        assert answers(server.url)  # still up: nothing said the run ended
        (tmp_path / LAUNCH_DIR / ENDED_FILE).write_text("done\n")  # what the trainer's node writes

    out = io.StringIO()
    helper = in_thread(end_the_run, tmp_path)
    code = supervise([server], urls=[server.url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                     resume_hint="-", log=Log(out))
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert code == 0 and "[launch] the trainer's node has ended: stopping the servers" in out.getvalue()
    assert not answers(server.url) and not alive(pids(tmp_path)["server 0"])


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path):
    """SIGKILL to the launcher (the OOM killer, a scheduler) leaves no server or trainer behind:
    each child gets SIGTERM when its parent dies (PR_SET_PDEATHSIG)."""
    code = ("import sys; from pathlib import Path; from saccade.tools.launcher.plan import Process; "
            "from saccade.tools.launcher.supervisor import supervise; "
            f"plan = {[(p.name, p.argv, p.env, p.url) for p in processes(tmp_path)]!r}; "
            "ps = [Process(*p) for p in plan]; "
            f"supervise(ps, urls=[ps[0].url], run_dir=Path({str(tmp_path)!r}), max_restarts=3, "
            "ready_timeout_s=60, resume_hint='-')")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: "trainer" in pids(tmp_path) and (tmp_path / "grandchild.pid").exists())
        children = [pids(tmp_path)["server 0"], pids(tmp_path)["trainer"]]
        launcher.kill()
        launcher.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in children), timeout_s=20)
    finally:
        grandchild = tmp_path / "grandchild.pid"  # the trainer's own child, which only a launcher stops
        for pid in [*pids(tmp_path).values(), *([int(grandchild.read_text())] if grandchild.exists() else [])]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


# A trainer that prints far more than a pipe holds (~64 KB), then ends: it ends only while the
# launcher drains its output.
LOUD_TRAINER = ("import sys\n"
                "for i in range(4000):\n"
                "    print(f'line {i} ' + 'x' * 100, flush=True)\n")


def loud_plan(run: Path) -> list[Process]:
    server, _ = processes(run)
    return [server, Process("trainer", (sys.executable, "-c", LOUD_TRAINER))]


def test_a_full_disk_under_the_logs_drops_lines_with_one_warning_and_never_blocks_a_child(tmp_path):
    """Each process's log file on a full disk (/dev/full: every write fails with ENOSPC): the
    launcher goes on draining the pipes, so the trainer's ~450 KB of output never blocks it."""
    plan = loud_plan(tmp_path)
    (tmp_path / LAUNCH_DIR).mkdir()
    for name in ("server-0.log", "trainer.log"):
        (tmp_path / LAUNCH_DIR / name).symlink_to("/dev/full")
    out = io.StringIO()
    start = time.time()
    code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                     resume_hint="-", log=Log(out))
    assert code == 0 and time.time() - start < 30
    log = out.getvalue()
    assert "[trainer] line 3999 " in log  # every line still reaches the launcher's own stream
    warnings = [line for line in log.splitlines() if "cannot write" in line and "trainer.log" in line]
    assert len(warnings) == 1, warnings
    assert "No space left on device" in warnings[0]


def test_a_closed_stdout_never_blocks_a_child(tmp_path):
    """The launcher's stream a pipe nobody reads any more (`saccade launch ... | head -1`): its
    lines are dropped, each process's own log keeps them all, and the trainer runs to its end."""
    plan = loud_plan(tmp_path)
    read, write = os.pipe()
    os.close(read)
    stream = os.fdopen(write, "w")
    start = time.time()
    try:
        code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                         resume_hint="-", log=Log(stream))
    finally:
        try:
            stream.close()
        except OSError:
            pass
    assert code == 0 and time.time() - start < 30
    assert "line 3999 " in (tmp_path / LAUNCH_DIR / "trainer.log").read_text()


def test_the_launcher_ends_cleanly_when_its_stdout_is_closed(tmp_path):
    """`saccade launch ... | head -1`, for real: the reader goes after one line; the launcher runs
    the trainer to its end and exits with its status, with no traceback."""
    plan = loud_plan(tmp_path)
    code = ("from pathlib import Path; from saccade.tools.launcher.plan import Process; "
            "from saccade.tools.launcher.supervisor import supervise; "
            f"ps = [Process(*p) for p in {[(p.name, p.argv, p.env, p.url) for p in plan]!r}]; "
            f"raise SystemExit(supervise(ps, urls=[ps[0].url], run_dir=Path({str(tmp_path)!r}), max_restarts=3, "
            "ready_timeout_s=60, resume_hint='-'))")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        launcher.stdout.readline()
        launcher.stdout.close()  # head -1 exits
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"Exception ignored" not in err, err.decode()
    assert "line 3999 " in (tmp_path / LAUNCH_DIR / "trainer.log").read_text()


def stranger_on(port: int) -> subprocess.Popen:
    """Another process serving /health on `port` (a server left from an earlier run)."""
    stranger = subprocess.Popen([sys.executable, str(HERE / "health_server.py"), str(port)], stdout=subprocess.DEVNULL)
    wait_for(lambda: answers(f"http://127.0.0.1:{port}"), timeout_s=20)
    return stranger


def test_a_port_held_by_another_process_is_refused_by_name_before_the_server_starts(tmp_path):
    plan = processes(tmp_path)
    stranger = stranger_on(url_port(plan[0].url))
    try:
        out = io.StringIO()
        code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                         resume_hint="-", log=Log(out))
        assert code == 1
        log = out.getvalue()
        assert f"[launch] error: port {url_port(plan[0].url)} of server 0 ({plan[0].url}) is already held by pid " \
               f"{stranger.pid} (" in log and "health_server.py" in log
        assert pids(tmp_path) == {}  # nothing started
        assert stranger.poll() is None  # and nothing of the stranger's stopped
    finally:
        stranger.kill()
        stranger.wait()


def test_a_url_answered_by_a_stranger_before_our_server_binds_is_refused(tmp_path):
    """Today's race: the port was free when checked, but another process bound it while our server
    loaded; its 200 must not be taken for our server's."""
    plan = processes(tmp_path, server_args=("--delay", "5"))
    strangers: list[subprocess.Popen] = []
    helper = in_thread(lambda: (wait_for(lambda: "server 0" in pids(tmp_path)),
                                strangers.append(stranger_on(url_port(plan[0].url)))), tmp_path)
    try:
        out = io.StringIO()
        code = supervise(plan, urls=[plan[0].url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60,
                         resume_hint="-", log=Log(out))
        helper.join(timeout=10)
        assert not helper.errors, helper.errors
        assert code == 1
        assert (f"[launch] error: {plan[0].url} answers, but not from server 0: port {url_port(plan[0].url)} is held "
                f"by pid {strangers[0].pid} (") in out.getvalue()
        assert "trainer" not in pids(tmp_path)
    finally:
        for stranger in strangers:
            stranger.kill()
            stranger.wait()


def test_a_reader_of_the_pids_file_never_sees_it_emptied_or_half_written(tmp_path):
    """pids.json is rewritten at each (re)start while a user's script, or this file's tests, read it:
    each read is the old list or the new (a file truncated, then written, was read empty in CI)."""
    path, done, seen = tmp_path / "pids.json", threading.Event(), []

    def read_all_the_while():
        while not done.is_set():
            seen.append(path.read_text())

    write_or_warn(path, json.dumps({"server 0": 1}) + "\n", Log(io.StringIO()))
    reader = threading.Thread(target=read_all_the_while)
    reader.start()
    try:
        for pid in range(2, 400):
            write_or_warn(path, json.dumps({"server 0": pid, "trainer": 1}) + "\n", Log(io.StringIO()))
    finally:
        done.set()
        reader.join()
    assert len(seen) > 100 and all(json.loads(text)["server 0"] > 0 for text in seen)


def test_restarts_back_off():
    assert [restart_delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 32, 60, 60]


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Exited:
    """A server process that has exited (or runs, code None) without a process behind it: the
    supervisor only signals a running one, and this one exits before anything would."""

    pid = 2**31 - 1  # no such process

    def __init__(self):
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout=None) -> int | None:
        return self.code


def test_the_restart_budget_refills_after_a_healthy_life_and_not_before(tmp_path):
    """look_after on a fake clock: two restarts of a budget of two, then an hour up and answering
    gives the server its two restarts back; a server failing within the hour is given up."""
    clock = Clock(1000.0)
    out = io.StringIO()
    child = Child(Process("server 0", ("-",), {}, f"http://127.0.0.1:{free_port()}"), Log(out), tmp_path)
    down: set[str] = set()

    def started(c: Child) -> None:  # the supervisor's start, without a process
        c.proc, c.started_at, c.answered_at = Exited(), clock.now, clock.now

    def turn() -> None:
        look_after(child, budget=RestartBudget(2, refill_after_s=3600.0), log=child.log, started=started,
                   allowances=(1800.0, 120.0), down=down, clock=clock)

    def up_and_answering_for(seconds: float) -> None:
        clock.now += seconds
        child.answered_at = clock.now
        turn()

    def crash_and_restart() -> None:
        child.proc.code = 1
        turn()  # ended, its restart scheduled after the backoff
        if child.restart_at is not None:
            clock.now = child.restart_at
            turn()  # started again

    started(child)
    crash_and_restart()
    up_and_answering_for(3599.0)
    crash_and_restart()
    assert child.restarts == 2 and not down  # the first life after a restart was 1 s short of the hour
    up_and_answering_for(3599.0)
    assert child.restarts == 2
    up_and_answering_for(1.0)
    assert child.restarts == 0
    assert "[launch] server 0 has run 3600 s since its last start and answers: its restarts count from 0 again " \
           "(launch.restart_budget_reset_s 3600 s)" in out.getvalue()
    crash_and_restart()
    crash_and_restart()
    assert child.restarts == 2 and not down  # two more, in quick succession
    crash_and_restart()
    assert down == {"server 0"}
    assert "server 0 exited with 1, after 2 restarts with none of its lives up 3600 s (launch.max_restarts, " \
           "launch.restart_budget_reset_s): it stays down" in out.getvalue()


def test_a_server_that_never_answered_in_its_life_keeps_its_count():
    budget = RestartBudget(3, refill_after_s=60.0)
    child = Child(Process("server 0", ("-",), {}, "http://127.0.0.1:1"), Log(io.StringIO()), Path("."))
    child.restarts, child.started_at = 2, 0.0
    assert not budget.refills(child, now=1e6)  # loading all along (ready_timeout_s bounds that)
    child.answered_at = 10.0
    assert budget.refills(child, now=60.0) and not budget.refills(child, now=59.9)
    child.restarts = 0
    assert not budget.refills(child, now=1e6)  # nothing to refill


def test_a_hung_server_is_ended_and_started_again_within_its_bound(tmp_path, monkeypatch):
    """SIGSTOP on the server process: it still holds its port, so the kernel accepts connections,
    but nothing answers. Bound: silent hang_after_s after its last answer, ended within
    HUNG_GRACE_S, started again after restart_delay(1) = 2 s."""
    monkeypatch.setattr(supervisor, "PROBE_EVERY_S", 0.2)
    monkeypatch.setattr(supervisor, "PROBE_TIMEOUT_S", 1.0)
    plan = processes(tmp_path)
    url = plan[0].url
    took: list[float] = []

    def freeze_the_server_then_finish():
        wait_for(lambda: "trainer" in pids(tmp_path))
        first = pids(tmp_path)["server 0"]
        frozen = time.time()
        os.kill(first, signal.SIGSTOP)
        wait_for(lambda: pids(tmp_path)["server 0"] != first and answers(url), timeout_s=60)
        took.append(time.time() - frozen)
        assert not alive(first)
        (tmp_path / "finish").touch()

    out = io.StringIO()
    helper = in_thread(freeze_the_server_then_finish, tmp_path)
    code = supervise(plan, urls=[url], run_dir=tmp_path, max_restarts=3, ready_timeout_s=60, resume_hint="-",
                     log=Log(out), hang_after_s=4.0)  # 2 s flaked on the loaded 2-core machine
    helper.join(timeout=10)
    assert not helper.errors, helper.errors
    assert code == 0
    assert re.search(r"\[launch\] server 0 has not answered /health for \d+ s \(launch.hang_after_s 4 s\): taken as "
                     r"hung: starting it again in 2 s \(1 of 3\); the count goes back to 0 once it has run 3600 s "
                     r"\(launch.restart_budget_reset_s\)", out.getvalue()), out.getvalue()
    assert took[0] < 4.0 + 1.0 + supervisor.HUNG_GRACE_S + 2.0 + 5.0  # + 5 s for the new process to answer
