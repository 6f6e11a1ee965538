"""Published scoring protocols: how EasyR1/verl (Geometry3K), OpenMMReasoner and MathVista
turn a reply into a score, so that saccade's figures compare with theirs.

A protocol is three parts, each a config value (`task.scoring`, docs/recipes.md):

- an **extractor** pulls the final answer out of the reply (`EXTRACTORS`);
- a **grader** compares it with the ground truth (`GRADERS`);
- a **format check** scores the reply's layout; it is a reward function of its own
  (`FORMAT_CHECKS`, weighted in `rollout.reward_weights` beside `correct`).

`saccade.rewards.Scorer` bundles an extractor and a grader; a data set's rows carry the scorer of
their task (`VQASample.scorer`), so the built-in `correct` reward, the periodic eval and `saccade eval`
score every row, of whichever eval set, by its own protocol.

What each part mirrors (read at the commits named; the tables in tests/rewards/scorers/ hold the
published code's own scores, written by scripts/scorer_tables.py, which runs that code):

- ``boxed`` / ``mathruler``: verl ``verl/utils/reward_score/geo3k.py`` (b178a3c): mathruler's
  ``extract_boxed_content`` (the last ``\\boxed{``, its braces balanced; the string
  ``"None"`` when there is none) and ``grade_answer`` (mathruler is a dependency: called, not
  restated). ``think_boxed`` is its format check, ``<think>...</think>`` then ``\\boxed{}``.
- ``easyr1`` / ``easyr1_format``: EasyR1 ``examples/reward_function/math.py`` (b44b311):
  the same, after removing whitespace around every ``<``, ``>`` and ``/`` of the reply.
- ``answer_tag`` / ``openmmreasoner`` / ``think_answer``: OpenMMReasoner
  ``custom_rewards/lmms_lab_recipe.py`` (67441eb): the first ``<answer>...</answer>``, else
  the last complete ``\\boxed{}``, else the last line ending in a number; a relaxed exact
  match (letters parsed out of the reply for a letter gold), then math-verify; the format
  check is 1 for ``<think>...</think>...<answer>...</answer>`` or a boxed answer, 0.8 for a
  long reply with some math and an extractable answer, else 0. Its LLM judge is not run.
- ``mathvista``: MathVista ``evaluation/extract_answer.py`` and ``calculate_score.py``
  (53d5258): the rule-based extraction (the reply is an option; an integer; a float;
  ``The answer is "x".``), then the official normalisation: a multiple-choice reply becomes an
  option (its letter, ``(B)``, or the nearest option by Levenshtein distance), an integer
  ``int(float(x))``, a float rounded to the row's precision, and the strings compared. Where
  the official script asks an LLM to extract the answer, saccade asks the endpoint
  ``task.scoring.judge_url`` with the official prompt when it is set, and otherwise takes
  saccade's own extraction (`saccade.rewards.extract_answer`): the one difference from the
  official protocol when no judge is set.

The ``saccade`` extractor and grader are `saccade.rewards.extract_answer` and `grade`. This
module imports nothing of saccade's: `saccade.rewards.builtin` composes it.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXTRACTORS",
    "FORMAT_CHECKS",
    "GRADERS",
    "LETTERS",
    "MATHVISTA_DEMO_PROMPT",
    "answer_tag_extract",
    "boxed_extract",
    "easyr1_extract",
    "easyr1_format",
    "gold_letter",
    "judge_extract",
    "last_complete_boxed",
    "mathruler_grade",
    "mathvista_extract_rules",
    "mathvista_judge_prompt",
    "mathvista_normalize",
    "nearest_option",
    "openmmreasoner_grade",
    "parse_letter",
    "squeeze_tag_spaces",
    "think_answer_format",
    "think_boxed_format",
]

EXTRACTORS = ("saccade", "boxed", "easyr1", "answer_tag", "mathvista")
GRADERS = ("saccade", "mathruler", "openmmreasoner", "mathvista")
LETTERS = ("A", "B", "C", "D", "E", "F", "G", "H")  # the option letters OpenMMReasoner's parser knows


# ------------------------------------------------------------------- EasyR1 / verl


_TAG_SPACES = re.compile(r"\s*(<|>|/)\s*")
_THINK_BOXED = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def squeeze_tag_spaces(text: str) -> str:
    """EasyR1's first step: no whitespace around any '<', '>' or '/' (Qwen2.5-VL-32B writes
    '< think >'). It applies to the whole reply, so '1 / 2' becomes '1/2' too."""
    return _TAG_SPACES.sub(r"\1", text)


def think_boxed_format(text: str) -> float:
    """verl geo3k's format check: the whole reply is '<think>...</think>' then a '\\boxed{...}'."""
    return 1.0 if _THINK_BOXED.fullmatch(text) else 0.0


