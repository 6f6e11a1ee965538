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


def fit_and_score(cfg: RunConfig, setup, held_out: list, *, images: bool, steps: int, name: str,
                  progress: bool = True) -> dict[str, float]:
    """One half of the probe from the model as it is: `steps` SFT steps on the gold answers, with
    the pictures or every one blank, then the held-out rows scored greedily (`evaluate`'s
    accuracy, accuracy_blank, visual_gain). Writes <run_dir>/`name`/."""
    from saccade.loops.sft import train_sft
    from saccade.orchestrator.evaluation import evaluate
    from saccade.run.tasks import task_from_config

    one = probe_config(cfg, images=images, steps=steps, run_dir=cfg.run_dir / name)
    train_sft(one, run_dir=one.run_dir, setup=setup, random_answers=False, progress=progress, phase=name)
    return evaluate(setup, task_from_config(cfg, blank=False), held_out, max_tokens=cfg.sampling.max_tokens,
                    visual_gain=True)


def run_probe(cfg: RunConfig, setup, held_out: list, *, steps: int = PROBE_STEPS, progress: bool = True) -> dict[str, float]:
    """Fit the setup's model on the gold answers with pictures, then (from the same start) with
    every picture blank; score each on `held_out` (the pictures, resp. blank ones). Leaves the
    model's trainable weights as it found them. Writes <run_dir>/probe-{images,blank}/. At the
    setup's picture size only (`saccade.tools.demo_sizes` tries others: `probe_stage`)."""
    start = snapshot_trainable(setup.model)
    scored = fit_and_score(cfg, setup, held_out, images=True, steps=steps, name="probe-images", progress=progress)
    figures = {"probe_accuracy": scored["accuracy"], "probe_visual_gain": scored["visual_gain"]}
    restore_trainable(setup.model, start)
    blank = fit_and_score(cfg, setup, held_out, images=False, steps=steps, name="probe-blank", progress=progress)
    figures["probe_blank_accuracy"] = blank["accuracy_blank"]
    restore_trainable(setup.model, start)
    setup.engine.update_weights()
    figures["probe_steps"] = steps
    return figures


def probe_sizes(cfg: RunConfig, held_out: list, *, chance: float, steps: int,
                progress: bool = True) -> tuple[RunConfig, dict[str, Any]]:
    """The probe at the data set's own picture size, then at larger ones until one reads the
    answers (`saccade.tools.demo_sizes`): one fit with every picture blank (blank pictures carry nothing
    at any size), then one with the pictures at each size in turn, each from the untrained model
    on its own embedded setup sized so (the probe samples nothing: it needs no server). Returns
    `cfg` with the chosen size's image bounds (the data set's own when none grounded) for every
    later stage, and the figures: the probe's, the sizes tried, the chosen one and its tokens."""
    from saccade.config import EmbeddedEngineConfig
    from saccade.run.setup import build_setup
    from saccade.tools.demo_sizes import plan_sizes, search_sizes, size_reason

    run_cfg = cfg
    cfg = cfg.model_copy(update={"engine": EmbeddedEngineConfig(model_mismatch_limit=cfg.engine.model_mismatch_limit)})
    scored: dict[int, dict[str, float]] = {}

    def sized(side: int) -> RunConfig:
        return cfg.model_copy(update={"images": plan.limits_at(side)})

    own_setup = build_setup(cfg, cfg.run_dir)
    plan = plan_sizes(cfg, held_out, own_setup.processor)
    start = snapshot_trainable(own_setup.model)
    blank = fit_and_score(cfg, own_setup, held_out, images=False, steps=steps, name="probe-blank",
                          progress=progress)["accuracy_blank"]
    restore_trainable(own_setup.model, start)

    def probe_at(side: int) -> float:
        setup = own_setup if side == plan.own else build_setup(sized(side), cfg.run_dir)
        name = "probe-images" if side == plan.own else f"probe-images-{side}px"
        scored[side] = fit_and_score(sized(side), setup, held_out, images=True, steps=steps, name=name,
                                     progress=progress)
        print(f"probe at {side} px ({plan.tokens[side]:g} image tokens a picture): {scored[side]['accuracy']:.3f} "
              f"with the pictures, {blank:.3f} with every picture blank (chance {chance:.2f})", flush=True)
        return scored[side]["accuracy"]

    def grounded(accuracy: float) -> bool:
        return is_grounded(accuracy, blank, chance)

    tried, chosen = search_sizes(plan.sides, probe_at, plan.tokens.get, grounded=grounded,
                                 enough=lambda a: grounded(a) and a >= LEARNED_ACCURACY)
    side = chosen if chosen is not None else max(tried, key=lambda t: t.accuracy).side
    limits = plan.limits_at(chosen if chosen is not None else plan.own)
    figures = {"probe_accuracy": scored[side]["accuracy"], "probe_visual_gain": scored[side]["visual_gain"],
               "probe_blank_accuracy": blank, "probe_steps": steps,
               "probe_sizes": [{"side": t.side, "tokens": t.tokens, "accuracy": t.accuracy} for t in tried],
               "own_side": plan.own, "image_side": chosen if chosen is not None else plan.own,
               "image_tokens": plan.tokens[chosen if chosen is not None else plan.own],
               "images_min_pixels": limits.min_pixels, "images_max_pixels": limits.max_pixels,
               "size_reason": size_reason(tried, chosen, blank=blank, chance=chance, enough=LEARNED_ACCURACY)}
    return run_cfg.model_copy(update={"images": limits}), figures


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


def sizes_tried(result: dict[str, Any]) -> str:
    """", at every picture size tried (64 px: 0.125, ...)" when the probe tried more than one."""
    sizes = result.get("probe_sizes") or []
    if len(sizes) < 2:
        return ""
    return " at every picture size tried (" + ", ".join(f"{t['side']} px: {t['accuracy']:.3f}" for t in sizes) + ")"


def larger_what(result: dict[str, Any]) -> str:
    """What to enlarge: the objects alone once the probe tried the pictures up to the model's bound."""
    return "larger objects" if result.get("probe_sizes") else "larger pictures or objects"


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
                              f"without them (chance {chance:.2f}){sizes_tried(result)}: what this model's frozen "
                              "tower keeps of the pictures does not tell the answers apart (they are not in the "
                              "pictures, or the tower loses them), so no recipe of RL will learn them. Check that the "
                              f"answers are in the pictures; then try {larger_what(result)}, or a real tower (a "
                              "pretrained checkpoint)")
    steps = result.get("grpo_steps", 0)
    if after <= chance + GROUNDED_MARGIN:
        lever = (f"GRPO never left chance: larger groups (--rollout.group_size) so that a group holds a right "
                 f"answer, and a higher --sampling.temperature")
    else:
        lever = (f"GRPO climbed to {after:.3f} of the probe's {probe:.3f}: more steps (--trainer.steps "
                 f"{2 * steps if steps else 'twice as many'}; one option is learned per 30-50 steps)")
    return NOT_LEARNED, (f"SFT on the gold answers reached {probe:.3f} with the pictures ({blank:.3f} without), "
                         f"so the tower keeps the answer; {lever}")
