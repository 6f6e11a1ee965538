"""Rewards: how an answer is scored, in one folder (docs/rewards.md).

- `builtin`: the built-in reward functions (`REWARD_FUNCTIONS`: correct, format, ...), answer
  extraction and grading, and `Scorer` (an extractor and a grader);
- `protocols`: the published scoring protocols (EasyR1/verl, OpenMMReasoner, MathVista), which
  `builtin` composes;
- `weighted`: `Rewards`, the run's reward functions and their weights (`rollout.reward_weights`),
  each call bounded;
- `bounded` and `bounded_child`: every call the library makes into the built-in scoring, run in
  one killable child and cut at 5 s;
- `user_workers` and `user_child`: a user's reward functions, run in worker processes that are
  killed when a call overruns.

The package exports the built-in names users import (`from saccade.rewards import score`,
"saccade.rewards:format_reward" in a config); the library itself imports them from their modules
(`saccade.rewards.builtin`), so that no module of this folder imports this file.
"""

from saccade.rewards.builtin import (
    REWARD_FUNCTIONS,
    RewardFunction,
    Scorer,
    boxed_format_reward,
    choice_index,
    correct_reward,
    easyr1_format_reward,
    extract_answer,
    extracted_answer,
    format_reward,
    grade,
    math_equal,
    normalize_text,
    parse_number,
    sample_precision,
    score,
    think_answer_reward,
    think_boxed_reward,
)

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "Scorer",
    "boxed_format_reward",
    "choice_index",
    "correct_reward",
    "easyr1_format_reward",
    "extract_answer",
    "extracted_answer",
    "format_reward",
    "grade",
    "math_equal",
    "normalize_text",
    "parse_number",
    "sample_precision",
    "score",
    "think_answer_reward",
    "think_boxed_reward",
]
