"""The demo's recipe for one's own data set, chosen from the data set's shape (`dataset_recipe`).

The shapes demo's recipe (demo.toml) was tuned on 3 options, and the data-set recipe of
docs/demo.md on 4; on 8 options it learned nothing (issue 48). Two things grow with the number
of options K, and the rule follows them:

* **A group needs a right answer.** From the random-answer warm start a sample is right with
  probability 1/K, so a group of G holds none with probability (1 - 1/K)^G, and such a group
  carries no signal (the zero-variance filter drops it). G is the smallest multiple of 4, at
  least 8, with (1 - 1/K)^G <= 0.11: 8 up to K = 4, 12 for 5, 16 for 6-7, 20 for 8-9, 24 for 10.
  The prompts per step keep the completions per step near the shapes demo's 256 (at least 16
  prompts: fewer groups per Adam step are noise, docs/demo.md).
* **The options are learnt one at a time.** GRPO climbs a staircase, one more option told apart
  every 30-50 steps (docs/demo.md), so the steps are 50 x K: 150 for 3 options (the shapes
  demo's), 200 for 4 (the tuned data-set recipe). From 8 options on, 75 x K (600 for 8): at 8
  the later steps of the staircase came slower, and 50 an option left one seed in four short
  (`colors8-small` seed 1: 0.75 at step 400, still rising; `colors8` seed 3: 0.906).

From 4 options on, the tuned data-set recipe's sampling temperature 1.3 (the confused option's
rare right word comes sooner) and its linear decay of the lr to a tenth (the late steps small
enough to stay); lr 5e-4 and the entropy bonus stay as demo.toml has them. The rows of the data
set cap the prompts per step and say how many epochs the steps make; the probe's SFT steps are
25 x K (at least 100). A key the user set on the command line is left as they set it.

The estimate of minutes (`demo_minutes`) counts the probe's fits at every picture size it tries
(a blank one, then the pictures at each size: `saccade.tools.demo_sizes`), and every stage at
the size taken, each step's cost grown with its image tokens (`token_scale`): 64-px pictures
are 4 tokens on the tiny model, 256-px ones 64, about twice the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from saccade.config import RunConfig

# The share of groups allowed to hold no right answer at the warm start: about one in ten
# (4 options, G 8: 0.75^8 = 0.1001, the tuned recipe's).
NO_RIGHT_ANSWER_MAX = 0.11
COMPLETIONS_PER_STEP = 256
MIN_PROMPTS = 16
STEPS_PER_OPTION = 50
# From MANY_OPTIONS options on, STEPS_PER_OPTION_MANY an option (the docstring's second point).
MANY_OPTIONS = 8
STEPS_PER_OPTION_MANY = 75
PROBE_STEPS_PER_OPTION = 25
# Seconds on a quiet 2-core CPU (2 torch threads, embedded engine): a GRPO step of 256 one-word
# completions on the tiny model, and an SFT step of 16 rows (the shapes demo: 2.5 minutes for
# 30 SFT steps and 2 x 150 GRPO steps, docs/demo.md).
GRPO_STEP_S_PER_256 = 0.45
SFT_STEP_S = 0.12
# ...at 4 image tokens a picture (64 px on the tiny model); larger pictures cost in proportion to
# a step's tokens, its fixed part (the prompt's text, the answer, the step's own work) worth
# FIXED_TOKENS image tokens: a GRPO step at 256 px (64 tokens) took 2.0 x the 64-px one, the
# probe's SFT 1.2-1.3 x at 128 px and 1.7-2.4 x at 256 px (docs/demo.md, "Pictures too small
# for the tower").
REFERENCE_IMAGE_TOKENS = 4
FIXED_TOKENS = 60


@dataclass(frozen=True)
class Recipe:
    """What the rule chose for a data set of `options` options and `rows` training rows."""

    options: int
    rows: int
    group_size: int
    prompts_per_step: int
    steps: int
    temperature: float
    lr_decay: str
    probe_steps: int



def token_scale(image_tokens: float) -> float:
    """A step's cost at `image_tokens` image tokens a picture, relative to the 64-px pictures the
    step costs were measured on (4 tokens): a step's fixed part is worth FIXED_TOKENS tokens."""
    return (FIXED_TOKENS + image_tokens) / (FIXED_TOKENS + REFERENCE_IMAGE_TOKENS)


