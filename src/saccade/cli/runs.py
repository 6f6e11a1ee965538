"""The commands that train, evaluate, export or serve a model: `saccade rl`, `sft`, `eval`,
`export` and `serve`."""

from __future__ import annotations

import argparse
import sys

from saccade.cli.common import write_json
from saccade.config import add_config_arguments


def cmd_serve(argv: list[str]) -> int:
    # vLLM parses its own arguments: everything after `serve` goes to it untouched, but for the
    # model, which a name like "tiny-warm" (built by training) turns into a folder here, before the server.
    from saccade.serving.server import main as serve_main

    if argv and not argv[0].startswith("-"):
        from saccade.tools.demo import resolve_model_name

        argv = [resolve_model_name(argv[0]), *argv[1:]]
    return serve_main(argv)


# `saccade rl`'s exit status when the stall watch stopped the run (2 is a user's error).
STALLED_EXIT = 3
# ... and when it stopped on request (Ctrl-C, SIGTERM, a STOP file) after saving a checkpoint: 128 + SIGINT.
STOPPED_EXIT = 130
# ... and when a write failed (a full disk, an unwritable folder): the message says what was kept.
UNWRITABLE_EXIT = 4


def _load_run_config(args: argparse.Namespace, overrides: list[str] | None = None):
    from saccade.config import RunConfig, describe, load_config
    from saccade.run.tasks import check_user_code

    cfg = load_config(RunConfig, args.config, args.overrides if overrides is None else overrides)
    check_user_code(cfg)  # a bad reward function or task name fails now, before anything is built
    if args.dry_run:
        print(describe(cfg))
    return cfg


