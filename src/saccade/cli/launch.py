"""`saccade launch CONFIG`: a run's vLLM servers and its trainer from the config's [launch]
layout, started, watched and stopped together (saccade.tools.launcher; docs/launch.md)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def _with_hosts(config: str, overrides: list[str], hosts: str | None):
    """The run config, with --hosts (comma-separated, one per node in order) as the nodes' hosts;
    the overrides the trainer must get to read the same config."""
    from saccade.config import RunConfig, load_config

    cfg = load_config(RunConfig, config, overrides)
    if hosts:
        names = [h.strip() for h in hosts.split(",") if h.strip()]
        if len(names) != len(cfg.launch.nodes):
            raise ValueError(f"--hosts names {len(names)} host(s), but the layout has {len(cfg.launch.nodes)} node(s)")
        nodes = [{**n.model_dump(), "host": h} for n, h in zip(cfg.launch.nodes, names, strict=True)]
        overrides = [*overrides, "--launch.nodes", json.dumps(nodes)]
        cfg = load_config(RunConfig, config, overrides)
    return cfg, overrides


def cmd_launch(args: argparse.Namespace) -> int:
    from saccade.config import is_loopback
    from saccade.tools.launcher.plan import check_node_rank, dry_run_text, node_plan
    from saccade.run.tasks import check_user_code

    cfg, overrides = _with_hosts(args.config, args.overrides, args.hosts)
    check_user_code(cfg)
    check_node_rank(cfg, args.node_rank)
    config = str(Path(args.config).absolute())
    if args.dry_run:
        print(dry_run_text(cfg, config=config, overrides=overrides, resume=args.resume))
        return 0
    if any(not is_loopback(n.host) for n in cfg.launch.nodes) and not os.environ.get("VLLM_API_KEY"):
        raise ValueError("the layout's servers listen on addresses other machines reach: set VLLM_API_KEY (any "
                         "secret string, the same on every node) so that only the trainer can use them")
    from saccade.tools.demo import resolve_model_name
    from saccade.tools.launcher.key import ensure_launch_key
    from saccade.tools.launcher.supervisor import LAUNCH_DIR, Log, supervise

    log = Log()
    # Before any child starts: each inherits the key from this process's environment.
    log.say(ensure_launch_key(os.environ, Path(cfg.run_dir) / LAUNCH_DIR, nodes=len(cfg.launch.nodes)))

    model = None
    if cfg.model.is_preset:  # built (or trained: a warm start) once, here, not by every server at once
        model = resolve_model_name(cfg.model.path)
        overrides = [*overrides, "--model.path", model]
    processes = node_plan(cfg, args.node_rank, config=config, overrides=overrides, resume=args.resume, model=model)
    rank = f" --node-rank {args.node_rank}" if len(cfg.launch.nodes) > 1 else ""
    again = " ".join(["saccade launch", args.config, *args.overrides, *(["--hosts", args.hosts] if args.hosts else [])])
    return supervise(processes, urls=cfg.launch.server_urls(), run_dir=cfg.run_dir,
                     max_restarts=cfg.launch.max_restarts, ready_timeout_s=cfg.launch.ready_timeout_s,
                     hang_after_s=cfg.launch.hang_after_s,
                     restart_budget_reset_s=cfg.launch.restart_budget_reset_s,
                     resume_hint=f"{again}{rank} --resume", log=log)


def add_launch_parser(sub) -> None:
    """`saccade launch CONFIG`."""
    launch = sub.add_parser(
        "launch",
        help="start a run's vLLM servers and its trainer from the config's [launch] layout, and stop them together",
        description="Reads CONFIG's [launch] layout ([[launch.nodes]]: trainer_gpus, server_gpus; docs/launch.md), "
        "starts this node's vLLM servers (`saccade serve`, with the flags the config implies: image bounds, LoRA "
        "rank, images per prompt, GPU memory share), waits until every server of the layout answers, starts the "
        "trainer (`saccade rl`, or torchrun when the layout has several ranks), streams one log with a prefix per "
        "process (each also in <run>/launch/NAME.log), starts again a server that dies (launch.max_restarts), and "
        "stops every process it started when the trainer ends, fails or is interrupted. Ctrl-C: the trainer saves "
        "a checkpoint after the step under way, then everything stops (exit 130; go on with --resume); Ctrl-C "
        "again: at once. Several machines: the same command on each, with --node-rank (scripts/slurm-launch.sh).",
    )
    launch.add_argument("config", metavar="CONFIG",
                        help="a TOML run config with a [launch] layout; then any dotted overrides (--trainer.lr 1e-5), "
                        "which the trainer gets too")
    launch.add_argument("--dry-run", action="store_true",
                        help="print every command each node would run (servers, then the trainer), and exit")
    launch.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="which node of launch.nodes this machine is (default 0)")
    launch.add_argument("--hosts", default=None, metavar="H0,H1,...",
                        help="the nodes' addresses, in order, replacing launch.nodes' hosts (a scheduler's node list)")
    launch.add_argument("--resume", action="store_true",
                        help="the trainer continues from the run's latest complete checkpoint")
    launch.set_defaults(func=cmd_launch)
