"""Held-out evaluation, composed once (`greedy_evaluation`): the greedy success the RL loop logs
every eval.every_steps (`evaluate`), and `saccade eval CHECKPOINT_OR_CONFIG` (`run_eval`), which
runs the same core on a checkpoint's weights and adds pass@k from n samples, a breakdown by
category and one row per prompt. Both score answers or whole episodes (views, scenes, a
verifiers env: token-in/token-out, `[env]` as in training) the same way, so `saccade eval` of
step k's checkpoint gives the figures the loop logged at step k.

The prompts are the task's held-out split: shapes, views and scenes from the evaluation seed
(scenes: the held-out scenes), a data set's eval split (MathVista testmini, OpenMMReasoner's
validation, Geometry3K's test, one's own data set's task.eval_split, else test, else
validation) in order. Each row keeps the question, the gold answer, the completion (an
episode: every reply), the answer extracted from it and whether it scored, so every figure can
be recounted from the samples file.

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
from contextlib import ExitStack
from dataclasses import dataclass
from math import comb
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from saccade.config import EnvConfig, RunConfig
from saccade.data.rows import recheck, row_check
from saccade.run.tasks import Prompt, Task

if TYPE_CHECKING:
    from saccade.inference.engine import SamplingParams
    from saccade.orchestrator.rollout import Rollout

S = TypeVar("S", bound=Prompt)  # the task's prompts

# Metadata fields that name a category, per task. MathVista's skills is a list: a row counts
# in each of its skills.
CATEGORY_FIELDS: dict[str, tuple[str, ...]] = {
    "shapes": ("kind",),
    "openmmreasoner": ("subset",),
    "mathvista": ("task", "skills", "grade"),
    "geometry3k": (),
    "dataset": ("category",),  # task.columns.category, when mapped
    "views": ("place",),
    "scenes": ("kind", "side"),
}


@dataclass
class Evaluation:
    """One greedy evaluation (`greedy_evaluation`): the figures, and the rollouts they count."""

    figures: dict[str, float]  # what the RL loop logs: accuracy, n, turns, env_<key>, reward_<name>, ...
    greedy: list[Rollout]  # one answer or episode per prompt, in order
    blank: list[Rollout] | None  # with visual_gain: the same prompts, every image blank


def rollouts_per_prompt(setup, task: Task[S], samples: list[S], params: SamplingParams, *,
                        env: EnvConfig | None = None) -> list[list[Rollout]]:
    """params.n scored answers or episodes per prompt, as the RL step samples them
    (`sample_groups`: an episode runs turn by turn, token-in/token-out, under `env`)."""
    from saccade.orchestrator.rollout import sample_groups

    return sample_groups(setup.engine, task, samples, params, positions=setup.positions,
                         continuation=setup.continuation, env=env, tokenizer=setup.processor.tokenizer)


def greedy_evaluation(setup, task: Task[S], samples: list[S], *, max_tokens: int, env: EnvConfig | None = None,
                      visual_gain: bool = False) -> Evaluation:
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
    by content).

    The one evaluation core: the RL loop (`evaluate`) and `saccade eval` (`run_eval`) both run it."""
    from saccade.inference.engine import SamplingParams
    from saccade.orchestrator.rollout import final_info_means, reward_metrics
    from saccade.orchestrator.visual import BlankImagesTask

    greedy_params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1)

    def greedy_rollouts(task: Task[S]) -> list[Rollout]:
        return [group[0] for group in rollouts_per_prompt(setup, task, samples, greedy_params, env=env)]

    rollouts = greedy_rollouts(task)
    skipped = {"skipped": float(len(samples.skipped))} if hasattr(samples, "skipped") else {}
    figures = {"accuracy": share_correct(rollouts), "n": len(rollouts),
               "turns": float(np.mean([r.turns for r in rollouts])), **skipped,
               **final_info_means([r.info for r in rollouts]), **reward_metrics([r.info for r in rollouts])}
    blank = None
    if visual_gain:
        blank = greedy_rollouts(BlankImagesTask(task, setup.images, setup.processor))
        figures["accuracy_blank"] = share_correct(blank)
        figures["visual_gain"] = figures["accuracy"] - figures["accuracy_blank"]
    return Evaluation(figures, rollouts, blank)