def easyr1_format(text: str) -> float:
    """EasyR1's format check: `think_boxed_format` after `squeeze_tag_spaces`."""
    return think_boxed_format(squeeze_tag_spaces(text))


def boxed_extract(text: str) -> str:
    """mathruler's extraction (verl geo3k): the last '\\boxed{' content, stripped; 'None' when
    there is none or its braces never close."""
    from mathruler.grader import extract_boxed_content

    return extract_boxed_content(text)


def easyr1_extract(text: str) -> str:
    """EasyR1's extraction: `boxed_extract` after `squeeze_tag_spaces`."""
    return boxed_extract(squeeze_tag_spaces(text))


def mathruler_grade(predicted: str, gold: str) -> bool:
    from mathruler.grader import grade_answer

    return bool(grade_answer(predicted, gold))


# ------------------------------------------------------------------ OpenMMReasoner


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_ANSWER = re.compile(r"<think>.*</think>.*<answer>.*</answer>", re.DOTALL)
_TRAILING_NUMBER = re.compile(r"\b(\d+(?:\.\d+)?)\b(?:\s*\.?\s*$)")
_HAS_MATH = re.compile(r"[=+\-*/()\[\]\\]")
_BOXED_OPEN = "\\boxed{"


def last_complete_boxed(text: str) -> str:
    """The content of the last '\\boxed{' whose braces close; '' when none does (a truncated
    last box gives the one before it)."""
    start = text.rfind(_BOXED_OPEN)
    while start != -1:
        depth = 0
        for i in range(start + len(_BOXED_OPEN) - 1, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len(_BOXED_OPEN): i]
        start = text.rfind(_BOXED_OPEN, 0, start)
    return ""


def answer_tag_extract(text: str) -> str:
    """OpenMMReasoner's extraction: the first '<answer>...</answer>', else the last complete
    box, else the number ending the last line that ends in one; '' when there is none."""
    if m := _ANSWER_TAG.search(text):
        return m.group(1)
    if boxed := last_complete_boxed(text):
        return boxed
    for line in reversed(text.strip().split("\n")):
        if line.strip() and (m := _TRAILING_NUMBER.search(line)):
            return m.group(1)
    return ""


def think_answer_format(text: str) -> float:
    """OpenMMReasoner's format check: 1 for '<think>...</think>...<answer>...</answer>' (the
    whole reply) or any complete box; 0.8 for a reply over 50 characters with some math in it
    and an answer `answer_tag_extract` finds; else 0."""
    if _THINK_ANSWER.fullmatch(text) or last_complete_boxed(text):
        return 1.0
    if len(text.strip()) > 50 and _HAS_MATH.search(text) and answer_tag_extract(text):
        return 0.8
    return 0.0


# OpenMMReasoner's parse_mcq: where a letter may sit, and how much each place is trusted.
_MCQ_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the answer", "answer",
    "correct answer", "the correct answer", "the best answer is", "best answer is", "the best answer",
    "best answer", "the option is", "option is", "the correct option is", "correct option is", "the choice is",
    "choice is", "the correct choice is", "correct choice is", "i choose", "i select", "i pick", "my answer is",
    "my choice is",
)
# (how the letter is written, the candidate's kind), in the order they are tried; "{}" is the letter.
_MCQ_MARKS = (("({})", "parentheses"), ("{}.", "period"), ("{}:", "colon"), ("{})", "right_paren"),
              ("{} ", "space"), ("{}-", "dash"), ("{}_", "underscore"), ("{}=", "equals"))
_MCQ_PRIORITY = {"start": 10, "end": 9, "numbered": 8, "phrase": 7, "parentheses": 6, "period": 5, "colon": 4,
                 "right_paren": 3, "space": 2, "dash": 1, "underscore": 1, "equals": 1, "fallback": 0}


