"""Rewards: turn a completion and a sample into a number.

Two stages, kept apart so later verifiers (math-verify, LLM judges, ...) slot in:

1. :func:`extract_answer` pulls the final answer out of free text: ``<think>`` blocks are
   dropped, then ``\\boxed{...}`` wins, else the text after the last ``Answer:`` (or
   "answer is"), else the last non-empty line.
2. :func:`score` compares an extracted answer with the reference: choice letters, numbers
   (``"3" == "3.0" == "three"``) and normalized text.

Reward functions take ``(completion, sample)``, where ``sample`` is a
:class:`saccade.data.shapes.VQASample` or a mapping with the same field names (``answer``,
``choices``, ``answer_type``, optional ``precision`` or ``metadata["precision"]``), and
return a float. :data:`REWARD_FUNCTIONS` names them for configuration files.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "choice_index",
    "correct_reward",
    "extract_answer",
    "format_reward",
    "normalize_text",
    "parse_number",
    "score",
]

RewardFunction = Callable[[str, Any], float]

NUMBER_WORDS: dict[str, int] = {
    w: i
    for i, w in enumerate("zero one two three four five six seven eight nine ten".split())
}

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.IGNORECASE | re.DOTALL)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</think>", re.IGNORECASE)
_ANSWER_MARK = re.compile(r"\banswer\s*(?::|is\b\s*:?)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\s*\{")
# A choice letter alone: "B", "(B)", "[B]", "B)", "B.", "B:", "Option B", "(B) blue".
_LETTER = re.compile(r"^(?:option\s+)?[(\[]?([A-Z])[)\]]?[.:)]?(?:\s+(.*))?$", re.IGNORECASE)
_TRAILING_PUNCT = ".,;:!?。"
_WRAPPERS = ("**", "__", "*", "_", "`", '"', "'", "“", "”", "‘", "’")
_QUOTE_PAIRS = {'"': '"', "'": "'", "“": "”", "‘": "’", "`": "`"}
_NUMBER = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?$", re.IGNORECASE)
_FRACTION = re.compile(r"^([+-]?\d+)\s*/\s*(\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_TEXT_CMD = re.compile(r"^\\(?:text|textbf|mathrm|mbox)\s*\{(.*)\}$", re.DOTALL)


# ----------------------------------------------------------------------- extraction


def extract_answer(completion: str | None) -> str:
    """The final answer in a completion, cleaned; ``""`` when there is none."""
    if not completion:
        return ""
    text = _strip_thinking(completion)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    marks = list(_ANSWER_MARK.finditer(text))
    if marks:
        rest = text[marks[-1].end():]
        return _clean(_first_nonempty_line(rest))
    return _clean(_last_nonempty_line(text))


def _strip_thinking(text: str) -> str:
    text = _THINK_BLOCK.sub(" ", text)
    # A chat template may open <think> in the prompt: the completion then holds only "</think>".
    closes = list(_THINK_CLOSE.finditer(text))
    if closes:
        text = text[closes[-1].end():]
    # Still-open thinking (the model ran out of tokens mid-thought) holds no answer.
    opened = _THINK_OPEN.search(text)
    if opened:
        text = text[: opened.start()]
    return text


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, with nested braces; None without one."""
    starts = list(_BOXED.finditer(text))
    for match in reversed(starts):
        depth, i = 1, match.end()
        while i < len(text):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[match.end(): i]
            i += 1
        # Unbalanced (truncated) box: try an earlier one.
    return None


def _first_nonempty_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line
    return ""


def _last_nonempty_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line
    return ""


def _clean(answer: str) -> str:
    """Strip whitespace, markdown emphasis, quotes, ``$...$``, ``\\text{}`` and trailing punctuation."""
    previous = None
    s = answer
    while s != previous:
        previous = s
        s = s.strip()
        s = s.rstrip(_TRAILING_PUNCT).strip()
        if len(s) >= 2 and s[0] == "$" and s[-1] == "$":
            s = s.strip("$")
        if m := _TEXT_CMD.match(s):
            s = m.group(1)
        for w in _WRAPPERS:
            if len(s) >= 2 * len(w) and s.startswith(w) and s.endswith(w):
                s = s[len(w): -len(w)]
                break
        else:
            # One-sided leftovers such as '**red' or 'red**' (cut-off markdown).
            s = s.strip("*")
            if s[:1] in _QUOTE_PAIRS and _QUOTE_PAIRS[s[0]] not in s[1:]:
                s = s[1:]
    return s.strip()