def evaluate(setup, task: Task[S], samples: list[S], *, max_tokens: int, env: EnvConfig | None = None,
             visual_gain: bool = False) -> dict[str, float]:
    """The figures of `greedy_evaluation`: what the RL loop logs every eval.every_steps."""
    return greedy_evaluation(setup, task, samples, max_tokens=max_tokens, env=env, visual_gain=visual_gain).figures


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
    from saccade.trainer.checkpoint.saving import load_checkpoint
    from saccade.trainer.checkpoint.folder import latest_checkpoint

    path = Path(checkpoint) if checkpoint else latest_checkpoint(cfg.run_dir)
    if path is None:
        return f"base model {cfg.model.path} (no checkpoint under {cfg.run_dir})"
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a folder; pass a step_* folder from <run_dir>/checkpoints")
    load_checkpoint(path, model=setup.model)
    return str(path)


# What `saccade rl` and `sft` write into a run folder: the config the run ran with, resolved.
RUN_CONFIG_FILE = "config.toml"


class EvalTarget(NamedTuple):
    """What `saccade eval CHECKPOINT_OR_CONFIG` evaluates: a config file (None: the defaults),
    overrides to apply before the command line's, and the weights (None: the run's latest)."""

    config: str | None
    overrides: list[str]
    checkpoint: str | None


def eval_target(target: str | None, checkpoint: str | None = None) -> EvalTarget:
    """`saccade eval`'s first argument. A TOML file (or none: the defaults) is the config, and
    the weights are `--checkpoint`'s, else the run's latest checkpoint. A checkpoint folder
    (<run_dir>/checkpoints/step_000012) is those weights, evaluated with the config its run ran
    with (<run_dir>/config.toml); a run folder is its latest complete checkpoint, the same way.
    Either way the run folder is the config's (`--log.dir`), so a vLLM engine's weights go there."""
    from saccade.trainer.checkpoint.folder import CHECKPOINTS_DIR, COMPLETE, STATE_FILE, latest_checkpoint

    if target is None or not Path(target).is_dir():
        return EvalTarget(target, [], checkpoint)
    path = Path(target)
    if checkpoint is not None:
        raise ValueError(f"{path} is a folder, evaluated with its own weights; --checkpoint {checkpoint} names "
                         "others: give a config file with --checkpoint, or the checkpoint folder alone")
    if (path / COMPLETE).is_file() or (path / STATE_FILE).is_file():  # a checkpoint; load_checkpoint checks it
        run_dir = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else None
        weights = path
    elif (path / RUN_CONFIG_FILE).is_file() or (path / CHECKPOINTS_DIR).is_dir():
        run_dir, weights = path, latest_checkpoint(path)
        if weights is None:
            raise ValueError(f"{path / CHECKPOINTS_DIR} holds no complete checkpoint (none saved yet, or only saves "
                             f"that did not finish); the base model: saccade eval {path / RUN_CONFIG_FILE}")
    else:
        raise ValueError(f"{path} is neither a config file, a checkpoint folder (no {COMPLETE} file) nor a run "
                         f"folder (no {RUN_CONFIG_FILE} or {CHECKPOINTS_DIR}/ inside)")
    config = run_dir / RUN_CONFIG_FILE if run_dir is not None else None
    if config is None or not config.is_file():
        where = config or f"<run_dir>/{RUN_CONFIG_FILE}, the checkpoint not being in a {CHECKPOINTS_DIR}/ folder"
        raise ValueError(f"no {RUN_CONFIG_FILE} of the run that saved {weights} (looked for {where}): give the "
                         f"run's config, saccade eval CONFIG --checkpoint {weights}")
    return EvalTarget(str(config), ["--log.dir", str(run_dir)], str(weights))


