"""The video demo (`saccade demo video`): a tiny VLM learns from rewards what only a clip's order
shows, and a control whose clips are reversed at random stays at chance.

The task (`saccade.data.clip_sets`, written once under <run folder>/data): a clip shows one
colour, then another; "Which color came first?", the two colours as the options. No frame alone
answers it, and the tower sees each colour whole: what is left to learn is time.

0. The supervised probe, before any engine is started (on an embedded setup): SFT on the gold
   answers with the clips, with every clip blank (gray frames, same timestamps), and with the
   control's reversed clips; each scored greedily on its own held-out rows. The clips carry the
   answer, and only by their order, when the first reads it and the other two stay at chance.
1. The warm start on random options (the answer format, nothing of the clip), as the other demos.
2. GRPO on the clips: held-out greedy accuracy before and after, the visual gain (accuracy minus
   the accuracy with every clip blank), and the learned policy on the reversed clips.
3. The control: the same GRPO from the same warm start on the reversed twin, scored on its own
   held-out rows (what it trained on; its chance, 1/2, is the task's) and on the real clips.

The bars are the data-set demo's (`saccade.tools.demo.verdict`): after GRPO at least 0.9 (or within
0.05 of the probe where the tower keeps less), before and the control within chance ± 0.1, the
visual gain at least the bar, the control's none. The recipe is the data-set demo's rule for two
options (`saccade.tools.demo_recipe`), for the keys the command line does not set.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from saccade.config import EmbeddedEngineConfig, RunConfig
from saccade.data.clip_sets import COLUMNS, SETS, write_clip_sets
from saccade.tools.demo import (
    chance_of, demo_start, load_demo_config, options_of, stage_config, train_rows_of, verdict,
)
from saccade.tools.demo_probe import restore_trainable, snapshot_trainable

RUN_NAME = "demo-video"  # runs/demo-video


def ensure_clip_sets(folder: Path) -> dict[str, Path]:
    """The data set and its control's twin under `folder`, written on first use."""
    paths = {name: folder / name for name in SETS}
    if not all((p / "data" / "test-00000-of-00001.parquet").is_file() for p in paths.values()):
        print(f"writing the video demo's data sets under {folder} (saccade.data.clip_sets)", flush=True)
        write_clip_sets(folder)
    return paths


def base_run_dir(overrides: list[str]) -> Path:
    """The demo's run folder as the command line sets it (--log.dir), else runs/demo-video: the data
    sets live in its data/, beside the seeds' folders (--seeds puts each in <run folder>/seed<S>)."""
    for i, token in enumerate(overrides):
        if token.startswith("--log.dir="):
            return Path(token.split("=", 1)[1])
        if token == "--log.dir" and i + 1 < len(overrides):
            return Path(overrides[i + 1])
    return Path("runs") / RUN_NAME


def load_video_config(overrides: list[str] | None = None, path: str | None = None) -> RunConfig:
    """demo.toml (or `path`) on the clip set, its run folder runs/demo-video, with the recipe rule for
    two options on the keys `overrides` does not set; the data sets written if missing."""
    from saccade.run.tasks import task_from_config
    from saccade.tools.demo_recipe import apply_recipe, dataset_recipe, overridden_keys

    overrides = list(overrides or [])
    sets = ensure_clip_sets(base_run_dir(overrides) / "data")
    defaults = ["--task.kind", "dataset", "--task.dataset", str(sets["order"]), "--task.columns", json.dumps(COLUMNS),
                "--log.name", RUN_NAME]
    cfg = demo_start(load_demo_config([*defaults, *overrides], path))
    if path is not None:
        return cfg
    task = task_from_config(cfg, blank=False)
    recipe = dataset_recipe(options_of(chance_of(task.eval_samples(cfg.eval.prompts))), train_rows_of(task))
    cfg, _ = apply_recipe(cfg, recipe, overridden_keys(overrides))
    return cfg


