"""`saccade demo`: the shapes, views and scenes demos, each checked against its bars, for one
seed or, with `--seeds`, for several one after another (every seed reported, and the worst)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Callable

from saccade.cli.common import write_json


def parse_seeds(text: str) -> list[int]:
    """"0,1,2,3" -> [0, 1, 2, 3]; an error that says what was wrong."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes integers separated by commas, e.g. 0,1,2,3; got {text!r}")
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs at least one seed and no seed twice; got {text!r}")
    return seeds


def seeded(cfg, seed: int):
    """The demo's config for one of several seeds: trainer.seed (the warm start, the sampling
    and the held-out set all follow it) and a run folder of its own, <run folder>/seed<S>."""
    return cfg.model_copy(update={
        "trainer": cfg.trainer.model_copy(update={"seed": seed}),
        "log": cfg.log.model_copy(update={"dir": str(cfg.run_dir / f"seed{seed}")}),
    })


@dataclass(frozen=True)
class Demo:
    """What `saccade demo X` runs and how it reports one run: its config loader and runner,
    the figures printed, the bar (`verdict`: what missed it, in words) and the seed table's
    columns (the result's keys)."""

    load_config: Callable
    run: Callable[..., dict]
    report: Callable[[dict], str]
    verdict: Callable[[dict], list[str]]
    ok: str
    columns: tuple[str, ...]
    # What runs before the engine is started (the data-set demo's probe and picture size):
    # (config) -> (the config the run takes, the figures handed to `run` as `probed`, or None).
    probe: Callable[..., tuple] | None = None


def engine_overrides(engine: str, overrides: list[str]) -> list[str]:
    """`--engine vllm` with servers of your own (`--engine.urls`): the engine's kind set first, so
    that the servers' fields, vLLM's alone, apply (`--engine.kind vllm` given too is left as it is)."""
    named = any(o.split("=", 1)[0] == "--engine.urls" for o in overrides)
    kind_given = any(o.split("=", 1)[0] == "--engine.kind" for o in overrides)
    return ["--engine.kind", "vllm", *overrides] if engine == "vllm" and named and not kind_given else list(overrides)


def _run_demo(args: argparse.Namespace, demo: Demo) -> list[dict] | None:
    """Load the demo's config (None after --dry-run), run it on the chosen engine once, or once
    per seed of `--seeds` (the data-set demo's probe first, before a server is started: it
    chooses the picture size the server must resize to), add the server's start to the minutes
    (the bar counts the whole demo), write the JSON: one run's figures, or with `--seeds` a list `seeds` of one such
    entry per seed (each with its `seed`)."""
    from saccade.config import describe
    from saccade.tools.demo import demo_engine

    cfg = demo.load_config(engine_overrides(args.engine, args.overrides), args.config)
    configs = [seeded(cfg, seed) for seed in args.seeds] if args.seeds else [cfg]
    if args.dry_run:
        for one in configs:
            print(describe(one))
        return None
    results = []
    for one in configs:
        one, probed = demo.probe(one) if demo.probe else (one, None)
        if probed is not None and probed.get("grpo_skipped"):  # the probe's verdict: nothing more to run
            result, server_minutes = probed, 0.0
        else:
            with demo_engine(one, args.engine) as (one, server_minutes):
                result = demo.run(one, probed=probed) if demo.probe else demo.run(one)
        result["server_start_minutes"] = server_minutes
        result["minutes"] += server_minutes
        result["seed"] = one.trainer.seed
        results.append(result)
    write_json(args.json, {"seeds": results} if args.seeds else results[0])
    return results


def seed_table(results: list[dict], demo: Demo) -> str:
    """One line per seed: its figures, its minutes and whether it met the bar; then the worst
    seed (the lowest first column) named."""
    head = "seed  " + "  ".join(f"{c:>22}" for c in demo.columns) + "  minutes  bar"
    lines = [head]
    for r in results:
        misses = demo.verdict(r)
        lines.append(f"{r['seed']:>4}  " + "  ".join(f"{r.get(c, float('nan')):>22.3f}" for c in demo.columns)
                     + f"  {r['minutes']:>7.1f}  {'met' if not misses else 'MISSED'}")
    worst = min(results, key=lambda r: r.get(demo.columns[0], -1.0))
    lines.append(f"worst seed: {worst['seed']} ({demo.columns[0]} {worst.get(demo.columns[0], float('nan')):.3f})")
    return "\n".join(lines)