def run_eval(cfg: RunConfig, *, checkpoint: str | None = None, setup=None) -> dict[str, Any]:
    """`saccade eval`: the RL loop's evaluation (`greedy_evaluation`, with the run's
    sampling.max_tokens, [env] and eval.visual_gain) on `checkpoint`'s weights (else the run's
    latest checkpoint, else the base model), answers or whole episodes; then, with
    eval.samples_k = n > 1, pass@1..n from n samples per prompt at the run's sampling settings;
    accuracy by category; and one row per prompt (`rows`; with eval.visual_gain each row's
    `completion_blank` and `correct_blank` too)."""
    from saccade.run.setup import build_setup
    from saccade.run.tasks import closing_task, eval_set_tasks, task_from_config

    with ExitStack() as ends:  # the tasks' reward workers end with the evaluation
        task = task_from_config(cfg)
        ends.enter_context(closing_task(task))
        # The prompts first: a data set's errors (no such split) come before the model loads.
        samples = task.eval_samples(cfg.eval.prompts)
        if not samples and not getattr(samples, "skipped", None):
            raise ValueError("eval.prompts is 0 (or the eval split is empty): nothing to evaluate")
        sets = {name: (set_task, set_task.eval_samples(cfg.eval.prompts))
                for name, set_task in eval_set_tasks(cfg).items()}
        for set_task, _ in sets.values():
            ends.enter_context(closing_task(set_task))
        setup = setup or build_setup(cfg, cfg.run_dir)
        # A data set's broken rows (saccade.data.rows) are reported apart, never counted wrong.
        fits = row_check(cfg, setup.processor)
        weights = load_weights(setup, cfg, checkpoint)
        setup.engine.update_weights()  # a vLLM server samples from these weights, not whatever it held
        result: dict[str, Any] = {"weights": weights, **_scored(cfg, setup, task, samples, fits, cfg.task.kind)}
        if sets:
            # The other held-out sets, each scored by its own protocol (its rows carry their scorer).
            result["sets"] = {name: _scored(cfg, setup, set_task, set_samples, fits, cfg.eval.sets[name].kind)
                              for name, (set_task, set_samples) in sets.items()}
        result["rows"] = result.pop("rows")
        return result


def _scored(cfg: RunConfig, setup, task: Task[S], samples: list[S], fits, kind: str) -> dict[str, Any]:
    """`run_eval`'s figures and rows for one task's held-out prompts, on the weights loaded."""
    from saccade.inference.engine import SamplingParams

    if fits is not None:
        samples = recheck(samples, fits)
    skipped = list(getattr(samples, "skipped", []))
    if not samples:
        raise ValueError(f"none of the {len(skipped)} held-out rows of {kind} could be used (skipped: "
                         f"{_reasons(skipped)}); see the rows' reasons with saccade eval --json")
    ev = greedy_evaluation(setup, task, samples, max_tokens=cfg.sampling.max_tokens, env=cfg.env,
                           visual_gain=cfg.eval.visual_gain)
    n = cfg.eval.samples_k
    sampled = rollouts_per_prompt(setup, task, samples, SamplingParams.sampled(cfg.sampling, n=n),
                                  env=cfg.env) if n > 1 else None
    episodes = task.max_turns > 1
    rows = []
    for i, (sample, answer) in enumerate(zip(samples, ev.greedy, strict=True)):
        row = eval_row(sample, answer, episodes=episodes)
        if ev.blank is not None:
            row["completion_blank"] = ev.blank[i].texts[-1]
            row["correct_blank"] = ev.blank[i].correct
        if sampled is not None:
            row["samples"] = [r.texts[-1] for r in sampled[i]]
            row["samples_correct"] = int(sum(r.correct for r in sampled[i]))
        rows.append(row)
    result: dict[str, Any] = {
        "task": kind,
        "max_turns": task.max_turns,
        # The loop's figures (accuracy; n, the prompts scored; turns, env_<key>, reward_<name>;
        # accuracy_blank, visual_gain), but not its count of skipped rows: they are listed below.
        **{k: v for k, v in ev.figures.items() if k != "skipped"},
        "by_category": by_category(rows, CATEGORY_FIELDS.get(kind, ())),
        "skipped": {reason: n for reason, n in Counter(r["reason"] for r in skipped).items()},
        "skipped_rows": skipped,
    }
    if sampled is not None:
        result["samples_per_question"] = n
        result["pass_at_k"] = {
            str(k): float(np.mean([pass_at_k(n, r["samples_correct"], k) for r in rows]))
            for k in sorted({1, *(k for k in (2, 4, 8, 16, 32) if k < n), n})
        }
        # mean@n: the accuracy of one sample, averaged over the n (what "avg@n" tables report).
        result["mean_at_k"] = {str(n): float(np.mean([r["samples_correct"] / n for r in rows]))}
    result["rows"] = rows
    return result


