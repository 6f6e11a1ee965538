"""`saccade demo`: the shapes, views and scenes demos, each checked against its bars."""

from __future__ import annotations

import argparse

from saccade.cli.common import write_json


def _run_demo(args: argparse.Namespace, load_config, run) -> dict | None:
    """Load the demo's config (None after --dry-run), run it on the chosen engine, add the
    server's start to the minutes (the bar counts the whole demo), write the JSON."""
    from saccade.config import describe
    from saccade.demo import demo_engine

    cfg = load_config(args.overrides, args.config)
    if args.dry_run:
        print(describe(cfg))
        return None
    with demo_engine(cfg, args.engine) as (cfg, server_minutes):
        result = run(cfg)
    result["server_start_minutes"] = server_minutes
    result["minutes"] += server_minutes
    write_json(args.json, result)
    return result


def _demo_exit(misses: list[str], ok: str) -> int:
    if misses:
        print("demo missed its bar: " + "; ".join(misses))
        return 1
    print(ok)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from saccade.demo import ACCURACY_AFTER_MIN, CHANCE_MARGIN, MINUTES_MAX, demo_start, load_demo_config, run_demo, verdict

    if args.task == "views":
        return cmd_demo_views(args)
    if args.task == "scenes":
        return cmd_demo_scenes(args)
    result = _run_demo(args, lambda overrides, path: demo_start(load_demo_config(overrides, path)), run_demo)
    if result is None:
        return 0
    chance = result["chance"]
    print(
        f"\nheld-out accuracy ({result['eval_size']} questions, chance {chance:.2f}, engine {result['engine']}):\n"
        f"  before GRPO (random-answer warm start): {result['accuracy_before']:.3f}   (bar: chance ± {CHANCE_MARGIN})\n"
        f"  after GRPO:                             {result['accuracy_after']:.3f}   (bar: ≥ {ACCURACY_AFTER_MIN})\n"
        f"  control, GRPO on blank images:          {result['control_accuracy_after']:.3f}   (bar: chance ± {CHANCE_MARGIN})\n"
        f"  control model on the real images:       {result['control_accuracy_on_real_images']:.3f}\n"
        f"  minutes: {result['minutes']:.1f} (bar: ≤ {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )
    return _demo_exit(verdict(result), "demo OK: the model learned from the images, and the control without images did not")


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


def cmd_demo_views(args: argparse.Namespace) -> int:
    from saccade.demo_views import MINUTES_MAX, SUCCESS_GAIN_MIN, load_views_config, run_views_demo, views_verdict

    result = _run_demo(args, load_views_config, run_views_demo)
    if result is None:
        return 0
    print(
        f"\nheld-out episodes ({result['eval_episodes']}, up to {result['max_turns']} turns, engine {result['engine']}):\n"
        + _episode_lines(result, SUCCESS_GAIN_MIN)
        + f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )
    return _demo_exit(views_verdict(result), "demo OK: success rose by the bar or more within the time")


def cmd_demo_scenes(args: argparse.Namespace) -> int:
    from saccade.demo_scenes import MINUTES_MAX, SUCCESS_GAIN_MIN, load_scenes_config, run_scenes_demo, scenes_verdict

    result = _run_demo(args, load_scenes_config, run_scenes_demo)
    if result is None:
        return 0
    print(
        f"\nheld-out episodes ({result['eval_episodes']} in generated rooms, up to {result['max_turns']} turns, "
        f"{result['render_size']} px, engine {result['engine']}):\n"
        + _episode_lines(result, SUCCESS_GAIN_MIN)
        + f"  render cache hit rate: {result['render_cache_hit_rate']:.2f}\n"
        f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )
    return _demo_exit(scenes_verdict(result), "demo OK: success rose by the bar or more within the time")


def add_demo_parser(sub) -> None:
    """`saccade demo [shapes|views|scenes]`."""
    demo = sub.add_parser(
        "demo",
        help="the main job: a tiny VLM learns a visual task with GRPO on CPU, with a blank-image control",
        description="Builds (once, cached) a tiny random vision-language model offline; SFT warm start on random answers "
        "(the answer format, no visual signal); GRPO on the synthetic shapes task; then the same GRPO on "
        "blank images as a control. Prints held-out accuracy before, after and for the control, and fails "
        "(exit 1) if the model did not learn or the control did. About 6 minutes on 2 cores (8 on vLLM). "
        "Settings: saccade/configs/demo.toml (configs/demo.toml in the repo); dotted overrides apply. "
        "Runs, metrics and plots go to runs/demo/{sft,grpo,control}, replacing a previous demo's. "
        "Another family: --model.path qwen2.5vl-tiny (its tiny preset; '<preset>-warm' runs the same demo, "
        "which trains its own warm start; docs/families.md).",
    )
    demo.add_argument("task", nargs="?", default="shapes", choices=["shapes", "views", "scenes"],
                      help="which demo: 'shapes' (default; single-turn VQA), 'views' (multi-turn: act to change "
                      "the view, then answer; configs/views.toml, runs/demo-views, about 10 minutes) or 'scenes' "
                      "(the same in generated 3D mesh rooms with camera-pose actions; configs/scenes.toml, "
                      "runs/demo-scenes)")
    demo.add_argument("--config", metavar="PATH",
                      help="a TOML config instead of the built-in demo.toml / views.toml / scenes.toml")
    demo.add_argument("--json", metavar="PATH", help="also write the figures as JSON: accuracy_before, "
                      "accuracy_after, control_accuracy_after, chance and minutes (views: success_before, "
                      "success_after and minutes; scenes: the same)")
    demo.add_argument("--engine", choices=["embedded", "vllm"], default="embedded",
                      help="who samples the rollouts: 'embedded' (default, in-process) or 'vllm' (the servers in "
                      "--engine.urls, or else a `saccade serve` started for the demo; needs vLLM installed)")
    demo.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    demo.set_defaults(func=cmd_demo)