def run_and_report(args: argparse.Namespace, demo: Demo) -> int:
    """Run the demo (each seed of --seeds in turn), print each run's figures, and with several
    seeds the table; exit 1 when any seed missed its bar, saying which and how."""
    results = _run_demo(args, demo)
    if results is None:
        return 0
    misses = []
    for r in results:
        print(("" if len(results) == 1 else f"\nseed {r['seed']}:") + demo.report(r))
        misses += [(f"seed {r['seed']}: " if args.seeds else "") + m for m in demo.verdict(r)]
    if args.seeds:
        print("\n" + seed_table(results, demo))
    if misses:
        print("demo missed its bar: " + "; ".join(misses))
        return 1
    print(demo.ok if not args.seeds else f"{demo.ok} (every seed: {', '.join(str(s) for s in args.seeds)})")
    return 0


def probe_lines(result: dict) -> str:
    """The data-set demo's probe and verdict (`saccade.tools.demo_probe`); nothing for the shapes."""
    if "verdict" not in result:
        return ""
    sizes = result.get("probe_sizes") or []
    tried = ", ".join(f"{t['side']} px {t['accuracy']:.3f}" for t in sizes)
    size = f"  picture sizes tried:                    {tried}\n" if sizes else ""
    if sizes and not result.get("grpo_skipped"):
        size += (f"  pictures taken at:                      {result['image_side']} px, {result['image_tokens']:g} "
                 f"image tokens a picture ({result['own_side']} px, their own size: {sizes[0]['tokens']:g})\n")
    return (
        f"\nsupervised probe ({result['probe_steps']} SFT steps on the gold answers, held-out greedy):\n"
        f"  with the pictures:                      {result['probe_accuracy']:.3f}\n"
        f"  with every picture blank:               {result['probe_blank_accuracy']:.3f}\n"
        + size + f"verdict: {result['verdict']}: {result['verdict_reason']}"
    )


def shapes_report(result: dict) -> str:
    from saccade.tools.demo import CHANCE_MARGIN, VISUAL_GAIN_MARGIN, MINUTES_MAX, accuracy_bars

    chance = result["chance"]
    if result.get("grpo_skipped"):
        return (f"\n{result['dataset']}, {result['eval_size']} held-out questions, chance {chance:.2f}: GRPO and its "
                f"control skipped\n  minutes: {result['minutes']:.1f};  runs and metrics: {result['run_dir']}/"
                + probe_lines(result))
    after_bar, gain_bar = accuracy_bars(result)
    minutes_bar = result.get("minutes_bar", MINUTES_MAX)
    estimate = f", estimated {result['minutes_estimate']:.1f}" if "minutes_estimate" in result else ""
    source = f"{result['dataset']}, " if result.get("task") == "dataset" else ""
    return (
        f"\nheld-out accuracy ({source}{result['eval_size']} questions, chance {chance:.2f}, "
        f"engine {result['engine']}):\n"
        f"  before GRPO (random-answer warm start): {result['accuracy_before']:.3f}   (bar: chance ± {CHANCE_MARGIN})\n"
        f"  after GRPO:                             {result['accuracy_after']:.3f}   (bar: ≥ {after_bar:.2f})\n"
        f"  control, GRPO on blank images:          {result['control_accuracy_after']:.3f}   (bar: chance ± {CHANCE_MARGIN})\n"
        f"  control model on the real images:       {result['control_accuracy_on_real_images']:.3f}\n"
        f"held-out visual gain (accuracy minus the accuracy with every image blank):\n"
        f"  before GRPO:                            {result['visual_gain_before']:+.3f}\n"
        f"  after GRPO:                             {result['visual_gain_after']:+.3f}   (bar: ≥ {gain_bar:.2f})\n"
        f"  control:                                {result['control_visual_gain']:+.3f}   (bar: 0 ± {VISUAL_GAIN_MARGIN})\n"
        f"  minutes: {result['minutes']:.1f} (bar: ≤ {minutes_bar:g}{estimate});  runs, metrics and plots: {result['run_dir']}/"
        + probe_lines(result)
    )