# What a row of `run_eval` copies from its prompt, where the prompt has it (a data set's or the
# shapes' question has them all; a views or scenes prompt its question, answer and choices).
ROW_FIELDS = ("question", "answer", "choices", "answer_type", "precision")


def eval_row(sample: Prompt, rollout: Rollout, *, episodes: bool) -> dict[str, Any]:
    """One prompt's row: its id and question fields, the greedy completion (its final reply),
    whether it scored, its metadata. A single-turn answer also has the answer extracted from it;
    an episode has every reply (`replies`), its `turns` and what its environment reported at the
    last step (`info`)."""
    from saccade.rewards.bounded import extracted_answer

    text = rollout.texts[-1]
    row = {"id": sample.sample_id, **{name: getattr(sample, name) for name in ROW_FIELDS if hasattr(sample, name)},
           "completion": text}
    if episodes:
        row.update(replies=list(rollout.texts), turns=rollout.turns, info=_plain(rollout.info))
    else:
        row["extracted"] = extracted_answer(text, sample)
    row.update(correct=rollout.correct, metadata=_plain(getattr(sample, "metadata", None) or {}))
    return row


def _reasons(skipped: list[dict[str, Any]]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in Counter(r["reason"] for r in skipped).most_common())


def write_samples(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """One JSON line per prompt (`eval_row`): id, question, answer, completion, extracted answer
    (an episode: every reply, its turns and its environment's last info instead), correct,
    metadata (with eval.visual_gain the blank-image completion_blank and correct_blank; with
    pass@k the n samples and their correct count)."""
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
    max_turns = result.get("max_turns", 1)
    what = "episodes" if max_turns > 1 else "questions"
    table = Table(title=f"held-out evaluation on {task}: {result['n']} {what}{also}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("greedy accuracy", f"{result['accuracy']:.3f}")
    if max_turns > 1:  # what the environments reported at the episodes' last step, as the loop logs it
        table.add_row(f"turns per episode (mean; at most {max_turns})", f"{result['turns']:.3f}")
        for key in sorted(k for k in result if k.startswith("env_") and k != "env_correct"):
            table.add_row(f"{key} (mean)", f"{result[key]:.3f}")
    if "visual_gain" in result:
        table.add_row("greedy accuracy, every image blank", f"{result['accuracy_blank']:.3f}")
        table.add_row("visual gain (accuracy - blank)", f"{result['visual_gain']:+.3f}")
    for k, v in result.get("pass_at_k", {}).items():
        table.add_row(f"pass@{k} (n={result['samples_per_question']})", f"{v:.3f}")
    for k, v in result.get("mean_at_k", {}).items():
        table.add_row(f"mean@{k}", f"{v:.3f}")
    for name, other in result.get("sets", {}).items():
        table.add_row(f"{name} ({other['task']}, n={other['n']}): greedy accuracy", f"{other['accuracy']:.3f}")
        for k, v in other.get("pass_at_k", {}).items():
            table.add_row(f"{name}: pass@{k}", f"{v:.3f}")
        for k, v in other.get("mean_at_k", {}).items():
            table.add_row(f"{name}: mean@{k}", f"{v:.3f}")
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
