"""Rewards: turn a completion and a sample into a number.

Two stages, kept apart so later verifiers (math-verify, LLM judges, ...) slot in:

1. :func:`extract_answer` pulls the final answer out of free text: ``<think>`` blocks are
   dropped, then ``\\boxed{...}`` wins, else the text after the last ``Answer:`` (or
   "answer is"), else the last non-empty line.
2. :func:`score` compares an extracted answer with the reference: choice letters and option
   text, numbers (``"3" == "3.0" == "three"``), MathVista's answer types (``integer`` compares
   ``int(float(x))``, ``float`` rounds both sides to ``precision`` places, ``list`` compares
   item by item), then mathematical equivalence through math-verify (``\\frac{1}{2}`` ==
   ``0.5``, ``2\\sqrt{3}`` == ``\\sqrt{12}``, ``5 cm`` == ``5``), then normalized text.

Unlike MathVista's official script, a prediction that names no option is not mapped to the
nearest option by edit distance: as a reward that would pay for unrelated text.

Reward functions take ``(completion, sample)``, where ``sample`` is a
:class:`saccade.data.questions.VQASample` or a mapping with the same field names (``answer``,
``choices``, ``answer_type``, optional ``precision`` or ``metadata["precision"]``), and
return a float. :data:`REWARD_FUNCTIONS` names them for configuration files
(``rollout.reward_weights``), beside a user's own functions given as import paths;
:mod:`saccade.rewards.weighted` calls them all (``fn(completion, sample=..., messages=...)``, each
with the keywords it names: docs/rewards.md).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFunction",
    "Scorer",
    "boxed_format_reward",
    "choice_index",
    "math_equal",
    "correct_reward",
    "extract_answer",
    "extracted_answer",
    "format_reward",
    "grade",
    "normalize_text",
    "parse_number",
    "sample_precision",
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
# What makes an answer worth handing to math-verify: a digit, a LaTeX command, pi or a root.
# Plain words are not: math-verify reads "red" as the product r*e*d, equal to "der".
_MATHY = re.compile(r"[\d\\π√]")
# Longer answers are not short final answers; sympy on them can take seconds.
_MATH_VERIFY_MAX_CHARS = 200
_MATH_VERIFY_TIMEOUT_S = 5


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


def _letter(text: str) -> str | None:
    """The option letter that ``text`` names ("B", "(B)", "B.", "Option B", "B. 45"), upper case."""
    m = _LETTER.match(text.strip())
    if m is None or (m.group(2) is None and m.group(1).islower()):
        return None
    return m.group(1).upper()


def _list_items(text: str) -> list[str]:
    """"[1, 2.5]", "(1, 2.5)" or "1, 2.5" as its items."""
    s = text.strip()
    if s[:1] in "[(" and s[-1:] in "])":
        s = s[1:-1]
    return [item.strip() for item in s.split(",") if item.strip()]


def _items_equal(gold: str, predicted: str, precision: int | None) -> bool:
    g, p = parse_number(gold), parse_number(predicted)
    if g is not None and p is not None:
        return _numbers_equal(g, p, precision)
    return normalize_text(gold) == normalize_text(predicted)


def _math_verify_timeout() -> int | None:
    # math-verify times out with SIGALRM, which Python allows only on the main thread; elsewhere
    # it raises. Off the main thread we run without its timeout: _MATH_VERIFY_MAX_CHARS bounds
    # the input instead.
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _as_latex(text: str) -> str:
    # math-verify extracts LaTeX only between delimiters: bare "2\sqrt{3}" parses as just "2".
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def math_equal(gold: str, predicted: str, *, precision: int | None = None) -> bool:
    """Mathematical equivalence by math-verify (sympy): fractions, roots, pi, units, degrees.

    Both sides must look mathematical (a digit, a LaTeX command, pi or a root) and be short.
    With ``precision``, two numeric values are compared after rounding, as MathVista does.
    Unbounded, in this process: a short power tower makes sympy compute for minutes holding the
    GIL. The library calls it inside `saccade.rewards.bounded`'s child, killed after 5 s.
    """
    if not (_MATHY.search(gold) and _MATHY.search(predicted)):
        return False
    if max(len(gold), len(predicted)) > _MATH_VERIFY_MAX_CHARS:
        return False
    from math_verify import parse, verify

    timeout = _math_verify_timeout()
    gold_parsed = parse(_as_latex(gold), parsing_timeout=timeout)
    predicted_parsed = parse(_as_latex(predicted), parsing_timeout=timeout)
    if not gold_parsed or not predicted_parsed:
        return False
    if precision is not None:
        g, p = _numeric(gold_parsed[0]), _numeric(predicted_parsed[0])
        if g is not None and p is not None:
            return _numbers_equal(g, p, precision)
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))


def _numeric(value: Any) -> float | None:
    """A parsed sympy value as a float, when it is a plain number."""
    try:
        if getattr(value, "is_number", False):
            return float(value)
    except (TypeError, ValueError):
        pass
    return None


def score(
    completion: str,
    answer: str,
    *,
    choices: list[str] | None = None,
    answer_type: str | None = None,
    precision: int | None = None,
) -> float:
    """1.0 when the completion's final answer matches ``answer``, else 0.0.

    Tried in order:

    * multiple choice with ``choices``: the same option, by its text or its letter (A = 0),
      for a gold answer given either way;
    * multiple choice with a letter gold and no option list (the options are only in the
      prompt text, as in OpenMMReasoner): the same letter;
    * ``answer_type="list"``: the same items in order, numbers rounded to ``precision``;
    * two plain numbers: ``integer`` compares ``int(float(x))`` (MathVista's rule), else equal
      after rounding to ``precision`` places, or to float tolerance without one;
    * math-verify equivalence (see :func:`math_equal`);
    * the same normalized text (case, spaces and trailing punctuation ignored).
    """
    return grade(extract_answer(completion), answer, choices=choices, answer_type=answer_type, precision=precision)


def grade(
    predicted: str,
    answer: str,
    *,
    choices: list[str] | None = None,
    answer_type: str | None = None,
    precision: int | None = None,
) -> float:
    """:func:`score`'s comparison, of an answer already extracted (``""``: none)."""
    if not predicted:
        return 0.0
    gold = _clean(str(answer))
    multi_choice = answer_type in (None, "multi_choice")
    if choices and multi_choice:
        gold_index = choice_index(gold, choices)
        predicted_index = choice_index(predicted, choices)
        if gold_index is not None and predicted_index is not None:
            return float(gold_index == predicted_index)
        if predicted_index is not None:
            predicted = str(choices[predicted_index])
    elif answer_type == "multi_choice" and _letter(gold) == gold.upper() and len(gold) == 1:
        return float(_letter(predicted) == gold.upper())
    if answer_type == "list":
        gold_items, predicted_items = _list_items(gold), _list_items(predicted)
        return float(
            len(gold_items) == len(predicted_items)
            and all(_items_equal(g, p, precision) for g, p in zip(gold_items, predicted_items, strict=True))
        )
    gold_number, predicted_number = parse_number(gold), parse_number(predicted)
    if gold_number is not None and predicted_number is not None:
        if answer_type == "integer":
            return float(int(gold_number) == int(predicted_number))
        return float(_numbers_equal(gold_number, predicted_number, precision))
    if math_equal(gold, predicted, precision=precision):
        return 1.0
    if answer_type in ("integer", "float") and gold_number is not None:
        return 0.0
    return float(normalize_text(predicted) == normalize_text(gold))


# ------------------------------------------------------------------ reward functions


def _field(sample: Any, name: str, default: Any = None) -> Any:
    if isinstance(sample, Mapping):
        return sample.get(name, default)
    return getattr(sample, name, default)


def sample_precision(sample: Any) -> int | None:
    """A sample's ``precision``, else its ``metadata["precision"]``; None without one."""
    precision = _field(sample, "precision")
    if precision is None:
        metadata = _field(sample, "metadata") or {}
        precision = metadata.get("precision") if isinstance(metadata, Mapping) else None
    return precision


def correct_reward(completion: str, sample: Any) -> float:
    """1.0 when the completion answers ``sample`` correctly: by the sample's own scorer when it
    carries one (``sample.scorer``, a :class:`saccade.rewards.Scorer`: the published
    protocols), else by :func:`score`."""
    scorer = _field(sample, "scorer")
    if scorer is not None:
        return scorer.correct(completion, sample)
    return score(
        completion,
        str(_field(sample, "answer")),
        choices=_field(sample, "choices"),
        answer_type=_field(sample, "answer_type"),
        precision=sample_precision(sample),
    )


def extracted_answer(completion: str, sample: Any = None) -> str:
    """The answer :func:`correct_reward` grades: by the sample's scorer, else :func:`extract_answer`."""
    scorer = _field(sample, "scorer") if sample is not None else None
    return scorer.extract(completion, sample) if scorer is not None else extract_answer(completion)


def format_reward(completion: str, sample: Sequence[str] | Any | None) -> float:
    """1.0 when the final answer is exactly one of the choices (text or letter), else 0.0.

    ``sample`` is a sample carrying the option list (every entry of :data:`REWARD_FUNCTIONS`
    is called as ``fn(completion, sample=...)``), or the option list itself. Without choices,
    any non-empty final answer is well formed.
    """
    choices = sample
    if choices is not None and not isinstance(choices, list | tuple):
        choices = _field(choices, "choices")
    predicted = extract_answer(completion)
    if not predicted:
        return 0.0
    if not choices:
        return 1.0
    return float(choice_index(predicted, choices) is not None)


def boxed_format_reward(completion: str, sample: Any = None) -> float:
    """1.0 when the completion finishes any ``<think>`` block and then gives its answer in
    exactly one ``\\boxed{...}`` (the format reasoning prompts ask for), else 0.0.

    With a multiple-choice ``sample``, the boxed answer must also name one of its options."""
    if not completion:
        return 0.0
    opens, closes = len(_THINK_OPEN.findall(completion)), len(_THINK_CLOSE.findall(completion))
    if opens > 1 or closes > 1 or (opens and not closes):
        return 0.0
    after = completion[_THINK_CLOSE.search(completion).end():] if closes else completion
    if len(_BOXED.findall(after)) != 1 or _last_boxed(after) is None:
        return 0.0
    answer = _clean(_last_boxed(after))
    if not answer:
        return 0.0
    choices = _field(sample, "choices") if sample is not None else None
    if choices and _field(sample, "answer_type") in (None, "multi_choice"):
        return float(choice_index(answer, choices) is not None)
    return 1.0


def think_boxed_reward(completion: str, sample: Any = None) -> float:
    """verl geo3k's format check (:func:`saccade.rewards.protocols.think_boxed_format`)."""
    from saccade.rewards.protocols import think_boxed_format

    return think_boxed_format(completion or "")


def easyr1_format_reward(completion: str, sample: Any = None) -> float:
    """EasyR1's format check (:func:`saccade.rewards.protocols.easyr1_format`)."""
    from saccade.rewards.protocols import easyr1_format

    return easyr1_format(completion or "")


def think_answer_reward(completion: str, sample: Any = None) -> float:
    """OpenMMReasoner's format check: 1, 0.8 or 0 (:func:`saccade.rewards.protocols.think_answer_format`)."""
    from saccade.rewards.protocols import think_answer_format

    return think_answer_format(completion or "")


# ------------------------------------------------------------- published protocols


@dataclass(frozen=True)
class Scorer:
    """An extractor and a grader (`saccade.rewards.protocols.EXTRACTORS`, `GRADERS`): what `correct`
    means for a row (`task.scoring`; the published protocols are `saccade.rewards.protocols`).

    `judge_url` (with the mathvista extractor): an OpenAI-compatible endpoint asked with the
    official prompt where MathVista's rules find no answer; `judge_model` the model it serves;
    `judge_api_key_env` the environment variable holding its key, if any."""

    extractor: str = "saccade"
    grader: str = "saccade"
    judge_url: str | None = None
    judge_model: str = "gpt-4o-mini"
    judge_api_key_env: str | None = None

    def __post_init__(self) -> None:
        from saccade.rewards.protocols import EXTRACTORS, GRADERS

        if self.extractor not in EXTRACTORS:
            raise ValueError(f"unknown extractor {self.extractor!r}; choose from {', '.join(EXTRACTORS)}")
        if self.grader not in GRADERS:
            raise ValueError(f"unknown grader {self.grader!r}; choose from {', '.join(GRADERS)}")

    def extract(self, completion: str, sample: Any = None) -> str:
        """The final answer in `completion`, by this scorer's extractor (and its judge, where the
        MathVista rules find none)."""
        found = self.extract_by_rules(completion, sample)
        if found is None:
            return self.ask_judge(completion, sample) if self.judge_url else extract_answer(completion or "")
        return found

    def extract_by_rules(self, completion: str, sample: Any = None) -> str | None:
        """The final answer by the extractor's rules; None where MathVista's rules find none (its
        judge, or saccade's own extraction, decides then)."""
        from saccade.rewards import protocols as p

        completion = completion or ""
        if self.extractor == "boxed":
            return p.boxed_extract(completion)
        if self.extractor == "easyr1":
            return p.easyr1_extract(completion)
        if self.extractor == "answer_tag":
            return p.answer_tag_extract(completion).strip()
        if self.extractor == "mathvista":
            choices = _field(sample, "choices")
            answer_type = _field(sample, "answer_type") or "text"
            question_type = "multi_choice" if answer_type == "multi_choice" else "free_form"
            return p.mathvista_extract_rules(completion, question_type=question_type, answer_type=answer_type,
                                             choices=choices)
        return extract_answer(completion)

    def ask_judge(self, completion: str, sample: Any) -> str:
        """The answer the judge at `judge_url` extracts, asked with MathVista's official prompt."""
        import os

        from saccade.rewards import protocols as p

        key = os.environ.get(self.judge_api_key_env) if self.judge_api_key_env else None
        return p.judge_extract(p.mathvista_judge_prompt(_query(sample), completion), url=self.judge_url,
                               model=self.judge_model, api_key=key)

    def correct(self, completion: str, sample: Any) -> float:
        """1.0 when the extracted answer grades equal to the sample's answer, else 0.0."""
        return self.grade(self.extract(completion, sample), sample)

    def grade(self, extracted: str, sample: Any) -> float:
        """1.0 when `extracted` grades equal to the sample's answer by this scorer's grader, else 0.0."""
        from saccade.rewards import protocols as p

        gold = str(_field(sample, "answer"))
        choices = _field(sample, "choices")
        answer_type = _field(sample, "answer_type")
        if self.grader == "mathruler":
            return float(p.mathruler_grade(extracted, gold))
        if self.grader == "openmmreasoner":
            return float(p.openmmreasoner_grade(extracted, p.gold_letter(gold, choices)))
        if self.grader == "mathvista":
            multi_choice = answer_type == "multi_choice" and bool(choices)
            normalized = p.mathvista_normalize(
                extracted, choices=choices, question_type="multi_choice" if multi_choice else "free_form",
                answer_type=answer_type or "text", precision=sample_precision(sample))
            return float(normalized == gold)
        return grade(extracted, gold, choices=choices, answer_type=answer_type, precision=sample_precision(sample))


def _query(sample: Any) -> str:
    """The prompt's user text, for the judge (MathVista's `query`)."""
    prompt = _field(sample, "prompt")
    if prompt:
        users = [m["content"] for m in prompt if m.get("role") == "user" and isinstance(m.get("content"), str)]
        if users:
            return users[-1]
    return str(_field(sample, "question") or "")



REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    "correct": correct_reward,
    "format": format_reward,
    "boxed_format": boxed_format_reward,
    # The published protocols' format checks (saccade.rewards.protocols.FORMAT_CHECKS).
    "think_boxed": think_boxed_reward,
    "easyr1_format": easyr1_format_reward,
    "think_answer": think_answer_reward,
}
