"""Held-out evaluation inside a run, every `eval.every_steps` steps: greedy success on the task's
held-out prompts (`saccade.orchestrator.evaluation.evaluate`, the core `saccade eval` runs too), with
`eval.visual_gain` the same with every image blank, and on each of `eval.sets` (another task's
held-out prompts, scored by its own protocol: `<name>_accuracy`). Rank 0 evaluates while the other ranks wait;
with the embedded engine every rank holds the whole weights meanwhile."""

from __future__ import annotations

from saccade.config import RunConfig
from saccade.data.rows import recheck
from saccade.distributed import World, barrier
from saccade.orchestrator.evaluation import evaluate
from saccade.loops.rl_step import RLStep


class Evaluator:
    def __init__(self, cfg: RunConfig, rl: RLStep, world: World):
        self.cfg, self.rl, self.world = cfg, rl, world
        self.every = cfg.eval.every_steps
        # Only built when the run evaluates: a data set's eval split is then opened (downloaded) too.
        self.samples = rl.task.eval_samples(cfg.eval.prompts) if self.every else []
        if rl.fits is not None and self.samples:
            self.samples = recheck(self.samples, rl.fits)
        # eval.sets: other tasks' held-out prompts, each scored by its own protocol.
        self.sets = {}
        if self.every:
            from saccade.run.tasks import eval_set_tasks

            for name, task in eval_set_tasks(cfg).items():
                samples = task.eval_samples(cfg.eval.prompts)
                self.sets[name] = (task, recheck(samples, rl.fits) if rl.fits is not None else samples)

    def close(self) -> None:
        """End the eval sets' tasks (their reward workers): the run's end."""
        from saccade.run.tasks import close_task

        for task, _ in self.sets.values():
            close_task(task)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def after_step(self, step: int, logger) -> dict[str, float]:
        """When due, evaluate the weights after `step` steps, log the eval row (rank 0) and return
        what the step's own row carries of it; {} otherwise."""
        if not self.due(step):
            return {}
        with self.rl.sampling_weights():
            ev = evaluate(self.rl.setup, self.rl.task, self.samples, max_tokens=self.cfg.sampling.max_tokens,
                          env=self.cfg.env, visual_gain=self.cfg.eval.visual_gain) if self.world.is_main else {}
            for name, (task, samples) in self.sets.items() if self.world.is_main else ():
                figures = evaluate(self.rl.setup, task, samples, max_tokens=self.cfg.sampling.max_tokens,
                                   env=self.cfg.env)
                ev.update({f"{name}_{k}": v for k, v in figures.items() if k in ("accuracy", "n", "skipped")})
            barrier(self.world)
        if not self.world.is_main:
            return {}
        logger.log(step, {k: v for k, v in ev.items() if k != "n"}, phase="eval")
        out = {"eval_accuracy": ev["accuracy"], **{f"eval_{name}_accuracy": ev[f"{name}_accuracy"] for name in self.sets}}
        if "visual_gain" in ev:  # eval.visual_gain: the same prompts, images blank
            out.update(eval_accuracy_blank=ev["accuracy_blank"], visual_gain=ev["visual_gain"])
        return out
