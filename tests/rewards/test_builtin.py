"""Tests for saccade.rewards.builtin, through the names saccade.rewards exports: answer extraction,
scoring, reward functions."""

from __future__ import annotations

import pytest

from saccade.rewards import (
    REWARD_FUNCTIONS,
    boxed_format_reward,
    choice_index,
    correct_reward,
    extract_answer,
    format_reward,
    math_equal,
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
    from saccade.data.questions import VQASample

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
    assert set(REWARD_FUNCTIONS) >= {"correct", "format", "boxed_format"}
    sample = {"answer": "red", "choices": COLORS4, "answer_type": "multi_choice"}
    # Every registered reward is called the same way: fn(completion, sample) -> float.
    rewards = {name: fn("A", sample) for name, fn in REWARD_FUNCTIONS.items()}
    assert rewards == {"correct": 1.0, "format": 1.0, "boxed_format": 0.0, "think_boxed": 0.0,
                       "easyr1_format": 0.0, "think_answer": 0.0}
    rewards = {name: fn("\\boxed{blue}", sample) for name, fn in REWARD_FUNCTIONS.items()}
    assert rewards == {"correct": 0.0, "format": 1.0, "boxed_format": 1.0, "think_boxed": 0.0,
                       "easyr1_format": 0.0, "think_answer": 1.0}


# ------------------------------------------------------------- answer equivalence table

MATHVISTA_CHOICES = ["145°", "135°", "90°", "45°"]

# (completion, answer, choices, answer_type, precision, expected): one row per kind of answer
# the data sets hold, each kind both equal and not equal.
EQUIVALENCE_CASES = [
    # letters, with the options in `choices`
    ("\\boxed{B}", "135°", MATHVISTA_CHOICES, "multi_choice", None, 1.0),
    ("Answer: (D)", "135°", MATHVISTA_CHOICES, "multi_choice", None, 0.0),
    # OpenMMReasoner: a letter gold, options only in the prompt text
    ("The answer is (C).", "C", None, "multi_choice", None, 1.0),
    ("\\boxed{C. 12 cm}", "C", None, "multi_choice", None, 1.0),
    ("\\boxed{A}", "C", None, "multi_choice", None, 0.0),
    ("\\boxed{12 cm}", "C", None, "multi_choice", None, 0.0),
    # option text (MathVista's gold is the choice's text)
    ("\\boxed{135°}", "135°", MATHVISTA_CHOICES, "multi_choice", None, 1.0),
    ("\\boxed{45°}", "135°", MATHVISTA_CHOICES, "multi_choice", None, 0.0),
    ("\\boxed{Yes}", "Yes", ["Yes", "No"], "multi_choice", None, 1.0),
    ("\\boxed{no}", "Yes", ["Yes", "No"], "multi_choice", None, 0.0),
    # integers: MathVista compares str(int(float(x)))
    ("\\boxed{27}", "27", None, "integer", None, 1.0),
    ("\\boxed{27.0}", "27", None, "integer", None, 1.0),
    ("\\boxed{1,000}", "1000", None, "integer", None, 1.0),
    ("\\boxed{28}", "27", None, "integer", None, 0.0),
    # floats with MathVista's precision
    ("\\boxed{1.456}", "1.46", None, "float", 2, 1.0),
    ("\\boxed{1.45}", "1.46", None, "float", 2, 0.0),
    ("\\boxed{0.3}", "0.33", None, "float", 1, 1.0),
    ("\\boxed{\\frac{1}{3}}", "0.33", None, "float", 2, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.33", None, "float", 2, 0.0),
    # fractions
    ("\\boxed{\\frac{3}{4}}", "0.75", None, None, None, 1.0),
    ("\\boxed{3/4}", "\\frac{3}{4}", None, None, None, 1.0),
    ("\\boxed{\\dfrac{4}{3}}", "\\frac{3}{4}", None, None, None, 0.0),
    # LaTeX expressions
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", None, None, None, 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\sqrt{3}/2", None, None, None, 1.0),
    ("\\boxed{3\\sqrt{2}}", "2\\sqrt{3}", None, None, None, 0.0),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", None, None, None, 1.0),
    ("\\boxed{x = 5}", "5", None, None, None, 1.0),
    # units and degrees
    ("\\boxed{5 \\text{ cm}}", "5", None, None, None, 1.0),
    ("Answer: 60°", "60", None, None, None, 1.0),
    ("\\boxed{60^\\circ}", "60", None, None, None, 1.0),
    ("\\boxed{6 cm}", "5", None, None, None, 0.0),
    # lists
    ("\\boxed{[1, 2, 3]}", "[1, 2, 3]", None, "list", None, 1.0),
    ("\\boxed{1.01, 2}", "[1.0, 2.0]", None, "list", 1, 1.0),
    ("\\boxed{[1, 3, 2]}", "[1, 2, 3]", None, "list", None, 0.0),
    ("\\boxed{[1, 2]}", "[1, 2, 3]", None, "list", None, 0.0),
    # text
    ("\\boxed{Paris}", "paris", None, "text", None, 1.0),
    ("\\boxed{London}", "paris", None, "text", None, 0.0),
    ("\\boxed{der}", "red", None, "text", None, 0.0),  # sympy would read both as r*e*d
    # reasoning around the answer
    ("<think>maybe 4/3</think>So the ratio is \\boxed{\\frac{3}{4}}.", "0.75", None, None, None, 1.0),
    ("<think>\\boxed{0.75}", "0.75", None, None, None, 0.0),
]


@pytest.mark.parametrize("completion, answer, choices, answer_type, precision, expected", EQUIVALENCE_CASES)
def test_score_equivalence_table(completion, answer, choices, answer_type, precision, expected):
    assert score(completion, answer, choices=choices, answer_type=answer_type, precision=precision) == expected


def test_equivalence_table_covers_both_outcomes():
    assert len(EQUIVALENCE_CASES) >= 30
    assert {case[-1] for case in EQUIVALENCE_CASES} == {0.0, 1.0}


def test_math_equal_works_off_the_main_thread():
    # math-verify's own timeout uses SIGALRM, which only the main thread may set.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda pair: math_equal(*pair), [("\\frac{1}{2}", "0.5"), ("2\\sqrt{3}", "3")]))
    assert results == [True, False]


def test_math_equal_ignores_words_and_long_inputs():
    assert not math_equal("red", "der")
    assert not math_equal("1" * 300, "1" * 300)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>hmm</think>\\boxed{12}", 1.0),
        ("\\boxed{12}", 1.0),
        ("12", 0.0),  # no box
        ("\\boxed{1} or \\boxed{2}", 0.0),  # two answers
        ("<think>\\boxed{12}", 0.0),  # thinking never finished
        ("<think>a</think><think>b</think>\\boxed{1}", 0.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{12", 0.0),
    ],
)
def test_boxed_format_reward(completion, expected):
    assert boxed_format_reward(completion) == expected


def test_boxed_format_reward_checks_options_of_a_multiple_choice_sample():
    sample = {"choices": COLORS4, "answer_type": "multi_choice"}
    assert boxed_format_reward("\\boxed{B}", sample) == 1.0
    assert boxed_format_reward("\\boxed{purple}", sample) == 0.0