def demo_minutes(*, steps: int, prompts_per_step: int, group_size: int, sft_steps: int, probe_steps: int,
                 image_tokens: float = REFERENCE_IMAGE_TOKENS, probe_tokens: Sequence[float] | None = None) -> float:
    """The demo's estimated minutes on a quiet 2-core CPU: the probe's fits (`probe_steps` SFT
    steps each; `probe_tokens`: each fit's image tokens a picture, by default two at
    `image_tokens`, with the pictures and blank), the warm start (SFT steps), GRPO and its
    control (each step's cost in proportion to its completions), every stage but the probe at
    `image_tokens` a picture (`token_scale`)."""
    fits = [image_tokens, image_tokens] if probe_tokens is None else list(probe_tokens)
    scale = token_scale(image_tokens)
    grpo = 2 * steps * GRPO_STEP_S_PER_256 * prompts_per_step * group_size / COMPLETIONS_PER_STEP * scale
    probe = probe_steps * SFT_STEP_S * sum(token_scale(t) for t in fits)
    return (grpo + sft_steps * SFT_STEP_S * scale + probe) / 60


def estimate_minutes(cfg: RunConfig, *, probe_steps: int, image_tokens: float = REFERENCE_IMAGE_TOKENS,
                     probe_tokens: Sequence[float] | None = None) -> float:
    """`demo_minutes` of the config as it will run."""
    return demo_minutes(steps=cfg.trainer.steps, prompts_per_step=cfg.rollout.prompts_per_step,
                        group_size=cfg.rollout.group_size, sft_steps=cfg.sft.steps, probe_steps=probe_steps,
                        image_tokens=image_tokens, probe_tokens=probe_tokens)


def group_size_for(options: int) -> int:
    """The smallest multiple of 4, at least 8, with P(no right answer in a group) =
    (1 - 1/options)^G at most NO_RIGHT_ANSWER_MAX."""
    if options < 2:
        raise ValueError(f"a multiple-choice data set has at least 2 options; got {options}")
    group = 8
    while (1 - 1 / options) ** group > NO_RIGHT_ANSWER_MAX:
        group += 4
    return group


def steps_for(options: int) -> int:
    """GRPO steps for `options` options: STEPS_PER_OPTION an option, STEPS_PER_OPTION_MANY from
    MANY_OPTIONS on."""
    return (STEPS_PER_OPTION_MANY if options >= MANY_OPTIONS else STEPS_PER_OPTION) * options


def dataset_recipe(options: int, rows: int) -> Recipe:
    """The rule of this module's docstring, a pure function of the data set's shape."""
    if rows < 1:
        raise ValueError(f"the data set has no training rows; got {rows}")
    group = group_size_for(options)
    prompts = min(max(MIN_PROMPTS, round(COMPLETIONS_PER_STEP / group)), rows)
    return Recipe(options=options, rows=rows, group_size=group, prompts_per_step=prompts,
                  steps=steps_for(options), temperature=1.3 if options >= 4 else 1.0,
                  lr_decay="linear" if options >= 4 else "constant",
                  probe_steps=max(100, PROBE_STEPS_PER_OPTION * options))


# The config keys the rule sets, and where each lives.
RULE_KEYS = ("rollout.group_size", "rollout.prompts_per_step", "trainer.steps", "sampling.temperature",
             "trainer.lr_decay")


def overridden_keys(overrides: Sequence[str]) -> set[str]:
    """The dotted keys named by argv-style override tokens ("--trainer.lr_decay.kind", "linear")."""
    return {tok[2:].split("=", 1)[0] for tok in overrides if tok.startswith("--")}


def is_set(key: str, named: set[str]) -> bool:
    """`key` was set by one of the `named` keys: itself, a key inside it, or its whole section."""
    return any(n == key or n.startswith(key + ".") or key.startswith(n + ".") for n in named)


