"""A user's reward functions in worker processes that can be killed, so that every call ends
within `rollout.reward_timeout_s` and nothing it leaves behind accumulates.

Python cannot stop a thread, and an `async def` function that blocks (a sync call inside it:
`time.sleep`, `requests.post`, a long computation) stops the event loop it runs on, where
`asyncio.wait_for` can no longer fire. So a user's functions run in child processes
(`python -m saccade.rewards.user_child`), which import each function by its import path: only a
call's arguments cross the pipe, pickled (`completion`, and the keywords the function names);
only floats come back.

- Sync functions: a pool of at most `SYNC_WORKERS` children per `Rewards`, started as calls
  need them, one call at a time each. A call past its limit has its child killed (SIGKILL, to
  its whole process group: what it started too), and a fresh child takes a later call.
- Async functions: one child per function, running its own event loop with every call of the
  step in flight at once (a judge's requests overlap). A call past its limit is cancelled
  there. A child whose loop does not acknowledge that cancel within `CANCEL_GRACE_S` is blocked
  (a cancel is cheaper than a steady heartbeat and asks exactly when it matters): it is killed,
  its calls in flight count as timed out, a warning names the function, and a fresh child takes
  the next calls.
- A child that dies (a segfault, os._exit) fails its call as an error; the next call starts
  another. A function a child cannot import (a module not on the path of a fresh process:
  `__main__`, a module made at run time) fails its every call with that error.

A child is a fresh interpreter (`spawn`'s semantics: safe with threads and torch loaded, and it
re-runs nothing of the parent's `__main__`), given the parent's `sys.path`. Its start, about
0.15 s bare and 1 s with the sample's module imported (`preload`: what unpickling the
arguments imports), plus the user's module's imports, is not counted in a call's limit, nor is
the wait for a free child. The children are driven from one event loop on a thread of
its own ("saccade-rewards"), whatever thread or event loop scores (a rollout thread sampling
ahead and the main thread's evaluation share a `Rewards`). They die with that thread
(PR_SET_PDEATHSIG; it lives until `close`, which the run calls when it ends, and at exit).

The frames on the pipes are a header (kind, call id, payload length) and a pickled payload.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import weakref
from typing import Any, BinaryIO

from saccade.loop_thread import LoopThread

log = logging.getLogger("saccade.scoring")

SYNC_WORKERS = 8  # child processes for a Rewards' sync functions, at most (a call each at a time)
START_TIMEOUT_S = 120.0  # a child's start: Python, saccade.rewards.weighted and the user's module imported
CANCEL_GRACE_S = 2.0  # an async child whose loop does not acknowledge a cancel within this is blocked

HEADER = struct.Struct("<cQQ")  # kind, call id, payload length
# Parent to child: START (what to import), CALL, CANCEL. Child to parent: READY (with the
# functions it could not import), DONE (a call's reply), ACK (a cancel seen by its event loop).
START, READY, CALL, DONE, CANCEL, ACK = b"S", b"R", b"C", b"D", b"X", b"A"


def frame(kind: bytes, call_id: int, payload: bytes) -> bytes:
    return HEADER.pack(kind, call_id, len(payload)) + payload


def write_frame(out: BinaryIO, kind: bytes, call_id: int, payload: bytes) -> None:
    out.write(frame(kind, call_id, payload))
    out.flush()


def read_frame(inp: BinaryIO) -> tuple[bytes, int, bytes] | None:
    """The next frame, or None at the pipe's end."""
    header = inp.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    kind, call_id, size = HEADER.unpack(header)
    payload = inp.read(size)
    return None if len(payload) < size else (kind, call_id, payload)


class RewardFailed(Exception):
    """A call that failed in its worker process (the traceback, as text, is the message), or one
    that could not be made (its arguments do not pickle, its child would not start or died)."""