def parse_letter(text: str) -> str:
    """The option letter (A-H) a reply names, by OpenMMReasoner's rules (``parse_mcq``): every
    place a letter could be written is a candidate, and the most trusted kind wins (the start of
    the reply, its end, "1. A", after "the answer is", "(A)", "A.", ...), the earliest of that
    kind; with no candidate, any capital A-H anywhere (the last). '' when none."""
    if not text or not text.strip():
        return ""
    reply = text.strip()
    for char in ",.!?;:'\"":
        reply = reply.strip(char)
    reply = f" {reply} "
    lower = reply.lower()
    found: list[tuple[str, int, str]] = []
    for mark, kind in _MCQ_MARKS:
        for letter in LETTERS:
            written = mark.format(letter)
            if written in reply:
                found.append((letter, reply.rfind(written), kind))
    for phrase in _MCQ_PHRASES:
        if phrase in lower:
            start = lower.find(phrase)
            for letter in LETTERS:
                if (at := reply.find(letter, start)) != -1:
                    found.append((letter, at, "phrase"))
    for letter in LETTERS:
        if reply.strip().startswith(letter):
            found.append((letter, 0, "start"))
    for letter in LETTERS:
        if reply.strip().endswith(letter):
            found.append((letter, len(reply) - 1, "end"))
    for i, letter in enumerate(LETTERS):
        if f"{i + 1}. {letter}" in reply:
            found.append((letter, reply.rfind(f"{i + 1}. {letter}"), "numbered"))
    if not found:
        found = [(letter, reply.rfind(letter), "fallback") for letter in LETTERS if letter in reply]
    if not found:
        return ""
    # Python's sort is stable: among equal keys the first found stays first, as in the original.
    found.sort(key=lambda c: (_MCQ_PRIORITY[c[2]], -c[1]), reverse=True)
    return found[0][0]


def _drop_final_period(text: str) -> str:
    return (text[:-1] if text.endswith(".") else text).strip()


def _relaxed_match(predicted: str, gold: str, portion: float = 0.9) -> bool:
    if gold in LETTERS:
        return parse_letter(predicted) == gold
    if predicted in gold and len(predicted) >= portion * len(gold):
        return True
    if gold in predicted and len(gold) >= portion * len(predicted):
        return True
    return predicted.strip() == gold.strip()


