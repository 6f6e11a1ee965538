"""The built-in `correct` reward's math-verify in a killable child (saccade.math_worker)."""

from __future__ import annotations

import threading
import time

from saccade.math_worker import worker
from saccade.rewards import correct_reward


def test_a_power_tower_scores_0_within_the_limit_off_the_main_thread_and_scoring_goes_on():
    """`$9^{9^{9^{9}}}$` makes sympy compute for minutes holding the GIL (measured before the
    worker: a thread scoring it had not returned after 60 s, and starved the process); on the
    rollout thread, as every real run scores, it now scores 0 within the 5 s limit."""
    out: dict[str, float] = {}
    cuts = worker().timeouts
    start = time.time()
    thread = threading.Thread(target=lambda: out.setdefault("tower", correct_reward("$9^{9^{9^{9}}}$", {"answer": "3"})),
                              daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and out == {"tower": 0.0}
    assert time.time() - start < 5.0 + 10.0  # the limit, and the child's start (twice on a busy machine)
    assert worker().timeouts == cuts + 1
    # the next comparison gets a new child, and is right
    assert correct_reward(r"$\frac{1}{2}$", {"answer": "0.5"}) == 1.0
    assert correct_reward(r"$2\sqrt{3}$", {"answer": r"\sqrt{12}"}) == 1.0
