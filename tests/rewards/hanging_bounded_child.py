"""The scoring child (saccade.rewards.bounded_child) made to never return, run by tests/rewards/test_bounded.py:

- `ops`: every call the child serves never returns: a library call that reaches the child is cut at
  the limit, and one that ran anywhere else would return, so the test sees every route;
- `math`: math-verify's parse and verify and sympy's parse_expr and simplify never return (what a
  power tower does to them, forever): every grader that calls them is cut at the limit.
"""

from __future__ import annotations

import sys
import time


def never_returns(*args, **kwargs):
    time.sleep(3600)


if __name__ == "__main__":
    from saccade.rewards import bounded_child

    if sys.argv[1] == "ops":
        bounded_child.OPS = {op: never_returns for op in bounded_child.OPS}
    else:
        import math_verify
        import sympy
        from sympy.parsing import sympy_parser

        math_verify.parse = math_verify.verify = sympy.simplify = sympy_parser.parse_expr = never_returns
    bounded_child.serve()
