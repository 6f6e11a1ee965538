"""Held-out evaluation: `evaluate`, the greedy success the RL loop logs every eval.every_steps,
and `saccade eval CONFIG` (`run_eval`): greedy accuracy, pass@k from n samples, and a
breakdown by category, on the weights of a run's latest checkpoint (or the base model).

The questions are the task's held-out split: shapes from the evaluation seed, a data set's
eval split (MathVista testmini, OpenMMReasoner's validation, Geometry3K's test, one's own
data set's task.eval_split, else test, else validation) in order.
Each row keeps the question, the gold answer, the completion, the answer extracted from it
and whether it scored, so every figure can be recounted from the samples file.

Visual reliance (`eval.visual_gain`, on by default): both score the same prompts a second
time with every image replaced by a uniform gray one of its size (`BlankImagesTask`):
`accuracy_blank`, and `visual_gain` = accuracy - accuracy_blank. RL can raise accuracy
through text priors alone while the policy stops looking at the image; then visual_gain
falls towards 0 while accuracy holds.

pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c are
correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over questions.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from math import comb
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from saccade.config import EnvConfig, RunConfig
from saccade.data.rows import recheck, row_check
from saccade.tasks import Prompt, Task

S = TypeVar("S", bound=Prompt)  # the task's prompts

# Metadata fields that name a category, per task. MathVista's skills is a list: a row counts
# in each of its skills.
CATEGORY_FIELDS: dict[str, tuple[str, ...]] = {
    "shapes": ("kind",),
    "openmmreasoner": ("subset",),
    "mathvista": ("task", "skills", "grade"),
    "geometry3k": (),
    "dataset": ("category",),  # task.columns.category, when mapped
}


def evaluate(setup, task: Task[S], samples: list[S], *, max_tokens: int, env: EnvConfig | None = None,
             visual_gain: bool = False) -> dict[str, float]:
    """Greedy decoding on held-out prompts, one answer or episode each, scored by the task's
    environments: `accuracy` (the share scored fully correct), `n`, `turns` and the mean of
    every number the environments reported at their last step (`env_<key>`). A data set's
    held-out rows that could not be used (`samples.skipped`, saccade.data.rows) are not
    scored: `skipped` counts them.

    `visual_gain`: the same prompts once more with every image blank (`BlankImagesTask`, every
    turn's images of an episode too): `accuracy_blank`, and `visual_gain` = accuracy -
    accuracy_blank, how much of the success the images bring. A policy that stopped looking
    has a visual_gain near 0 however high its accuracy. The blank pass decodes as much again;
    its images, one gray picture per image size, are encoded once (the embedding cache keys
    by content)."""
    from saccade.inference.engine import SamplingParams
    from saccade.orchestrator.rollout import final_info_means, reward_metrics, sample_groups
    from saccade.visual import BlankImagesTask

    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1)

    def greedy_rollouts(task: Task[S]) -> list:
        groups = sample_groups(setup.engine, task, samples, greedy, merge=setup.merge,
                               continuation=setup.continuation, env=env, tokenizer=setup.processor.tokenizer)
        return [group[0] for group in groups]

    rollouts = greedy_rollouts(task)
    skipped = {"skipped": float(len(samples.skipped))} if hasattr(samples, "skipped") else {}
    result = {"accuracy": share_correct(rollouts), "n": len(rollouts),
              "turns": float(np.mean([r.turns for r in rollouts])), **skipped,
              **final_info_means([r.info for r in rollouts]), **reward_metrics([r.info for r in rollouts])}
    if visual_gain:
        result["accuracy_blank"] = share_correct(greedy_rollouts(BlankImagesTask(task, setup.images)))
        result["visual_gain"] = result["accuracy"] - result["accuracy_blank"]
    return result


def share_correct(rollouts: list) -> float:
    """The share of rollouts scored fully correct (`Rollout.correct`)."""
    return float(np.mean([r.correct for r in rollouts]))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k draws (without replacement) from n samples, c of them
    correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def by_category(rows: list[dict[str, Any]], fields: tuple[str, ...] = CATEGORY_FIELDS["shapes"]) -> dict[str, dict]:
    """{field: {value: {"n", "accuracy"}}} over the rows' greedy correctness. A list value
    (MathVista's skills) puts the row in each of its entries."""
    out: dict[str, dict] = {}
    for name in fields:
        groups: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            value = row["metadata"].get(name)
            if value is None:
                continue
            for v in value if isinstance(value, list) else [value]:
                groups[str(v)].append(row["correct"])
        if groups:
            out[name] = {v: {"n": len(c), "accuracy": float(np.mean(c))} for v, c in sorted(groups.items())}
    return out


def load_weights(setup, cfg: RunConfig, checkpoint: str | None) -> str:
    """Load `checkpoint`, else the run's latest one, into the setup's model; say which."""
    from saccade.trainer.checkpoint import load_checkpoint
    from saccade.trainer.checkpoint_folder import latest_checkpoint

    path = Path(checkpoint) if checkpoint else latest_checkpoint(cfg.run_dir)
    if path is None:
        return f"base model {cfg.model.path} (no checkpoint under {cfg.run_dir})"
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a folder; pass a step_* folder from <run_dir>/checkpoints")
    load_checkpoint(path, model=setup.model)
    return str(path)


def run_eval(cfg: RunConfig, *, checkpoint: str | None = None, setup=None) -> dict[str, Any]:
    """Greedy accuracy, with eval.visual_gain also with every image blank (`accuracy_blank`,
    `visual_gain`; each row's `completion_blank`, `correct_blank`), and (with eval.samples_k =
    n > 1) pass@1..n on the held-out split."""
    from saccade.inference.engine import SamplingParams
    from saccade.orchestrator.rollout import sample_groups
    from saccade.rewards import extract_answer
    from saccade.setup import build_setup
    from saccade.tasks import task_from_config
    from saccade.visual import BlankImagesTask

    task = task_from_config(cfg)
    if task.max_turns > 1:
        # Episodes need the environment loop, which this single-turn report does not run yet.
        raise ValueError(f"saccade eval scores single-turn questions; task.kind = {cfg.task.kind!r} runs "
                         "multi-turn episodes. Their greedy success is logged during `saccade rl` "
                         "(eval.every_steps) and printed by `saccade demo views`.")
    # The questions first: a data set's errors (no such split) come before the model loads.
    samples = task.eval_samples(cfg.eval.prompts)
    if not samples and not getattr(samples, "skipped", None):
        raise ValueError("eval.prompts is 0 (or the eval split is empty): nothing to evaluate")
    setup = setup or build_setup(cfg, cfg.run_dir)
    # A data set's broken rows (saccade.data.rows) are reported apart, never counted wrong.
    fits = row_check(cfg, setup.processor)
    if fits is not None:
        samples = recheck(samples, fits)
    skipped = list(getattr(samples, "skipped", []))
    if not samples:
        raise ValueError(f"none of the {len(skipped)} held-out rows could be used (skipped: "
                         f"{_reasons(skipped)}); see the rows' reasons with saccade eval --json")
    weights = load_weights(setup, cfg, checkpoint)
    setup.engine.update_weights()  # a vLLM server samples from these weights, not whatever it held

    def answers(params: SamplingParams, task=task) -> list[list]:
        return sample_groups(setup.engine, task, samples, params, merge=setup.merge)

    greedy_params = SamplingParams(temperature=0.0, max_tokens=cfg.sampling.max_tokens, n=1)
    greedy = answers(greedy_params)
    # eval.visual_gain: the same questions with every image blank, greedy too.
    blank = answers(greedy_params, BlankImagesTask(task, setup.images)) if cfg.eval.visual_gain else None
    n = cfg.eval.samples_k
    sampled = None
    if n > 1:
        sampled = answers(SamplingParams.sampled(cfg.sampling, n=n))
    rows = []
    for i, (sample, (answer,)) in enumerate(zip(samples, greedy, strict=True)):
        text = answer.texts[-1]
        row = {"id": sample.sample_id, "question": sample.question, "answer": sample.answer,
               "choices": sample.choices, "answer_type": sample.answer_type, "precision": sample.precision,
               "completion": text, "extracted": extract_answer(text),
               "correct": float(answer.info["correct"]), "metadata": _plain(sample.metadata)}
        if blank is not None:
            (blank_answer,) = blank[i]
            row["completion_blank"] = blank_answer.texts[-1]
            row["correct_blank"] = float(blank_answer.info["correct"])
        if sampled is not None:
            row["samples"] = [r.texts[-1] for r in sampled[i]]
            row["samples_correct"] = int(sum(r.info["correct"] for r in sampled[i]))
        rows.append(row)
    result: dict[str, Any] = {
        "weights": weights,
        "n": len(rows),  # the rows scored; accuracy is over these, the skipped ones apart
        "accuracy": float(np.mean([r["correct"] for r in rows])),
        "task": cfg.task.kind,
        **(visual_gain_figures(rows) if blank is not None else {}),
        "by_category": by_category(rows, CATEGORY_FIELDS.get(cfg.task.kind, ())),
        "skipped": {reason: n for reason, n in Counter(r["reason"] for r in skipped).items()},
        "skipped_rows": skipped,
    }
    if sampled is not None:
        result["samples_per_question"] = n
        result["pass_at_k"] = {
            str(k): float(np.mean([pass_at_k(n, r["samples_correct"], k) for r in rows]))
            for k in sorted({1, *(k for k in (2, 4, 8, 16, 32) if k < n), n})
        }
    result["rows"] = rows
    return result


def visual_gain_figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """`accuracy_blank` (the greedy answers with every image blank, scored) and `visual_gain` =
    accuracy - accuracy_blank, over the rows of `run_eval`."""
    accuracy = float(np.mean([r["correct"] for r in rows]))
    blank = float(np.mean([r["correct_blank"] for r in rows]))
    return {"accuracy_blank": blank, "visual_gain": accuracy - blank}


def _reasons(skipped: list[dict[str, Any]]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in Counter(r["reason"] for r in skipped).most_common())


def write_samples(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One JSON line per question: id, question, answer, completion, extracted answer,
    correct, metadata (with eval.visual_gain the blank-image completion_blank and correct_blank;
    with pass@k the n samples and their correct count)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def _plain(meta: dict) -> dict:
    """Metadata as JSON-safe values (tuples to lists)."""
    return json.loads(json.dumps(meta, default=list))


def format_eval(result: dict[str, Any]) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    task = result.get("task", "shapes")
    skipped = sum(result.get("skipped", {}).values())
    also = f" ({skipped} rows skipped as broken, not scored)" if skipped else ""
    table = Table(title=f"held-out evaluation on {task}: {result['n']} questions{also}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("greedy accuracy", f"{result['accuracy']:.3f}")
    if "visual_gain" in result:
        table.add_row("greedy accuracy, every image blank", f"{result['accuracy_blank']:.3f}")
        table.add_row("visual gain (accuracy - blank)", f"{result['visual_gain']:+.3f}")
    for k, v in result.get("pass_at_k", {}).items():
        table.add_row(f"pass@{k} (n={result['samples_per_question']})", f"{v:.3f}")
    for field, groups in result["by_category"].items():
        for value, g in groups.items():
            table.add_row(f"{field}={value} (n={g['n']})", f"{g['accuracy']:.3f}")
    buffer = StringIO()
    Console(file=buffer, width=100).print(table)
    # Outside the table: a long checkpoint path would wrap inside its title.
    out = f"weights: {result['weights']}\n{buffer.getvalue()}"
    if skipped:
        out += f"skipped: {_reasons(result['skipped_rows'])}\n"
    return out