def apply_recipe(cfg: RunConfig, recipe: Recipe, named: set[str]) -> tuple[RunConfig, list[str]]:
    """`cfg` with the recipe's values for every rule key the user did not name; and the keys
    that were left as the user set them."""
    from saccade.config.sections import LinearDecayConfig

    values: dict[str, Any] = {
        "rollout.group_size": recipe.group_size, "rollout.prompts_per_step": recipe.prompts_per_step,
        "trainer.steps": recipe.steps, "sampling.temperature": recipe.temperature,
        "trainer.lr_decay": LinearDecayConfig() if recipe.lr_decay == "linear" else None,
    }
    kept = [k for k in RULE_KEYS if is_set(k, named)]
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if key in kept or value is None:
            continue
        section, field = key.split(".")
        sections.setdefault(section, {})[field] = value
    update = {s: getattr(cfg, s).model_copy(update=fields) for s, fields in sections.items()}
    return cfg.model_copy(update=update), kept


def size_estimates(cfg: RunConfig, *, probe_steps: int, sides: Sequence[int],
                   tokens: dict[int, float]) -> list[tuple[int, float]]:
    """(side, estimated minutes) for each size the probe may take, smallest first: the probe at
    every size up to it (a blank fit at the first, the pictures at each) and every stage at its
    tokens (`estimate_minutes`)."""
    own = tokens[sides[0]]
    return [(side, estimate_minutes(cfg, probe_steps=probe_steps, image_tokens=tokens[side],
                                    probe_tokens=[own, *(tokens[s] for s in sides[: i + 1])]))
            for i, side in enumerate(sides)]


def describe_recipe(cfg: RunConfig, recipe: Recipe, kept: list[str], *, floor: float,
                    sizes: Sequence[tuple[int, float]] = (), tokens: dict[int, float] | None = None) -> str:
    """The recipe as the demo prints it up front (the config's values: the rule's, or the user's
    where they set them), with its estimated minutes and the time bar (`minutes_bar` over
    `floor`): at the pictures' own size, and at each larger one the probe may take (`sizes`,
    from `size_estimates`; `tokens`: each side's image tokens a picture)."""
    group, prompts, steps = cfg.rollout.group_size, cfg.rollout.prompts_per_step, cfg.trainer.steps
    miss = (1 - 1 / recipe.options) ** group
    head = (f"recipe for {recipe.options} options and {recipe.rows} training rows (docs/demo.md, 'The recipe rule'): "
            f"group size {group} (P(no right answer in a group) at the warm start {miss:.2f}), "
            f"{prompts} prompts per step, {steps} GRPO steps ({steps * prompts / recipe.rows:.1f} epochs), "
            f"temperature {cfg.sampling.temperature}, lr decay {cfg.trainer.lr_decay.kind}; "
            f"probe: {recipe.probe_steps} SFT steps on the gold answers, with the pictures and blank"
            + (f"; left as you set them: {', '.join(kept)}" if kept else ""))
    if not sizes:
        minutes = estimate_minutes(cfg, probe_steps=recipe.probe_steps)
        return head + f"\nestimated: {minutes:.1f} minutes on a quiet 2-core CPU (time bar {minutes_bar(minutes, floor):g})"
    tokens = tokens or {}

    def one(side: int, minutes: float) -> str:
        return f"{side} px ({tokens.get(side, float('nan')):g} image tokens a picture): {minutes:.1f} (time bar " \
               f"{minutes_bar(minutes, floor):g})"

    (own, own_minutes), larger = sizes[0], sizes[1:]
    return (head + f"\nestimated minutes on a quiet 2-core CPU, by the picture size the probe takes: the pictures' "
            f"own, {one(own, own_minutes)}"
            + ("; if they do not ground there, the probe tries larger ones, up to the model's bound: "
               + ", ".join(one(side, minutes) for side, minutes in larger) if larger else ""))


def minutes_bar(estimate: float, floor: float) -> float:
    """The demo's time bar: `floor` (10 minutes), or half as much again as the estimate when
    the recipe needs more."""
    return max(floor, math.ceil(1.5 * estimate))
