"""What saccade tells the person running it, as it happens: a step skipped, a server taken out
or back, a stop asked for. Through `logging`, in one hierarchy: each module logs to
`logging.getLogger(__name__)`, under the `saccade` logger.

The command line calls `configure` once, first thing: every `saccade.*` record of INFO and up
goes to stderr as `saccade: <message>`. Without it (saccade used as a library) warnings still
show, through logging's last-resort handler; a program of your own configures the `saccade`
logger as it likes.

Under torchrun every rank is a process of its own. What every rank sees alike (a step skipped:
all ranks skip it together) is said by rank 0 alone: the caller asks `world.is_main`. What
happens to one rank (its servers, a signal it caught, its reward function failing) is said by
that rank, and ranks other than 0 name themselves: `saccade[rank 3]: ...`.

Not here: a command's own output (tables, results, `--help`: `saccade.cli` prints those) and
the progress bar with its step line (`saccade.progress`).
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "saccade"


class StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record comes, not the one there was when it was
    made: the progress bar (rich) redirects stderr while it draws, so lines go above it."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(rank: int | None = None, level: int = logging.INFO) -> logging.Handler:
    """Send the `saccade` loggers' records of `level` and up to stderr, once per process (a
    second call returns the first's handler). `rank`: this process's rank under torchrun (None:
    from the RANK variable torchrun sets, 0 without it)."""
    logger = logging.getLogger(ROOT)
    for handler in logger.handlers:
        if isinstance(handler, StderrHandler):
            return handler
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    handler = StderrHandler()
    handler.setFormatter(logging.Formatter(("saccade" if rank == 0 else f"saccade[rank {rank}]") + ": %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler
