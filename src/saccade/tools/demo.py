"""The demo (`saccade demo`): a tiny VLM learns from rewards on images, and a control proves
that the images are what it learned from.

1. Warm start: SFT on answers drawn at random from the choices, independent of the image.
   The model learns the answer format (one option word, then stop) and nothing about the
   picture, so it sits at chance on held-out questions.
2. GRPO from that warm start on the shapes task: held-out greedy accuracy before and after.
3. Control: the same GRPO from the same warm start, on the same questions with every image
   replaced by one uniform gray picture. With nothing to see it can only stay at chance.

The same three stages run on one's own multiple-choice data set (`--task.kind dataset`, every
row with a choices column, `task.columns.choices`): the warm start's target is an option drawn
at random per row, the control blanks every image of the data set (uniform gray, each
image's own size), and chance is the held-out rows' mean of 1 / their number of options. It
asks of a data set what the shapes show: can a model learn it from the pictures, and not
without them (docs/demo.md, "Your own multiple-choice data set").

Each trained policy is also scored with every held-out image blank (`saccade.orchestrator.visual`): the
GRPO policy's `visual_gain_after` (its accuracy minus its accuracy on blank images) shows it
reads the image, the control's `control_visual_gain` that it never learned to.

The settings live in `saccade/configs/demo.toml` (also `configs/demo.toml` in the repo).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from saccade.config import EmbeddedEngineConfig, RunConfig, VLLMEngineConfig, load_config
from saccade.distributed import SINGLE, World, barrier
from saccade.tools.demo_probe import restore_trainable, snapshot_trainable  # noqa: F401 (the demo's too)

# The bar the demo is held to (issue 3): learned with images, chance without.
ACCURACY_AFTER_MIN = 0.9
CHANCE_MARGIN = 0.1
MINUTES_MAX = 10.0
# ...and (issue 31) the learned policy's success comes from the image: blanking the images
# takes at least this much accuracy from it (chance is 1/3), and nothing from the control's
# (0 ± VISUAL_GAIN_MARGIN).
VISUAL_GAIN_MIN = 0.5
VISUAL_GAIN_MARGIN = 0.1


def demo_config_path() -> Path:
    return Path(str(resources.files("saccade") / "configs" / "demo.toml"))


def load_demo_config(overrides: list[str] | None = None, path: str | None = None) -> RunConfig:
    return load_config(RunConfig, path or demo_config_path(), overrides or [])




# The demo's warm start of Qwen3-VL's tiny model; every family's tiny preset has one, named
# "<preset>-warm" (saccade.models.presets.warm_start_names).
WARM_PRESET = "tiny-warm"


def warm_model_path(preset: str = "tiny") -> Path:
    """The demo's warm start of a family's tiny `preset` as a model folder: the preset after the
    demo config's SFT on random answers (step 1 above), LoRA-free full weights in an ordinary
    model folder. Built on first use and cached beside the preset's folder as
    "<preset>-warm-<key>", the key a hash of the demo config and the preset's folder (whose name
    holds the preset, seed and build), so runs that do not go through `saccade demo` (torchrun,
    `saccade bench distributed`, `saccade rl --model.path qwen2.5vl-tiny-warm`) can start from a
    policy whose groups have reward variance. Two processes racing both end up with a complete
    folder."""
    import hashlib

    from saccade.models.presets import build_once, cache_dir, resolve_model

    cfg = load_demo_config(["--model.path", preset])
    key = hashlib.sha256((demo_config_path().read_text() + resolve_model(preset)).encode()).hexdigest()[:10]
    return build_once(cache_dir() / f"{preset}-warm-{key}", lambda tmp: _build_warm_model(cfg, tmp))


def _warm_folder(base: str) -> Path:
    return warm_model_path() if base == "tiny" else warm_model_path(base)


def resolve_warm_start(cfg: RunConfig, world: World = SINGLE) -> RunConfig:
    """`cfg` with a warm start's name (`model.path = "tiny-warm"`, "qwen2.5vl-tiny-warm", ...)
    replaced by its folder (any other model is left as it is). The warm start is built by
    training, so it is resolved here, where a run starts, and handed down as a path: the library
    below never trains to find a model (`saccade serve tiny-warm` would otherwise train inside
    the vLLM server). Under torchrun rank 0 builds it while the others wait, then they read it
    from the cache."""
    from saccade.models.presets import warm_start_base

    base = warm_start_base(cfg.model.path)
    if base is None:
        return cfg
    if not world.is_main:
        barrier(world)
    path = _warm_folder(base)
    if world.is_main:
        barrier(world)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path)})})


def resolve_model_name(name: str) -> str:
    """A model name as `saccade serve` and the benches take it: a warm start's name ("tiny-warm",
    "qwen2.5vl-tiny-warm") is its folder (`resolve_warm_start`), a preset its built folder,
    anything else as it is."""
    from saccade.models.presets import resolve_model, warm_start_base

    base = warm_start_base(name)
    return str(_warm_folder(base)) if base else resolve_model(name)


def demo_start(cfg: RunConfig) -> RunConfig:
    """The demo trains its warm start itself (step 1), from the preset: a warm start's name
    ("qwen2.5vl-tiny-warm") runs the same demo as its preset's ("qwen2.5vl-tiny"), so either
    names the family to show."""
    from saccade.models.presets import warm_start_base

    base = warm_start_base(cfg.model.path)
    if base is None:
        return cfg
    print(f"{cfg.model.path!r} is the demo's warm start of {base!r}, which the demo trains itself (step 1): "
          f"running it from {base!r}", flush=True)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": base})})


def _build_warm_model(cfg: RunConfig, out: Path) -> None:
    from saccade.run.setup import build_setup
    from saccade.loops.sft import train_sft
    from saccade.trainer.checkpoint.engine_weights import merge_full_weights_for_engine

    run_dir = out / "sft-run"
    cfg = cfg.model_copy(update={"log": cfg.log.model_copy(update={"dir": str(run_dir)}),
                                 "trainer": cfg.trainer.model_copy(update={"device": "cpu"})})
    setup = build_setup(cfg, run_dir)
    train_sft(cfg, run_dir=run_dir, setup=setup, random_answers=True, progress=False, phase="warm-start")
    merge_full_weights_for_engine(setup.model, setup.model_path, out / "model")
    for p in (out / "model").iterdir():
        os.replace(p, out / p.name)
    shutil.rmtree(out / "model")
    shutil.rmtree(run_dir)


# On vLLM the demo samples one step ahead of the trainer (saccade bench async: 1.4x the steps
# per second of the on-policy loop on 2 cores, same accuracy bar) unless the config says otherwise.
VLLM_ASYNC_LEVEL = 1


@contextmanager
def demo_engine(cfg: RunConfig, engine: str):
    """The demo's config on the engine asked for. 'vllm' uses the servers in engine.urls, or,
    without any, starts `saccade serve` on the demo's model for the length of the demo (its
    log: <run_dir>/vllm-server.log); it samples VLLM_ASYNC_LEVEL steps ahead unless the config
    sets rollout.max_async_level. A server it starts gets the first half of the cores and the
    trainer the other half, so that sampling and training really overlap. Yields (config,
    minutes spent starting a server)."""
    if engine == "embedded":
        yield cfg.model_copy(update={"engine": EmbeddedEngineConfig(
            model_mismatch_limit=cfg.engine.model_mismatch_limit)}), 0.0
        return
    if "max_async_level" not in cfg.rollout.model_fields_set:
        cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_async_level": VLLM_ASYNC_LEVEL})})
    if cfg.engine.kind == "vllm":  # its servers
        yield cfg, 0.0
        return
    from saccade.timing import split_cores
    from saccade.models.presets import resolve_model
    from saccade.data.messages import processor_size
    from saccade.serving.launch import cpu_args, served

    start = time.perf_counter()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    everything = sorted(os.sched_getaffinity(0))
    server_cores, trainer_cores = split_cores(everything) if len(everything) >= 2 else (None, None)
    print("starting a vLLM server for the demo (saccade serve; about a minute on CPU)"
          + (f" on cores {server_cores}, the trainer on {trainer_cores}" if server_cores else "") + " ...", flush=True)
    # No line per request in the log: the demo makes thousands. The run's picture bounds (the
    # data-set demo's probe may have raised them): the server resizes as the trainer does.
    model = resolve_model(cfg.model.path)
    args = (*cpu_args(model), "--disable-uvicorn-access-log",
            "--mm-processor-kwargs", json.dumps({"size": processor_size(cfg.images)}))
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, server_cores))} if server_cores else None
    # The server may load weights only from where this run's trainer writes them.
    weights_root = cfg.engine_weights_dir
    with served(model, args=args, log_path=cfg.run_dir / "vllm-server.log", env=env,
                cores=server_cores, weights_root=weights_root) as url:
        engine_cfg = VLLMEngineConfig(urls=[url], model_mismatch_limit=cfg.engine.model_mismatch_limit)
        minutes = (time.perf_counter() - start) / 60
        threads = torch.get_num_threads()
        if trainer_cores:
            os.sched_setaffinity(0, trainer_cores)
            torch.set_num_threads(len(trainer_cores))
        try:
            yield cfg.model_copy(update={"engine": engine_cfg}), minutes
        finally:
            if trainer_cores:
                os.sched_setaffinity(0, everything)
                torch.set_num_threads(threads)


# The tasks the demo runs: the shapes, and a data set whose rows all have options.
DEMO_TASKS = ("shapes", "dataset")


def check_demo_task(cfg: RunConfig) -> RunConfig:
    """`cfg` when the demo can run its task, else a ValueError that says what to do: the demo's
    warm start draws random options and its chance is 1 / options, so it needs multiple choice."""
    kind = cfg.task.kind
    if kind not in DEMO_TASKS:
        raise ValueError(f"saccade demo runs task.kind 'shapes' (the default) or 'dataset' (your own multiple-choice "
                         f"data set, with task.columns.choices); got {kind!r}. Train it with saccade rl instead")
    if kind == "dataset" and cfg.task.format == "columns" and cfg.task.columns.choices is None:
        raise ValueError("saccade demo on a data set needs its options: set task.columns.choices to the list column "
                         "of each row's options (the warm start answers with one of them at random, and chance is "
                         "1 / their number)")
    return cfg


def chance_of(samples: list) -> float:
    """Held-out chance of a random option: the mean over the questions of 1 / their number of
    options (1 / options when every row has as many). A question without options is refused."""
    if not samples:
        raise ValueError("the demo's held-out set is empty: the data set's held-out split has no usable rows")
    missing = [s.sample_id for s in samples if not s.choices]
    if missing:
        raise ValueError(f"held-out questions without options ({', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''}): the demo needs multiple choice on every row; "
                         "check task.columns.choices")
    return sum(1.0 / len(s.choices) for s in samples) / len(samples)


def within_chance(accuracy: float, chance: float, margin: float = CHANCE_MARGIN) -> bool:
    return abs(accuracy - chance) <= margin


def accuracy_bars(result: dict[str, Any]) -> tuple[float, float]:
    """The bars of accuracy after GRPO and of its visual gain: 0.9 and 0.5; on a data set with
    the probe's figures, 0.9 or within 0.05 of the probe when the tower keeps less (and the
    probe found the answers in the pictures at all)
    (`saccade.tools.demo_probe.accuracy_bar`). The gain's bar is never above the accuracy bar's
    gain over chance (0.4 with two options, where 0.5 would need every answer right)."""
    from saccade.tools.demo_probe import accuracy_bar, is_grounded

    probe = result.get("probe_accuracy")
    grounded = probe is not None and is_grounded(probe, result["probe_blank_accuracy"], result["chance"])
    after_bar = accuracy_bar(probe if grounded else None)
    return after_bar, min(VISUAL_GAIN_MIN, round(after_bar - result["chance"], 3))


def verdict(result: dict[str, Any]) -> list[str]:
    """What missed the bar, in words; empty when the demo met it."""
    minutes_max = result.get("minutes_bar", MINUTES_MAX)
    late = [f"minutes {result['minutes']:.1f} > {minutes_max:g}"] if result["minutes"] > minutes_max else []
    if result.get("grpo_skipped"):
        return [f"the probe found no answer in the pictures: {result['verdict']}"] + late
    misses = []
    chance = result["chance"]
    after_bar, gain_bar = accuracy_bars(result)
    if result["accuracy_after"] < after_bar:
        misses.append(f"accuracy_after {result['accuracy_after']:.2f} < {after_bar:.3g}")
    if not within_chance(result["accuracy_before"], chance):
        misses.append(f"accuracy_before {result['accuracy_before']:.2f} is not within chance {chance:.2f} ± {CHANCE_MARGIN}")
    if not within_chance(result["control_accuracy_after"], chance):
        misses.append(
            f"control_accuracy_after {result['control_accuracy_after']:.2f} is not within chance {chance:.2f} ± {CHANCE_MARGIN}"
        )
    if result["visual_gain_after"] < gain_bar:
        misses.append(f"visual_gain_after {result['visual_gain_after']:.2f} < {gain_bar:.3g}")
    if abs(result["control_visual_gain"]) > VISUAL_GAIN_MARGIN:
        misses.append(f"control_visual_gain {result['control_visual_gain']:.2f} is not within 0 ± {VISUAL_GAIN_MARGIN}")
    return misses + late


DEMO_STAGES = ("sft", "grpo", "control")


def stage_config(cfg: RunConfig, stage: str) -> RunConfig:
    """The config of one of the demo's stages: its run folder <run_dir>/<stage>, and for the
    control every image of the task blank (`task.blank_images`, the shapes' or the data set's)."""
    if stage not in DEMO_STAGES:
        raise ValueError(f"the demo's stages are {', '.join(DEMO_STAGES)}; got {stage!r}")
    update: dict[str, Any] = {"log": cfg.log.model_copy(update={"dir": str(cfg.run_dir / stage)})}
    if stage == "control":
        update["task"] = cfg.task.model_copy(update={"blank_images": True})
    return cfg.model_copy(update=update)


def probe_stage(cfg: RunConfig, *, probe_steps: int | None = None,
                progress: bool = True) -> tuple[RunConfig, dict[str, Any] | None]:
    """Step 0 of the demo on a data set, before any engine is started: the supervised probe
    (`probe_steps` SFT steps each way; None: the recipe rule's, 0: none) at the pictures' own
    size and, when they do not ground there, at larger ones (`saccade.tools.demo_probe.
    probe_sizes`). Returns the config every later stage runs (the chosen size's image bounds:
    the warm start, GRPO, the control, their engine and trainer all see the same pictures) and
    the probe's figures; None for the shapes, or without a probe. When no size grounds, the
    figures are the demo's whole result (`grpo_skipped`, the verdict), and nothing more runs.
    Writes probe-blank/, probe-images/ (and probe-images-<side>px/) under cfg.run_dir."""
    if cfg.task.kind != "dataset":
        return cfg, None
    from saccade.run.tasks import task_from_config
    from saccade.tools.demo_probe import is_grounded, probe_sizes, probe_verdict
    from saccade.tools.demo_recipe import dataset_recipe, estimate_minutes, minutes_bar

    check_demo_task(cfg)
    start = time.perf_counter()
    for part in cfg.run_dir.glob("probe-*"):
        shutil.rmtree(part, ignore_errors=True)
    task = task_from_config(cfg, blank=False)
    held_out = task.eval_samples(cfg.eval.prompts)
    chance = chance_of(held_out)
    if probe_steps is None:
        probe_steps = dataset_recipe(options_of(chance), train_rows_of(task)).probe_steps
    if probe_steps == 0:
        return cfg, None
    sized, probe = probe_sizes(cfg, held_out, chance=chance, steps=probe_steps, progress=progress)
    probe["probe_minutes"] = (time.perf_counter() - start) / 60
    probe["minutes_estimate"] = estimate_minutes(sized, probe_steps=probe_steps, image_tokens=probe["image_tokens"],
                                                 probe_tokens=probe_fit_tokens(probe))
    probe["minutes_bar"] = minutes_bar(probe["minutes_estimate"], MINUTES_MAX)
    if is_grounded(probe["probe_accuracy"], probe["probe_blank_accuracy"], chance):
        print(f"pictures at {probe['image_side']} px (images.min_pixels {probe['images_min_pixels']}, max_pixels "
              f"{probe['images_max_pixels']}) for every stage: {probe['size_reason']}\nestimated: "
              f"{probe['minutes_estimate']:.1f} minutes with the probe (time bar {probe['minutes_bar']:g})", flush=True)
        return sized, probe
    # What SFT on the gold answers cannot read off the pictures at any size, GRPO will not: stop here.
    print(f"the pictures do not carry the answers for this tower: {probe['size_reason']}. GRPO and its control "
          "skipped (--probe-steps 0 runs them without the probe)", flush=True)
    result = {**probe, "chance": chance, "eval_size": len(held_out), **task_fields_of(cfg, held_out),
              "grpo_steps": 0, "grpo_skipped": True, "engine": cfg.engine.kind, "torch_threads": torch.get_num_threads(),
              "run_dir": str(cfg.run_dir), "minutes": probe["probe_minutes"]}
    result["verdict"], result["verdict_reason"] = probe_verdict(result)
    return cfg, result


def probe_fit_tokens(probe: dict[str, Any]) -> list[float]:
    """The image tokens a picture of each of the probe's fits: the blank one at the pictures' own
    size, then one with the pictures at each size tried."""
    own = next(t["tokens"] for t in probe["probe_sizes"] if t["side"] == probe["own_side"])
    return [own, *(t["tokens"] for t in probe["probe_sizes"])]


def run_demo(cfg: RunConfig, *, progress: bool = True, probed: dict[str, Any] | None = None) -> dict[str, Any]:
    """Warm start, GRPO, control, at the config's picture size; on a data set after the probe
    (`probe_stage`, whose figures are `probed`: the result holds them, and its minutes count).
    Writes sft/, grpo/ and control/ (metrics, plots, checkpoint) under cfg.run_dir, replacing a
    previous demo's; returns the figures."""
    from saccade.orchestrator.evaluation import evaluate
    from saccade.tools.plot import plot_run
    from saccade.loops.rl import train_rl
    from saccade.run.setup import build_setup
    from saccade.loops.sft import train_sft
    from saccade.run.tasks import task_from_config

    check_demo_task(cfg)
    start = time.perf_counter()
    root = cfg.run_dir
    for part in DEMO_STAGES:
        shutil.rmtree(root / part, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)

    setup = build_setup(cfg, root)
    task = task_from_config(cfg, blank=False)
    held_out = task.eval_samples(cfg.eval.prompts)

    def evaluated() -> dict[str, float]:
        """Greedy accuracy on the held-out questions, and on the same with every image blank
        (the very pixels of the control task's images: tests/data/test_shapes.py)."""
        return evaluate(setup, task, held_out, max_tokens=cfg.sampling.max_tokens, visual_gain=True)

    # 1. Warm start on answers that carry no visual signal.
    train_sft(stage_config(cfg, "sft"), run_dir=root / "sft", setup=setup, random_answers=True, progress=progress,
              phase="warm-start")
    warm = snapshot_trainable(setup.model)
    before = evaluated()

    # 2. GRPO on the real images.
    grpo_cfg = stage_config(cfg, "grpo")
    train_rl(grpo_cfg, run_dir=grpo_cfg.run_dir, setup=setup, progress=progress, fresh=True)  # a demo run again
    after = evaluated()

    # 3. Control: the same warm start and sampling seed, every image blank.
    restore_trainable(setup.model, warm)
    setup.engine.reseed(cfg.trainer.seed)
    control_cfg = stage_config(cfg, "control")
    train_rl(control_cfg, run_dir=control_cfg.run_dir, setup=setup, progress=progress, fresh=True)
    control = evaluated()  # on blank images: what it trained on; on the real ones: what it never saw

    for part in ("grpo", "control"):
        plot_run(root / part)
    result = {
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "control_accuracy_after": control["accuracy_blank"],
        "control_accuracy_on_real_images": control["accuracy"],
        "visual_gain_before": before["visual_gain"],
        "visual_gain_after": after["visual_gain"],
        "control_visual_gain": control["visual_gain"],
        "chance": chance_of(held_out),
        "eval_size": len(held_out),
        **task_fields_of(cfg, held_out),
        "grpo_steps": cfg.trainer.steps,
        "engine": cfg.engine.kind,
        "torch_threads": torch.get_num_threads(),
        "run_dir": str(root),
        "minutes": (time.perf_counter() - start) / 60,
    }
    return dataset_figures(cfg, result, probed, setup, held_out) if cfg.task.kind == "dataset" else result


def dataset_figures(cfg: RunConfig, result: dict[str, Any], probed: dict[str, Any] | None, setup,
                    held_out: list) -> dict[str, Any]:
    """The data-set demo's result: with the probe's figures, its minutes counted, and the verdict;
    without a probe, the estimate and the time bar at the pictures' own size."""
    from saccade.tools.demo_probe import probe_verdict
    from saccade.tools.demo_recipe import estimate_minutes, minutes_bar
    from saccade.tools.demo_sizes import plan_sizes

    if probed is None:
        plan = plan_sizes(cfg, held_out, setup.processor)
        estimate = estimate_minutes(cfg, probe_steps=0, image_tokens=plan.tokens[plan.own])
        return {**result, "minutes_estimate": estimate, "minutes_bar": minutes_bar(estimate, MINUTES_MAX)}
    result = {**result, **probed, "minutes": result["minutes"] + probed["probe_minutes"]}
    result["verdict"], result["verdict_reason"] = probe_verdict(result)
    return result


def task_fields_of(cfg: RunConfig, held_out: list) -> dict[str, Any]:
    """What the result says of the task: the shapes' question kinds, or the data set and its
    held-out rows' number of options (a sorted list when rows differ)."""
    if cfg.task.kind == "shapes":
        return {"task": "shapes", "question_kinds": list(cfg.task.question_kinds), "num_choices": cfg.task.num_choices}
    counts = sorted({len(s.choices) for s in held_out})
    return {"task": "dataset", "dataset": cfg.task.dataset, "num_choices": counts[0] if len(counts) == 1 else counts}


def options_of(chance: float) -> int:
    """The number of options a held-out set's chance stands for (its rows' mean of 1 / options)."""
    return max(2, round(1 / chance))


def train_rows_of(task) -> int:
    """The training rows of a data-set task (`QuestionTask` over a `DatasetTask`)."""
    return len(task.questions.train_rows)


def prepare_dataset_demo(cfg: RunConfig, overrides: list[str], path: str | None) -> RunConfig:
    """The demo's config on a data set with the recipe rule applied (`saccade.tools.demo_recipe`)
    to the keys the command line did not set, and the recipe and its estimated minutes printed:
    at the pictures' own size and at each larger one the probe may take (`probe_stage`). A
    config file of one's own (`path`) is run as it is; the shapes as demo.toml has them."""
    if cfg.task.kind != "dataset":
        return cfg
    from saccade.models.loading import load_processor
    from saccade.models.presets import resolve_model
    from saccade.run.tasks import task_from_config
    from saccade.tools.demo_recipe import (apply_recipe, dataset_recipe, describe_recipe, overridden_keys,
                                           size_estimates)
    from saccade.tools.demo_sizes import plan_sizes

    task = task_from_config(cfg, blank=False)
    held_out = task.eval_samples(cfg.eval.prompts)
    recipe = dataset_recipe(options_of(chance_of(held_out)), train_rows_of(task))
    if path is not None:
        print(f"your config file {path} is run as it is: the recipe rule (docs/demo.md) is not applied", flush=True)
        return cfg
    cfg, kept = apply_recipe(cfg, recipe, overridden_keys(overrides))
    plan = plan_sizes(cfg, held_out, load_processor(resolve_model(cfg.model.path)))
    sizes = size_estimates(cfg, probe_steps=recipe.probe_steps, sides=plan.sides, tokens=plan.tokens)
    print(describe_recipe(cfg, recipe, kept, floor=MINUTES_MAX, sizes=sizes, tokens=plan.tokens), flush=True)
    return cfg
