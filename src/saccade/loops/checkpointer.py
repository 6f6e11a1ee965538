"""A run's checkpoints: when to save, resuming, rolling back, and the unwritable disk.

The loop asks `after_step` once per step and the checkpointer decides: every
`checkpoint.every_steps` steps, after a rollback (a resume must not go back to the stalled
weights), and always at the run's last step. `resume` loads the latest complete checkpoint;
`roll_back` a stalled run's newest one from before the stall, at a lower peak lr. Every rank
takes part in each (the weights are gathered or sharded collectively).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import time
from pathlib import Path

from saccade.config import RunConfig, StallRollbackConfig
from saccade.distributed import World, barrier
from saccade.inference.servers import NoServerError
from saccade.loops.rl_step import RLStep
from saccade.trainer.checkpoint.saving import TrainState, load_checkpoint, load_latest_checkpoint, save_checkpoint
from saccade.trainer.checkpoint.folder import (check_same_base, checkpoint_before, latest_checkpoint,
                                               set_aside_checkpoints, start_afresh)
from saccade.trainer.step import set_peak_lr

GRAD_SPIKE = "grad_spike"  # TrainState.extra's key for the spike guard's recent gradient norms
# TrainState.extra's key for the product of the stall rollbacks' lr factors (1.0: none): the
# peak lr is trainer.lr times it, after a resume too.
LR_SCALE = "lr_scale"


def check_fresh_start(run_dir: Path, *, fresh: bool, world: World) -> None:
    """A new run (no --resume): a ValueError, on every rank, when `run_dir` holds another run's
    checkpoints; with `fresh`, the main rank moves them aside first (`start_afresh`)."""
    if world.is_main or not fresh:
        moved = start_afresh(run_dir, fresh=fresh and world.is_main, stamp=time.strftime("%Y%m%d-%H%M%S"))
        if moved:
            logging.getLogger(__name__).warning("--fresh: moved another run's %d checkpoint folder(s) to %s",
                                                len(moved), moved[0].parent)
    barrier(world)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, folder unwritable): the run stops."""


# The errors of a disk with no room left: no space, a file size limit, a quota.
DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


# Free space under which a failed write is put down to a full disk (a checkpoint's smallest file
# is bigger; a filesystem keeps no slack for a user's files).
FULL_BELOW_BYTES = 1 << 20


def disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_FULL


def stopped_by_full_disk(err: OSError, checkpoints: Checkpointer, state: TrainState) -> CheckpointWriteError:
    """A run write other than a checkpoint (metrics.jsonl, samples, skipped rows, the engine's
    weights) failed on a full disk: the run stops the documented way, with a checkpoint of the
    state so far where one can still be written (else `CheckpointWriteError` names the intact
    previous one), and a message saying what failed and how to go on."""
    saved = checkpoints.save(state)  # CheckpointWriteError, with its own message, when it cannot
    return CheckpointWriteError(
        f"a write of the run failed on a full disk ({err}); the run stopped after step {state.step} and saved "
        f"{saved}. Free space, then go on with: saccade rl {checkpoints.run_dir / 'config.toml'} --resume")


def stopped_unsaved_by_full_disk(err: OSError, run_dir: Path, world: World, command: str) -> CheckpointWriteError:
    """A write of one rank of a sharded run failed on a full disk. The other ranks are inside the
    step's collectives, so no checkpoint can be saved now (a collective save would wait for them
    until trainer.dist_timeout_s): this rank stops (torchrun then ends the others) naming the last
    complete checkpoint, which a save's rename keeps whole."""
    return CheckpointWriteError(
        f"a write of rank {world.rank} failed on a full disk ({err}); a sharded run cannot save a checkpoint while "
        f"its other ranks are mid-step, so it stopped: {intact_checkpoint(run_dir)}. Free space, then go on with: "
        f"{command} --resume")


