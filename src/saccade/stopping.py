"""Stopping a run on request: at the end of the step under way, with a checkpoint, every rank alike.

Two ways to ask, both read at each step's end (`StopRequest.agreed`):
- a file named STOP in the run folder, newer than the run's start (`touch runs/NAME/STOP`):
  `saccade launch` asks this way when it is interrupted, because a signal would not reach
  torchrun's workers intact (torchrun forwards one and kills them 30 s later);
- SIGINT or SIGTERM to `saccade rl` (Ctrl-C; a cluster's preemption notice), once
  `catch_signals` is in force. A terminal's Ctrl-C reaches a process more than once under
  torchrun (the terminal, then torchrun's forward), so signals within `REPEAT_WINDOW_S` of the
  first are the same request; one after that is a second Ctrl-C: stop now (KeyboardInterrupt).

Every rank learns whether any rank was asked (one small all-reduce per step), so all save the
same checkpoint and stop together.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

from saccade.distributed import SINGLE, World, all_reduce_sum

STOP_FILE = "STOP"
# Written by rank 0 when a stop on request is carried out, with its message: torchrun reports its
# workers' exit status 130 as a failure (1), so `saccade launch` reads this file to tell the two apart.
STOPPED_FILE = "STOPPED"
REPEAT_WINDOW_S = 5.0

log = logging.getLogger(__name__)


class RunStopped(RuntimeError):
    """A run stopped on request after a step, its checkpoint saved; the message says how to go on."""


class StopRequest:
    """Whether this run was asked to stop (a STOP file in `run_dir`, or a caught signal)."""

    def __init__(self, run_dir: Path):
        self.file = Path(run_dir) / STOP_FILE
        self.started = time.time()
        self.signalled_at: float | None = None

    def asked(self) -> bool:
        """This process's view: a caught signal, or a STOP file written since the run started
        (an older one is left from an earlier run and ignored)."""
        return self.signalled_at is not None or written_since(self.file, self.started)

    def agreed(self, world: World = SINGLE, device=None) -> bool:
        """True on every rank when any rank was asked (a collective: every rank calls it)."""
        return all_reduce_sum([float(self.asked())], world, device)[0] > 0

    def done(self, message: str, world: World = SINGLE) -> None:
        """The request was carried out: rank 0 removes the STOP file, so that `--resume` goes on,
        and writes STOPPED with `message`."""
        if world.is_main:
            self.file.unlink(missing_ok=True)
            (self.file.parent / STOPPED_FILE).write_text(message + "\n")

    @contextlib.contextmanager
    def catch_signals(self):
        """SIGINT and SIGTERM ask for a stop instead of killing the process (main thread only;
        elsewhere a no-op). A signal more than REPEAT_WINDOW_S after the first stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handler(signum, frame):
            now = time.time()
            if self.signalled_at is not None and now - self.signalled_at > REPEAT_WINDOW_S:
                raise KeyboardInterrupt
            if self.signalled_at is None:
                self.signalled_at = now
                # Said by the rank that caught it (a signal may reach one rank only).
                log.warning("%s: stopping after this step, with a checkpoint (the same signal again, %.0f s or "
                            "more from now, stops at once, unsaved)", signal.Signals(signum).name, REPEAT_WINDOW_S)

        previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def written_since(path: Path, since: float) -> bool:
    """True when `path` exists and was written at or after `since` (1 s of slack: file times may be
    coarser than the clock)."""
    try:
        return path.stat().st_mtime >= since - 1.0
    except OSError:
        return False


def stopped_since(run_dir: Path, since: float) -> bool:
    """True when a run in `run_dir` stopped on request (STOPPED written) at or after `since`."""
    return written_since(Path(run_dir) / STOPPED_FILE, since)
