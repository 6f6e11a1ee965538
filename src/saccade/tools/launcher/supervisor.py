"""Running one node's processes (`saccade launch`): start the servers, wait until every server of
the layout answers, start the trainer, stream everything as one log with a prefix per process,
start again a server that dies or hangs, and stop every process started here when the trainer
ends, fails or is interrupted.

A server's port must be free before it starts, and the server that answers at its URL must be
ours: a port held by another process is refused by name (`ports`). A server that stops
answering /health for `launch.hang_after_s` is taken as hung; it is then ended with all its
processes, as one that exited is, and started again after a backoff (2 s, 4 s, ... up to 60 s),
at most `launch.max_restarts` times in a row: a server that has run
`launch.restart_budget_reset_s` in one life, answering, has its count back at 0 (`RestartBudget`),
so a week-long run does not give up for good on a server that failed three times in a week.

Each process starts in a session of its own, so the terminal's Ctrl-C reaches the launcher
alone, and the launcher decides:
- the first Ctrl-C (or SIGTERM) asks the trainer to stop after its step with a checkpoint, by
  the run folder's STOP file (`saccade.stopping`): torchrun would forward a signal to its
  workers and kill them 30 s later, a file it never sees. The servers stay up until the
  trainer is done with them;
- a second one stops everything at once (SIGTERM, then SIGKILL after `KILL_AFTER_S`).
A process's children are stopped with it, also those in sessions of their own (torchrun's
workers): the launcher walks /proc for them before it signals.

On a node without trainer ranks (several machines) the servers run until the trainer's node
says it ended, in the shared run folder (`ENDED_FILE`), or until interrupted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from saccade.atomic import write_file_atomically
from saccade.parent_death import start_child
from saccade.tools.launcher.plan import Process
from saccade.tools.launcher.ports import foreign_listener, port_taken, url_port
from saccade.stopping import STOP_FILE, stopped_since, written_since

# Folder under the run folder with each process's log and the pids started.
LAUNCH_DIR = "launch"
ENDED_FILE = "ended"  # written by the trainer's node when it is done: other nodes stop their servers
KILL_AFTER_S = 30.0  # from SIGTERM to SIGKILL
POLL_S = 0.5
PROBE_EVERY_S = 5.0  # a running server's /health, asked this often ...
PROBE_TIMEOUT_S = 5.0  # ... and waited for this long
HUNG_GRACE_S = 5.0  # a dead or hung server's processes: from SIGTERM to SIGKILL
RESTART_BACKOFF_S = 2.0  # before a server's first restart; doubled for each one after ...
MAX_BACKOFF_S = 60.0  # ... up to this


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name: state, ppid, ... (None: no such process)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot): with the pid, a process's identity (pids are reused)."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (Linux: /proc), whatever their session."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        fields = _stat(entry.name) if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def send(pid: int, sig: int) -> None:
    """`sig` to `pid`, if it still exists."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie has exited: only its parent's wait is missing)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


class Log:
    """The launcher's one stream: each line of each process with its name in front.

    A stream that fails once (nobody reads the pipe any more, as after `saccade launch ... |
    head -1`; a full disk under a redirect) is given up with one warning on stderr: the lines
    after it are dropped, never left to block the thread that writes them, and so the child whose
    output that thread drains. Each process's own log file (<run>/launch/NAME.log) has them all."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.lock = threading.Lock()
        self.given_up = False

    def line(self, name: str, text: str) -> None:
        with self.lock:
            if self.given_up:
                return
            try:
                self.stream.write(f"[{name}] {text}\n")
                self.stream.flush()
            except (OSError, ValueError) as err:  # ValueError: a stream closed under us
                self.given_up = True
                to_devnull(self.stream)
                warn(f"saccade launch: its output cannot be written any more ({err}); the run goes on, and each "
                     "process's log goes on in the run folder's launch/ folder")

    def say(self, text: str) -> None:
        self.line("launch", text)


def to_devnull(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null, so that what is still in its buffer, flushed
    at exit, goes nowhere instead of raising again (Python's 'Exception ignored ... BrokenPipeError')."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass  # not a file (a StringIO), or already closed: nothing will flush into it


def warn(text: str) -> None:
    """One line on stderr, if stderr can still take it."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def write_or_warn(path: Path, text: str, log: Log) -> None:
    """A small file of the launcher's own (pids, the end mark), replaced whole: a reader (a user's
    script, another node) sees the old text or the new, never an emptied file. One that cannot be
    written (a full disk) is said in the log and does not stop the launcher from stopping what it
    started."""
    try:
        write_file_atomically(path, text.encode())
    except OSError as err:
        log.say(f"cannot write {path} ({err.strerror or err})")