class ImportFailed(RewardFailed):
    """A child could not import a function: the next one would not either."""

    def __init__(self, path: str, why: str):
        super().__init__(f"its worker process could not import it: {why}\n(a reward function must import by its "
                         "path in a fresh Python process: a module on sys.path or an installed package, not "
                         "__main__ or a module made at run time)")
        self.path = path


class ChildGone(Exception):
    """The child died, or was killed by us (`killed`), with calls in flight."""

    def __init__(self, how: str, *, killed: bool):
        super().__init__(how)
        self.killed = killed


class Child:
    """One worker process, driven from the workers' loop: calls are sent, their replies matched
    by call id (many at once for an async child)."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.waiting: dict[int, asyncio.Future] = {}
        self.killed = False  # by us: a call past its limit, a blocked loop, close()
        self.reader: asyncio.Task | None = None

    @classmethod
    async def start(cls, paths: list[str], *, is_async: bool, preload: list[str]) -> tuple[Child, list[ImportFailed]]:
        """A child that has imported `paths` (and `preload`), and the paths it could not import;
        RewardFailed when it does not start."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "saccade.rewards.user_child", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, start_new_session=True)  # its own group: killpg takes what it starts
        child = cls(proc)
        start = {"paths": paths, "is_async": is_async, "preload": preload, "sys_path": list(sys.path),
                 "parent": os.getpid()}
        try:
            proc.stdin.write(frame(START, 0, pickle.dumps(start)))
            _, _, payload = await asyncio.wait_for(child._next(), START_TIMEOUT_S)
        except (asyncio.IncompleteReadError, ConnectionError) as err:
            child.kill()
            raise RewardFailed(f"its worker process ended as it started ({await child.ending()})") from err
        except TimeoutError:
            child.kill()
            raise RewardFailed(f"its worker process did not start within {START_TIMEOUT_S:g} s (importing "
                               f"{', '.join(paths)})") from None
        except BaseException:
            child.kill()
            raise
        child.reader = asyncio.get_running_loop().create_task(child._read())
        return child, [ImportFailed(path, why) for path, why in pickle.loads(payload).items()]

    @property
    def alive(self) -> bool:
        return not self.killed and self.proc.returncode is None

    async def ask(self, call_id: int, request: bytes) -> Any:
        """The reply to one call: ("ok", total, parts) or ("error", traceback); ChildGone if the
        child ends first."""
        reply = asyncio.get_running_loop().create_future()
        self.waiting[call_id] = reply
        try:
            self.proc.stdin.write(frame(CALL, call_id, request))
            await self.proc.stdin.drain()
            return await reply
        except ConnectionError:
            raise ChildGone(await self.ending(), killed=self.killed) from None
        finally:
            self.waiting.pop(call_id, None)

    def cancel(self, call_id: int) -> asyncio.Future:
        """Ask an async child to cancel a call; the future is done when its loop says so (ACK)."""
        ack = asyncio.get_running_loop().create_future()
        self.waiting[-call_id] = ack
        try:
            self.proc.stdin.write(frame(CANCEL, call_id, b""))
        except ConnectionError:
            pass  # it is gone: the ack never comes, and nothing is left to kill
        return ack

    def kill(self) -> None:
        """SIGKILL to the child's process group (itself and what it started); the watcher reaps it."""
        self.killed = True
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def stop(self) -> None:
        """Kill the child and wait until it is gone (reaped)."""
        self.kill()
        await self.ending()

    async def ending(self) -> str:
        """How the child ended, for a message."""
        try:
            code = await asyncio.wait_for(self.proc.wait(), 5.0)
        except TimeoutError:
            return "it closed its pipe and is still running"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    async def _next(self) -> tuple[bytes, int, bytes]:
        kind, call_id, size = HEADER.unpack(await self.proc.stdout.readexactly(HEADER.size))
        return kind, call_id, await self.proc.stdout.readexactly(size)

    async def _read(self) -> None:
        """Hand each reply to its call, until the pipe ends; then every call still waiting fails."""
        try:
            while True:
                kind, call_id, payload = await self._next()
                waiting = self.waiting.pop(-call_id, None) if kind == ACK else self.waiting.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result(pickle.loads(payload) if kind == DONE else None)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        gone = ChildGone("killed" if self.killed else await self.ending(), killed=self.killed)
        for call_id, waiting in self.waiting.items():
            if not waiting.done():  # a cancel's ACK (negative id): nothing is left to wait for
                waiting.set_result(None) if call_id < 0 else waiting.set_exception(gone)