def control_config(cfg: RunConfig, run_dir: Path | None = None) -> RunConfig:
    """The control's config: the same run on the reversed twin (beside the task's data set)."""
    twin = Path(cfg.task.dataset).parent / SETS[1]
    update: dict[str, Any] = {"task": cfg.task.model_copy(update={"dataset": str(twin)})}
    if run_dir is not None:
        update["log"] = cfg.log.model_copy(update={"dir": str(run_dir)})
    return cfg.model_copy(update=update)


def video_probe(cfg: RunConfig, *, probe_steps: int | None = None,
                progress: bool = True) -> tuple[RunConfig, dict[str, Any]]:
    """Step 0 on an embedded setup (it samples greedily after each fit, and needs no server): the
    probe with the clips and with them blank (`run_probe`), then a fit on the control's reversed
    clips scored on its own held-out rows. Returns `cfg` and the figures."""
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config
    from saccade.tools.demo_probe import fit_and_score, run_probe
    from saccade.tools.demo_recipe import dataset_recipe

    start = time.perf_counter()
    for part in cfg.run_dir.glob("probe-*"):
        shutil.rmtree(part, ignore_errors=True)
    embedded = cfg.model_copy(update={"engine": EmbeddedEngineConfig(
        model_mismatch_limit=cfg.engine.model_mismatch_limit)})
    setup = build_setup(embedded, cfg.run_dir)
    task = task_from_config(embedded, blank=False)
    held_out = task.eval_samples(cfg.eval.prompts)
    if probe_steps is None:
        probe_steps = dataset_recipe(options_of(chance_of(held_out)), train_rows_of(task)).probe_steps
    warm = snapshot_trainable(setup.model)
    figures = run_probe(embedded, setup, held_out, steps=probe_steps, progress=progress)
    control = control_config(embedded)
    control_held_out = task_from_config(control, blank=False).eval_samples(cfg.eval.prompts)
    reversed_fit = fit_and_score(control, setup, control_held_out, images=True, steps=probe_steps,
                                 name="probe-reversed", progress=progress)
    restore_trainable(setup.model, warm)
    figures["probe_reversed_accuracy"] = reversed_fit["accuracy"]
    figures["probe_minutes"] = (time.perf_counter() - start) / 60
    print(f"probe ({probe_steps} SFT steps on the gold answers): {figures['probe_accuracy']:.3f} with the clips, "
          f"{figures['probe_blank_accuracy']:.3f} with every clip blank, {figures['probe_reversed_accuracy']:.3f} "
          f"on the clips reversed at random (chance {chance_of(held_out):.2f})", flush=True)
    return cfg, figures