def _episode_lines(result: dict, success_gain_min: float) -> str:
    """What the views and scenes demos both report on their held-out episodes."""
    return (
        f"  success before GRPO (random-action warm start): {result['success_before']:.3f}"
        f"   (turns {result['turns_before']:.2f})\n"
        f"  success after GRPO:                             {result['success_after']:.3f}"
        f"   (turns {result['turns_after']:.2f}; bar: >= before + {success_gain_min})\n"
        f"  brought the object into view:  before {result['seen_before']:.3f}, after {result['seen_after']:.3f}\n"
        f"  right color once it was seen:  before {result['correct_when_seen_before']:.3f}, "
        f"after {result['correct_when_seen_after']:.3f}   (chance {result['color_chance']:.2f})\n"
    )


def views_report(result: dict) -> str:
    from saccade.tools.demo_views import MINUTES_MAX, SUCCESS_GAIN_MIN

    return (
        f"\nheld-out episodes ({result['eval_episodes']}, up to {result['max_turns']} turns, engine {result['engine']}):\n"
        + _episode_lines(result, SUCCESS_GAIN_MIN)
        + f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )


def scenes_report(result: dict) -> str:
    from saccade.tools.demo_scenes import MINUTES_MAX, SUCCESS_GAIN_MIN

    return (
        f"\nheld-out episodes ({result['eval_episodes']} in generated rooms, up to {result['max_turns']} turns, "
        f"{result['render_size']} px, engine {result['engine']}):\n"
        + _episode_lines(result, SUCCESS_GAIN_MIN)
        + f"  render cache hit rate: {result['render_cache_hit_rate']:.2f}\n"
        f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )


def demo_of(task: str) -> Demo:
    """The demo named on the command line, its modules imported only now (--help stays light)."""
    episodes = ("success_after", "success_before")
    if task == "views":
        from saccade.tools.demo_views import load_views_config, run_views_demo, views_verdict

        return Demo(load_views_config, run_views_demo, views_report, views_verdict,
                    "demo OK: success rose by the bar or more within the time", episodes)
    if task == "video":
        from saccade.tools.demo_video import load_video_config, run_video_demo, video_probe, video_report, video_verdict

        return Demo(load_video_config, run_video_demo, video_report, video_verdict,
                    "demo OK: the model learned the clips' order, and the control on reversed clips did not",
                    ("accuracy_after", "accuracy_before", "control_accuracy_after", "probe_reversed_accuracy"),
                    probe=video_probe)
    if task == "scenes":
        from saccade.tools.demo_scenes import load_scenes_config, run_scenes_demo, scenes_verdict

        return Demo(load_scenes_config, run_scenes_demo, scenes_report, scenes_verdict,
                    "demo OK: success rose by the bar or more within the time", episodes)
    from saccade.tools.demo import (check_demo_task, demo_start, load_demo_config, prepare_dataset_demo, probe_stage,
                                    run_demo, verdict)

    def load(overrides, path):
        cfg = check_demo_task(demo_start(load_demo_config(overrides, path)))
        return prepare_dataset_demo(cfg, overrides or [], path)

    return Demo(load, run_demo,
                shapes_report,
                verdict, "demo OK: the model learned from the images, and the control without images did not",
                ("accuracy_after", "accuracy_before", "control_accuracy_after", "visual_gain_after",
                 "control_visual_gain"), probe=probe_stage)


def cmd_demo(args: argparse.Namespace) -> int:
    demo = demo_of(args.task)
    if args.probe_steps is not None:
        if args.task not in ("shapes", "video"):
            raise SystemExit(f"--probe-steps is for the data-set and video demos; not for {args.task!r}")
        from functools import partial

        demo = replace(demo, probe=partial(demo.probe, probe_steps=args.probe_steps))
    return run_and_report(args, demo)