def openmmreasoner_grade(extracted: str, gold: str) -> bool:
    """OpenMMReasoner's accuracy: the extracted answer and the gold each lose one final period
    and outer whitespace; a letter gold (A-H) is matched by `parse_letter`, anything else by
    containment covering 90% of the longer side or equality; failing that, math-verify."""
    predicted, gold = _drop_final_period(extracted.strip()), _drop_final_period(gold)
    if _relaxed_match(predicted, gold):
        return True
    from math_verify import parse, verify

    timeout = _timeout()
    try:
        return bool(verify(parse(gold, parsing_timeout=timeout), parse(predicted, parsing_timeout=timeout),
                           timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - the published scorer counts any failure as wrong
        return False


def _timeout() -> int | None:
    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    return 5 if threading.current_thread() is threading.main_thread() else None


# ------------------------------------------------------------------------- MathVista


_QUICK_ANSWER = re.compile(r'The answer is "(.*)"\.')
_PAREN_LETTER = re.compile(r"\(([a-zA-Z])\)")


def mathvista_extract_rules(response: str, *, question_type: str, answer_type: str,
                            choices: Sequence[str] | None) -> str | None:
    """MathVista's rule-based extraction (``extract_answer`` with ``quick_extract``): '' for an
    empty reply; the reply itself when it is one of the options, an integer, or a float; the
    quoted text of 'The answer is "x".'; None where the official script asks its LLM."""
    if response == "":
        return ""
    if question_type == "multi_choice" and choices and response in choices:
        return response
    if answer_type == "integer":
        try:
            return str(int(response))
        except ValueError:
            pass
    if answer_type == "float":
        try:
            return str(float(response))
        except ValueError:
            pass
    if m := _QUICK_ANSWER.search(response):
        return m.group(1)
    return None


def nearest_option(text: str, choices: Sequence[str]) -> str:
    """The option nearest `text` by Levenshtein distance, the first on a tie (MathVista's
    ``get_most_similar``)."""
    from Levenshtein import distance

    distances = [distance(text, choice) for choice in choices]
    return choices[distances.index(min(distances))]


def mathvista_normalize(extraction: Any, *, choices: Sequence[str] | None, question_type: str,
                        answer_type: str, precision: int | float | None) -> str | None:
    """MathVista's ``normalize_extracted_answer``: a multiple-choice extraction becomes an
    option ('(B) ...' and 'B' by letter, anything else the nearest option); an integer
    ``str(int(float(x)))``; a float ``str(round(float(x), precision))``; a list ``str(x)``;
    None when the number does not parse (or for a type it does not know)."""
    if question_type == "multi_choice":
        text = extraction.strip() if isinstance(extraction, str) else str(extraction)
        if letters := _PAREN_LETTER.findall(text):
            text = letters[0].upper()
        options = list(choices or [])
        letters_in_order = [chr(ord("A") + i) for i in range(len(options))]
        if text in letters_in_order:
            return options[letters_in_order.index(text)]
        return nearest_option(text, options)
    try:
        if answer_type == "integer":
            return str(int(float(extraction)))
        if answer_type == "float":
            return str(round(float(extraction), int(precision)))  # type: ignore[arg-type]
        if answer_type == "list":
            return str(extraction)
    except (TypeError, ValueError, OverflowError):
        return None
    return None


# The official extraction prompt, MathVista evaluation/prompts/ext_ans.py (demo_prompt), and its
# assembly in extract_answer.py's create_test_prompt.
MATHVISTA_DEMO_PROMPT = """
Please read the following example. Then extract the answer from the model response and type it at the end of the prompt.

Hint: Please answer the question requiring an integer answer and provide the final value, e.g., 1, 2, 3, at the end.
Question: Which number is missing?

Model response: The number missing in the sequence is 14.

Extracted answer: 14

Hint: Please answer the question requiring a floating-point number with one decimal place and provide the final value, e.g., 1.2, 1.3, 1.4, at the end.
Question: What is the fraction of females facing the camera?

Model response: The fraction of females facing the camera is 0.6, which means that six out of ten females in the group are facing the camera.

Extracted answer: 0.6

Hint: Please answer the question requiring a floating-point number with two decimal places and provide the final value, e.g., 1.23, 1.34, 1.45, at the end.
Question: How much money does Luca need to buy a sour apple candy and a butterscotch candy? (Unit: $)

Model response: Luca needs $1.45 to buy a sour apple candy and a butterscotch candy.

Extracted answer: 1.45

Hint: Please answer the question requiring a Python list as an answer and provide the final list, e.g., [1, 2, 3], [1.2, 1.3, 1.4], at the end.
Question: Between which two years does the line  graph saw its maximum peak?

Model response: The line graph saw its maximum peak between 2007 and 2008.

Extracted answer: [2007, 2008]

Hint: Please answer the question and provide the correct option letter, e.g., A, B, C, D, at the end.
Question: What fraction of the shape is blue?\\nChoices:\\n(A) 3/11\\n(B) 8/11\\n(C) 6/11\\n(D) 3/5

Model response: The correct answer is (B) 8/11.

Extracted answer: B
"""


def mathvista_judge_prompt(query: str, response: str) -> str:
    """The official extraction prompt for one reply: the examples, the row's query, the reply."""
    return f"{MATHVISTA_DEMO_PROMPT.strip()}\n\n{query}\n\n{response}\n\nExtracted answer: "


def judge_extract(prompt: str, *, url: str, model: str, api_key: str | None, timeout_s: float = 60.0) -> str:
    """Ask an OpenAI-compatible endpoint (``{url}/chat/completions``) to complete `prompt`,
    greedily; its reply, stripped. Blocking: it runs inside the reward call."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0.0}
    reply = httpx.post(f"{url.rstrip('/')}/chat/completions", json=body, headers=headers, timeout=timeout_s)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["message"]["content"]).strip()


def gold_letter(gold: str, choices: Sequence[str] | None) -> str:
    """A gold that is one of the options, as its letter (OpenMMReasoner's MathVista task grades
    MathVista's option-text golds so, ``lmms_eval_tasks/mathvista/utils.py``)."""
    if choices and gold in choices and list(choices).index(gold) < len(LETTERS):
        return LETTERS[list(choices).index(gold)]
    return gold


FORMAT_CHECKS = {
    "think_boxed": think_boxed_format,
    "easyr1_format": easyr1_format,
    "think_answer": think_answer_format,
}
"""Format checks, each a built-in reward function of the same name (`saccade.rewards.builtin`)."""
