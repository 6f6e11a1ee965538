"""The demo's supervised probe: do a data set's pictures carry its answers for this model's tower?

The demo's GRPO can fail for two reasons that look alike from outside: the frozen vision tower
does not keep what the answer needs (a random tiny tower keeps colour only for large shapes,
docs/demo.md), or it does and RL did not find it within its steps. The probe tells them apart
cheaply: the same model (frozen tower, trainable language model) fitted by SFT on the *gold*
answers (`saccade.loops.sft`, the warm start's loop and settings with the true answer), once on
the pictures and once with every picture blank, each scored greedily on the held-out rows
(`saccade.orchestrator.evaluation.evaluate`). Supervision is the easiest way to learn the
mapping, so a probe at chance with the pictures, or no better than without them, says the
pictures carry nothing this tower can use: RL will not learn it either.

`probe_verdict` turns the probe's and the demo's figures into one of three verdicts, a pure
function of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from saccade.config import RunConfig

# The probe's SFT steps (batch sft.batch_size, lr sft.lr): 200 x 16 rows is enough for the
# tiny model to read 8 colours of large shapes off the tower (docs/demo.md).
PROBE_STEPS = 200
# The pictures carry the answer when the probe with them beats both chance and the probe
# without them by this much.
GROUNDED_MARGIN = 0.1
# GRPO learned what the probe learned when it came within this of the probe (or reached 0.9).
LEARNED_WITHIN = 0.05
LEARNED_ACCURACY = 0.9

LEARNED = "learned"
NOT_GROUNDED = "not visually grounded for this tower"
NOT_LEARNED = "grounded, but RL did not learn it in budget"


def snapshot_trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the trainable tensors: enough to put the model back to this point."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def restore_trainable(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in saved:
                p.copy_(saved[name])


def probe_config(cfg: RunConfig, *, images: bool, steps: int, run_dir: Path) -> RunConfig:
    """The SFT config of one half of the probe: `steps` steps on the gold answers, pictures or
    blank ones, its run folder `run_dir`."""
    return cfg.model_copy(update={
        "sft": cfg.sft.model_copy(update={"steps": steps}),
        "task": cfg.task.model_copy(update={"blank_images": not images}),
        "log": cfg.log.model_copy(update={"dir": str(run_dir)}),
    })


def run_probe(cfg: RunConfig, setup, held_out: list, *, steps: int = PROBE_STEPS, progress: bool = True) -> dict[str, float]:
    """Fit the setup's model on the gold answers with pictures, then (from the same start) with
    every picture blank; score each on `held_out` (the pictures, resp. blank ones). Leaves the
    model's trainable weights as it found them. Writes <run_dir>/probe-{images,blank}/."""
    from saccade.loops.sft import train_sft
    from saccade.orchestrator.evaluation import evaluate
    from saccade.run.tasks import task_from_config

    start = snapshot_trainable(setup.model)
    task = task_from_config(cfg, blank=False)
    figures: dict[str, float] = {}
    for images, name in ((True, "probe-images"), (False, "probe-blank")):
        restore_trainable(setup.model, start)
        one = probe_config(cfg, images=images, steps=steps, run_dir=cfg.run_dir / name)
        train_sft(one, run_dir=one.run_dir, setup=setup, random_answers=False, progress=progress, phase=name)
        scored = evaluate(setup, task, held_out, max_tokens=cfg.sampling.max_tokens, visual_gain=True)
        if images:
            figures["probe_accuracy"] = scored["accuracy"]
            figures["probe_visual_gain"] = scored["visual_gain"]
        else:
            figures["probe_blank_accuracy"] = scored["accuracy_blank"]
    restore_trainable(setup.model, start)
    setup.engine.update_weights()
    figures["probe_steps"] = steps
    return figures


def is_grounded(probe_accuracy: float, probe_blank_accuracy: float, chance: float,
                margin: float = GROUNDED_MARGIN) -> bool:
    """The probe read the answer off the pictures: above chance and above its blank twin."""
    return probe_accuracy >= chance + margin and probe_accuracy >= probe_blank_accuracy + margin


def accuracy_bar(probe_accuracy: float | None) -> float:
    """What GRPO's held-out accuracy must reach to count as learned: 0.9, or within 0.05 of what
    the probe reached when the tower keeps less than 0.95 of the answers."""
    if probe_accuracy is None:
        return LEARNED_ACCURACY
    return min(LEARNED_ACCURACY, probe_accuracy - LEARNED_WITHIN)


def probe_verdict(result: dict[str, Any]) -> tuple[str, str]:
    """(verdict, what it means / what to change) from the demo's figures: "learned" (GRPO
    reached the accuracy bar and read it from the pictures), "not visually grounded for this
    tower" (the probe could not read it from them), or "grounded, but RL did not learn it in
    budget" (the probe could, GRPO did not), with the lever to pull. Without GRPO's figures (the
    demo skips GRPO when the probe finds nothing in the pictures) only the probe's count."""
    chance, after = result["chance"], result.get("accuracy_after", result["chance"])
    probe, blank = result["probe_accuracy"], result["probe_blank_accuracy"]
    grounded = is_grounded(probe, blank, chance)
    read_from_pictures = result.get("visual_gain_after", 0.0) >= GROUNDED_MARGIN
    if after >= accuracy_bar(probe) and read_from_pictures and (grounded or after >= LEARNED_ACCURACY):
        return LEARNED, (f"GRPO reached {after:.3f} (the probe {probe:.3f}, chance {chance:.2f}) and read it from "
                         f"the pictures (visual gain {result['visual_gain_after']:+.3f})")
    if not grounded:
        return NOT_GROUNDED, (f"SFT on the gold answers reached {probe:.3f} with the pictures and {blank:.3f} "
                              f"without them (chance {chance:.2f}): what this model's frozen tower keeps of the "
                              "pictures does not tell the answers apart (they are not in the pictures, or the tower "
                              "loses them), so no recipe of RL will learn them. Check that the answers are in the "
                              "pictures; then try larger pictures or objects, or a real tower (a pretrained checkpoint)")
    steps = result.get("grpo_steps", 0)
    if after <= chance + GROUNDED_MARGIN:
        lever = (f"GRPO never left chance: larger groups (--rollout.group_size) so that a group holds a right "
                 f"answer, and a higher --sampling.temperature")
    else:
        lever = (f"GRPO climbed to {after:.3f} of the probe's {probe:.3f}: more steps (--trainer.steps "
                 f"{2 * steps if steps else 'twice as many'}; one option is learned per 30-50 steps)")
    return NOT_LEARNED, (f"SFT on the gold answers reached {probe:.3f} with the pictures ({blank:.3f} without), "
                         f"so the tower keeps the answer; {lever}")
