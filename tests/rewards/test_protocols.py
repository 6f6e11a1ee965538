"""saccade's published-protocol scorers (saccade.rewards.protocols) against the published code's own
scores: tests/rewards/scorers/*.jsonl, written by scripts/scorer_tables.py, which runs EasyR1's
math.py, verl's geo3k.py, OpenMMReasoner's lmms_lab_recipe.py and MathVista's
evaluation scripts on a few hundred replies. Every row must agree."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from saccade.rewards import REWARD_FUNCTIONS, Scorer, correct_reward, protocols

TABLES = Path(__file__).parent / "scorers"


def table(name: str) -> list[dict]:
    return [json.loads(line) for line in (TABLES / f"{name}.jsonl").read_text().splitlines()]


def disagreements(rows: list[dict], check) -> list[str]:
    out = []
    for row in rows:
        if problem := check(row):
            out.append(f"{problem}: {json.dumps(row, ensure_ascii=False)[:300]}")
    return out


def _geo3k_check(extractor: str, format_check):
    scorer = Scorer(extractor, "mathruler")

    def check(row: dict) -> str | None:
        accuracy = scorer.correct(row["reply"], {"answer": row["gold"]})
        fmt = format_check(row["reply"])
        got = (accuracy, fmt, 0.9 * accuracy + 0.1 * fmt)
        want = (row["accuracy"], row["format"], row["overall"])
        return None if got == pytest.approx(want) else f"saccade {got} != published {want}"

    return check


@pytest.mark.parametrize("name, extractor, format_check", [
    ("geo3k_easyr1", "easyr1", protocols.easyr1_format),
    ("geo3k_verl", "boxed", protocols.think_boxed_format),
])
def test_geo3k_scorers_agree_with_published(name, extractor, format_check):
    rows = table(name)
    assert len(rows) >= 300
    assert disagreements(rows, _geo3k_check(extractor, format_check)) == []
    # The table holds both outcomes of both parts, not a constant.
    assert {r["accuracy"] for r in rows} == {0.0, 1.0} and {r["format"] for r in rows} == {0.0, 1.0}


def test_openmmreasoner_scorer_agrees_with_published():
    scorer = Scorer("answer_tag", "openmmreasoner")

    def check(row: dict) -> str | None:
        got = (scorer.correct(row["reply"], {"answer": row["gold"]}), protocols.think_answer_format(row["reply"]))
        want = (row["accuracy"], row["format"])
        return None if got == want else f"saccade {got} != published {want}"

    rows = table("openmmreasoner")
    assert len(rows) >= 200
    assert disagreements(rows, check) == []
    assert {r["format"] for r in rows} == {0.0, 0.8, 1.0}


def _mathvista_sample(row: dict) -> dict:
    multi = row["question_type"] == "multi_choice"
    return {"answer": row["answer"], "choices": row["choices"] if multi else None,
            "answer_type": "multi_choice" if multi else row["answer_type"],
            "precision": int(row["precision"]) if row["precision"] is not None else None,
            "prompt": [{"role": "user", "content": "Question"}]}


def test_mathvista_scorer_agrees_with_published(monkeypatch):
    judged: dict[str, str] = {}
    monkeypatch.setattr(protocols, "judge_extract", lambda prompt, **kw: judged["reply"])
    scorer = Scorer("mathvista", "mathvista", judge_url="http://judge.invalid/v1")

    def check(row: dict) -> str | None:
        sample = _mathvista_sample(row)
        rules = protocols.mathvista_extract_rules(
            row["reply"], question_type=row["question_type"], answer_type=sample["answer_type"],
            choices=sample["choices"])
        if (rules is None) != row["asks_llm"] or (rules is not None and rules != row["extraction"]):
            return f"rules extract {rules!r}, published {row['extraction']!r} (asks its LLM: {row['asks_llm']})"
        judged["reply"] = row["judged"] or ""
        normalized = protocols.mathvista_normalize(
            row["extraction"], choices=sample["choices"], question_type=row["question_type"],
            answer_type=row["answer_type"], precision=row["precision"])
        if normalized != row["normalized"]:
            return f"normalized {normalized!r}, published {row['normalized']!r}"
        got = scorer.correct(row["reply"], sample)
        return None if got == row["score"] else f"score {got} != published {row['score']}"

    rows = table("mathvista")
    assert len(rows) >= 100
    assert disagreements(rows, check) == []
    assert any(r["asks_llm"] for r in rows) and not all(r["asks_llm"] for r in rows)


def test_mathvista_without_a_judge_uses_saccades_extraction():
    sample = {"answer": "14", "choices": None, "answer_type": "integer", "precision": None}
    scorer = Scorer("mathvista", "mathvista")
    assert scorer.correct("There are 14 objects.\nAnswer: 14", sample) == 1.0  # the LLM's place: saccade's
    assert scorer.correct("14", sample) == 1.0  # the official rules
    assert scorer.correct("15", sample) == 0.0


def test_judge_is_asked_over_http_with_the_official_prompt():
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"choices": [{"message": {"content": " B \n"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        scorer = Scorer("mathvista", "mathvista", judge_url=f"http://127.0.0.1:{server.server_port}/v1",
                        judge_model="judge")
        sample = {"answer": "8/11", "choices": ["3/11", "8/11", "6/11", "3/5"], "answer_type": "multi_choice",
                  "prompt": [{"role": "user", "content": "What fraction is blue?"}]}
        assert scorer.correct("The blue part is the second option.", sample) == 1.0
    finally:
        server.shutdown()
    prompt = seen[0]["messages"][0]["content"]
    assert seen[0]["model"] == "judge"
    assert prompt.startswith("Please read the following example.")
    assert prompt.endswith("What fraction is blue?\n\nThe blue part is the second option.\n\nExtracted answer: ")


def test_correct_reward_uses_the_samples_scorer():
    reply = "<think>x</think><answer>B</answer>"
    sample = {"answer": "blue", "choices": ["red", "blue"], "answer_type": "multi_choice"}
    assert correct_reward(reply, {**sample, "scorer": Scorer("answer_tag", "openmmreasoner")}) == 1.0
    assert correct_reward("\\boxed{3}", {"answer": "3", "scorer": Scorer("boxed", "mathruler")}) == 1.0
    assert correct_reward("3", {"answer": "3", "scorer": Scorer("boxed", "mathruler")}) == 0.0  # "None"


def test_format_checks_are_reward_functions():
    for name, check in protocols.FORMAT_CHECKS.items():
        assert REWARD_FUNCTIONS[name]("<think>a</think> \\boxed{1}") == check("<think>a</think> \\boxed{1}")
    assert REWARD_FUNCTIONS["easyr1_format"]("< think >a</ think > \\boxed{1}") == 1.0
    assert REWARD_FUNCTIONS["think_boxed"]("< think >a</ think > \\boxed{1}") == 0.0


def test_unknown_parts_are_refused():
    with pytest.raises(ValueError, match="unknown extractor"):
        Scorer("regex", "mathruler")
    with pytest.raises(ValueError, match="unknown grader"):
        Scorer("boxed", "exact")