class SyncPool:
    """At most `size` children for the sync functions `paths`, a call each at a time."""

    def __init__(self, paths: list[str], size: int):
        self.paths = paths
        self.slots = asyncio.Semaphore(size)
        self.idle: list[Child] = []
        self.busy: set[Child] = set()
        self.broken: dict[str, ImportFailed] = {}  # functions a child could not import

    async def call(self, key: str, call_id: int, request: bytes, timeout_s: float, preload: list[str]) -> Any:
        async with self.slots:
            if key in self.broken:
                raise self.broken[key]
            child = self._idle() or await self._start(preload)
            if key in self.broken:  # found out as this child started
                self.idle.append(child)
                raise self.broken[key]
            self.busy.add(child)
            try:
                reply = await asyncio.wait_for(child.ask(call_id, request), timeout_s)
            except ChildGone as gone:
                raise RewardFailed(f"its worker process died during the call ({gone}); a new one takes the next "
                                   "call") from None
            except TimeoutError:  # past its limit: the call cannot be stopped otherwise
                await child.stop()
                raise
            except BaseException:  # the caller gave up (cancelled): the child is mid-call
                child.kill()
                raise
            finally:
                self.busy.discard(child)
            self.idle.append(child)
            return reply

    def _idle(self) -> Child | None:
        while self.idle:
            child = self.idle.pop()
            if child.alive:  # not one that ended while idle
                return child
        return None

    async def _start(self, preload: list[str]) -> Child:
        child, failed = await Child.start(self.paths, is_async=False, preload=preload)
        self.broken.update((f.path, f) for f in failed)
        return child

    def children(self) -> list[Child]:
        return [*self.idle, *self.busy]


class AsyncWorker:
    """One child running an async function's calls together on its own event loop."""

    def __init__(self, key: str):
        self.key = key
        self.child: Child | None = None
        self.starting = asyncio.Lock()
        self.broken: ImportFailed | None = None
        self.warned = False
        self.watches: set[asyncio.Task] = set()

    async def call(self, call_id: int, request: bytes, timeout_s: float, preload: list[str]) -> Any:
        child = await self._child(preload)
        try:
            return await asyncio.wait_for(child.ask(call_id, request), timeout_s)
        except TimeoutError:
            if child.alive:  # slow, or its loop blocked: which, the cancel's acknowledgement tells
                watch = asyncio.get_running_loop().create_task(self._watch(child, child.cancel(call_id)))
                self.watches.add(watch)
                watch.add_done_callback(self.watches.discard)
            raise
        except ChildGone as gone:
            if gone.killed:  # cut with the blocked loop it was waiting on
                raise TimeoutError from None
            raise RewardFailed(f"its worker process died during the call ({gone}); a new one takes the next "
                               "calls") from None
        except asyncio.CancelledError:  # the caller gave up
            if child.alive:
                child.cancel(call_id)
            raise

    async def _child(self, preload: list[str]) -> Child:
        async with self.starting:  # the calls that come while a child starts wait for that one
            if self.broken is not None:
                raise self.broken
            if self.child is None or not self.child.alive:
                self.child, failed = await Child.start([self.key], is_async=True, preload=preload)
                if failed:
                    self.broken = failed[0]
                    self.child.kill()
                    raise self.broken
            return self.child

    async def _watch(self, child: Child, ack: asyncio.Future) -> None:
        try:
            await asyncio.wait_for(ack, CANCEL_GRACE_S)
            return  # its loop runs: the call was only slow
        except TimeoutError:
            pass
        if not child.alive:
            return
        await child.stop()
        if not self.warned:
            self.warned = True
            log.warning(f"reward function {self.key!r} blocks its event loop: a call ran past rollout.reward_timeout_s "
                        f"and its worker's loop did not answer a cancel within {CANCEL_GRACE_S:g} s, so the worker was "
                        "killed (its calls in flight count as timed out) and a new one takes the next calls. An async "
                        "reward must await its waits (asyncio.sleep, an async HTTP client) and make no blocking call "
                        "(time.sleep, requests, a long computation); or make it a plain def, which runs in a pool "
                        "of processes (logged once)")


