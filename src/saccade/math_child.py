"""The child process of `saccade.math_worker`: reads [gold, predicted, precision] as JSON lines
on stdin and writes math-verify's verdict (true/false) for each on stdout. It says "ready" once
math-verify and sympy are imported, so that their import never counts against a comparison's
limit."""

from __future__ import annotations

import json
import os
import sys


def serve() -> None:
    import math_verify  # noqa: F401 - imported before "ready": see the module's docstring

    from saccade.rewards import math_equal_here

    print("ready", flush=True)
    for line in sys.stdin:
        gold, predicted, precision = json.loads(line)
        try:
            verdict = math_equal_here(gold, predicted, precision=precision)
        except Exception:  # noqa: BLE001 - any failure of sympy's is "not equal"
            verdict = False
        print(json.dumps(verdict), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    serve()
