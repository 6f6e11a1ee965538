"""math-verify in a worker process that can be killed: the built-in `correct` reward's one call
with no bound of its own.

A reply as short as `$9^{9^{9^{9}}}$` makes sympy compute a power of hundreds of millions of
digits: one C call that holds the GIL, so neither math-verify's SIGALRM timeout (main thread
only, and only between bytecodes) nor a thread abandoned by the scorer can end it; measured, a
thread running it starved the process for over a minute. Here each comparison is sent to one
long-lived child (`python -m saccade.math_child`, JSON lines on its stdin/stdout); one that
does not answer within its limit is killed, the answer scores 0, and the next comparison
starts a new child (about a second: sympy's import).
"""

from __future__ import annotations

import atexit
import json
import select
import subprocess
import sys
import threading

TIMEOUT_S = 5.0  # one comparison's limit, the child's start not counted


class MathWorker:
    """One child process comparing answers, shared by every thread (one call at a time)."""

    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.timeouts = 0  # comparisons cut (tests, and what a person may ask)
        atexit.register(self.close)

    def equal(self, gold: str, predicted: str, precision: int | None) -> bool | None:
        """math-verify's verdict; None when it did not come within `timeout_s` (the child killed)."""
        with self.lock:
            proc = self._started()
            try:
                proc.stdin.write(json.dumps([gold, predicted, precision]) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
                line = proc.stdout.readline() if ready else ""
            except OSError:  # the child died under us
                line = ""
            if not line:
                self.timeouts += 1
                self._kill()
                return None
            return bool(json.loads(line))

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "saccade.math_child"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, bufsize=1)
            self._warm(self.proc)
        return self.proc

    def _warm(self, proc: subprocess.Popen) -> None:
        """Wait for the child's imports (its 'ready' line), so they never count against a comparison."""
        proc.stdout.readline()

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            self._kill()


_worker: MathWorker | None = None
_worker_lock = threading.Lock()


def worker() -> MathWorker:
    """The process's one math worker, started on first use."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = MathWorker()
        return _worker
