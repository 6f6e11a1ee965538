"""The child process of `saccade.rewards.user_workers`: a user's reward functions, imported here by
their import paths, called with the arguments the parent sends (pickled) and their values
sent back as floats.

    python -m saccade.rewards.user_child

The parent's first frame says what to import (the paths, its `sys.path`, modules to import
before the first call) and whether the functions are async. Then this process says READY,
with the functions it could not import and why, and serves calls: sync functions one at a
time on the main thread (so math-verify's SIGALRM timeouts work in them); async ones on an
event loop, all at once, a reader thread handing it the frames, and the loop itself
acknowledging a CANCEL, which is how the parent tells a slow call from a blocked loop. The
protocol has this process's stdin and stdout to itself: the functions' prints go to stderr.
It dies with the parent's thread that started it (PR_SET_PDEATHSIG) and ends at the pipe's
end (EOF) when idle.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

from saccade.parent_death import die_with_parent
from saccade.plugins import load_callable
from saccade.rewards.user_workers import ACK, CALL, CANCEL, DONE, READY, read_frame, write_frame
from saccade.rewards.weighted import as_parts

def end_with_parent(parent: int) -> None:
    """SIGKILL this process when the parent's thread that started it ends (Linux), and end now if
    that parent is already gone (it died before the signal was asked for)."""
    die_with_parent(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(0)


def claim_stdio() -> tuple[BinaryIO, BinaryIO]:
    """The protocol's own copies of stdin and stdout; fd 0 then reads /dev/null and fd 1 writes
    to stderr, so that a function's print() cannot garble a frame."""
    protocol_in, protocol_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return os.fdopen(protocol_in, "rb"), os.fdopen(protocol_out, "wb")


def value_of(key: str, value: Any) -> bytes:
    """A function's value as the reply the parent reads: ("ok", total, parts), floats only, so
    that any value a function returns (a numpy scalar, a torch tensor) comes back, and one that is
    not a number is refused here, with as_parts' own message."""
    total, parts = as_parts(value, key)
    return pickle.dumps(("ok", total, parts))


def failure(err: BaseException) -> bytes:
    """A call that raised, as ("error", its traceback as text): text, because a user's exception
    need not pickle. This module's own frame is left out."""
    tb = err.__traceback__.tb_next if err.__traceback__ is not None else None
    return pickle.dumps(("error", "".join(traceback.format_exception(type(err), err, tb)).rstrip()))


def serve_sync(functions: dict[str, Callable[..., Any]], protocol_in: BinaryIO, protocol_out: BinaryIO) -> None:
    """One call at a time, until the parent closes the pipe."""
    while (frame := read_frame(protocol_in)) is not None:
        kind, call_id, payload = frame
        if kind != CALL:
            continue
        try:
            key, completion, kwargs = pickle.loads(payload)
            value = functions[key](completion, **kwargs)
            if inspect.isawaitable(value):  # a sync function that returned a coroutine
                value = asyncio.run(_awaited(value))
            reply = value_of(key, value)
        except BaseException as err:  # noqa: BLE001 - SystemExit from a function too: the parent scores it
            reply = failure(err)
        write_frame(protocol_out, DONE, call_id, reply)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def serve_async(functions: dict[str, Callable[..., Any]], protocol_in: BinaryIO, protocol_out: BinaryIO) -> None:
    """Every call at once on one event loop, until the parent closes the pipe. The frames are read
    on a thread, so the pipe drains even while a function blocks the loop; a CANCEL is answered by
    the loop (ACK): an ACK that does not come tells the parent the loop is blocked."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    running: dict[int, asyncio.Task] = {}

    async def call(call_id: int, payload: bytes) -> None:
        try:
            key, completion, kwargs = pickle.loads(payload)
            value = functions[key](completion, **kwargs)
            if inspect.isawaitable(value):
                value = await value
            reply = value_of(key, value)
        except asyncio.CancelledError:
            return  # the parent gave up on this call: it wants no reply
        except BaseException as err:  # noqa: BLE001 - the parent scores it
            reply = failure(err)
        finally:
            running.pop(call_id, None)
        write_frame(protocol_out, DONE, call_id, reply)

    def on_frame(frame: tuple[bytes, int, bytes] | None) -> None:
        if frame is None:  # the parent closed the pipe
            loop.stop()
            return
        kind, call_id, payload = frame
        if kind == CALL:
            running[call_id] = loop.create_task(call(call_id, payload))
        elif kind == CANCEL:
            task = running.pop(call_id, None)
            if task is not None:
                task.cancel()
            write_frame(protocol_out, ACK, call_id, b"")

    def read() -> None:
        while True:
            frame = read_frame(protocol_in)
            loop.call_soon_threadsafe(on_frame, frame)
            if frame is None:
                return

    threading.Thread(target=read, name="frames", daemon=True).start()
    loop.run_forever()


def main() -> None:
    protocol_in, protocol_out = claim_stdio()
    frame = read_frame(protocol_in)
    if frame is None:
        return
    start = pickle.loads(frame[2])
    end_with_parent(start["parent"])
    sys.path[:] = start["sys_path"]
    functions, failed = {}, {}
    for path in start["paths"]:
        try:
            functions[path] = load_callable(path)
        except BaseException as err:  # noqa: BLE001 - said to the parent, which fails that function's calls
            failed[path] = "".join(traceback.format_exception_only(type(err), err)).strip()
    for module in start["preload"]:  # what unpickling the calls' arguments imports, before READY
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - then the first call imports it, or fails to
            pass
    write_frame(protocol_out, READY, 0, pickle.dumps(failed))
    (serve_async if start["is_async"] else serve_sync)(functions, protocol_in, protocol_out)


if __name__ == "__main__":
    main()
    sys.stderr.flush()
    os._exit(0)  # not a normal exit: it would wait for threads a function started