def cmd_rl(args: argparse.Namespace) -> int:
    cfg = _load_run_config(args)
    if args.dry_run:
        return 0
    from saccade.tools.demo import resolve_warm_start
    from saccade.devices import resolve_device
    from saccade.distributed import close_world, exit_rank, init_world
    from saccade.loops.checkpointer import CheckpointWriteError
    from saccade.loops.rl import train_rl
    from saccade.loops.stall import StallError
    from saccade.stopping import RunStopped, StopRequest

    stop = StopRequest(cfg.run_dir)
    # Under torchrun: join the process group (NCCL on CUDA, gloo on the CPU); else one process.
    world = init_world(resolve_device(cfg.trainer.device), timeout_s=cfg.trainer.dist_timeout_s)
    try:
        with stop.catch_signals():  # Ctrl-C / SIGTERM: stop after the step under way, with a checkpoint
            cfg = resolve_warm_start(cfg, world)
            result = train_rl(cfg, run_dir=cfg.run_dir, resume=args.resume, world=world, stop=stop,
                              fresh=args.fresh)
    except (StallError, RunStopped, CheckpointWriteError) as err:  # no traceback: the message is what to run next
        if world.is_main:
            print(f"saccade: stopped: {err}", file=sys.stderr)
        codes = {StallError: STALLED_EXIT, RunStopped: STOPPED_EXIT, CheckpointWriteError: UNWRITABLE_EXIT}
        return next(code for kind, code in codes.items() if isinstance(err, kind))
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
    from saccade.tools.demo import resolve_warm_start
    from saccade.loops.sft import train_sft

    train_sft(resolve_warm_start(cfg), run_dir=cfg.run_dir)
    print(f"done; metrics in {cfg.run_dir / 'metrics.jsonl'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from saccade.orchestrator.evaluation import eval_target

    # CHECKPOINT_OR_CONFIG: a checkpoint or run folder brings its run's config.toml.
    target = eval_target(args.config, args.checkpoint)
    args.config = target.config
    cfg = _load_run_config(args, [*target.overrides, *args.overrides])
    if args.dry_run:
        return 0
    from saccade.tools.demo import resolve_warm_start
    from saccade.orchestrator.evaluation import format_eval, run_eval, write_samples

    result = run_eval(resolve_warm_start(cfg), checkpoint=target.checkpoint)
    print(format_eval(result))
    rows = result.pop("rows")
    if args.samples:
        print(f"per-prompt rows (completions, episodes' replies): {write_samples(rows, args.samples)}")
    write_json(args.json, result)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from saccade.tools.export import HubUploadError, export_adapter, export_merged, push_to_hub, usage_lines

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


def add_serve_parser(sub) -> None:
    """`saccade serve MODEL ...`, for --help: `main` hands serve's arguments to vLLM unparsed."""
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


def add_rl_parser(sub) -> None:
    """`saccade rl CONFIG`."""
    rl = sub.add_parser(
        "rl",
        help="GRPO-family RL from a TOML config (dotted overrides: --trainer.lr 1e-5)",
        description="Train with RL from verifiable rewards. CONFIG is a TOML file (see configs/); any field can be "
        "overridden as --section.key VALUE. --dry-run prints the resolved config and exits. On several GPUs or "
        "machines, start it with torchrun (`torchrun --nproc-per-node N -m saccade rl CONFIG`): the trainer is then "
        "sharded with FSDP2 over the N processes and each samples its share of the prompts (docs/distributed.md). "
        "A run that stalls (no group with reward variance, or most replies cut at sampling.max_tokens, for "
        "stall.steps steps; stall.truncated_frac) warns, stops (exit status 3, naming the --resume command) or "
        "rolls back to its last checkpoint from before the stall at stall.lr_factor times the lr (at most "
        "stall.max_rollbacks times), as stall.action says (docs/stalls.md). Ctrl-C or SIGTERM (or a "
        "file named STOP in the run folder) stops it after the step under way, with a checkpoint: exit status 130, "
        "naming the --resume command. A write that fails (a full disk, an unwritable folder) stops it with a "
        "checkpoint where one can still be written, else naming the intact one: exit status 4 (docs/robustness.md).",
    )
    add_config_arguments(rl)
    rl.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of the run")
    rl.add_argument("--fresh", action="store_true",
                    help="start a new run in a folder that holds another run's checkpoints, moving them to "
                    "<run>/checkpoints-previous/<time>/ first (without it, such a start is refused)")
    rl.set_defaults(func=cmd_rl)


def add_sft_parser(sub) -> None:
    """`saccade sft CONFIG`."""
    sft = sub.add_parser(
        "sft",
        help="supervised fine-tuning on the same packed, cached-image path",
        description="SFT from a TOML config, on the same data path as RL (images included).",
    )
    add_config_arguments(sft)
    sft.set_defaults(func=cmd_sft)


def add_eval_parser(sub) -> None:
    """`saccade eval CHECKPOINT_OR_CONFIG`."""
    ev = sub.add_parser(
        "eval",
        help="held-out accuracy of a checkpoint, answers or episodes (greedy, pass@k, mean@k, by category, eval sets)",
        description="Runs the RL loop's own evaluation (the figures `saccade rl` logs every eval.every_steps) on a "
        "checkpoint's weights: a checkpoint folder (<run_dir>/checkpoints/step_000012) with the config its run ran "
        "with (<run_dir>/config.toml), a run folder's latest checkpoint, or, given a config file, the latest "
        "checkpoint under its run folder (or --checkpoint, or the base model when there is none). On the held-out "
        "prompts (shapes, views, scenes: the evaluation seed; a data set, task.kind = mathvista, openmmreasoner, "
        "geometry3k or dataset: the first eval.prompts rows of its eval split; a verifiers env: its first tasks), "
        "single answers or whole episodes (views, scenes, verifiers: turn by turn, as in training): greedy "
        "accuracy, with eval.visual_gain the same with every image blank, an episode's turns and what its "
        "environment reported, pass@k and mean@k from eval.samples_k samples per prompt at sampling.temperature, and "
        "accuracy per category (shapes: kind; views: place; scenes: kind, side; MathVista: task, skills, grade; "
        "OpenMMReasoner: subset; dataset: the task.columns.category column); the same figures for each of "
        "eval.sets (other data set tasks, each scored by its own task.scoring: docs/recipes.md). Prints a table.",
    )
    ev.add_argument(
        "config", nargs="?", default=None, metavar="CHECKPOINT_OR_CONFIG",
        help="a checkpoint folder, a run folder (its latest checkpoint), or a TOML config file (default: the "
        "built-in defaults); then any number of dotted overrides such as --eval.prompts 32")
    ev.add_argument("--dry-run", action="store_true", help="print the resolved config as TOML and exit without "
                    "running")
    ev.add_argument("--checkpoint", metavar="DIR", help="with a config file: a step_* folder to evaluate instead of "
                    "the latest")
    ev.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ev.add_argument("--samples", metavar="PATH", help="write one JSON line per prompt: id, question, answer, "
                    "completion, extracted answer (an episode: every reply, its turns, its environment's last "
                    "report), correct, metadata (and the pass@k samples); the training task's rows: eval.sets' are in --json, "
                    "under sets")
    ev.set_defaults(func=cmd_eval)


def add_export_parser(sub) -> None:
    """`saccade export CHECKPOINT`."""
    export = sub.add_parser(
        "export",
        help="a checkpoint as a folder transformers and vLLM load as they are: merged model or PEFT adapter",
        description="saccade export CHECKPOINT (--merged OUT | --adapter OUT) [--push-to-hub REPO]. --merged writes "
        "a complete model folder: the base model's config, tokenizer, processor, chat template, generation config "
        "and vision tower (the trainer never trains or saves the tower), with the trained language model, LoRA "
        "merged in; transformers' <family class>.from_pretrained(OUT) (the class is printed) and `vllm serve OUT` load it. "
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
                        help="the model folder or hub id the run trained from, when the one the checkpoint "
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
