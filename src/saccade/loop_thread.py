"""`LoopThread`: one asyncio event loop on a daemon thread of its own, which coroutines are
handed to from any other thread (and any other event loop). The vLLM engine's HTTP client
(`saccade.inference.server_client`) and the reward functions' worker processes
(`saccade.rewards.user_workers`) each own one, so that whichever thread calls them, a rollout thread
sampling ahead or the trainer's, their state lives on one loop."""

from __future__ import annotations

import asyncio
import threading


class LoopThread:
    """One asyncio event loop in a daemon thread; `run` executes a coroutine on it from any
    other thread and returns its result (or raises its exception)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro):
        if threading.current_thread() is self.thread:
            raise RuntimeError(f"{self.thread.name}: a synchronous method was called from its own event loop's "
                               "thread, where waiting for the loop would wait forever")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