def intact_checkpoint(run_dir: Path) -> str:
    """What a failed write leaves to go on from: the run's latest complete checkpoint (a save is
    published by one rename, so a failed one never touches it)."""
    previous = latest_checkpoint(run_dir)
    return f"the previous one, {previous}, is intact" if previous else "there is no earlier checkpoint"


class Checkpointer:
    """Saves, resumes and rolls back the run of `rl` (its model, optimizer, schedule and the
    engine's sampling RNG) under `run_dir`."""

    def __init__(self, cfg: RunConfig, rl: RLStep, run_dir: Path, world: World):
        self.cfg, self.rl, self.run_dir, self.world = cfg, rl, run_dir, world

    def start(self, resume: bool) -> TrainState:
        """The state to go on from: the run's latest checkpoint with --resume, else a fresh one."""
        return self.resume() if resume else TrainState(step=0, data_position=0, policy_version=0, extra={})

    def resume(self) -> TrainState:
        """The run's latest complete checkpoint that loads (the one before it, warned, when the
        newest does not: `load_latest_checkpoint`) loaded into the model and optimizer, the engine's
        sampling RNG restored. The peak lr is this config's trainer.lr (times the factors of the
        run's stall rollbacks, if any), not the one saved with the optimizer: going on at a lower
        lr is what a resume from a stall is for."""
        newest = latest_checkpoint(self.run_dir)
        if newest is not None:  # before anything loads: weights trained from another model are no resume
            check_same_base(newest, self.rl.setup.model_path)
        loaded = load_latest_checkpoint(self.run_dir, model=self.rl.setup.model, optimizer=self.rl.optimizer,
                                        scheduler=self.rl.scheduler)
        if loaded is None:
            raise ValueError(f"--resume: no complete checkpoint under {self.run_dir}; start without --resume")
        _, state = loaded
        set_peak_lr(self.rl.optimizer, self.rl.scheduler, self.cfg.trainer.lr * state.extra.get(LR_SCALE, 1.0))
        self.rl.setup.engine.set_rng_state(state.extra.get("engine_rng"))
        if self.rl.spike_guard is not None:  # the same recent gradient norms as the run that saved it
            self.rl.spike_guard.restore(state.extra.get(GRAD_SPIKE))
        return state

    def due(self, step: int, *, rolled_back: bool) -> bool:
        """Whether the state after `step` steps is saved, the run's last step aside (`after_step`)."""
        every = self.cfg.checkpoint.every_steps
        return rolled_back or (bool(every) and step % every == 0)

    def after_step(self, state: TrainState, *, rolled_back: bool) -> Path | None:
        """A checkpoint of `state` when one is due, and always after the run's last step."""
        if self.due(state.step, rolled_back=rolled_back) or state.step == self.cfg.trainer.steps:
            return self.save(state)
        return None

    def save(self, state: TrainState, *, guarded: bool = True) -> Path:
        """A checkpoint of the run as it stands (every rank takes part), the engine's sampling RNG
        with it. `guarded`: a failed write stops the run saying what to do (`stop_if_unwritable`)."""
        with stop_if_unwritable(self.run_dir, state.step) if guarded else contextlib.nullcontext():
            state.extra["engine_rng"] = self.rl.setup.engine.rng_state()
            if self.rl.spike_guard is not None:
                state.extra[GRAD_SPIKE] = self.rl.spike_guard.saved()
            return save_checkpoint(self.run_dir, model=self.rl.setup.model, optimizer=self.rl.optimizer,
                                   scheduler=self.rl.scheduler, state=state, keep_last=self.cfg.checkpoint.keep_last,
                                   base_model_path=self.rl.setup.model_path)

    @contextlib.contextmanager
    def guarding(self, state: TrainState, command: str):
        """The run's steps, stopped the documented way when the disk fills up or every server is
        gone: with a checkpoint of the finished steps where one can be written, and the command to
        go on with (`command ... --resume`)."""
        try:
            yield
        except OSError as err:
            if not disk_full(err):
                raise
            if self.world.size > 1:  # ranks apart: a save now would wait for the others; torchrun ends them
                raise stopped_unsaved_by_full_disk(err, self.run_dir, self.world, command) from err
            state.policy_version = state.step
            raise stopped_by_full_disk(err, self, state) from err
        except NoServerError as err:  # every rank at the same step: the finished steps are saved
            state.policy_version = state.step
            raise NoServerError(
                f"{err}. The run stopped after step {state.step} and saved {self.save(state, guarded=False)}; once a "
                f"server answers again, go on with: {command} --resume") from None

    def roll_back(self, state: TrainState, *, since: int) -> dict[str, float]:
        """A stalled run back to the newest checkpoint saved before policy version `since` (the
        weights the stall's first step sampled): its weights, optimizer state and place in the lr
        schedule reloaded, the peak lr multiplied by stall.lr_factor (kept in `state.extra`, so a
        resume keeps it), the checkpoints from the stall on set aside. The checkpoint's own
        TrainState is not used: the step count, the data position and the policy versions go on
        forward, so metrics.jsonl stays append-only. Returns the figures the step logs, or {}
        when no checkpoint from before the stall is left (the run then stops)."""
        found = checkpoint_before(self.run_dir, since)
        if found is None:
            return {}
        assert isinstance(self.cfg.stall, StallRollbackConfig)
        step, path = found
        rl = self.rl
        load_checkpoint(path, model=rl.setup.model, optimizer=rl.optimizer, scheduler=rl.scheduler)
        state.extra[LR_SCALE] = state.extra.get(LR_SCALE, 1.0) * self.cfg.stall.lr_factor
        lr = set_peak_lr(rl.optimizer, rl.scheduler, self.cfg.trainer.lr * state.extra[LR_SCALE])
        if self.world.is_main:  # the stalled weights: never the latest checkpoint a resume would load
            set_aside_checkpoints(self.run_dir, since)
        barrier(self.world)
        return {"rollback_to_step": float(step), "rollback_lr": lr}


