"""Write the scorer tables, tests/rewards/scorers/*.jsonl: replies with the scores the published
scorers give them, computed by running the published code itself.

    uv run python scripts/scorer_tables.py --easyr1 EASYR1_CHECKOUT --verl VERL_CHECKOUT \\
        --openmmreasoner OPENMMREASONER_CHECKOUT --mathvista MATHVISTA_CHECKOUT

Each checkout is a clone of the published repository (its commit is written into every row):

- EasyR1 (github.com/hiyouga/EasyR1): examples/reward_function/math.py, whose
  ``compute_score`` calls mathruler; its rows score EasyR1's whole reward (overall, format,
  accuracy).
- verl (github.com/volcengine/verl): verl/utils/reward_score/geo3k.py (compute_score,
  format_reward, acc_reward): the same reward without EasyR1's whitespace step.
- OpenMMReasoner (github.com/EvolvingLMMs-Lab/OpenMMReasoner):
  custom_rewards/lmms_lab_recipe.py's ``compute_score`` (its LLM judge off, as by default).
- MathVista (github.com/lupantech/MathVista): evaluation/extract_answer.py's
  ``extract_answer`` (quick_extract on; its model a stub that says where the LLM would be
  asked) and calculate_score.py's ``normalize_extracted_answer`` and ``safe_equal``.

tests/rewards/test_protocols.py reads the tables and requires saccade's scorers
(saccade.rewards.protocols) to give every row's scores: agreement 100%.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "rewards" / "scorers"
THINK = "<think>Angle sum: 180 - 2x. So x follows.</think>"


def load(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def commit(repo: Path) -> str:
    """The checkout's commit: git's, else a COMMIT file beside the files (a `git archive` export)."""
    if (repo / "COMMIT").is_file():
        return (repo / "COMMIT").read_text().strip()
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def write(name: str, rows: list[dict]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{path.relative_to(ROOT)}: {len(rows)} rows")


# ----------------------------------------------------------------- Geometry3K / EasyR1

GEO_GOLDS = ["3", "60", "12.5", "2\\sqrt{3}", "\\frac{5}{2}", "4\\sqrt{2}", "\\frac{40}{3}", "7.2", "22",
             "45", "8\\sqrt{3}", "2.5"]


def geo_variants(gold: str) -> list[str]:
    """Answers to put in the box: the gold and the ways a model writes it, right and wrong."""
    out = [gold, f"{gold}^\\circ", f"{gold}°", f"{gold} cm", f"x = {gold}", f"\\text{{{gold}}}", f"${gold}$",
           gold.replace("\\frac", "\\dfrac"), f"{gold}.0", f"{gold}+1", "0", f"({gold})"]
    numeric = {"3": "3.0", "60": "60.00", "12.5": "\\frac{25}{2}", "2\\sqrt{3}": "\\sqrt{12}",
               "\\frac{5}{2}": "2.5", "4\\sqrt{2}": "\\sqrt{32}", "\\frac{40}{3}": "13.33", "7.2": "\\frac{36}{5}",
               "22": "22.0", "45": "\\frac{90}{2}", "8\\sqrt{3}": "13.86", "2.5": "5/2"}
    out.append(numeric[gold])
    return out


def geo_replies(gold: str) -> list[str]:
    replies = [f"{THINK} The answer is \\boxed{{{v}}}." for v in geo_variants(gold)]
    replies += [
        f"{THINK}\\boxed{{{gold}}}",  # no space
        f"< think >Working.< / think > \\boxed{{{gold}}}",  # spaced tags (EasyR1 squeezes them)
        f"<think>Working.</think> \\boxed{{{gold}}} and \\boxed{{0}}",  # last box wrong
        f"<think>Working.</think> \\boxed{{0}} then \\boxed{{{gold}}}",  # last box right
        f"<think>Working.</think> The answer is {gold}.",  # no box: "None"
        f"The answer is \\boxed{{{gold}}}.",  # no think
        f"<think>Working. \\boxed{{{gold}}}</think>",  # box inside the think only
        f"<think>Working.</think> \\boxed{{{gold}",  # truncated box
        f"<think>Working.</think> \\boxed{{\\boxed{{{gold}}}}}",  # nested boxes
        f"<think>Working.</think> \\boxed {{{gold}}}",  # space before the brace
        f"<think>Working.",  # truncated thought
        "",
        "<think>Working.</think> \\boxed{None}",
        f"<think>Working.</think>\n\n**Answer:** $\\boxed{{{gold}}}$",
        f"<think>a</think><think>b</think> \\boxed{{{gold}}}",  # two thoughts
        f"<think>Working.</think> \\boxed{{ {gold} }}",  # spaces inside
        f"<think>Working.</think> \\boxed{{{gold} / 1}}",  # a slash EasyR1's squeeze touches
    ]
    return replies


def easyr1_table(repo: Path) -> list[dict]:
    module = load(repo / "examples" / "reward_function" / "math.py", "easyr1_math")
    rows = []
    for gold in GEO_GOLDS:
        replies = geo_replies(gold)
        scores = module.compute_score([{"response": r, "ground_truth": gold} for r in replies])
        for reply, s in zip(replies, scores, strict=True):
            rows.append({"reply": reply, "gold": gold, "overall": s["overall"], "format": s["format"],
                         "accuracy": s["accuracy"]})
    source = {"source": "hiyouga/EasyR1 examples/reward_function/math.py", "commit": commit(repo)}
    return [{**source, **r} for r in rows]


def verl_geo3k_table(repo: Path) -> list[dict]:
    module = load(repo / "verl" / "utils" / "reward_score" / "geo3k.py", "verl_geo3k")
    rows = []
    for gold in GEO_GOLDS:
        for reply in geo_replies(gold):
            rows.append({"source": "volcengine/verl verl/utils/reward_score/geo3k.py", "commit": commit(repo),
                         "reply": reply, "gold": gold, "overall": module.compute_score(reply, gold),
                         "format": module.format_reward(reply), "accuracy": module.acc_reward(reply, gold)})
    return rows


# ------------------------------------------------------------------- OpenMMReasoner

OMR_CASES: list[tuple[str, list[str]]] = [
    ("A", ["<think>x</think><answer>A</answer>", "<think>x</think><answer>(A) 45</answer>",
           "<think>x</think><answer>The answer is A.</answer>", "<think>x</think><answer>B</answer>",
           "<think>x</think><answer>a</answer>", "<think>x</think><answer>Option A</answer>",
           "<think>x</think>\\boxed{A}", "The answer is A", "<answer>A</answer>", "A",
           "<think>x</think><answer>A. 12 cm</answer>", "<think>x</think><answer>C) red</answer>",
           "<think>x</think><answer>B or A</answer>", "<think>x</think><answer>1. A</answer>",
           "<think>x</think><answer>Answer: D</answer>", "<think>x</think><answer></answer>",
           "<think>x</think><answer>A</answer><answer>B</answer>", "I choose (A) because AB = 3.",
           "<think>long</think>\n<answer>\n(A)\n</answer>", "<think>x</think>The correct option is A."]),
    ("C", ["<think>x</think><answer>C</answer>", "<think>x</think><answer>(C)</answer>",
           "<think>x</think><answer>c</answer>", "<think>x</think><answer>The best answer is C</answer>",
           "<think>x</think><answer>A, B, or C: C</answer>", "<think>x</think><answer>C.</answer>",
           "<think>x</think><answer>Choice: C-</answer>", "<think>x</think><answer>ABC</answer>",
           "<think>x</think><answer>E</answer>", "<think>x</think><answer>H</answer>",
           "<think>x</think><answer>(C) 2\\sqrt{3}</answer>", "<think>x</think>\\boxed{C}",
           "<think>x</think>\\boxed{(C)}", "C", "<answer>C", "Final: (B) then (C)",
           "<think>x</think><answer>CAT</answer>", "<think>x</think><answer>Choose C_</answer>",
           "<think>x</think><answer>C=</answer>", "<think>x</think><answer>the answer</answer>"]),
    ("14", ["<think>x</think><answer>14</answer>", "<think>x</think><answer>14.</answer>",
            "<think>x</think><answer>14.0</answer>", "<think>x</think><answer>fourteen</answer>",
            "<think>x</think><answer>140</answer>", "<think>x</think><answer>x = 14</answer>",
            "<think>x</think><answer>$14$</answer>", "<think>x</think>\\boxed{14}",
            "<think>x</think>So the total is 14.", "Some reasoning, 3 + 11 = 14\nThe answer is 14.",
            "The count is 14 apples", "<think>x</think><answer>\\boxed{14}</answer>",
            "<think>x</think><answer>14 cm</answer>", "<think>x</think><answer>1 4</answer>",
            "<think>x</think><answer> 14 </answer>", "<think>x</think><answer>13</answer>",
            "x\\boxed{14", "<think>x</think><answer>\\frac{28}{2}</answer>", "", "14"]),
    ("0.5", ["<think>x</think><answer>0.5</answer>", "<think>x</think><answer>1/2</answer>",
             "<think>x</think><answer>\\frac{1}{2}</answer>", "<think>x</think><answer>.5</answer>",
             "<think>x</think><answer>0.50</answer>", "<think>x</think><answer>50%</answer>",
             "<think>x</think><answer>0.51</answer>", "<think>x</think>\\boxed{\\frac{1}{2}}",
             "<think>x</think>\\boxed{0.5}", "The ratio is 0.5"]),
    ("\\frac{\\sqrt{3}}{2}", ["<think>x</think><answer>\\frac{\\sqrt{3}}{2}</answer>",
                              "<think>x</think><answer>$\\frac{\\sqrt{3}}{2}$</answer>",
                              "<think>x</think><answer>\\sqrt{3}/2</answer>",
                              "<think>x</think><answer>0.866</answer>",
                              "<think>x</think>\\boxed{\\frac{\\sqrt{3}}{2}}",
                              "<think>x</think>\\boxed{\\dfrac{\\sqrt{3}}{2}}",
                              "<think>x</think><answer>\\frac{\\sqrt{2}}{2}</answer>"]),
    ("red", ["<think>x</think><answer>red</answer>", "<think>x</think><answer>Red</answer>",
             "<think>x</think><answer>red.</answer>", "<think>x</think><answer>The ball is red</answer>",
             "<think>x</think><answer>reds</answer>", "<think>x</think><answer>blue</answer>",
             "<think>x</think>\\boxed{red}", "It is red."]),
    ("Yes", ["<think>x</think><answer>Yes</answer>", "<think>x</think><answer>yes</answer>",
             "<think>x</think><answer>Yes.</answer>", "<think>x</think><answer>No</answer>",
             "<think>x</think><answer>Yes, it is.</answer>"]),
    ("(2, 3)", ["<think>x</think><answer>(2, 3)</answer>", "<think>x</think><answer>(2,3)</answer>",
                "<think>x</think><answer>(3, 2)</answer>", "<think>x</think>\\boxed{(2, 3)}"]),
    ("1250", ["<think>x</think><answer>1250</answer>", "<think>x</think><answer>1,250</answer>",
              "<think>x</think><answer>$1250$</answer>", "<think>x</think><answer>1250.00</answer>",
              "<think>x</think><answer>1.25 \\times 10^3</answer>"]),
]
# Longer replies for the 0.8 format credit: over 50 characters, some math, an extractable answer.
OMR_LONG = [
    "We compute 3 + 4 = 7 and then 7 * 2 = 14, so the total length of the segment is\n14",
    "We compute the sum of the two angles and subtract it from the straight angle\n14",
    "We compute (3 + 4) and double it, that gives the total length of the segment: fourteen",
    "<think>3 + 4 = 7, 7 * 2 = 14, over fifty characters here for sure</think> so 14",
    "Using the Pythagorean theorem a^2 + b^2 = c^2 we find c = 5 and the answer is <answer>5</answer>",
]


def omr_table(repo: Path) -> list[dict]:
    module = load(repo / "custom_rewards" / "lmms_lab_recipe.py", "omr_recipe")
    assert module.USE_LLM_JUDGE != "True", "unset USE_LLM_JUDGE: the table is of the rule-based scorer"
    cases = [(gold, reply) for gold, replies in OMR_CASES for reply in replies]
    cases += [(gold, reply) for gold in ("14", "5") for reply in OMR_LONG]
    # Each reply against each gold of another kind too: letters vs numbers vs text.
    golds = [g for g, _ in OMR_CASES]
    cases += [(golds[(i + 1) % len(golds)], reply) for i, (_, replies) in enumerate(OMR_CASES) for reply in replies]
    rows = []
    for gold, reply in cases:
        s = module.compute_score("openmmreasoner", reply, gold)
        rows.append({"source": "EvolvingLMMs-Lab/OpenMMReasoner custom_rewards/lmms_lab_recipe.py",
                     "commit": commit(repo), "reply": reply, "gold": gold, "score": s["score"],
                     "accuracy": float(s["acc_score"]), "format": s["format_reward_score"],
                     "extracted": s["predict_str"]})
    return rows


# ------------------------------------------------------------------------ MathVista

MV_ROWS = [
    {"question_type": "multi_choice", "answer_type": "text", "precision": None,
     "choices": ["3/11", "8/11", "6/11", "3/5"], "answer": "8/11"},
    {"question_type": "multi_choice", "answer_type": "text", "precision": None,
     "choices": ["red", "green", "blue", "yellow", "purple"], "answer": "blue"},
    {"question_type": "multi_choice", "answer_type": "text", "precision": None,
     "choices": ["Yes", "No"], "answer": "No"},
    {"question_type": "multi_choice", "answer_type": "text", "precision": None,
     "choices": ["larger than", "equal to", "smaller than"], "answer": "smaller than"},
    {"question_type": "free_form", "answer_type": "integer", "precision": None, "choices": None, "answer": "14"},
    {"question_type": "free_form", "answer_type": "integer", "precision": None, "choices": None, "answer": "0"},
    {"question_type": "free_form", "answer_type": "float", "precision": 1.0, "choices": None, "answer": "0.6"},
    {"question_type": "free_form", "answer_type": "float", "precision": 2.0, "choices": None, "answer": "1.45"},
    {"question_type": "free_form", "answer_type": "float", "precision": 1.0, "choices": None, "answer": "6.0"},
    {"question_type": "free_form", "answer_type": "list", "precision": None, "choices": None,
     "answer": "[2007, 2008]"},
]


def mv_replies(row: dict) -> list[tuple[str, str]]:
    """(reply, what the stub LLM extracts from it where the rules ask it): rules-only replies
    and replies that need the LLM, each with the extraction the LLM is assumed to give."""
    gold, choices = row["answer"], row["choices"]
    if row["question_type"] == "multi_choice":
        letter = "ABCDE"[choices.index(gold)]
        other = choices[(choices.index(gold) + 1) % len(choices)]
        return [(gold, ""), (other, ""), (f'The answer is "{gold}".', ""), (f'The answer is "{letter}".', ""),
                (f'The answer is "({letter}) {gold}".', ""), (f"The correct answer is ({letter}) {gold}.", letter),
                (f"I think it is {gold}.", gold), ("", ""), (f"It is {gold.upper()}", gold.upper()),
                (f"Hmm, {other}", other), ("The answer is Z.", "Z"), (f"<think>x</think>{letter}", letter),
                (f"Choice: {letter.lower()}", letter.lower()), (f"{gold}s", f"{gold}s"),
                (f"The answer is ({letter.lower()}).", f"({letter.lower()})"), ("I cannot tell.", "")]
    if row["answer_type"] == "integer":
        return [(gold, ""), (f"{gold}.0", gold), (f" {gold} ", ""), (f'The answer is "{gold}".', ""),
                (f"There are {gold} objects.", gold), ("15", ""), ("-3", ""), ("14.7", "14.7"),
                ("fourteen", "fourteen"), ("", ""), ('The answer is "1e3".', ""), ("[14]", "[14]")]
    if row["answer_type"] == "float":
        value = float(gold)
        return [(gold, ""), (f"{value:.3f}", ""), (f"{value + 0.04:.2f}", ""), (f"{value + 0.06:.2f}", ""),
                (f'The answer is "{gold}".', ""), (f"About {gold} units.", gold), ("nan", ""), ("inf", ""),
                (f"${gold}", f"${gold}"), (f"{int(value)}", ""), ("", ""), ("1/2", "1/2")]
    return [(gold, gold), ("[2007,2008]", "[2007,2008]"), ('The answer is "[2007, 2008]".', ""),
            ("between 2007 and 2008", "[2007, 2008]"), ("[2008, 2009]", "[2008, 2009]"), ("", "")]


class _StubModel:
    """Stands where MathVista asks its LLM; returns the extraction the row assumes."""

    def __init__(self) -> None:
        self.reply = ""
        self.asked = False

    def get_response(self, user_prompt: str) -> str:
        self.asked = True
        return self.reply


def mathvista_table(repo: Path) -> list[dict]:
    sys.path.insert(0, str(repo))
    sys.path.insert(0, str(repo / "evaluation"))
    sys.modules.setdefault("utilities", types.ModuleType("utilities"))
    sys.modules["utilities"].read_json = sys.modules["utilities"].save_json = None
    models = types.ModuleType("models")
    models.gpt = types.ModuleType("models.gpt")
    sys.modules.setdefault("models", models)
    sys.modules.setdefault("models.gpt", models.gpt)
    extract = load(repo / "evaluation" / "extract_answer.py", "mathvista_extract")
    calc = load(repo / "evaluation" / "calculate_score.py", "mathvista_calculate")
    rows = []
    stub = _StubModel()
    for i, row in enumerate(MV_ROWS):
        for reply, judged in mv_replies(row):
            problem = {**row, "query": f"Question {i}", "pid": str(i)}
            stub.reply, stub.asked = judged, False
            extraction = extract.extract_answer(stub, reply, problem, quick_extract=True)
            normalized = calc.normalize_extracted_answer(extraction, row["choices"], row["question_type"],
                                                         row["answer_type"], row["precision"])
            rows.append({"source": "lupantech/MathVista evaluation/extract_answer.py, calculate_score.py",
                         "commit": commit(repo), **row, "reply": reply, "asks_llm": stub.asked,
                         "judged": judged if stub.asked else None, "extraction": extraction,
                         "normalized": normalized, "score": float(calc.safe_equal(normalized, row["answer"]))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--easyr1", type=Path)
    parser.add_argument("--verl", type=Path)
    parser.add_argument("--openmmreasoner", type=Path)
    parser.add_argument("--mathvista", type=Path)
    args = parser.parse_args()
    if args.easyr1:
        write("geo3k_easyr1", easyr1_table(args.easyr1))
    if args.verl:
        write("geo3k_verl", verl_geo3k_table(args.verl))
    if args.openmmreasoner:
        write("openmmreasoner", omr_table(args.openmmreasoner))
    if args.mathvista:
        write("mathvista", mathvista_table(args.mathvista))


if __name__ == "__main__":
    main()
