"""The child process of `saccade.rewards.bounded`: reads [op, args] as JSON lines on stdin, runs
`OPS[op](*args)` on its main thread and writes {"value": result} (or {"error": traceback}) for each
on stdout. It says "ready" once math-verify and sympy are imported, so that their import never
counts against a call's limit. The parent kills it when a call overruns."""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def as_sample(fields: dict[str, Any]) -> dict[str, Any]:
    """A sample rebuilt from `saccade.rewards.bounded.sample_fields`: a mapping with the fields
    scoring reads, its scorer an object again (without a judge: the parent asks it)."""
    from saccade.rewards.builtin import Scorer

    scorer = fields.get("scorer")
    return {**fields, "scorer": None if scorer is None else Scorer(*scorer)}


def reward(name: str, completion: str, fields: dict[str, Any]) -> float:
    from saccade.rewards.builtin import REWARD_FUNCTIONS

    sample = as_sample(fields)
    return float(REWARD_FUNCTIONS[name](completion, sample if fields else None))


def extracted_answer(completion: str, fields: dict[str, Any]) -> str:
    from saccade.rewards.builtin import extracted_answer as extract

    return extract(completion, as_sample(fields) if fields else None)


def extract_by_rules(completion: str, fields: dict[str, Any]) -> str | None:
    sample = as_sample(fields)
    return sample["scorer"].extract_by_rules(completion, sample)


def grade(extracted: str, fields: dict[str, Any]) -> float:
    sample = as_sample(fields)
    return sample["scorer"].grade(extracted, sample)


def math_equal(gold: str, predicted: str, precision: int | None) -> bool:
    from saccade.rewards.builtin import math_equal as equal

    try:
        return equal(gold, predicted, precision=precision)
    except Exception:  # noqa: BLE001 - any failure of sympy's is "not equal"
        return False


OPS = {"reward": reward, "extracted_answer": extracted_answer, "extract_by_rules": extract_by_rules,
       "grade": grade, "math_equal": math_equal}


def preload() -> None:
    """What the calls import, imported before "ready" (see the module's docstring). math-verify is
    needed only by the graders that compare math: a machine without it (the GPU machines' own
    Python) scores everything else, and a grader that needs it fails there with its own error."""
    import saccade.rewards.builtin  # noqa: F401
    import saccade.rewards.protocols  # noqa: F401

    try:
        import math_verify  # noqa: F401
        import sympy  # noqa: F401
    except ImportError:
        pass


def serve() -> None:
    preload()

    print("ready", flush=True)
    for line in sys.stdin:
        op, args = json.loads(line)
        try:
            reply = {"value": OPS[op](*args)}
        except Exception:  # noqa: BLE001 - the parent raises it, with this traceback
            reply = {"error": traceback.format_exc(limit=8)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve()
