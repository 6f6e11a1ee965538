"""`saccade bench ...`: one subcommand per benchmark or parity check; each prints its report,
writes its figures with --json, and exits 1 where it has a bar and misses it.

Each bench is configured like a run: its options are one config type (`saccade.config.bench`),
read by `load_config` from the type's defaults, an optional TOML file of its keys (CONFIG), its
options (`saccade.config.options`: each field an option, `--image-size 448`, `--lora`, its
`--help` the field's description) and dotted overrides; `--dry-run` prints the resolved options
as TOML. The benches that run `saccade rl` themselves (async, kill, soak) take a run config as
CONFIG instead, and the dotted overrides go to its runs. The bench function gets the typed
config (and hands it to its worker processes, serialized).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from saccade.cli.common import write_json
from saccade.config.bench import (
    AsyncBenchConfig, ChangedWeightsBenchConfig, DistributedBenchConfig, EngineParityBenchConfig, GpuBenchConfig,
    KillBenchConfig, ParityBenchConfig, RenderBenchConfig, RolloutBenchConfig, RunBenchConfig, SoakBenchConfig,
    StepBenchConfig, TrainerBenchConfig, VideoMemoryBenchConfig, WeightSyncBenchConfig,
)
from saccade.config.options import add_options, load_options


def _print_parity(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from saccade.tools.parity import tolerance

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
    if result.get("video"):  # the cases that hold the clip, apart
        table.add_row("clips: LM-only vs full", f"{result['clip_lm_only_vs_full_max_abs']:.2e}", bar)
        table.add_row("clips: packed vs full", f"{result['clip_packed_vs_full_max_abs']:.2e}", bar)
        if result["deepstack_levels"]:
            table.add_row("clips: DeepStack dropped (a bug)", f"{result['clip_deepstack_dropped_max_abs']:.2e}",
                          "far above the bar")
        table.add_row("clips: 1-D positions (a bug)", f"{result['clip_positions_1d_max_abs']:.2e}", "far above the bar")
    console.print(table)
    cases = Table(title="per conversation")
    for col in ("case", "tokens", "images", "clips", "max |Δ| vs full", "packed vs full"):
        cases.add_column(col)
    for name, c in result["cases"].items():
        cases.add_row(name, str(c["tokens"]), str(c["images"]), str(c["clips"]), f"{c['lm_only_vs_full_max_abs']:.2e}",
                      f"{c['packed_vs_full_max_abs']:.2e}")
    console.print(cases)
    console.print(f"vision cache hit rate: {result['cache']['hit_rate']:.0%} ({result['cache']['entries']} images encoded)")


def cmd_bench_parity(cfg: ParityBenchConfig, args: argparse.Namespace) -> int:
    from saccade.models.model_path import resolve_model_path
    from saccade.tools.demo import resolve_model_name

    # A folder that is not a model is refused before the loaders' imports (15 s), the name resolved
    # by the bench's own rule (a preset or warm start built, a hub id fetched: each kept in its
    # cache, where the bench's own resolution finds it again).
    resolve_model_path(resolve_model_name(cfg.model))
    from saccade.tools.parity import run_parity_bench, tolerance

    result = run_parity_bench(cfg)
    _print_parity(result)
    write_json(args.json, result)
    bar = tolerance(result["dtype"])
    ok = result["lm_only_vs_full_max_abs"] <= bar and result["packed_vs_unpacked_max_abs"] <= bar
    print("parity OK" if ok else "PARITY FAILED: the LM-only path does not reproduce the full model")
    return 0 if ok else 1


def cmd_bench_trainer(cfg: TrainerBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.trainer import format_report, run_trainer_bench

    result = run_trainer_bench(cfg)
    print(format_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_video_memory(cfg: VideoMemoryBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.video_memory import format_video_memory_report, run_video_memory_bench

    result = run_video_memory_bench(cfg)
    print(format_video_memory_report(result))
    write_json(args.json, result)
    return 0 if result["tower_params_in_trainer"] == 0 else 1


def cmd_bench_step(cfg: StepBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.step import format_step_report, run_step_bench

    result = run_step_bench(cfg)
    print(format_step_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_distributed(cfg: DistributedBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.distributed import format_distributed_report, run_distributed_bench

    result = run_distributed_bench(cfg)
    print(format_distributed_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_async(cfg: AsyncBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.async_rollouts import format_async_report, run_async_bench

    result = run_async_bench(cfg)
    print(format_async_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_kill(cfg: KillBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.kill import format_kill_report, matched, run_kill_bench

    result = run_kill_bench(cfg)
    print(format_kill_report(result))
    write_json(args.json, result)
    return 0 if matched(result) and result["kills"] == cfg.kills else 1


def cmd_bench_soak(cfg: SoakBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.soak import format_soak_report, run_soak_bench

    result = run_soak_bench(cfg)
    print(format_soak_report(result))
    write_json(args.json, result)
    return 0 if result["ok"] else 1


def cmd_bench_engine_parity(cfg: EngineParityBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.engine import format_engine_parity, meets_bars, run_engine_parity

    result = run_engine_parity(cfg)
    print(format_engine_parity(result))
    write_json(args.json, result)
    return 0 if meets_bars(result) else 1


def cmd_bench_rollout(cfg: RolloutBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.engine import format_rollout, run_rollout_bench

    result = run_rollout_bench(cfg)
    print(format_rollout(result))
    write_json(args.json, result)
    return 0


def cmd_bench_weight_sync(cfg: WeightSyncBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.weight_sync import format_weight_sync, run_weight_sync_bench

    result = run_weight_sync_bench(cfg)
    print(format_weight_sync(result))
    write_json(args.json, result)
    return 0


def cmd_bench_changed_weights(cfg: ChangedWeightsBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.changed_weights import format_changed_weights, run_changed_weights_bench

    result = run_changed_weights_bench(cfg)
    print(format_changed_weights(result))
    write_json(args.json, result)
    return 0


def cmd_bench_render(cfg: RenderBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench.render import format_render_report, run_render_bench

    result = run_render_bench(cfg)
    print(format_render_report(result))
    write_json(args.json, result)
    return 0


def cmd_bench_gpu(cfg: GpuBenchConfig, args: argparse.Namespace) -> int:
    from saccade.tools.bench import gpu

    return gpu.run_gpu_bench(cfg)


def _list_gpu_stages() -> int:
    from saccade.tools.bench import gpu

    print(gpu.list_stages())
    return 0


@dataclass(frozen=True)
class Bench:
    """A `saccade bench` subcommand: its config type, the command that runs it, its help."""

    name: str
    config: type[Any]  # its options (saccade.config.bench)
    run: Callable[[Any, argparse.Namespace], int]
    help: str
    description: str
    json: bool = True  # --json PATH: it writes its figures


# In the order `saccade bench --help` lists them.
BENCHES = (
    Bench(
        "parity", ParityBenchConfig, cmd_bench_parity,
        help="max |Δ logprob| of the LM-only path vs the full model, packed vs unpacked, and two known bugs",
        description="Writes lm_only_vs_full_max_abs, packed_vs_unpacked_max_abs, deepstack_dropped_max_abs and "
        "positions_1d_max_abs. Runs on any folder of a supported family with --model (or any family's preset: tiny, "
        "qwen3vl-2b, qwen2.5vl-3b, moe-tiny, qwen3vl-30b-a3b-l6, ...). Bars: 1e-5 in float32, 0.25 in bfloat16 (two "
        "bf16 paths round differently; the mistakes move "
        "it by more than 1 at 2B). Mean |Δ| figures are written too. With --video PATH (a video file) the "
        "conversations hold that clip too, and the clip cases' figures are written apart (clip_*_max_abs)."
    ),
    Bench(
        "trainer", TrainerBenchConfig, cmd_bench_trainer,
        help="step time and memory: cached embeddings vs full VLM; packed vs padded; activation checkpointing",
        description="On the 'small' preset, side by side in one run: (a) step time and peak memory of the "
        "cached-embeddings path against a full-VLM path that runs the vision tower every step; "
        "(b) packed against padded batches (padding fraction, tokens/s); (c) activation checkpointing on and off "
        "(activation_checkpointing_step_ratio, activation_checkpointing_peak_ratio); (d) the language model's "
        "FLOPs, TFLOP/s and MFU, and saccade memory's estimate beside the measured peak. Prints ratios."
    ),
    Bench(
        "video-memory", VideoMemoryBenchConfig, cmd_bench_video_memory,
        help="the trainer's peak memory against frames per clip, the text fixed: it grows with tokens only",
        description="For each frame count (--frames 4,8,16,32,64), one step of --samples completions of a clip's "
        "prompt, the clip through the frozen tower once beforehand; then the trainer's step (load_policy_lm + LoRA, "
        "the trainer's pack and optimizer step on the cached clip embedding) in a fresh process per frame count, "
        "its peak memory measured as `bench trainer` measures it. Prints a row per frame count (video pads, tokens "
        "per sample and per step, the peak, the tower parameters the trained model holds, the pixel values a "
        "trainer that runs the tower would hold) and the least-squares line of peak against tokens, beside saccade "
        "memory's activation bytes per token. Exit 1 if the trained model holds any tower parameter."
    ),
    Bench(
        "step", StepBenchConfig, cmd_bench_step,
        help="one RL step's wall time broken down, against HF transformers' own path (TRL's) on the same batch",
        description="8 prompts x G=8, <= 8 new tokens, one shapes image per prompt: saccade's step (rollout on the "
        "embedded engine, pack, train step, weight sync) timed part by part (env, templating, image_prep, encode, "
        "prefill, decode, rewards, samples, pack, forward, logprobs, loss, backward, optimizer, weight_sync, other), "
        "interleaved with the reference: transformers generate on the repeated prompts, then a padded forward and "
        "backward of the full model from the pixels. Prints saccade_s, reference_s, their ratio (reference / "
        "saccade), the trainer's tokens/s against the reference's forward+backward, and the overhead's share."
    ),
    Bench(
        "distributed", DistributedBenchConfig, cmd_bench_distributed,
        help="the FSDP2 trainer at world 1 against world N (torchrun): per-rank memory, step time, export",
        description="Two torchrun launches on one machine, --nproc-per-node 1 then N, on the same model and global "
        "batch (16 synthetic samples): per-rank parameter+gradient+AdamW bytes (world N / world 1, about 1/N), the "
        "train step's time, the engine-weights export's time and peak-RSS rise, and one decode-sized forward with "
        "the weights whole (the embedded engine's rollout) against sharded (an all-gather per forward)."
    ),
    Bench(
        "async", AsyncBenchConfig, cmd_bench_async,
        help="the vLLM demo config at rollout.max_async_level 0, then 1, at each world size and seed: seconds per "
        "step, ratio, learning per seed",
        description="Runs the demo config on a vLLM server from the demo's warm start (model tiny-warm), back to back "
        "on the same server: rollout.max_async_level 0 (sample, train, push) and 1 (step n+1 sampled while step n "
        "trains), at each trainer world size of --world-sizes (1: one `saccade rl` process; more: torchrun) and each "
        "trainer.seed of --seeds. Prints "
        "seconds per step (the loop's own, start-up left out), level 1's steps per second over level 0's at each "
        "world size, the fraction of the loop the trainer waited for rollouts and the server had nothing to do, the "
        "lag, each run's held-out accuracy, and per seed whether level 1 learned as level 0 did (within 0.05) and its "
        "longest run of steps with reward 0. The cores are split: the server's compute threads on the first half, "
        "the trainer's ranks on the other half. Dotted overrides (--trainer.steps 40) apply to every run."
    ),
    Bench(
        "kill", KillBenchConfig, cmd_bench_kill,
        help="SIGKILL a run at random instants, resume it each time, compare with a run never killed",
        description="Runs the config (default: the demo's, embedded engine, from its warm start, a checkpoint every "
        "step) straight to the end, then again while SIGKILLing it --kills times at random instants (drawn from the "
        "straight run's timing: start-up, sampling, training, metrics and checkpoint writes alike), resuming it "
        "with --resume after each kill. --world N: both runs under torchrun with N ranks, each kill taking torchrun "
        "and every rank. --engine vllm: both sample from one vLLM server started once and kept up across the kills, "
        "one step ahead (rollout.max_async_level 1, a checkpoint every 2 steps), some kills aimed at a weight push. "
        "--control: the straight run twice, their spread the bar. Reports the kills that landed, how many hit a "
        "checkpoint write or tore a metrics line, and whether every metrics line is whole and logged once, every "
        "computed figure equal (abs 1e-6) and the final weights bit-identical. Exits 1 otherwise. Dotted overrides "
        "apply to every run."
    ),
    Bench(
        "soak", SoakBenchConfig, cmd_bench_soak,
        help="a long demo-config run: RSS slope, open descriptors, threads and the image cache over the steps",
        description="Runs `saccade rl` on the config (default configs/demo.toml) from the demo's warm start (model "
        "tiny-warm), embedded engine, evaluation and intermediate checkpoints off, the image cache at 8 MB unless "
        "--image_cache.budget_bytes is given. Prints the RSS slope after the warm-up (least squares, MB per 100 steps), "
        "open file descriptors and threads at the start, after the warm-up and at the end, and the image-embedding "
        "cache's entries and MB over time; writes a memory plot in the run folder. Exit 1 if the slope is 1 MB per "
        "100 steps or more, or descriptors or threads grew after the warm-up. Dotted overrides apply to the run."
    ),
    Bench(
        "engine-parity", EngineParityBenchConfig, cmd_bench_engine_parity,
        help="vLLM against the trainer: sampled-token logprobs, /encode_images, and after /update_weights",
        description="Starts `saccade serve` on the model (or uses --url), samples shapes questions with one and "
        "two images, and writes mean_abs and max_abs (|vLLM logprob - trainer logprob| of every sampled token), "
        "encode_max_abs (/encode_images against the transformers tower, DeepStack included) and "
        "after_update_mean_abs (the same gap after one training step and /update_weights). Exit 1 if a bar is missed."
    ),
    Bench(
        "rollout", RolloutBenchConfig, cmd_bench_rollout,
        help="completion tokens/s: embedded engine, HF generate and vLLM on the same prompts, side by side",
        description="32 shapes prompts x 8 samples, up to 16 tokens, three interleaved repeats per engine: the "
        "embedded engine (each prompt prefilled once for its 8 samples), transformers' generate on the prompts "
        "repeated 8 times (TRL without vLLM), and a started vLLM server."
    ),
    Bench(
        "weight-sync", WeightSyncBenchConfig, cmd_bench_weight_sync,
        help="full fine-tuning's weights to a vLLM server: through a folder against the collective transfer",
        description="Starts `saccade serve` on the model (or uses --url) and syncs the trainer's full weights to it "
        "repeats times each way, interleaved: engine.weight_sync.kind = \"files\" (the folder written, the server reads "
        "it back) and \"collective\" (the language model broadcast over gloo, layer group by layer group). Prints "
        "the median seconds of each, their ratio and the collective's one-time rendezvous."
    ),
    Bench(
        "changed-weights", ChangedWeightsBenchConfig, cmd_bench_changed_weights,
        help="the share of bf16 weights one optimizer step of full fine-tuning changes (what a sparse sync sends)",
        description="Runs `saccade rl` on the demo's task with the model in bf16 (AdamW on float32 masters, LoRA "
        "off), once per preset and learning rate, and counts, around every optimizer step, the language model's "
        "weights whose bf16 value changed. Prints each run's fractions and, from the largest, one sync of "
        "Qwen3-VL-8B's language model dense against sparse (estimates, the arithmetic shown)."
    ),
    Bench(
        "render", RenderBenchConfig, cmd_bench_render,
        help="renders/s of the mesh renderer on generated rooms, cold and cached",
        description="Renders random free poses in generated rooms with saccade.scenes' MeshRenderer (cold: every "
        "pose new) and again through its CachedRenderer (every pose a hit). Prints renders/s of each."
    ),
    Bench(
        "gpu", GpuBenchConfig, cmd_bench_gpu,
        help="every GPU check that needs no vLLM, in stages that resume: one JSON and a markdown table",
        description="With --lease, what a GPU lease runs (scripts/gpu-lease.sh; docs/gpu-runs.md, \"The lease\"): the "
        "stages the carried results (--results, docs/gpu-results.json) lack, in the order of their value (smoke, "
        "parity-2b, trainer-lora, syncs, rl, ...), within --budget (default 450 s), each written to OUT the moment it "
        "ends; --record DIR merges a lease's results into --results and rewrites docs/gpu-runs.md's table. "
        "Without it: runs, stage by stage, each in a fresh process: a smoke check (versions, the GPU, the head's "
        "matmuls, fla's precision, every module imports), building the random real-shape models (2B, "
        "4B), bf16 parity at 2B and 4B shapes at 1k and 8k positions, host syncs per decoded token and per trainer "
        "micro-batch, `bench trainer` at 2B (LoRA, full fine-tuning), `bench step` at 2B, RL steps that train "
        "(tiny-warm), FSDP2 at world 1 (2B; bf16 mixed precision against fp32), `bench render`, `bench trainer` at "
        "8B; then for the other "
        "families bf16 parity and `bench trainer` LoRA at Qwen2.5-VL-3B's shapes and at Qwen3-VL-30B-A3B's widths "
        "with 6 layers (qwen3vl-30b-a3b-l6), each built by its first stage. Results go into "
        "OUT/bench-gpu.json as each stage ends, with OUT/bench-gpu.md (docs/gpu-runs.md's table) and OUT/bench-gpu.log. "
        "Run again, it skips stages that are ok (--force runs them again) or failed (name them with --stage to "
        "retry). --budget S starts a stage only if its H100 estimate fits in what is left of S seconds, and exits 3 "
        "when stages are left: run the same command again. Exit 1 if a stage failed. --device cpu --quick runs "
        "every stage on its family's tiny preset (the tests do).",
        json=False,
    ),
)


def bench_command(bench: Bench) -> Callable[[argparse.Namespace], int]:
    """The subcommand's function: its config read like a run's, then the bench run (or printed)."""

    def command(args: argparse.Namespace) -> int:
        from saccade.config import describe

        if getattr(args, "list", False):  # bench gpu --list: nothing to configure
            return _list_gpu_stages()
        if issubclass(bench.config, RunBenchConfig):  # CONFIG and the dotted overrides are the runs'
            from saccade.config import RunConfig, load_config

            extra = [("CONFIG", "config", args.config)] if args.config else []
            extra.append(("the dotted overrides", "overrides", _json(args.overrides)))
            cfg = load_options(bench.config, args, extra=extra)
            load_config(RunConfig, cfg.config, cfg.overrides)  # a bad file or key fails now, not in a run
        else:
            cfg = load_options(bench.config, args, path=args.config, overrides=args.overrides)
        if args.dry_run:
            print(describe(cfg))
            return 0
        return bench.run(cfg, args)

    return command


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def add_bench_parser(sub) -> None:
    """`saccade bench BENCH`: one subcommand per benchmark, its options those of its config type."""
    bench_parser = sub.add_parser("bench", help="benchmarks and parity figures")
    bench_sub = bench_parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for bench in BENCHES:
        parser = bench_sub.add_parser(bench.name, help=bench.help, description=bench.description)
        if issubclass(bench.config, RunBenchConfig):
            default = bench.config.model_fields["config"].default
            parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                                help=f"the run config (default {default}); then dotted overrides for its runs, "
                                "such as --trainer.steps 40")
            add_options(parser, bench.config, skip=("config", "overrides"))
        else:
            parser.add_argument("config", nargs="?", default=None, metavar="CONFIG",
                                help="a TOML file of this bench's options, the keys named as below with "
                                "underscores (default: none); the options given here override it")
            add_options(parser, bench.config)
        if bench.name == "gpu":
            parser.add_argument("--list", action="store_true",
                                help="list the stages and their estimated H100 seconds, and exit")
        if bench.json:
            parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
        parser.add_argument("--dry-run", action="store_true",
                            help="print the resolved options as TOML and exit without running")
        parser.set_defaults(func=bench_command(bench))
