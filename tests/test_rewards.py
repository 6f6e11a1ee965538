"""Tests for saccade.rewards: answer extraction, scoring, reward functions."""

from __future__ import annotations

import pytest

from saccade.rewards import (
    REWARD_FUNCTIONS,
    choice_index,
    correct_reward,
    extract_answer,
    format_reward,
    parse_number,
    score,
)

COLORS4 = ["red", "green", "blue", "yellow"]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("red", "red"),
        ("  red  \n", "red"),
        ("", ""),
        ("   \n\n ", ""),
        ("The shape is red.\nblue", "blue"),
        ("I see a shape.\n\nGreen.\n", "Green"),
        ("Answer: blue", "blue"),
        ("answer:   Yellow!", "Yellow"),
        ("Reasoning...\nFinal Answer:\n**purple**\nThat is all.", "purple"),
        ("Answer: red. Wait, Answer: green", "green"),
        ("The answer is blue.", "blue"),
        ("so \\boxed{42} is it", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("Answer: 3 \\boxed{5}", "5"),
        ("<think>it is red</think>blue", "blue"),
        ("<think>Answer: red\n\\boxed{red}</think>\nAnswer: green", "green"),
        ("hmm</think> yellow", "yellow"),  # template opened <think> in the prompt
        ("<think>still thinking about red", ""),  # never finished thinking: no answer
        ('"red"', "red"),
        ("'green'.", "green"),
        ("**Answer:** blue", "blue"),
        ("`(B)`", "(B)"),
        ("$3.5$", "3.5"),
        ("\\boxed{\\text{red}}", "red"),
        (None, ""),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


# (completion, answer, choices, expected): hand-written cases for `score`.
SCORE_CASES = [
    ("red", "red", COLORS4, 1.0),
    ("Red", "red", COLORS4, 1.0),
    ("RED.", "red", COLORS4, 1.0),
    ("  red!\n", "red", COLORS4, 1.0),
    ("blue", "red", COLORS4, 0.0),
    ("Answer: green", "green", COLORS4, 1.0),
    ("Answer: green", "blue", COLORS4, 0.0),
    ("It looks reddish.\nAnswer: red", "red", COLORS4, 1.0),
    ("I think it is red\nbut actually\nblue", "blue", COLORS4, 1.0),
    ("I think it is red\nbut actually\nblue", "red", COLORS4, 0.0),
    ("\\boxed{yellow}", "yellow", COLORS4, 1.0),
    ("Answer: red \\boxed{green}", "green", COLORS4, 1.0),
    ("<think>maybe red</think>Answer: blue", "blue", COLORS4, 1.0),
    ("<think>maybe red</think>Answer: blue", "red", COLORS4, 0.0),
    ("<think>red red red", "red", COLORS4, 0.0),
    ("B", "green", COLORS4, 1.0),
    ("(B)", "green", COLORS4, 1.0),
    ("Answer: (C)", "blue", COLORS4, 1.0),
    ("\\boxed{D}", "yellow", COLORS4, 1.0),
    ("B. green", "green", COLORS4, 1.0),
    ("(B) red", "green", COLORS4, 0.0),  # letter and text disagree
    ("C", "green", COLORS4, 0.0),
    ("E", "green", COLORS4, 0.0),  # no fifth option
    ("B", "B", COLORS4, 1.0),  # gold given as a letter
    ("green", "B", COLORS4, 1.0),
    ("b", "green", COLORS4, 0.0),  # a bare lowercase letter is not read as an option
    ("**red**", "red", COLORS4, 1.0),
    ('"yellow"', "yellow", COLORS4, 1.0),
    ("", "red", COLORS4, 0.0),
    ("   ", "red", COLORS4, 0.0),
    ("red green", "red", COLORS4, 0.0),
    ("3", "3", ["1", "2", "3", "4"], 1.0),
    ("three", "3", ["1", "2", "3", "4"], 1.0),
    ("Answer: Three.", "3", ["1", "2", "3", "4"], 1.0),
    ("3.0", "3", ["1", "2", "3", "4"], 1.0),
    ("4", "3", ["1", "2", "3", "4"], 0.0),
    ("C", "3", ["1", "2", "3", "4"], 1.0),
    ("3", "3", None, 1.0),
    ("3.0", "3", None, 1.0),
    ("three", "3", None, 1.0),
    ("3", "three", None, 1.0),
    ("ten", "10", None, 1.0),
    ("eleven", "11", None, 0.0),  # number words stop at ten
    ("\\boxed{1,000}", "1000", None, 1.0),
    ("\\boxed{1/2}", "0.5", None, 1.0),
    ("0.50", "0.5", None, 1.0),
    ("Answer: 2", "3", None, 0.0),
    ("New  York", "new york", None, 1.0),
    ("A", "A", None, 1.0),  # free-form answer that happens to be a letter
    ("B", "green", None, 0.0),  # no choices: a letter is just a letter
]


@pytest.mark.parametrize("completion, answer, choices, expected", SCORE_CASES)
def test_score(completion, answer, choices, expected):
    answer_type = "multi_choice" if choices else None
    assert score(completion, answer, choices=choices, answer_type=answer_type) == expected


def test_score_case_count():
    assert len(SCORE_CASES) >= 25


def test_precision_and_answer_types():
    assert score("3.14159", "3.14", precision=2) == 1.0
    assert score("3.14159", "3.14") == 0.0
    assert score("1.005", "1.0", precision=1) == 1.0
    assert score("2.49", "2.5", answer_type="float", precision=1) == 1.0
    assert score("2.4", "2.5", answer_type="float", precision=1) == 0.0
    assert score("five", "5", answer_type="integer") == 1.0
    assert score("many", "5", answer_type="integer") == 0.0
    # letters map only for multiple choice
    assert score("B", "green", choices=COLORS4, answer_type="free_form") == 0.0
    assert score("green", "green", choices=COLORS4, answer_type="free_form") == 1.0
    assert score("B", "green", choices=COLORS4) == 1.0  # answer_type unknown: choices decide


def test_scores_are_floats_zero_or_one():
    for completion, answer, choices, _ in SCORE_CASES:
        value = score(completion, answer, choices=choices)
        assert isinstance(value, float) and value in (0.0, 1.0)


def test_parse_number_and_choice_index():
    assert parse_number("3") == 3.0 and parse_number("-2.5") == -2.5 and parse_number("Zero") == 0.0
    assert parse_number("1,234,567") == 1234567.0 and parse_number("50%") == 50.0
    assert parse_number("3/4") == 0.75 and parse_number("1/0") is None
    assert parse_number("red") is None and parse_number("") is None and parse_number("inf") is None
    assert choice_index("Blue", COLORS4) == 2
    assert choice_index("(D)", COLORS4) == 3 and choice_index("[A]", COLORS4) == 0
    assert choice_index("Option C", COLORS4) == 2
    assert choice_index("F", COLORS4) is None and choice_index("purple", COLORS4) is None
    assert choice_index("red", None) is None


def test_correct_reward_reads_sample_fields():
    from saccade.data.shapes import VQASample

    sample = VQASample("s1", [], "What color?", "blue", COLORS4, "multi_choice", {})
    assert correct_reward("Answer: blue", sample) == 1.0
    assert correct_reward("C", sample) == 1.0
    assert correct_reward("red", sample) == 0.0
    as_dict = {"answer": "3.14", "choices": None, "answer_type": "float", "precision": 2}
    assert correct_reward("\\boxed{3.1416}", as_dict) == 1.0
    with_meta = VQASample("s2", [], "Pi?", "3.14", None, "float", {"precision": 2})
    assert correct_reward("3.141", with_meta) == 1.0
    assert correct_reward("3.2", with_meta) == 0.0


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("red", 1.0),
        ("Answer: Yellow.", 1.0),
        ("(B)", 1.0),
        ("\\boxed{D}", 1.0),
        ("E", 0.0),
        ("purple", 0.0),
        ("red green", 0.0),
        ("The shape is red", 0.0),
        ("", 0.0),
        ("<think>red", 0.0),
    ],
)
def test_format_reward(completion, expected):
    assert format_reward(completion, COLORS4) == expected


def test_format_reward_without_choices_and_with_a_sample():
    assert format_reward("anything", None) == 1.0
    assert format_reward("   ", None) == 0.0
    assert format_reward("blue", {"choices": COLORS4}) == 1.0
    assert format_reward("blue", {"choices": ["red"]}) == 0.0


def test_reward_registry():
    assert set(REWARD_FUNCTIONS) >= {"correct", "format"}
    sample = {"answer": "red", "choices": COLORS4, "answer_type": "multi_choice"}
    # Every registered reward is called the same way: fn(completion, sample) -> float.
    assert {name: fn("A", sample) for name, fn in REWARD_FUNCTIONS.items()} == {"correct": 1.0, "format": 1.0}
    assert {name: fn("blue", sample) for name, fn in REWARD_FUNCTIONS.items()} == {"correct": 0.0, "format": 1.0}