def run_video_demo(cfg: RunConfig, *, progress: bool = True, probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm start, GRPO on the clips, the control on the reversed twin (module note); writes sft/,
    grpo/ and control/ under cfg.run_dir; returns the figures, the probe's among them."""
    from saccade.loops.rl import train_rl
    from saccade.loops.sft import train_sft
    from saccade.orchestrator.evaluation import evaluate
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config
    from saccade.tools.plot import plot_run

    start = time.perf_counter()
    root = cfg.run_dir
    for part in ("sft", "grpo", "control"):
        shutil.rmtree(root / part, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    setup = build_setup(cfg, root)
    task = task_from_config(cfg, blank=False)
    held_out = task.eval_samples(cfg.eval.prompts)
    control_cfg = control_config(cfg, root / "control")
    control_task = task_from_config(control_cfg, blank=False)
    control_held_out = control_task.eval_samples(cfg.eval.prompts)

    def scored(on_task, rows, blank: bool = True) -> dict[str, float]:
        return evaluate(setup, on_task, rows, max_tokens=cfg.sampling.max_tokens, visual_gain=blank)

    train_sft(stage_config(cfg, "sft"), run_dir=root / "sft", setup=setup, random_answers=True, progress=progress,
              phase="warm-start")
    warm = snapshot_trainable(setup.model)
    before = scored(task, held_out)

    grpo_cfg = stage_config(cfg, "grpo")
    train_rl(grpo_cfg, run_dir=grpo_cfg.run_dir, setup=setup, progress=progress, fresh=True)
    after = scored(task, held_out)
    after_reversed = scored(control_task, control_held_out, blank=False)

    restore_trainable(setup.model, warm)
    setup.engine.reseed(cfg.trainer.seed)
    train_rl(control_cfg, run_dir=control_cfg.run_dir, setup=setup, progress=progress, fresh=True)
    control = scored(control_task, control_held_out)
    control_on_real = scored(task, held_out, blank=False)

    for part in ("grpo", "control"):
        plot_run(root / part)
    chance = chance_of(held_out)
    result = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "accuracy_after_on_reversed_clips": after_reversed["accuracy"],
        "control_accuracy_after": control["accuracy"],
        "control_chance": chance_of(control_held_out),
        "control_accuracy_on_real_clips": control_on_real["accuracy"],
        "visual_gain_before": before["visual_gain"],
        "visual_gain_after": after["visual_gain"],
        "control_visual_gain": control["visual_gain"],
        "chance": chance,
        "eval_size": len(held_out),
        "task": "video", "dataset": cfg.task.dataset, "num_choices": options_of(chance),
        "grpo_steps": cfg.trainer.steps,
        "engine": cfg.engine.kind,
        "torch_threads": torch.get_num_threads(),
        "run_dir": str(root),
        "minutes": (time.perf_counter() - start) / 60,
    }
    if probed is not None:
        result = {**result, **probed, "minutes": result["minutes"] + probed["probe_minutes"]}
    return result


def video_verdict(result: dict[str, Any]) -> list[str]:
    """The data-set demo's bars (`saccade.tools.demo.verdict`), and the probe's order: the reversed
    clips must not read the answer either (their fit within chance ± 0.1)."""
    from saccade.tools.demo import CHANCE_MARGIN, within_chance

    misses = verdict(result)
    reversed_fit = result.get("probe_reversed_accuracy")
    if reversed_fit is not None and not within_chance(reversed_fit, result["control_chance"]):
        misses.append(f"probe_reversed_accuracy {reversed_fit:.2f} is not within chance "
                      f"{result['control_chance']:.2f} ± {CHANCE_MARGIN}: the answer shows without the order")
    return misses


def video_report(result: dict[str, Any]) -> str:
    from saccade.tools.demo import CHANCE_MARGIN, MINUTES_MAX, VISUAL_GAIN_MARGIN, accuracy_bars

    chance = result["chance"]
    after_bar, gain_bar = accuracy_bars(result)
    probe = "" if "probe_accuracy" not in result else (
        f"\nsupervised probe ({result['probe_steps']} SFT steps on the gold answers, held-out greedy):\n"
        f"  with the clips:                         {result['probe_accuracy']:.3f}\n"
        f"  with every clip blank:                  {result['probe_blank_accuracy']:.3f}\n"
        f"  on the clips reversed at random:        {result['probe_reversed_accuracy']:.3f}   "
        f"(bar: chance ± {CHANCE_MARGIN})")
    return (
        f"\nheld-out accuracy ({result['eval_size']} clips, \"which color came first?\", chance {chance:.2f}, "
        f"engine {result['engine']}):\n"
        f"  before GRPO (random-answer warm start): {result['accuracy_before']:.3f}   (bar: chance ± {CHANCE_MARGIN})\n"
        f"  after GRPO:                             {result['accuracy_after']:.3f}   (bar: ≥ {after_bar:.2f})\n"
        f"  after GRPO, on the clips reversed:      {result['accuracy_after_on_reversed_clips']:.3f}\n"
        f"  control, GRPO on clips reversed at random: {result['control_accuracy_after']:.3f}   (bar: its chance "
        f"{result['control_chance']:.2f} ± {CHANCE_MARGIN})\n"
        f"  control model on the real clips:        {result['control_accuracy_on_real_clips']:.3f}\n"
        f"held-out visual gain (accuracy minus the accuracy with every clip blank):\n"
        f"  after GRPO:                             {result['visual_gain_after']:+.3f}   (bar: ≥ {gain_bar:.2f})\n"
        f"  control:                                {result['control_visual_gain']:+.3f}   (bar: 0 ± {VISUAL_GAIN_MARGIN})\n"
        f"  minutes: {result['minutes']:.1f} (bar: ≤ {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
        + probe
    )