class Child:
    """A started process: its output streamed to the log and to <run>/launch/<name>.log."""

    def __init__(self, process: Process, log: Log, log_dir: Path):
        self.process = process
        self.log = log
        self.log_path = log_dir / (process.name.replace(" ", "-") + ".log")
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.reader: threading.Thread | None = None
        self.started_at = 0.0
        self.answered_at: float | None = None  # a server's last 200 from /health, this life
        self.restart_at: float | None = None  # a server waiting out its backoff
        # Every process seen below it, pid -> start time: a child that outlives its parent (in a
        # session of its own, as torchrun's workers) is stopped with it all the same.
        self.seen: dict[int, int] = {}

    @property
    def name(self) -> str:
        return self.process.name

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.process.env}
        # SIGTERM when the launcher dies, even by SIGKILL: no server is left holding a GPU; the child
        # (saccade serve, torchrun) stops its own children as on any SIGTERM.
        self.proc = start_child(list(self.process.argv), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.reader = threading.Thread(target=self._stream, args=(self.proc,), daemon=True,
                                       name=f"log {self.name}")
        self.reader.start()
        self.started_at, self.answered_at = time.time(), None
        if self.process.url:
            threading.Thread(target=self._probe, args=(self.proc,), daemon=True, name=f"probe {self.name}").start()

    def _probe(self, proc: subprocess.Popen) -> None:
        """Ask a server's /health while this life of it runs; each 200 is noted (`answered_at`)."""
        import httpx

        with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
            while proc.poll() is None:
                try:
                    if client.get(self.process.url + "/health").status_code == 200:
                        self.answered_at = time.time()
                except httpx.HTTPError:
                    pass
                time.sleep(PROBE_EVERY_S)

    def silent_for(self, now: float, ready_timeout_s: float, hang_after_s: float) -> float | None:
        """How long past its allowance a running server has not answered /health (None: within
        it). A server that answered has `hang_after_s` from its last answer; one that has not
        answered yet in this life (loading) has `ready_timeout_s` from its start."""
        if self.answered_at is not None:
            silent, allowed = now - self.answered_at, hang_after_s
        else:
            silent, allowed = now - self.started_at, ready_timeout_s
        return silent if silent > allowed else None

    def _stream(self, proc: subprocess.Popen) -> None:
        """Drain the child's output to the end, whatever fails to take it: a log file that cannot
        be written (a full disk) is given up with one line in the launcher's log, for this life of
        the child; a pipe left undrained would block the child once it holds ~64 KB."""
        out = self._open_log()
        for raw in proc.stdout:
            text = raw.decode("utf-8", "replace").rstrip("\r\n").split("\r")[-1]  # a progress bar's last state
            if out is not None:
                try:
                    out.write((text + "\n").encode("utf-8", "replace"))
                except OSError as err:
                    out.close()
                    out = None
                    self.log.say(f"cannot write {self.log_path} ({err.strerror or err}): {self.name}'s lines "
                                 "go on in this log only")
            self.log.line(self.name, text)
        if out is not None:
            out.close()

    def _open_log(self):
        """The process's log file, unbuffered (a failed write leaves nothing behind to fail again), or
        None, said in the launcher's log, when it cannot be opened."""
        try:
            return open(self.log_path, "ab", buffering=0)
        except OSError as err:
            self.log.say(f"cannot open {self.log_path} ({err.strerror or err}): {self.name}'s lines go on in "
                         "this log only")
            return None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def look(self) -> None:
        """Note the processes below it now (`seen`)."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in process_tree(self.proc.pid):
                started = start_time(pid)
                if started is not None:
                    self.seen.setdefault(pid, started)

    def tree(self) -> list[int]:
        """Every process of it that still runs: those below it now, and those seen below it before."""
        self.look()
        return [pid for pid, started in self.seen.items() if start_time(pid) == started and alive(pid)]

    def stop(self, tree: list[int], grace_s: float = KILL_AFTER_S) -> None:
        """SIGTERM to its session, then SIGKILL to whatever of `tree` (taken before any signal,
        while every process of it still had its parent) is left after `grace_s`."""
        if self.proc is None:
            return
        self.signal(signal.SIGTERM)
        for pid in tree:  # those in sessions of their own
            if pid != self.proc.pid and alive(pid):
                send(pid, signal.SIGTERM)
        for pid in tree:  # a stopped process (SIGSTOP, a hung server) acts on its SIGTERM once continued
            if alive(pid):
                send(pid, signal.SIGCONT)
        deadline = time.time() + grace_s
        while time.time() < deadline and any(alive(p) for p in tree):
            self.proc.poll()
            time.sleep(0.2)
        for pid in tree:
            if alive(pid):
                send(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.reader is not None:
            self.reader.join(timeout=5)


class Interrupts:
    """Counts SIGINT and SIGTERM while in force (the handlers are put back after)."""

    def __init__(self):
        self.count = 0

    def __enter__(self) -> Interrupts:
        def handler(signum, frame):
            self.count += 1

        self.previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


class LaunchError(RuntimeError):
    """The launch could not go on: a server did not start, or did not answer in time."""


@dataclass(frozen=True)
class RestartBudget:
    """How often a server is started again: `restarts` times (launch.max_restarts), a count that
    goes back to 0 once the server has run `refill_after_s` in one life and answers
    (launch.restart_budget_reset_s). A server that fails at once keeps failing within the count
    and is given up; one that fails once a day in a week-long run is started again each time."""

    restarts: int
    refill_after_s: float = 3600.0

    def refills(self, child: Child, now: float) -> bool:
        """True when `child`, restarted before, has run refill_after_s in this life and has
        answered /health in it (the caller checks that it answers still)."""
        return child.restarts > 0 and child.answered_at is not None and now - child.started_at >= self.refill_after_s


def restart_delay(restart: int) -> float:
    """How long to wait before a server's `restart`-th start again (1 for the first): doubled each
    time, so that a server failing at once (its port taken, a GPU still held) is not started again
    `max_restarts` times in as many seconds."""
    return min(RESTART_BACKOFF_S * 2 ** (restart - 1), MAX_BACKOFF_S)


def check_port_free(child: Child) -> None:
    """A LaunchError naming who holds a server's port, if anyone does, before the server starts."""
    port = url_port(child.process.url)
    if port_taken(port):
        raise LaunchError(f"port {port} of {child.name} ({child.process.url}) is already held by "
                          f"{foreign_listener(port, set()) or 'another process'}: stop it, or give the servers "
                          "other ports (launch.server_port)")


def check_ours(child: Child) -> None:
    """A LaunchError when a process outside `child`'s tree listens on its port: the URL answered,
    but not from our server (a stranger bound the port first)."""
    port = url_port(child.process.url)
    stranger = foreign_listener(port, set(child.tree()))
    if stranger:
        raise LaunchError(f"{child.process.url} answers, but not from {child.name}: port {port} is held by "
                          f"{stranger}; stop it, or give the servers other ports (launch.server_port)")


def wait_until_answering(urls: list[str], servers: list[Child], *, timeout_s: float, log: Log,
                         interrupts: Interrupts) -> bool:
    """Wait until every URL's /health answers 200 (servers of other nodes too), each local one
    from our own server. A local server that exits meanwhile is a LaunchError with the end of its
    log. False when interrupted."""
    import httpx

    ours = {c.process.url: c for c in servers}
    waiting, deadline, said = list(urls), time.time() + timeout_s, time.time()
    while waiting:
        if interrupts.count:
            return False
        for child in servers:
            code = child.exit_code()
            if code is not None:
                raise LaunchError(f"{child.name} exited with {code} before it answered; the end of its log "
                                  f"({child.log_path}):\n{child.tail()}")
        for url in list(waiting):
            try:
                answered = httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                answered = False
            if answered:
                if url in ours:
                    check_ours(ours[url])
                    # An answer, as its probe's would be: from now on a silence is a hang
                    # (hang_after_s), even if the probe has not had its first 200 yet (a loaded
                    # machine), not a start (ready_timeout_s).
                    ours[url].answered_at = time.time()
                waiting.remove(url)
                log.say(f"{url} answers")
        if waiting and time.time() > deadline:
            raise LaunchError(f"no answer in {timeout_s:.0f} s (launch.ready_timeout_s) from {', '.join(waiting)}")
        if waiting and time.time() - said > 60:
            log.say(f"waiting for {', '.join(waiting)}")
            said = time.time()
        if waiting:
            time.sleep(1.0)
    return True


def supervise(processes: list[Process], *, urls: list[str], run_dir: Path, max_restarts: int, ready_timeout_s: float,
              resume_hint: str, log: Log | None = None, hang_after_s: float = 120.0,
              restart_budget_reset_s: float = 3600.0) -> int:
    """Run one node's `processes` (servers first, then the trainer, if this node runs one) until
    the trainer ends; returns its exit status (130 after a stop on request; 1 if the launch
    itself failed). `urls`: every server of the layout, waited for before the trainer starts.
    `hang_after_s`: a running server silent on /health this long is ended and started again, at
    most `max_restarts` times in a row (`RestartBudget`: `restart_budget_reset_s` up refills it)."""
    log = log or Log()
    folder = run_dir / LAUNCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    children = [Child(p, log, folder) for p in processes]
    servers = [c for c in children if c.process.url]
    trainer = next((c for c in children if not c.process.url), None)
    started_at = time.time()
    pids: dict[str, int] = {}

    def started(child: Child) -> None:
        child.start()
        pids[child.name] = child.proc.pid
        write_or_warn(folder / "pids.json", json.dumps(pids, indent=1) + "\n", log)
        log.say(f"started {child.name} (pid {child.proc.pid}): {child.process.shell()}")

    code = 1
    with Interrupts() as interrupts:
        try:
            for child in servers:
                check_port_free(child)
                started(child)
            if not wait_until_answering(urls, servers, timeout_s=ready_timeout_s, log=log, interrupts=interrupts):
                log.say("interrupted while the servers started: stopping them")
                return 130
            if trainer is not None:
                (run_dir / STOP_FILE).unlink(missing_ok=True)  # an old request must not stop this run
                started(trainer)
            code = watch(servers, trainer, run_dir=run_dir, started_at=started_at,
                         budget=RestartBudget(max_restarts, restart_budget_reset_s), log=log, interrupts=interrupts,
                         started=started, allowances=(ready_timeout_s, hang_after_s))
        except LaunchError as err:
            log.say(f"error: {err}")
            return 1
        finally:
            if trainer is not None:
                write_or_warn(folder / ENDED_FILE, f"{time.time()}\n", log)
            stopping = [c for c in children if c.exit_code() is None]
            if stopping:
                log.say(f"stopping {', '.join(c.name for c in stopping)}")
            trees = [child.tree() for child in children]
            for child in children:  # SIGTERM to all first, so that they wind down together
                child.signal(signal.SIGTERM)
            for child, tree in zip(children, trees, strict=True):
                child.stop(tree, grace_s=KILL_AFTER_S if interrupts.count < 2 else 2.0)
    if code == 0:
        log.say("the trainer finished; every process started here has stopped")
    elif code == 130 and stopped_since(run_dir, started_at):
        log.say(f"stopped on request, with a checkpoint; go on with: {resume_hint}")
    elif code == 130:  # Ctrl-C twice, or a node without the trainer: nothing was saved here
        log.say(f"stopped at once; go on from the run's last checkpoint with: {resume_hint}")
    elif trainer is not None:
        log.say(f"the trainer exited with {code}; every process started here has stopped (logs: {folder})")
    return code


def watch(servers: list[Child], trainer: Child | None, *, run_dir: Path, started_at: float, budget: RestartBudget,
          log: Log, interrupts: Interrupts, started, allowances: tuple[float, float] = (1800.0, 120.0)) -> int:
    """The launcher's loop once everything runs: the trainer's end (or, on a node without one,
    the trainer node's ENDED_FILE) ends it; a server that exits or hangs is started again.
    `allowances`: (ready_timeout_s, hang_after_s), see `Child.silent_for`."""
    asked = 0
    ended = run_dir / LAUNCH_DIR / ENDED_FILE
    down: set[str] = set()
    while True:
        if trainer is not None:
            code = trainer.exit_code()
            if code is not None:  # torchrun reports a stop on request (130 from each rank) as 1
                return 130 if code != 0 and stopped_since(run_dir, started_at) else code
        elif written_since(ended, started_at):
            log.say("the trainer's node has ended: stopping the servers")
            return 0
        if interrupts.count > asked:
            asked = interrupts.count
            if trainer is None:
                return 130
            if asked == 1:
                (run_dir / STOP_FILE).touch()
                log.say("stopping: the trainer saves a checkpoint after the step under way, then everything stops "
                        "(Ctrl-C again: stop at once, unsaved)")
            else:
                log.say("stopping at once")
                trainer.signal(signal.SIGTERM)
                return 130
        for child in (*servers, *([trainer] if trainer else [])):
            child.look()
        for child in servers:
            if child.name not in down:
                look_after(child, budget=budget, log=log, started=started, allowances=allowances, down=down)
        time.sleep(POLL_S)


def look_after(child: Child, *, budget: RestartBudget, log: Log, started, allowances: tuple[float, float],
               down: set[str], clock=time.time) -> None:
    """One server, once per turn of `watch`: start it again once its backoff is over; a server
    that exited, or has been silent past its allowance (hung), is ended with every process of it
    (a dead vLLM server's engine process can outlive it, holding its port and GPU memory) and its
    restart scheduled; past the budget's restarts it stays down. A server that runs and answers
    has its budget refilled once it has run long enough (`RestartBudget.refills`)."""
    now = clock()
    if child.restart_at is not None:
        if now < child.restart_at:
            return
        child.restart_at = None
        port = url_port(child.process.url)
        if port_taken(port):
            why = f"cannot start again: port {port} is held by {foreign_listener(port, set()) or 'another process'}"
        else:
            started(child)
            return
    else:
        code = child.exit_code()
        if code is None:
            silent = child.silent_for(now, *allowances)
            if silent is None:
                if budget.refills(child, now):
                    log.say(f"{child.name} has run {now - child.started_at:.0f} s since its last start and answers: "
                            f"its restarts count from 0 again (launch.restart_budget_reset_s "
                            f"{budget.refill_after_s:g} s)")
                    child.restarts = 0
                return
            why = (f"has not answered /health for {silent:.0f} s (launch.hang_after_s {allowances[1]:g} s): "
                   "taken as hung")
        else:
            why = f"exited with {code}"
        child.stop(child.tree(), grace_s=HUNG_GRACE_S)
    if child.restarts < budget.restarts:
        child.restarts += 1
        delay = restart_delay(child.restarts)
        child.restart_at = clock() + delay
        log.say(f"{child.name} {why}: starting it again in {delay:.0f} s ({child.restarts} of {budget.restarts}); "
                f"the count goes back to 0 once it has run {budget.refill_after_s:g} s (launch.restart_budget_reset_s); "
                "the trainer takes it back with the current weights once it answers")
    else:
        down.add(child.name)
        log.say(f"{child.name} {why}, after {budget.restarts} restarts with none of its lives up "
                f"{budget.refill_after_s:g} s (launch.max_restarts, launch.restart_budget_reset_s): it stays down, the "
                "other servers go on")
