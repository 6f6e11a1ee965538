"""A child process that ends when its parent does, even when the parent is SIGKILLed.

Linux's PR_SET_PDEATHSIG: the kernel sends `sig` to the child when the parent *thread* that
started it ends (not the parent process: a child started from a thread that ends is signalled
then). Elsewhere there is no such thing, and the parent's own stop is all there is.
"""

from __future__ import annotations

import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child: `sig` to this process when its parent dies (Linux; a no-op elsewhere)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass  # not Linux (no prctl)
