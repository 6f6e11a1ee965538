"""Every shipped reward, extractor and grader, bounded: run in a child process that is killed when a
call overruns `TIMEOUT_S`.

A reply as short as `$9^{9^{9^{9}}}$` makes sympy compute a power of hundreds of millions of
digits: one C call that holds the GIL, so neither math-verify's SIGALRM timeout (main thread
only, and only between bytecodes; off it math-verify turns its timeouts off) nor a thread
abandoned by the scorer can end it; measured, a thread running it starved the process for over a
minute. Graders other than saccade's call math-verify too (OpenMMReasoner's; mathruler's sympy),
and the extractors and format checks scan the reply with regular expressions and brace counts
that a long, adversarial reply makes slow. So every call the library makes into them goes
through here: one long-lived child (`python -m saccade.rewards.bounded_child`, JSON lines on its
stdin/stdout) runs it; one that does not answer within its limit is killed, the call raises
`ScoringTimeout` (the reward is counted in `reward_timeouts` and scores 0; `score` and
`extracted_answer` give 0 and ""), and the next call starts a new child (about a second:
sympy's import, never counted against a call).

The functions in `saccade.rewards.builtin` and `saccade.rewards.protocols` are the computation,
unbounded, in whatever process calls them; the library calls them only through this module's
functions (a test holds it: tests/rewards/test_bounded.py). What crosses to the child is plain
data: the reply, and of the sample only what scoring reads (`sample_fields`). An LLM judge
(MathVista's extraction with `task.scoring.judge_url`) is asked from this process, between two
bounded calls: its HTTP request has a timeout of its own, longer than a call's limit.
"""

from __future__ import annotations

import atexit
import json
import logging
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from saccade.parent_death import start_child

log = logging.getLogger("saccade.scoring")

TIMEOUT_S = 5.0  # one call's limit, the child's start not counted


class ScoringTimeout(TimeoutError):
    """A scoring call did not return within its limit (its child was killed)."""


class ScoringWorker:
    """One child process running scoring calls, shared by every thread (one call at a time)."""

    def __init__(self, timeout_s: float = TIMEOUT_S, command: list[str] | None = None):
        self.timeout_s = timeout_s
        self.command = command or [sys.executable, "-m", "saccade.rewards.bounded_child"]
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.timeouts = 0  # calls cut (tests, and what a person may ask)
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saccade-scoring-spawner")
        atexit.register(self.close)

    def call(self, op: str, *args: Any) -> Any:
        """`saccade.rewards.bounded_child.OPS[op](*args)`, run in the child. ScoringTimeout when it did not
        return within `timeout_s` (the child killed); RuntimeError with the child's traceback when
        the call raised."""
        with self.lock:
            proc = self._started()
            try:
                proc.stdin.write(json.dumps([op, list(args)]) + "\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
                line = proc.stdout.readline() if ready else ""
            except OSError:  # the child died under us
                line = ""
            if not line:
                self.timeouts += 1
                self._kill()
                if self.timeouts == 1:
                    log.warning("a scoring call (%s) took longer than %g s: its child was killed and the answer "
                                "scores 0 (logged once; later ones count in reward_timeouts)", op, self.timeout_s)
                raise ScoringTimeout(f"{op} took longer than {self.timeout_s:g} s")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"scoring call {op} failed in the scoring child:\n{reply['error']}")
        return reply["value"]

    def warm(self) -> None:
        """Start the child now, if none runs (else the next call starts it, before its limit counts)."""
        with self.lock:
            self._started()

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            # Tied to this process (SIGKILL when it dies: a child mid power tower would run on for
            # minutes), from a thread of the worker's own that lives as long as it: the kernel signals
            # the child when its starting thread ends, and the callers' threads come and go.
            self.proc = self._spawner.submit(
                start_child, self.command, death_signal=signal.SIGKILL, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, bufsize=1).result()
            ready = self.proc.stdout.readline()  # the child's imports never count against a call
            if ready.strip() != "ready":
                code = self.proc.wait()
                self.proc = None
                raise RuntimeError(f"the scoring child ({' '.join(self.command)}) exited with {code} before it was "
                                   "ready; its error is above, on this process's stderr")
        return self.proc

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            self._kill()


_worker: ScoringWorker | None = None
_worker_lock = threading.Lock()


def worker() -> ScoringWorker:
    """The process's one scoring worker, started on first use."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ScoringWorker()
        return _worker


# ----------------------------------------------------------------- what crosses


def _field(sample: Any, name: str) -> Any:
    return sample.get(name) if isinstance(sample, Mapping) else getattr(sample, name, None)


def sample_fields(sample: Any) -> dict[str, Any]:
    """What scoring reads of a sample, as plain data: the answer, the options, the answer type,
    the precision, the scorer's extractor and grader. A list or tuple is the option list itself
    (`format_reward`'s older form)."""
    from saccade.rewards.builtin import sample_precision

    if isinstance(sample, Sequence) and not isinstance(sample, str):
        return {"choices": [str(c) for c in sample]}
    if sample is None:
        return {}
    choices = _field(sample, "choices")
    scorer = _field(sample, "scorer")
    answer = _field(sample, "answer")
    return {"answer": None if answer is None else str(answer),
            "choices": None if choices is None else [str(c) for c in choices],
            "answer_type": _field(sample, "answer_type"), "precision": sample_precision(sample),
            "scorer": None if scorer is None else [scorer.extractor, scorer.grader]}


def _judged(sample: Any) -> Any:
    """The sample's scorer when it asks a judge where its extraction rules find nothing."""
    scorer = _field(sample, "scorer") if sample is not None else None
    return scorer if scorer is not None and scorer.judge_url and scorer.extractor == "mathvista" else None


# ------------------------------------------------------- the library's calls


def reward(name: str, completion: str, sample: Any) -> float:
    """Built-in reward function `name` (`saccade.rewards.REWARD_FUNCTIONS`) of one answer, bounded.
    ScoringTimeout past the limit (the caller counts it and scores 0)."""
    scorer = _judged(sample) if name == "correct" else None
    if scorer is None:
        return float(worker().call("reward", name, completion or "", sample_fields(sample)))
    extracted = worker().call("extract_by_rules", completion or "", sample_fields(sample))
    if extracted is None:
        extracted = scorer.ask_judge(completion or "", sample)  # HTTP, bounded by its own timeout
    return float(worker().call("grade", extracted, sample_fields(sample)))


def correct(completion: str, sample: Any) -> float:
    """The built-in `correct` of one answer, bounded; 0 past the limit."""
    try:
        return reward("correct", completion, sample)
    except ScoringTimeout:
        return 0.0


def score(completion: str, answer: str, *, choices: list[str] | None = None, answer_type: str | None = None,
          precision: int | None = None) -> float:
    """`saccade.rewards.score`, bounded; 0 past the limit."""
    return correct(completion, {"answer": answer, "choices": choices, "answer_type": answer_type,
                                "precision": precision})


def extracted_answer(completion: str, sample: Any = None) -> str:
    """The answer `correct` grades (`saccade.rewards.extracted_answer`), bounded; "" past the limit."""
    scorer = _judged(sample)
    try:
        found = worker().call("extract_by_rules" if scorer else "extracted_answer", completion or "",
                              sample_fields(sample))
    except ScoringTimeout:
        return ""
    return scorer.ask_judge(completion or "", sample) if found is None else found


def math_equal(gold: str, predicted: str, *, precision: int | None = None) -> bool:
    """`saccade.rewards.math_equal`, bounded; False past the limit."""
    try:
        return bool(worker().call("math_equal", gold, predicted, precision))
    except ScoringTimeout:
        return False