def add_demo_parser(sub) -> None:
    """`saccade demo [shapes|views|scenes|video]`."""
    demo = sub.add_parser(
        "demo",
        help="the main job: a tiny VLM learns a visual task with GRPO on CPU, with a blank-image control",
        description="Builds (once, cached) a tiny random vision-language model offline; SFT warm start on random answers "
        "(the answer format, no visual signal); GRPO on the synthetic shapes task; then the same GRPO on "
        "blank images as a control. Prints held-out accuracy before, after and for the control, and fails "
        "(exit 1) if the model did not learn or the control did. About 2.5 minutes on a quiet 2-core CPU (docs/demo.md has each seed's). "
        "Settings: saccade/configs/demo.toml (configs/demo.toml in the repo); dotted overrides apply. "
        "Runs, metrics and plots go to runs/demo/{sft,grpo,control}, replacing a previous demo's. "
        "Another family: --model.path qwen2.5vl-tiny (its tiny preset; '<preset>-warm' runs the same demo, "
        "which trains its own warm start; docs/families.md). "
        "Your own multiple-choice data set instead of the shapes: --task.kind dataset --task.dataset PATH "
        "--task.columns '{\"images\": ..., \"prompt\": ..., \"answer\": ..., \"choices\": ...}' (the warm start "
        "answers a random option of each row, the control blanks every image, chance is 1 / options): is the "
        "data set visually grounded, and does the path learn it? A supervised probe (SFT on the gold answers, "
        "with the pictures and blank) says whether the pictures carry the answers for this tower, at their own "
        "size or, when they do not, upscaled (the side doubled, up to the model's max_pixels: the smallest size "
        "that reads them is taken for every stage, images.min_pixels), and the "
        "verdict whether it was learned, not grounded, or grounded but not learned in budget; the recipe "
        "(group size, steps, temperature, lr decay) follows the number of options, printed up front with "
        "its estimated minutes, for the keys you do not set. "
        "python -m saccade.data.choices_example FOLDER writes one to try (docs/demo.md).",
    )
    demo.add_argument("task", nargs="?", default="shapes", choices=["shapes", "views", "scenes", "video"],
                      help="which demo: 'shapes' (default; single-turn VQA; with --task.kind dataset your own "
                      "multiple-choice data set instead), 'views' (multi-turn: act to change "
                      "the view, then answer; configs/views.toml, runs/demo-views, about 10.5 minutes on one core) or 'scenes' "
                      "(the same in generated 3D mesh rooms with camera-pose actions; configs/scenes.toml, "
                      "runs/demo-scenes) or 'video' (clips: \"which color came first?\", which only their order answers; "
                      "the control's clips reversed at random; a supervised probe first; runs/demo-video, docs/video.md)")
    demo.add_argument("--config", metavar="PATH",
                      help="a TOML config instead of the built-in demo.toml / views.toml / scenes.toml")
    demo.add_argument("--json", metavar="PATH", help="also write the figures as JSON: accuracy_before, "
                      "accuracy_after, control_accuracy_after, chance and minutes (views: success_before, "
                      "success_after and minutes; scenes: the same)")
    demo.add_argument("--engine", choices=["embedded", "vllm"], default="embedded",
                      help="who samples the rollouts: 'embedded' (default, in-process) or 'vllm' (the servers in "
                      "--engine.urls, or else a `saccade serve` started for the demo; needs vLLM installed)")
    demo.add_argument("--seeds", type=parse_seeds, metavar="0,1,2,3",
                      help="run the demo once per seed (trainer.seed), one after another, each in "
                      "<run folder>/seed<S>; prints every seed's figures, a table and the worst seed, and "
                      "fails if any seed missed its bar. --json then holds {\"seeds\": [one entry per seed]}")
    demo.add_argument("--probe-steps", type=int, metavar="N",
                      help="the data-set demo's supervised probe: N SFT steps on the gold answers each way "
                      "(default: 25 x options, at least 100); 0 skips the probe and its verdict")
    demo.add_argument("--dry-run", action="store_true", help="print the resolved config (each seed's) and exit")
    demo.set_defaults(func=cmd_demo)
