"""A child process that ends when its parent does, even when the parent is SIGKILLed.

Linux's PR_SET_PDEATHSIG: the kernel sends `sig` to the child when the parent *thread* that
started it ends (not the parent process: a child started from a thread that ends is signalled
then). Elsewhere there is no such thing, and the parent's own stop is all there is.

`start_child` and `run_child` are subprocess.Popen and subprocess.run for the children saccade
starts (servers, a bench's `saccade rl`, torchrun, a bench's stages): each is tied to the
process that starts it, so that a bench killed by SIGKILL (or the OOM killer, or a closed
terminal) takes its server and its runs with it, as `saccade launch` does. The signal is the
child's way to end: SIGTERM for a process that ends its own children on it (`saccade serve`
stops vLLM's engine processes, which a SIGKILL would leave running; torchrun ends its ranks);
SIGKILL for one that would take SIGTERM as a request to finish its step first (`saccade rl`).
The tie holds only for the signal's own process: each level that starts children ties them
in turn.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterable

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl():
    """libc's prctl, or None off Linux. Looked up in the parent: a forked child of a threaded
    process must not import or load anything before exec (a lock held by another thread at the
    fork would never be released in the child)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux (no prctl)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child: `sig` to this process when its parent dies (Linux; a no-op elsewhere)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, sig)


def tied_to_parent(sig: int = signal.SIGTERM, cores: Iterable[int] | None = None) -> Callable[[], None]:
    """A `preexec_fn` (run in the child between fork and exec) that asks for `sig` when this
    process (the thread calling this) ends, and pins the child to `cores` when any. A parent
    that died before the ask is seen at once: the child then exits before it execs."""
    prctl, parent, pinned = _prctl(), os.getpid(), set(cores or ()) or None  # no cores: not pinned

    def in_child() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, sig)
            if os.getppid() != parent:  # the parent is gone already: nobody would signal us
                os._exit(1)
        if pinned is not None:
            os.sched_setaffinity(0, pinned)

    return in_child


def start_child(argv: list[str], *, death_signal: int = signal.SIGTERM, cores: Iterable[int] | None = None,
                **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen_kwargs) of a child that gets `death_signal` when this
    process ends, however it ends. Start it from the main thread, or from a thread that lives as
    long as the child should: the kernel signals the child when the starting thread ends.
    `cores`: the CPU cores it (and whatever it starts) runs on."""
    return subprocess.Popen(argv, preexec_fn=tied_to_parent(death_signal, cores), **popen_kwargs)


def run_child(argv: list[str], *, death_signal: int = signal.SIGTERM, cores: Iterable[int] | None = None,
              **run_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, **run_kwargs) with the child tied to this process as `start_child`'s."""
    return subprocess.run(argv, preexec_fn=tied_to_parent(death_signal, cores), **run_kwargs)