# -------------------------------------------------------------------------- scoring


def normalize_text(text: str) -> str:
    """Lowercase, collapse whitespace, drop trailing punctuation."""
    return " ".join(text.lower().split()).rstrip(_TRAILING_PUNCT).strip()


def parse_number(text: str) -> float | None:
    """A number written as digits, a simple fraction or a word zero..ten; else None."""
    s = normalize_text(text)
    if not s:
        return None
    if s in NUMBER_WORDS:
        return float(NUMBER_WORDS[s])
    s = _THOUSANDS.sub("", s).replace(" ", "")
    s = s.lstrip("$").rstrip("%")
    if _NUMBER.match(s):
        value = float(s)
        return value if math.isfinite(value) else None
    if m := _FRACTION.match(s):
        num, den = int(m.group(1)), int(m.group(2))
        return float(Fraction(num, den)) if den else None
    return None


def choice_index(text: str, choices: Sequence[str] | None) -> int | None:
    """The index of the choice that ``text`` names: its text, or its letter (A = 0)."""
    if not choices or not text:
        return None
    norm = normalize_text(text)
    for i, choice in enumerate(choices):
        if normalize_text(str(choice)) == norm:
            return i
    m = _LETTER.match(text.strip())
    if m is None:
        return None
    letter, rest = m.group(1), m.group(2)
    bare = rest is None and m.group(0).strip() == letter
    if bare and letter.islower():
        return None  # a lone lowercase "a" is an article far more often than an option
    i = ord(letter.upper()) - ord("A")
    if i >= len(choices):
        return None
    if rest is not None and normalize_text(rest) != normalize_text(str(choices[i])):
        return None  # "(B) red" where B is not red: contradictory, count it wrong
    return i


def _numbers_equal(a: float, b: float, precision: int | None) -> bool:
    if precision is not None:
        return round(a, precision) == round(b, precision)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def score(
    completion: str,
    answer: str,
    *,
    choices: list[str] | None = None,
    answer_type: str | None = None,
    precision: int | None = None,
) -> float:
    """1.0 when the completion's final answer matches ``answer``, else 0.0.

    Matches, in order: the same choice (by text or letter, when ``choices`` are given and
    the question is multiple choice), the same number (``precision`` rounds both first),
    the same normalized text.
    """
    predicted = extract_answer(completion)
    if not predicted:
        return 0.0
    gold = _clean(str(answer))
    if choices and answer_type in (None, "multi_choice"):
        gold_index = choice_index(gold, choices)
        predicted_index = choice_index(predicted, choices)
        if gold_index is not None and predicted_index is not None:
            return float(gold_index == predicted_index)
        if predicted_index is not None:
            predicted = str(choices[predicted_index])
    gold_number, predicted_number = parse_number(gold), parse_number(predicted)
    if gold_number is not None and predicted_number is not None:
        return float(_numbers_equal(gold_number, predicted_number, precision))
    if answer_type in ("integer", "float") and gold_number is not None:
        return 0.0
    return float(normalize_text(predicted) == normalize_text(gold))


# ------------------------------------------------------------------ reward functions


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def correct_reward(completion: str, sample: Any) -> float:
    """1.0 when the completion answers ``sample`` correctly (see :func:`score`)."""
    precision = _field(sample, "precision")
    if precision is None:
        metadata = _field(sample, "metadata") or {}
        precision = metadata.get("precision") if isinstance(metadata, Mapping) else None
    return score(
        completion,
        str(_field(sample, "answer")),
        choices=_field(sample, "choices"),
        answer_type=_field(sample, "answer_type"),
        precision=precision,
    )


def format_reward(completion: str, choices: Sequence[str] | Any | None) -> float:
    """1.0 when the final answer is exactly one of the choices (text or letter), else 0.0.

    ``choices`` may be the option list or a sample carrying one (so that every entry of
    :data:`REWARD_FUNCTIONS` is called as ``fn(completion, sample)``). Without choices,
    any non-empty final answer is well formed.
    """
    if choices is not None and not isinstance(choices, list | tuple):
        choices = _field(choices, "choices")
    predicted = extract_answer(completion)
    if not predicted:
        return 0.0
    if not choices:
        return 1.0
    return float(choice_index(predicted, choices) is not None)


REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "correct": correct_reward,
    "format": format_reward,
}
