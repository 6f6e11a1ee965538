"""The `[loss]` section: a union of policy-gradient terms picked by `kind`, each variant with its
own fields, on top of what every kind has (the normalisation, the two off-policy corrections
TIS and masked IS, the KL term, the entropy bonus). `saccade.trainer.loss.policy_loss` takes the
variant itself; docs/objectives.md says what each kind and correction does, and which peer's
setting it matches.

This module imports only `saccade.config.sections` (the `Section` base).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from saccade.config.sections import Section

LOSS_KIND = (
    "the policy-gradient term: 'ppo_clip' (the clipped PPO surrogate), 'reinforce' (plain REINFORCE), 'cispo' "
    "(MiniMax-M1: every token's gradient weighted by its clipped, detached ratio) or 'gspo' (Qwen: one ratio per "
    "sequence, clipped per sequence)"
)
NORMALIZATION = (
    "'sequence': mean per sequence, then over sequences (GRPO); 'token': over all tokens (DAPO); 'constant': "
    "sum / (sequences * max_completion_tokens) (Dr. GRPO)"
)
Normalization = Literal["sequence", "token", "constant"]
OFF_POLICY = "rollout.max_async_level > 0 or engine.sync_every_steps > 1"
DEFAULT_TIS_CAP = 2.0


class BaseLossConfig(Section):
    """The policy loss, whatever its kind (`[loss]`, the fields every kind has): normalisation,
    truncated and masked importance sampling, the KL term and the entropy bonus. `kind` picks
    the policy-gradient term; `saccade.trainer.loss.policy_loss` takes the variant itself.

    A new kind is a subclass with its own fields (kind first) and a line in `LossConfig`, and its
    branch in `policy_loss`."""

    kind: str = Field("ppo_clip", description=LOSS_KIND)
    normalization: Normalization = Field("token", description=NORMALIZATION)
    max_completion_tokens: int = Field(
        16, ge=1, description="the constant of 'constant' normalization; set it to sampling.max_tokens"
    )
    denominator: Literal["kept", "sampled"] = Field(
        "kept",
        description="what the normalisation counts when rollout.filter_zero_variance drops the groups whose rewards "
        "are all equal: 'kept', only the groups trained on (each step's gradient is as large however few groups "
        "carry a signal: late in a run, when nearly every group is all-right, full-size optimizer steps on one or "
        "two groups); 'sampled', every group sampled, the dropped ones as the zero-advantage terms they are (the "
        "loss of the unfiltered batch: the step shrinks with the share of groups that carry a signal)",
    )
    tis: Literal["auto", "on", "off"] = Field(
        "auto",
        description="truncated importance sampling (the ratio against the trainer's own logprobs before the update, "
        "pi_old / mu a capped weight); off, the ratio is against the engine's logprobs (the clip bounds the move from "
        "the policy that sampled). 'auto' is on when rollouts can come from older weights than the trainer's "
        f"({OFF_POLICY}) and trainer.num_iterations > 1, or tis_cap is set (at num_iterations 1 TIS's ratio is 1 and "
        "nothing bounds the update: docs/async.md); 'on' always; 'off' never",
    )
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling cap on pi_old / mu; unset: 2.0 when TIS is on"
    )
    is_mask: Literal["auto", "on", "off"] = Field(
        "off",
        description="masked importance sampling (IcePop, arXiv 2510.18855): a loss token whose ratio pi_old / mu "
        "(the trainer's logprob before the update over the engine's) leaves [is_mask_low, is_mask_high] gets no "
        "policy gradient (weight 0, not truncated; its KL and entropy terms stay, and it still counts in the "
        "normalisation). Without TIS, pi_old is read from the loss's own forward (exact at a batch's first "
        "optimizer step) and the clipped ratio stays pi / mu; with TIS, it is TIS's. 'off' (the default: one step "
        "ahead, the ratio also holds the last update's move, and masking it took the gradient that would have "
        "undone a bad update: docs/async.md); 'auto' is on whenever rollouts can come from older weights than the "
        f"trainer's ({OFF_POLICY}); 'on' always. With TIS on as well, the tokens kept are weighted by "
        "min(pi_old / mu, tis_cap): IcePop's own form. is_masked_frac is the share of loss tokens masked",
    )
    is_mask_low: float = Field(
        0.5, gt=0, lt=1,
        description="masked importance sampling: a token with pi_old / mu below this is masked (0.5: verl's "
        "rollout_rs = 'token_k1' band '0.5_2.0'; prime-rl's token_mask_low was 0.125)",
    )
    is_mask_high: float = Field(
        2.0, gt=1, le=1000,
        description="masked importance sampling: a token with pi_old / mu above this is masked (2.0: verl's band, "
        "and its TIS threshold; prime-rl's token_mask_high was 8). At or below tis_cap, TIS then truncates nothing",
    )
    kl_coef: float = Field(
        0.0, ge=0,
        description="weight of the KL(pi || reference) penalty, estimated per token by kl_estimator. The reference "
        "is the policy the run starts from: with LoRA the base with the adapters off (no copy); with full "
        "fine-tuning a frozen copy of the language model in model.dtype (sharded like the policy under torchrun; "
        "`saccade memory` counts it), taken before the first step, so a resumed run keeps the original anchor, "
        "not its checkpoint",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="the per-token KL estimate, with d = log ref - log pi (Schulman's approximations): 'k1' -d "
        "(an unbiased value, negative on some tokens; as a loss term its gradient averages to 0 over pi's "
        "tokens, so it regularises nothing), 'k2' d^2 / 2 (a biased value; its gradient averages to KL(pi || "
        "ref)'s), 'k3' exp(d) - d - 1 (unbiased, >= 0; its gradient averages to KL(ref || pi)'s). The `kl` "
        "metric is the chosen estimator's mean over the loss tokens",
    )
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")


class PpoClipLossConfig(BaseLossConfig):
    """The clipped PPO surrogate, per loss token: -min(ratio x A, clip(ratio, 1 - eps_low,
    1 + eps_high) x A), ratio = pi / pi_old (DAPO's clip-higher: eps_high > eps_low)."""

    kind: Literal["ppo_clip"] = Field("ppo_clip", description=LOSS_KIND)
    eps_low: float = Field(0.2, ge=0, lt=1, description="the ratio is clipped below at 1 - eps_low")
    eps_high: float = Field(
        0.28, ge=0, le=10, description="the ratio is clipped above at 1 + eps_high (DAPO clip-higher)"
    )


class ReinforceLossConfig(BaseLossConfig):
    """Plain REINFORCE, per loss token: -A x logprob; no ratio, so nothing to clip."""

    kind: Literal["reinforce"] = Field("reinforce", description=LOSS_KIND)


class CispoLossConfig(BaseLossConfig):
    """CISPO (MiniMax-M1, arXiv 2506.13585), per loss token: -sg(clip(ratio, 1 - eps_low,
    1 + eps_high)) x A x logprob. The importance weight is clipped and its gradient stopped, so
    every token keeps a gradient (PPO's clip takes it from the tokens it clips: the rare,
    high-ratio "fork" tokens the paper found reflective behaviour hangs on)."""

    kind: Literal["cispo"] = Field("cispo", description=LOSS_KIND)
    eps_low: float = Field(
        1.0, ge=0, le=1,
        description="the weight is clipped below at 1 - eps_low; 1 (the default): no lower bound, as MiniMax-M1 "
        "ran it (it tuned eps_high only)",
    )
    eps_high: float = Field(
        4.0, ge=0, le=100,
        description="the weight is clipped above at 1 + eps_high; 4: a cap of 5, ScaleRL's eps_max (TRL's "
        "epsilon_high = 5.0 for loss_type = 'cispo', where it is the cap itself; verl's example: 0.2)",
    )


class GspoLossConfig(BaseLossConfig):
    """GSPO (Qwen, arXiv 2507.18071): one ratio per sequence, s_i = exp(mean over its loss tokens
    of (logprobs - old_logprobs)), clipped per sequence: per loss token -min(s_i,t x A_i,
    clip(s_i,t, 1 - eps_low, 1 + eps_high) x A_i) with s_i,t = sg(s_i) x pi_t / sg(pi_t) (the
    paper's GSPO-token form): its value is s_i, its gradient s_i x grad log pi_t."""

    kind: Literal["gspo"] = Field("gspo", description=LOSS_KIND)
    normalization: Normalization = Field(
        "sequence", description=NORMALIZATION + ". GSPO's own is 'sequence' (the paper's objective, verl's)"
    )
    eps_low: float = Field(
        3e-4, ge=0, lt=1,
        description="the sequence ratio is clipped below at 1 - eps_low; 3e-4, the paper's. A sequence's ratio is "
        "the geometric mean of its tokens' and far narrower than one token's: PPO's 0.2 would clip nothing",
    )
    eps_high: float = Field(
        4e-4, ge=0, le=10, description="the sequence ratio is clipped above at 1 + eps_high; 4e-4, the paper's"
    )


LossConfig = Annotated[
    PpoClipLossConfig | ReinforceLossConfig | CispoLossConfig | GspoLossConfig, Field(discriminator="kind")
]
