"""saccade's command line: thin entry points. Arguments are parsed before torch is imported,
so `--help` and argument errors answer at once.

A module per command group, each holding its commands (`cmd_*`) and the functions that add
their parsers: `demos` (demo), `benches` (bench ...), `runs` (serve, rl, sft, eval, export) and
`tools` (memory, doctor, plot, report, build-model), `launch` (launch).
"""

from __future__ import annotations

import argparse
import os
import sys

from saccade.cli.benches import add_bench_parser
from saccade.cli.demos import add_demo_parser
from saccade.cli.launch import add_launch_parser
from saccade.cli.runs import (
    add_eval_parser, add_export_parser, add_rl_parser, add_serve_parser, add_sft_parser, cmd_serve,
)
from saccade.cli.tools import (
    add_build_model_parser, add_doctor_parser, add_memory_parser, add_plot_parser, add_report_parser,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saccade",
        description="Reinforcement learning for vision-language models (Qwen-VL families: docs/families.md), with a frozen, cached vision tower.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_demo_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_rl_parser(sub)
    add_launch_parser(sub)
    add_sft_parser(sub)
    add_eval_parser(sub)
    add_export_parser(sub)
    add_memory_parser(sub)
    add_doctor_parser(sub)
    add_plot_parser(sub)
    add_report_parser(sub)
    add_build_model_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from saccade.config import split_overrides
    from saccade.logs import configure

    configure()  # what the library says as it runs (a step skipped, a server out) goes to stderr
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