# What torch.save's writer says of a write that came up short, as on a full disk: "unexpected pos"
# (its zip writer), "basic_ios::clear: iostream error" (its stream, once the disk filled within a
# tensor: tests/loops/test_full_disk.py met it in CI), "failed writing file".
SHORT_WRITE_SAID = ("unexpected pos", "basic_ios::clear", "iostream error", "failed writing file")


def room_left(folder: Path, err: BaseException | None = None) -> str:
    """", the disk holding it is full (N bytes free)" when it is nearly so. torch.save's writer on
    a full disk says only "unexpected pos" (a short write), not ENOSPC, and by the time this is
    asked the failed save has removed its partial folder, so the disk may have room again: that
    error is then named as what a full disk does. Empty otherwise."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    if free < FULL_BELOW_BYTES:
        return f"; the disk holding it is full ({free:,} bytes free)"
    if err is not None and any(said in str(err) for said in SHORT_WRITE_SAID):
        return (f"; a write came up short, as on a full disk ({free:,} bytes free now that the partial checkpoint "
                "is removed)")
    return ""


@contextlib.contextmanager
def stop_if_unwritable(run_dir: Path, step: int):
    """Turn a failed checkpoint write into an error that says what is safe and what to do. The
    run stops rather than train on without checkpoints: days of steps that no checkpoint
    holds would be lost to the next crash. The save itself is atomic, so the previous
    checkpoint is intact (a half-written one is only ever a `.tmp-*` folder)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - a full disk fails as OSError, torch.save's writer as RuntimeError
        raise CheckpointWriteError(
            f"the checkpoint of step {step} could not be written under {run_dir / 'checkpoints'} "
            f"({type(err).__name__}: {err}{room_left(run_dir, err)}); {intact_checkpoint(run_dir)}. The run stopped "
            "rather than train on without checkpoints. "
            f"Fix the cause (a full disk: free space; an unwritable folder: its permissions), then go on "
            f"with: saccade rl {run_dir / 'config.toml'} --resume"
        ) from err
