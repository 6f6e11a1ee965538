"""Scoring answers with the run's reward functions (`rollout.reward_weights`).

Each key of `rollout.reward_weights` names a reward function: a built-in
(`saccade.rewards.REWARD_FUNCTIONS`: correct, format, boxed_format) or an import path
"package.module:function" (`saccade.plugins`). Every one is called as

    fn(completion, *, sample, messages) -> float | dict[str, float]

- `completion`: the answer's text, as sampled;
- `sample`: the prompt (a `saccade.data.questions.VQASample`: answer, choices, answer_type,
  precision, metadata, ...; a data set's rows are mapped onto the same fields);
- `messages`: the prompt as OpenAI-format chat messages, images as
  ``{"type": "image", "image": PIL.Image}`` parts.

`sample` and `messages` are passed as keywords, and only those the function's signature
names (both to one with ``**kwargs``): ``def f(completion, sample)`` is a reward function,
as are the built-ins. A signature that needs anything else is refused before the run
builds anything (`saccade.run.tasks.check_user_code`, --dry-run included).

A float is the function's value. A dict is its named parts: every part is logged, and the
function's value is their sum. The step's reward for an answer is
``sum(weight * value)`` over the functions.

Every call is bounded by `rollout.reward_timeout_s`, and one that overruns is cut: a user's
functions run in worker processes, killed when a call overruns (`saccade.rewards.user_workers`; a
thread cannot be stopped, and an ``async def`` that blocks stops the event loop it runs on).
Sync functions share a pool of at most `SYNC_WORKERS` (8) processes per `Rewards`, one call
each at a time. Async functions (``async def``) are awaited, each on its own worker's event
loop, where all of a step's answers are in flight together (`saccade.envs.rollout.step_all`
gathers the environments), so functions that wait on I/O (a judge model behind HTTP)
overlap; one that blocks its loop has its worker killed, with a warning naming it. Only a
call's arguments cross to a worker (pickled): the worker imports the function by its path.
The built-ins (their extractors, graders and format checks) run in one child process, each
call killed after 5 s (`saccade.rewards.bounded`: a short power tower holds sympy and the GIL for
minutes, which no thread or SIGALRM can cut; a long adversarial reply slows the extractors). `Rewards.close` ends the workers; the run calls
it when it ends.

A call that raises, times out, returns something other than a finite number (or a dict of
them), or whose worker dies, scores 0 for that answer and the run goes on. It is counted in
the step's metrics, and the first failure of each function is logged with its traceback
(logger "saccade.scoring"); later ones only count.

Metrics, per step, over every answer sampled (`saccade.orchestrator.rollout.reward_metrics`):
``reward_<name>`` the mean unweighted value of each function, ``reward_<name>_<part>`` the
mean of each part, and ``reward_errors`` / ``reward_timeouts`` the number of failed calls.
``<name>`` is the built-in's name, or the function's own name for an import path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from saccade.plugins import is_import_path, load_callable
from saccade.rewards.bounded import TIMEOUT_S as SCORING_TIMEOUT_S
from saccade.rewards.bounded import reward as bounded_reward
from saccade.rewards.user_workers import RewardFailed, Workers

log = logging.getLogger("saccade.scoring")

# Metric names that rollout_metrics already uses: a function of one of these names is refused.
RESERVED_NAMES = ("mean", "std", "errors", "timeouts")


@dataclass(frozen=True)
class RewardFunction:
    """One weighted reward function, resolved and checked."""

    key: str  # as written in rollout.reward_weights
    name: str  # in metrics: reward_<name>
    weight: float
    fn: Callable[..., Any]
    keywords: tuple[str, ...]  # which of "sample", "messages" it takes
    builtin: bool
    is_async: bool


def resolve(key: str) -> Callable[..., Any]:
    """The function a reward_weights key names; ValueError listing the built-ins otherwise."""
    from saccade.rewards.builtin import REWARD_FUNCTIONS

    if key in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[key]
    if is_import_path(key):
        return load_callable(key)
    raise ValueError(f"unknown reward function {key!r}; built-in: {', '.join(REWARD_FUNCTIONS)}; "
                     "or your own as 'package.module:function' (docs/rewards.md)")


def metric_name(key: str) -> str:
    """reward_<this> in metrics: the built-in's name, or the function's name after the colon."""
    return key.rsplit(":", 1)[-1].rsplit(".", 1)[-1] if is_import_path(key) else key


def call_keywords(fn: Callable[..., Any], key: str) -> tuple[str, ...]:
    """Which of `sample` and `messages` to pass `fn` by keyword; ValueError for a signature that
    cannot be called as fn(completion, *, sample, messages)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins have no signature: pass everything
        return ("sample", "messages")
    P = inspect.Parameter
    if any(p.kind is P.VAR_KEYWORD for p in params.values()):
        keywords = ("sample", "messages")
    else:
        keywords = tuple(n for n in ("sample", "messages")
                         if n in params and params[n].kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY))
    positional = [p for p in params.values()
                  if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD) and p.name not in keywords]
    takes_completion = bool(positional) or any(p.kind is P.VAR_POSITIONAL for p in params.values())
    unmet = [p.name for p in positional[1:] if p.default is P.empty]
    unmet += [p.name for p in params.values()
              if p.kind is P.KEYWORD_ONLY and p.default is P.empty and p.name not in keywords]
    if not takes_completion or unmet:
        problem = "takes no completion argument" if not takes_completion else \
            f"needs arguments saccade does not pass ({', '.join(unmet)})"
        raise ValueError(f"{key!r} {problem}; a reward function is called as "
                         "fn(completion, *, sample, messages), with only the keywords it names")
    return keywords


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def reward_functions(weights: Mapping[str, float]) -> list[RewardFunction]:
    """The weighted functions, resolved and checked (what config validation runs, too)."""
    from saccade.rewards.builtin import REWARD_FUNCTIONS

    out: list[RewardFunction] = []
    by_name: dict[str, str] = {}
    for key, weight in weights.items():
        fn = resolve(key)
        name = metric_name(key)
        if name in RESERVED_NAMES:
            raise ValueError(f"{key!r} would be logged as reward_{name}, a metric saccade already "
                             "writes; give the function another name")
        if name in by_name:
            raise ValueError(f"{by_name[name]!r} and {key!r} would both be logged as reward_{name}; "
                             "give one of the functions another name")
        by_name[name] = key
        out.append(RewardFunction(key, name, float(weight), fn, call_keywords(fn, key),
                                  builtin=key in REWARD_FUNCTIONS, is_async=_is_async(fn)))
    return out


