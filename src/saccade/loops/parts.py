"""A run's parts, built in one place (`RunParts.build`) before `train_rl`'s loop starts, and closed
together when it ends (`RunParts.open`): the setup (model, engine, cache), the task, the step,
the evaluator, the checkpoints and the state to go on from, the guards, the metrics logger, the
prompt stream and the rollout source, the weight sync and its push check, the sample log, the
progress bar.

The order matters and is kept here: a new run refuses a folder holding another run's checkpoints
before config.toml is written over; the start weights reach the engine before any rollout is
sampled; a rollback's start checkpoint is saved before the first step.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from saccade.config import RunConfig, config_changes, describe
from saccade.distributed import SINGLE, World
from saccade.loops.checkpointer import Checkpointer, check_fresh_start
from saccade.loops.evaluator import Evaluator
from saccade.loops.guards import StepGuards
from saccade.loops.push_check import PushCheck
from saccade.loops.rl_step import RLStep
from saccade.loops.step_log import EngineCounters, NoLogger, SampleLog
from saccade.loops.weight_sync import WeightSync, push_start_weights
from saccade.metrics import MetricsLogger
from saccade.orchestrator.source import RolloutSource
from saccade.progress import ProgressBar
from saccade.run.setup import Setup, build_setup
from saccade.run.tasks import Task, closing_task, task_from_config
from saccade.stopping import StopRequest
from saccade.trainer.checkpoint.saving import TrainState


def say_config_changes(saved: Path, now: str, *, resume: bool) -> None:
    """A resume with a config other than the run's (config.toml) goes on (more steps, a lower lr
    are what resumes are for), but says each change, since config.toml is about to be rewritten."""
    if not resume or not saved.is_file():
        return
    changes = config_changes(saved.read_text(), now)
    if changes:
        logging.getLogger(__name__).warning("--resume with a config other than the run's (%s):\n  %s", saved,
                                            "\n  ".join(changes))


def rl_command(run_dir: Path, world: World) -> str:
    """The command that runs this run's config again: under torchrun, with as many ranks."""
    config = run_dir / "config.toml"
    if world.size > 1:
        return f"torchrun --nproc-per-node {world.size} -m saccade rl {config}"
    return f"saccade rl {config}"


@dataclass
class RunParts:
    """What `train_rl`'s loop calls, built by `build`."""

    cfg: RunConfig
    run_dir: Path
    world: World
    setup: Setup
    built_task: Task | None  # made here from the config (closed with the run), else None
    rl: RLStep
    evaluator: Evaluator
    checkpoints: Checkpointer
    state: TrainState
    guards: StepGuards
    logger: Any  # MetricsLogger on rank 0, else NoLogger
    end: int
    stream: Any  # the task's prompt stream (`saccade.data.rows.PromptStream`)
    source: RolloutSource
    weights: WeightSync
    samples: SampleLog
    counters: EngineCounters
    stop: StopRequest
    command: str  # what runs this run's config again (its errors say: `command --resume`)
    progress: bool

    @classmethod
    def build(cls, cfg: RunConfig, run_dir: Path, *, resume: bool = False, setup: Setup | None = None,
              task: Task | None = None, stop_after: int | None = None, progress: bool = True,
              world: World = SINGLE, stop: StopRequest | None = None, fresh: bool = False) -> RunParts:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:  # before config.toml is written over: the folder may be another run's
            check_fresh_start(run_dir, fresh=fresh, world=world)
        if world.is_main:
            say_config_changes(run_dir / "config.toml", describe(cfg), resume=resume)
            (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
        setup = setup or build_setup(cfg, run_dir, world)
        built = None if task is not None else task_from_config(cfg)  # closed when the run ends (its reward workers)
        rl = RLStep.build(cfg, setup, task or built, world)
        checkpoints = Checkpointer(cfg, rl, run_dir, world)
        state = checkpoints.start(resume)
        check = PushCheck.of(cfg, setup, world)  # on vLLM servers: every push checked on every server
        push_start_weights(setup.engine, state, world, check)
        command = rl_command(run_dir, world)
        guards = StepGuards(cfg, checkpoints, state, world, command=command)
        guards.start(state, resume=resume)
        logger = MetricsLogger(run_dir, wandb=cfg.log.wandb, wandb_project=cfg.log.wandb_project,
                               tensorboard=cfg.log.tensorboard, config=cfg.model_dump(), resume=resume,
                               ) if world.is_main else NoLogger()
        if resume:
            logger.truncate_after(state.step)
        end = cfg.trainer.steps if stop_after is None else min(cfg.trainer.steps, state.step + stop_after)
        stream = rl.prompt_stream(run_dir, position=state.data_position, done_steps=state.step, resume=resume)
        source = RolloutSource(  # each step's rollouts; on the rollout thread when sampling ahead
            lambda step: rl.sample(step, stream.take(cfg.rollout.prompts_per_step, step=step + 1)),
            first_step=state.step, end=end, max_async_level=cfg.rollout.max_async_level,
            # After a periodic checkpoint, from its weights: what a resume from it can sample (source.py).
            on_policy=lambda step: checkpoints.due(step, rolled_back=False))
        return cls(
            cfg, run_dir, world, setup, built, rl, Evaluator(cfg, rl, world), checkpoints, state, guards, logger, end,
            stream, source, WeightSync(cfg, setup.engine, source, world, end=end, check=check),
            SampleLog(rl, logger, run_dir),
            EngineCounters(setup.engine), stop or StopRequest(run_dir), command, progress)

    @contextmanager
    def open(self):
        """The parts that hold threads, files or processes, closed together whatever ends the run;
        yields the progress bar. A disk that fills up or servers all gone stop the run the
        documented way (`Checkpointer.guarding`)."""
        with ExitStack() as stack:
            stack.enter_context(closing_task(self.built_task))
            stack.enter_context(closing(self.evaluator))
            stack.enter_context(self.logger)
            stack.enter_context(self.stream)
            bar = stack.enter_context(ProgressBar(self.progress and self.world.is_main, self.end - self.state.step,
                                                  "rl"))
            stack.enter_context(self.source)
            stack.enter_context(self.checkpoints.guarding(self.state, self.command))
            yield bar
