"""The spike guard: skip an optimizer step whose gradient norm is far above the run's recent ones.

One destructive update is how an off-policy run breaks: in `saccade bench async` at one step ahead
the gradient norm sat at 0.05-0.4 for 18 steps, reached 9.05 (Intel Xeon) or 5.96 (AMD EPYC) in
one step, and the next steps' engine/trainer mismatch went from 0.01 to 2.4 nats and the replies to
nonsense (docs/async.md). Clipping the norm to `trainer.grad_clip` bounds the step's size but keeps
its direction, which is what broke the policy. Large pretraining runs skip such a step instead (the
batch is dropped, the weights and the optimizer state untouched); so does this guard, before the
weights reach the engine.

The rule: after `warmup` steps, a step whose pre-clip norm is more than `factor` times the median
of the last `window` norms is skipped and counted (`grad_spike_skipped`). Every norm, skipped or
not, enters the window: one spike hardly moves the median, while a lasting change of scale (a
warm-up of the learning rate, a new phase of the task) is accepted once it fills half the window,
so the guard never blocks a run for good. It costs nothing when nothing spikes: the norm is
already read once per step for clipping and the metrics, and the median of a few numbers is
taken on the host. The norm is the whole model's on every rank (`clip_grad_norm`), so every rank
decides alike.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from saccade.config import GradSpikeConfig


@dataclass
class GradSpikeGuard:
    factor: float
    window: int
    warmup: int
    norms: deque = field(default_factory=deque)

    @classmethod
    def of(cls, cfg: GradSpikeConfig | None) -> GradSpikeGuard | None:
        return None if cfg is None else cls(cfg.factor, cfg.window, cfg.warmup, deque(maxlen=cfg.window))

    def median(self) -> float | None:
        """The median of the window's norms, once it holds `warmup` of them."""
        return statistics.median(self.norms) if len(self.norms) >= self.warmup else None

    def is_spike(self, norm: float) -> bool:
        """Whether a step of this pre-clip norm is a spike to skip; the norm joins the window
        either way. A non-finite norm is not judged here (that step is skipped anyway) and does
        not join the window."""
        if not norm < float("inf"):  # NaN or inf
            return False
        median = self.median()
        self.norms.append(norm)
        return median is not None and norm > self.factor * median

    def saved(self) -> dict:
        """The window as JSON values, for a checkpoint's TrainState.extra: a resumed run judges
        its first steps against the same recent norms."""
        return {"norms": list(self.norms)}

    def restore(self, saved: Mapping | None) -> None:
        self.norms = deque((saved or {}).get("norms", []), maxlen=self.window)