@dataclass
class Outcome:
    """One function's result on one answer."""

    value: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)
    error: bool = False
    timed_out: bool = False


def as_parts(value: Any, key: str) -> tuple[float, dict[str, float]]:
    """A float (bool, int) or a dict of them as (value, parts); TypeError/ValueError otherwise."""
    if isinstance(value, Mapping):
        parts = {}
        for part, v in value.items():
            if not isinstance(part, str) or not part:
                raise TypeError(f"reward function {key!r} returned a dict whose key {part!r} is not a name")
            parts[part] = _finite(v, f"{key!r} part {part!r}")
        return sum(parts.values()), parts
    return _finite(value, repr(key)), {}


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, (int, float)):  # bool is an int; numpy floats are floats
        try:
            value = float(value)  # numpy and torch scalars
        except (TypeError, ValueError):
            raise TypeError(f"reward function {what} returned {type(value).__name__}, not a float "
                            "or a dict of floats") from None
    if not math.isfinite(float(value)):
        raise ValueError(f"reward function {what} returned {value}, not a finite number")
    return float(value)


class Rewards:
    """The run's weighted reward functions: `score` one answer, concurrently with the others
    scored on the same event loop (any thread's). One object per task, shared by its
    environments, so each function's first failure is logged once per run; `close` when the run
    ends."""

    def __init__(self, weights: Mapping[str, float], *, timeout_s: float = 60.0):
        self.functions = reward_functions(weights)
        self.timeout_s = timeout_s
        self.reported: set[str] = set()  # functions whose failure has been logged
        self.workers: Workers | None = None  # the user's functions' processes, started on first call
        self._guard = threading.Lock()

    @property
    def weights(self) -> dict[str, float]:
        return {f.key: f.weight for f in self.functions}

    async def score(self, completion: str, *, sample: Any, messages: list[dict[str, Any]]) -> tuple[float, dict]:
        """(total, {"reward_<name>": value, "reward_<name>_<part>": part, "reward_errors": n,
        "reward_timeouts": n}) for one answer; every function runs, failures score 0."""
        outcomes = await asyncio.gather(*(self._call(f, completion, sample, messages) for f in self.functions))
        total = 0.0
        values: dict[str, float] = {"reward_errors": 0.0, "reward_timeouts": 0.0}
        for f, o in zip(self.functions, outcomes, strict=True):
            total += f.weight * o.value
            values[f"reward_{f.name}"] = o.value
            for part, v in o.parts.items():
                values[f"reward_{f.name}_{part}"] = v
            values["reward_errors"] += float(o.error)
            values["reward_timeouts"] += float(o.timed_out)
        return total, values

    async def _call(self, f: RewardFunction, completion: str, sample: Any, messages: list) -> Outcome:
        kwargs = {k: v for k, v in (("sample", sample), ("messages", messages)) if k in f.keywords}
        try:
            if f.builtin:  # in the scoring child, killed past its limit; a thread keeps this loop free meanwhile
                total, parts = as_parts(await asyncio.to_thread(bounded_reward, f.key, completion, sample), f.key)
            else:
                total, parts = await self._workers().call(f.key, f.is_async, completion, kwargs)
        except TimeoutError:
            limit = f"its bound of {SCORING_TIMEOUT_S:g} s" if f.builtin else \
                f"rollout.reward_timeout_s = {self.timeout_s:g} s"
            self._report(f, f"reward function {f.key!r} took longer than {limit} on an answer: scored 0, counted "
                            "in reward_timeouts (logged once; later timeouts only count)")
            return Outcome(timed_out=True)
        except Exception as err:  # noqa: BLE001 - a user's function may fail any way; the run goes on
            # A worker's failure carries the function's own traceback as text: this process's
            # frames would only show the pipe.
            trace = None if isinstance(err, RewardFailed) else err.__traceback__
            self._report(f, f"reward function {f.key!r} failed on an answer: scored 0, counted in "
                            "reward_errors (logged once; later failures only count)", error=(type(err), err, trace))
            return Outcome(error=True)
        return Outcome(total, parts)

    def _report(self, f: RewardFunction, message: str, *, error: tuple | None = None) -> None:
        if f.key in self.reported:
            return
        self.reported.add(f.key)
        log.warning(message, exc_info=error)

    def _workers(self) -> Workers:
        with self._guard:
            if self.workers is None:
                sync = [f.key for f in self.functions if not f.builtin and not f.is_async]
                self.workers = Workers(sync, timeout_s=self.timeout_s)
            return self.workers

    def close(self) -> None:
        """Kill the worker processes of the user's functions (the run calls this when it ends; exit
        does too). A later call starts new ones."""
        if self.workers is not None:
            self.workers.close()
