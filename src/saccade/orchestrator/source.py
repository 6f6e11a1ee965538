"""Where the RL loop gets each step's rollouts: sampled when asked (on-policy), or up to
`max_async_level` steps ahead on a thread of their own while the trainer trains.

Level k: the rollouts of step s start once the trainer has finished step s - k - 1 and its
weights are on the servers, so they are sampled from weights at most k versions older than
the ones step s trains (k + sync_every_steps - 1 when weights are pushed every few steps).
Level 0 is today's loop: sample, train, push, sample. Level 1 samples step s + 1 while step
s trains. At most k sampled steps wait in the queue: the bound is the rule above, not a size.

Which weights a step samples from is fixed by the schedule, never by timing: the trainer
pushes version v only once every step that may not see it (steps before v + k) has been
sampled (`wait_to_push`). So step s samples the newest weights pushed by step s - k, whatever
the machine's speed: a run's rollouts are the same at any world size and on a resume, and the
lag histogram of a step is a single bar. The price is that a push no longer overlaps the
sampling of the step before it; at level 1 the trainer would wait for that step anyway.

A resume is the one place the rule cannot hold by itself: a run resumed from the checkpoint
after step c has the weights of step c, not those of the steps before it, which steps c to
c + k - 1 of the run never stopped sampled from. So the steps right after a periodic
checkpoint (`on_policy`) are sampled from the checkpoint's own weights in every run: step c
waits for them, and the steps after it sample as a resumed run does. A resume then samples
exactly what the run never stopped did (`saccade bench kill --engine vllm`); the price is one
step without overlap per checkpoint. A checkpoint nobody planned (a STOP file, lost servers)
is not such a step: a resume from it samples its first k steps from newer weights.

The sampling thread runs the same rollout code as level 0 (environments, rewards, the engine's
synchronous calls, which go to the engine's own event loop). An error there (no server left,
a broken environment) is handed to the trainer, which raises it at its next `get`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from saccade.orchestrator.rollout import StepRollouts

__all__ = ["RolloutSource", "SamplingFailed", "StepRollouts"]  # StepRollouts: what `get` hands out


@dataclass
class SamplingFailed:
    """What the sampling thread queues for a step whose sampling raised: the trainer raises
    `error` when it asks for that step."""

    step: int
    error: BaseException = field(repr=False)


class RolloutSource:
    """`get(step)` returns step's rollouts; `trained(step)` says the step's weights are out."""

    def __init__(self, sample: Callable[[int], StepRollouts], *, first_step: int, end: int, max_async_level: int,
                 on_policy: Callable[[int], bool] = lambda step: False):
        self.sample = sample
        self.level = max_async_level
        self.end = end
        self.on_policy = on_policy  # steps sampled from the weights of every step before them (the module note)
        self._trained = first_step  # steps before this one have trained and pushed their weights
        self._sampled = first_step  # steps before this one have been sampled (or failed)
        self._ready: deque[StepRollouts | SamplingFailed] = deque()
        self._changed = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if max_async_level > 0:
            self._thread = threading.Thread(target=self._sample_ahead, args=(first_step,), name="saccade-rollouts",
                                            daemon=True)
            self._thread.start()

    def get(self, step: int) -> tuple[StepRollouts, float, int]:
        """Step's rollouts, the seconds the trainer waited for them, and how many later steps'
        rollouts were ready in the queue behind them."""
        start = time.perf_counter()
        if self._thread is None:
            return self.sample(step), time.perf_counter() - start, 0
        with self._changed:
            self._changed.wait_for(lambda: bool(self._ready))
            item = self._ready.popleft()
            depth = len(self._ready)
        if isinstance(item, SamplingFailed):
            raise item.error
        if item.step != step:
            raise RuntimeError(f"rollouts of step {item.step + 1} came when step {step + 1} was due")
        return item, time.perf_counter() - start, depth

    def wait_to_push(self, version: int) -> None:
        """Block until the weights of `version` may go to the servers: every step that samples
        from older weights (those before version + level) has been sampled, or sampling stopped.
        A no-op when nothing samples ahead."""
        if self._thread is None:
            return
        due = min(version + self.level, self.end)
        # An on-policy step samples from these weights: it, and the steps after it, wait for them.
        due = next((s for s in range(version, due) if self.on_policy(s)), due)
        with self._changed:
            self._changed.wait_for(lambda: self._sampled >= due or self._stopping)

    def trained(self, step: int) -> None:
        """Step has trained and its weights are where the servers sample (when it pushed any)."""
        with self._changed:
            self._trained = step + 1
            self._changed.notify_all()

    def close(self) -> None:
        """Stop sampling ahead (a step being sampled finishes first) and drop what is queued."""
        if self._thread is None:
            return
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(timeout=600)
        for item in self._ready:
            if isinstance(item, StepRollouts):
                item.pins.release()
        self._ready.clear()

    def __enter__(self) -> RolloutSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sample_ahead(self, first_step: int) -> None:
        for step in range(first_step, self.end):
            trained_before = step if self.on_policy(step) else step - self.level  # steps whose weights it needs
            with self._changed:
                self._changed.wait_for(lambda: self._stopping or trained_before <= self._trained)
                if self._stopping:
                    return
            item: StepRollouts | SamplingFailed
            try:
                item = self.sample(step)
            except BaseException as err:  # the trainer raises it at its next get()
                item = SamplingFailed(step, err)
            failed = isinstance(item, SamplingFailed)
            with self._changed:
                self._ready.append(item)
                self._sampled = self.end if failed else step + 1  # a failure samples nothing more
                self._changed.notify_all()
            if failed:
                return