_open: weakref.WeakSet[Workers] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for workers in list(_open):
        workers.close()


class Workers:
    """The child processes of one `Rewards`' user functions: `call` from any thread's event loop."""

    def __init__(self, sync_paths: list[str], *, timeout_s: float):
        self.sync_paths = sync_paths  # what each child of the sync pool imports
        self.timeout_s = timeout_s
        self.ids = itertools.count(1)
        self._guard = threading.Lock()
        self._thread: LoopThread | None = None
        self._sync: SyncPool | None = None
        self._async: dict[str, AsyncWorker] = {}

    async def call(self, key: str, is_async: bool, completion: str, kwargs: dict[str, Any]) -> tuple[float, dict]:
        """(value, parts) of one call in a worker; TimeoutError past the limit, RewardFailed for an
        error (the function's, or the worker's)."""
        try:
            request = pickle.dumps((key, completion, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - anything in a sample's metadata
            raise RewardFailed(f"the call's arguments cannot be sent to its worker process (they do not pickle: "
                               f"{type(err).__name__}: {err})") from None
        preload = sorted({type(v).__module__ for v in kwargs.values()} - {"builtins"}
                         | ({"PIL.Image"} if "messages" in kwargs else set()))
        work = self._call(key, is_async, next(self.ids), request, preload)
        reply = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self._loop()))
        if reply[0] == "error":
            raise RewardFailed(f"in its worker process:\n{reply[1]}")
        return reply[1], reply[2]

    async def _call(self, key: str, is_async: bool, call_id: int, request: bytes, preload: list[str]) -> Any:
        """On the workers' loop."""
        if is_async:
            worker = self._async.get(key) or self._async.setdefault(key, AsyncWorker(key))
            return await worker.call(call_id, request, self.timeout_s, preload)
        if self._sync is None:
            self._sync = SyncPool(self.sync_paths, SYNC_WORKERS)
        return await self._sync.call(key, call_id, request, self.timeout_s, preload)

    def _loop(self) -> asyncio.AbstractEventLoop:
        with self._guard:
            if self._thread is None:
                self._thread = LoopThread("saccade-rewards")
                _open.add(self)
            return self._thread.loop

    def children(self) -> list[Child]:
        """The live children (on the workers' loop)."""
        pool = self._sync.children() if self._sync is not None else []
        return [c for c in [*pool, *(w.child for w in self._async.values() if w.child)] if c.alive]

    def close(self) -> None:
        """Kill every child and stop the loop's thread; a later call starts afresh."""
        with self._guard:
            thread, self._thread = self._thread, None
            if thread is None:
                return

        async def shut() -> None:
            children = self.children()
            for child in children:
                child.kill()
            await asyncio.wait_for(asyncio.gather(*(c.proc.wait() for c in children), return_exceptions=True), 10.0)
            # Calls still here (waiting for a child, or starting one) end cancelled, not forgotten
            # with the loop: their callers would wait forever.
            calls = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            self._sync, self._async = None, {}

        try:
            asyncio.run_coroutine_threadsafe(shut(), thread.loop).result(timeout=30.0)
        finally:
            thread.close()
            _open.discard(self)
