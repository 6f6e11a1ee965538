"""The optimizer step, once (`optimizer_step`), and one RL train step over packed micro-batches
(`train_step`), with every input an explicit argument.

`optimizer_step` is the loop every trainer here runs: gradients accumulated over the step's
micro-batches (each sent to the device one ahead of the one being computed), a step whose
loss or gradient is NaN/inf skipped (the weights and the optimizer state left as they were),
the gradient clipped, the device read once. What a micro-batch's loss is comes in as a
function: the clipped policy objective (`train_step`), SFT's negative log-likelihood
(`saccade.loops.sft.sft_step`), the trainer benchmark's variants (`saccade.tools.bench.trainer_variants`).

`train_step` never sees a run's setup or config file: it gets the model, the optimizer and
its scheduler, the step's micro-batches (packed, in host memory), the loss
settings, the sampled distribution (temperature, top_k, top_p, min_p) and the banned tokens
(so the trainer scores exactly the distribution the engine sampled from), and optionally a
reference policy for the KL term (`saccade.trainer.reference`: the base with LoRA's adapters
off, or a frozen copy for full fine-tuning; the same callable either way).
A distributed trainer or an async orchestrator calls it the same way.

Per step: behaviour logprobs first (the engine's, or with TIS the trainer's own before the
update), reference logprobs when the KL term is on, then `num_iterations` optimizer steps,
each accumulating gradients over every micro-batch with the step-global token and sequence
counts (so the micro-batch losses sum to the loss of the whole batch).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from saccade.config import ConstantDecayConfig, CosineDecayConfig, LinearDecayConfig, LossConfig, TrainerConfig
from saccade.distributed import SINGLE, World, all_reduce_sum
from saccade.models.families.interface import Routing
from saccade.models.lm import ban_bias, to_device, unwrap_policy
from saccade.models.sampling import SampledDistribution
from saccade.timing import timed
from saccade.trainer.forward import forward_logprobs, predecessors
from saccade.trainer.loss import LossInputs, policy_loss
from saccade.trainer.reference import Reference
from saccade.trainer.routing import (
    expert_counts, load_figures, routing_differs, routing_split_figures, routing_split_sums,
)
from saccade.trainer.samples import MicroBatch
from saccade.trainer.spike import GradSpikeGuard

# A micro-batch's loss: (its index k in the step, micro-batch k on the device) in; the loss to
# backpropagate (normalised by the step's totals, so the micro-batches' losses sum to the
# step's) and figures to sum over the step (0-dim device tensors) out.
MicroBatchLoss = Callable[[int, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]

log = logging.getLogger(__name__)


def lr_schedule(trainer: TrainerConfig) -> Callable[[int], float]:
    """Linear warm-up, then `trainer.lr_decay`: constant, or linear or cosine decay to its
    min_lr_ratio, per optimizer step."""
    total = max(1, trainer.steps * trainer.num_iterations)

    def factor(opt_step: int) -> float:
        if trainer.warmup_steps and opt_step < trainer.warmup_steps:
            return (opt_step + 1) / trainer.warmup_steps
        decay = trainer.lr_decay
        if isinstance(decay, ConstantDecayConfig):
            return 1.0
        progress = min(1.0, (opt_step - trainer.warmup_steps) / max(1, total - trainer.warmup_steps))
        if isinstance(decay, LinearDecayConfig):
            shape = 1.0 - progress
        else:
            assert isinstance(decay, CosineDecayConfig), decay
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return decay.min_lr_ratio + (1.0 - decay.min_lr_ratio) * shape

    return factor


class MasterWeights:
    """float32 master copies of parameters that train in a narrower dtype (full fine-tuning in
    bf16), the way mixed-precision trainers keep them.

    The model computes in bf16 (as the inference engine does). During backward, each bf16
    gradient is added into its master's float32 gradient as soon as it is complete (a
    post-accumulate-grad hook) and dropped, so micro-batches accumulate in float32 and at most
    one bf16 gradient lives at a time. The optimizer steps the masters; a post-step hook
    copies them back into the model. `named` maps the model's parameter names to masters
    (checkpoints save and restore these, not the rounded bf16 weights)."""

    def __init__(self, model: nn.Module):
        # A model gets one set at a time: a new optimizer (SFT, then RL) replaces the old hooks.
        previous = _MASTERS.get(model)
        if previous is not None:
            previous.detach()
        _MASTERS[model] = self
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.named: dict[str, torch.Tensor] = {}
        self._hooks = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            master = param.detach().to(torch.float32).clone().requires_grad_(True)
            self._hooks.append(param.register_post_accumulate_grad_hook(self._accumulate(master)))
            self.pairs.append((param, master))
            self.named[name] = master

    def detach(self) -> None:
        """Stop collecting the model's gradients (another optimizer takes over)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @staticmethod
    def _accumulate(master: torch.Tensor):
        def hook(param: nn.Parameter) -> None:
            grad = param.grad.to(torch.float32)
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

        return hook

    @property
    def params(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for param, master in self.pairs:
            param.copy_(master)


_MASTERS: weakref.WeakKeyDictionary[nn.Module, MasterWeights] = weakref.WeakKeyDictionary()


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, schedule: Callable[[int], float]):
    """AdamW over the trainable parameters and a LambdaLR following `schedule`.

    Trainable parameters narrower than float32 (full fine-tuning in bf16) get float32 master
    weights (`MasterWeights`, kept as `optimizer.master_weights`): the optimizer and its
    state, the gradients and the clipping are all float32. LoRA adapters are float32 already."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert params, "nothing to train"
    masters = None
    if any(p.dtype != torch.float32 for p in params):
        masters = MasterWeights(model)
        params = masters.params
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    optimizer.master_weights = masters
    if masters is not None:
        optimizer.register_step_post_hook(lambda *_: masters.copy_to_model())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return optimizer, scheduler


def set_peak_lr(optimizer: torch.optim.Optimizer, scheduler, peak_lr: float) -> float:
    """Make `peak_lr` the schedule's peak from here on, at the schedule's current position:
    the LambdaLR's base lr and every group's lr now, which the next optimizer step uses. A
    checkpoint's scheduler and optimizer hold the lr they were saved with, so a resume with
    another trainer.lr, or a stall's rollback to a lower one, must set it after loading them.
    Returns the lr of the next optimizer step (with the peak unchanged, the very value it had)."""
    scheduler.base_lrs = [peak_lr for _ in scheduler.base_lrs]
    # LambdaLR.get_lr's own expression, so an unchanged peak gives the same float bit for bit.
    lrs = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs,
                                                                        strict=True)]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"], group["initial_lr"] = lr, peak_lr
    scheduler._last_lr = lrs  # what get_last_lr() (the logged lr) reports until the next step
    return lrs[0]


def optimized_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors the optimizer steps (where the gradients end up): the trainable parameters,
    or their float32 masters."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip in place and return the pre-clip norm as a 0-dim device tensor (not read here). With
    sharded (DTensor) parameters the norm is the whole model's, the same on every rank. A NaN/inf
    norm means the step must be skipped (the clipped gradients are then garbage)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def staged(micro_batches: list[MicroBatch], device: torch.device) -> list[MicroBatch]:
    """A step's micro-batches as `train_step` takes them: in host memory, page-locked once when
    they are bound for a GPU (`MicroBatch.pinned`), so that every pass's copy is asynchronous."""
    return [mb.pinned() for mb in micro_batches] if device.type == "cuda" else micro_batches


def on_device(micro_batches: Sequence, device: torch.device) -> Iterator[tuple[int, Any]]:
    """(k, micro-batch k on `device`), each sent one ahead of the one being computed: while the
    caller works on k, k + 1 is on its way (non_blocking, from pinned memory on CUDA), and k - 1
    is gone, provided the caller keeps nothing of it (drop the loop variable before the next
    one). At most two micro-batches are on the device at once, which is what `saccade memory`
    counts; a whole step's would not fit beside a large model. A micro-batch is anything with
    `.to(device)` (`MicroBatch`; the trainer benchmark's padded and full-model batches)."""
    ahead = micro_batches[0].to(device) if micro_batches else None
    for k in range(len(micro_batches)):
        current, ahead = ahead, None
        if k + 1 < len(micro_batches):
            ahead = micro_batches[k + 1].to(device)
        yield k, current
        del current  # before the next one is sent


@dataclass
class StepOutcome:
    """What one optimizer step did. `sums` holds "loss" and the loss function's figures, each
    summed over the step's micro-batches (this rank's); a skipped step's are NaN or garbage."""

    applied: bool  # False: a NaN/inf loss or gradient, or a spike; the weights and optimizer state did not change
    grad_norm: float  # before clipping (the whole model's, with sharded parameters)
    sums: dict[str, float]
    spiked: bool = False  # skipped by the spike guard (`saccade.trainer.spike`)


def optimizer_step(optimizer: torch.optim.Optimizer, scheduler, micro_batches: Sequence,
                   micro_batch_loss: MicroBatchLoss, *, device: torch.device, grad_clip: float,
                   world: World = SINGLE, spike_guard: GradSpikeGuard | None = None) -> StepOutcome:
    """One optimizer step: each micro-batch's loss (`micro_batch_loss`) backpropagated, the
    gradients accumulated over all of them, clipped to `grad_clip`, then applied, unless the
    loss or the gradient is NaN/inf on any rank, or `spike_guard` judges the norm a spike (the
    norm is the whole model's, so every rank judges alike): then nothing is applied, on every rank.

    The micro-batches are in host memory (pinned on CUDA) and go to `device` one ahead of the
    one being computed (`on_device`). The loss, its figures and the finite check stay on the
    device; they are read once, after the last backward, together with the gradient norm."""
    optimizer.zero_grad(set_to_none=True)
    finite = torch.ones((), dtype=torch.bool, device=device)
    sums: dict[str, torch.Tensor] = {}
    for k, mb in on_device(micro_batches, device):
        loss_value, figures = micro_batch_loss(k, mb)
        # A NaN/inf loss is noted, not read: backward still runs (on every rank of a sharded
        # model FSDP's reduce-scatters are collective), and the step is skipped below.
        finite &= torch.isfinite(loss_value)
        with timed("backward"):
            loss_value.backward()
        _accumulate(sums, "loss", loss_value.detach())
        for name, value in figures.items():
            _accumulate(sums, name, value)
        del mb, loss_value, figures  # nothing of k outlives its turn
    with timed("optimizer"):
        norm = clip_grad_norm(optimized_params(optimizer), grad_clip)
        names = sorted(sums)
        finite_loss, norm_value, *values = torch.stack(
            [finite.double(), norm.double()] + [sums[name] for name in names]).tolist()
    if world.size > 1:  # a non-finite loss on any rank skips the step on every rank
        finite_loss = all_reduce_sum([1.0 - finite_loss], world, device)[0] == 0
    finite_step = bool(finite_loss) and math.isfinite(norm_value)
    median, seen = (spike_guard.median(), len(spike_guard.norms)) if spike_guard is not None else (None, 0)
    spiked = finite_step and spike_guard is not None and spike_guard.is_spike(norm_value)
    outcome = StepOutcome(finite_step and not spiked, norm_value, dict(zip(names, values)), spiked)
    if not outcome.applied:
        # Not applied: a NaN/inf loss or gradient would poison the weights and the optimizer state,
        # and a spike's direction is what breaks a policy (clipping keeps it).
        optimizer.zero_grad(set_to_none=True)
        if spiked:
            reason = (f"gradient norm {norm_value:.3g} is {norm_value / median:.0f}x the median {median:.3g} of the "
                      f"last {seen} steps (trainer.grad_spike.factor {spike_guard.factor:g})")
        else:
            reason = "non-finite loss" if not finite_loss else "non-finite gradient"
        if world.is_main:  # every rank skipped it: one says so
            log.warning("step skipped: %s; the weights were not changed", reason)
        return outcome
    with timed("optimizer"):
        optimizer.step()
        scheduler.step()
    return outcome


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    micro_batches: list[MicroBatch],
    *,
    loss: LossConfig,
    num_iterations: int,
    grad_clip: float,
    distribution: SampledDistribution,
    banned_token_ids: list[int],
    reference: Reference | None = None,
    world: World = SINGLE,
    current_version: int | None = None,
    spike_guard: GradSpikeGuard | None = None,
    filtered: tuple[int, int] = (0, 0),
    max_lag: int = 0,
) -> dict[str, float]:
    """`num_iterations` optimizer steps over the micro-batches; returns the step's metrics.

    `micro_batches` are the step's, in host memory (pinned on CUDA: `MicroBatch.pinned`); every
    pass over them sends them to the model's device one ahead of the one being computed
    (`on_device`), so at most two are there at once. What the host needs (token counts, which
    tokens are scored) is read from the host copies; the loss, the metrics and the finite check
    stay on the device and are read once per optimizer step.

    `filtered`: the loss tokens and samples of the whole step's groups that the zero-variance
    filter dropped (the same on every rank); with loss.denominator 'sampled' the normalisation
    counts them, as the zero-advantage terms they are, so the step is the unfiltered batch's.

    `spike_guard`: skip an optimizer step whose gradient norm spikes (`saccade.trainer.spike`);
    `grad_spike_skipped` counts them, `grad_norm_spike` is the largest skipped norm.

    `current_version`: the version of the weights being trained (the step count). Then
    `mismatch_abs_lag0` is the engine/trainer logprob gap over the tokens sampled under exactly
    these weights: the numerics gap alone, apart from what the policy moved since older ones. The
    same gap at every lag 0..`max_lag`, apart for the tokens that follow an image in their sample
    (`MicroBatch.after_image`) and the text-only ones: `mismatch_abs_image_lag{k}` and
    `mismatch_abs_text_lag{k}` (each only where the step has such tokens). A fault in how one side
    places or encodes images (positions, the tower) shows in the first and not the second
    (`saccade.loops.guards.ImageMismatch` budgets it).

    A mixture-of-experts family (`ModelFamily.record_routing`) adds the router's load balance over
    the step's loss tokens, from the first pass's forwards (`saccade.trainer.routing`):
    `router_max_over_mean`, `router_cv`, `router_dead_experts`. Where the samples carry the
    engine's experts (`MicroBatch.routed_experts`: the embedded engine reports them, vLLM is not
    asked), the same forwards' experts at each loss token's predecessor are compared with the
    engine's: `routing_differs_frac` (loss tokens whose top-k set differs in some MoE layer),
    `mismatch_abs_routing_same` and `mismatch_abs_routing_differs` (mean |logprobs - engine's|
    over each group; a group with no token has no figure, and none of the three is logged
    without engine routing). Over all loss tokens, as `mismatch_abs`: a stale sample's experts
    also differ by what the policy moved since it was sampled.

    With a sharded model (`world.size` > 1), `micro_batches` are this rank's share of the step
    (`saccade.trainer.packing.rank_micro_batches`, padded so that every rank has as many) and
    the returned metrics are the whole step's: the loss normalisation, the metric sums and the
    decision to skip a non-finite step are all taken over every rank."""
    if loss.kl_coef > 0 and reference is None:
        raise ValueError("loss.kl_coef > 0 needs a reference policy")
    policy = unwrap_policy(model)
    device = policy.lm_head.weight.device
    totals = loss_counts(micro_batches, loss, filtered, world, device)
    ban_bias_V = ban_bias(policy.lm_head, banned_token_ids)  # once per step, not once per forward
    score = dict(distribution=distribution, only_loss_tokens=True, ban_bias_V=ban_bias_V)
    old_logprobs, ref_logprobs = behaviour_logprobs(model, micro_batches, device, score,
                                                    tis=loss.tis_cap is not None, reference=reference)
    objective = ClippedObjective(model, micro_batches, loss, score, totals, old_logprobs, ref_logprobs,
                                 current_version=current_version, device=device, max_lag=max_lag)
    model.train()
    done = optimizer_steps(optimizer, scheduler, micro_batches, objective, num_iterations, device=device,
                           grad_clip=grad_clip, world=world, spike_guard=spike_guard)
    return step_metrics(done, objective, micro_batches, totals, scheduler, world=world, device=device,
                        guarded=spike_guard is not None)


@dataclass(frozen=True)
class LossCounts:
    """A train step's counts for the loss's normalisation, taken once before its passes."""

    per_micro_batch: list[int]  # each micro-batch's loss tokens (this rank's, read on the host copies)
    tokens: float  # the whole step's loss tokens, every rank's: what the metrics are means over
    sequences: float
    # The loss's denominators: the kept samples', or with loss.denominator 'sampled' every sampled
    # group's (the zero-variance filter's drops counted as the zero-advantage terms they are).
    counted_tokens: float
    counted_sequences: float


def loss_counts(micro_batches: list[MicroBatch], loss: LossConfig, filtered: tuple[int, int], world: World,
                device: torch.device) -> LossCounts:
    """`LossCounts` of the step's micro-batches, summed over the ranks; `filtered` (train_step's) added
    to the denominators with loss.denominator 'sampled'."""
    loss_tokens = [int(mb.on_host.loss_mask.sum()) for mb in micro_batches]  # host copies: no device read
    total_loss_tokens, total_sequences = all_reduce_sum(
        [float(sum(loss_tokens)), float(sum(mb.num_samples for mb in micro_batches))], world, device)
    counted_tokens, counted_sequences = total_loss_tokens, total_sequences
    if loss.denominator == "sampled":
        counted_tokens, counted_sequences = counted_tokens + filtered[0], counted_sequences + filtered[1]
    return LossCounts(loss_tokens, total_loss_tokens, total_sequences, counted_tokens, counted_sequences)


def behaviour_logprobs(model: nn.Module, micro_batches: list[MicroBatch], device: torch.device, score: dict, *,
                       tis: bool, reference: Reference | None) -> tuple[list, list]:
    """The logprobs a step takes before its update, per micro-batch (None where not needed): with TIS
    the trainer's own, which the ratio is then taken against (the engine/trainer gap corrected by a
    capped weight; without TIS the behaviour logprobs are the engine's), and the reference policy's
    when the KL term is on. (Masked IS needs no pass of its own: without TIS it takes the trainer's
    side from the forward the loss is computed on, and the ratio stays the engine's: saccade.trainer.loss.)"""
    old_logprobs: list[torch.Tensor | None] = [None] * len(micro_batches)
    ref_logprobs: list[torch.Tensor | None] = [None] * len(micro_batches)
    if tis or reference is not None:
        with torch.no_grad():
            for k, mb in on_device(micro_batches, device):
                if tis:
                    old_logprobs[k], _ = forward_logprobs(model, mb, **score)
                if reference is not None:
                    ref_logprobs[k] = reference(mb)
                del mb
    return old_logprobs, ref_logprobs


class ClippedObjective:
    """One train step's policy loss as `optimizer_step` takes it (a `MicroBatchLoss`): micro-batch k's
    share of the loss, and its metrics weighted by its loss tokens. On the step's first pass
    (`iteration` 0; `optimizer_steps` sets it) its forwards also measure, on the device, unread: the
    engine/trainer gap by lag (0..`max_lag`: lag 0, the tokens sampled under exactly these weights) and
    by whether the token follows an image (`lag_gaps`), and for a mixture of experts the experts the
    loss tokens went to (`router_counts`) and, where the engine reported its own, the mismatch split
    by whether the two routed alike (`routing_split`)."""

    def __init__(self, model: nn.Module, micro_batches: list[MicroBatch], loss: LossConfig, score: dict,
                 totals: LossCounts, old_logprobs: list, ref_logprobs: list, *, current_version: int | None,
                 device: torch.device, max_lag: int = 0):
        self.model, self.policy = model, unwrap_policy(model)
        self.hosts = [mb.on_host for mb in micro_batches]
        self.loss, self.score, self.totals = loss, score, totals
        self.old_logprobs, self.ref_logprobs = old_logprobs, ref_logprobs
        self.current_version = current_version
        self.iteration = 0  # the optimizer step under way
        # (lag, text 0 / after an image 1, [sum of |logprobs - engine's|, tokens]), lags 0..max_lag
        self.lag_gaps = torch.zeros(max_lag + 1, 2, 2, dtype=torch.float64, device=device)
        self.router_counts: torch.Tensor | None = None  # (layers, E): the first pass's loss tokens' experts
        self.routing_split = torch.zeros(4, dtype=torch.float64, device=device)  # `routing_split_sums`

    def __call__(self, k: int, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        with self.policy.family.record_routing(self.policy.language_model) as routing:  # dense families: None
            logprobs, entropy = forward_logprobs(self.model, mb, **self.score)
        if self.iteration == 0:
            self._measure(mb, logprobs, routing)
        inputs = LossInputs(
            logprobs_N=logprobs,
            old_logprobs_N=self.old_logprobs[k] if self.old_logprobs[k] is not None else mb.inference_logprobs,
            advantages_N=mb.advantages,
            loss_mask_N=mb.loss_mask,
            cu_seqlens=self.hosts[k].cu_seqlens,
            inference_logprobs_N=mb.inference_logprobs,
            ref_logprobs_N=self.ref_logprobs[k],
            entropy_N=entropy,
            total_loss_tokens=self.totals.counted_tokens,
            total_sequences=self.totals.counted_sequences,
        )
        with timed("loss"):
            loss_value, metrics = policy_loss(inputs, self.loss)
        weight = self.totals.per_micro_batch[k] / max(1.0, self.totals.tokens)
        # A figure that is a mean over sequences (`clip_frac_seq`) is weighed by sequences.
        per_sequence = self.hosts[k].num_samples / max(1.0, self.totals.sequences)
        return loss_value, {name: value * (per_sequence if name.endswith("_seq") else weight)
                            for name, value in metrics.items()}

    def _measure(self, mb: MicroBatch, logprobs: torch.Tensor, routing: Routing | None) -> None:
        """The first pass's figures of micro-batch mb, added on the device."""
        if routing is not None:
            counts_YE = expert_counts(routing.chosen, routing.num_experts, mb.loss_mask.reshape(-1))
            self.router_counts = counts_YE if self.router_counts is None else self.router_counts + counts_YE
            if mb.routed_experts is not None:
                self.routing_split.add_(engine_routing_split(routing, mb, logprobs))
        if self.current_version is not None and mb.policy_versions is not None:
            self.lag_gaps.add_(lag_gap_sums(logprobs.detach() - mb.inference_logprobs, mb, self.current_version,
                                                self.lag_gaps.shape[0]))


@dataclass
class Iterations:
    """What a train step's optimizer steps did."""

    sums: dict[str, float] = field(default_factory=dict)  # the applied ones' loss and metrics, summed
    grad_norms: list[float] = field(default_factory=list)  # the applied ones'
    skipped: int = 0  # not applied: non-finite, or a spike
    spikes: list[float] = field(default_factory=list)  # the norms the spike guard skipped

    @property
    def applied(self) -> int:
        """How many were applied, at least 1: what the sums are divided by."""
        return max(1, len(self.grad_norms))


def optimizer_steps(optimizer: torch.optim.Optimizer, scheduler, micro_batches: list[MicroBatch],
                    objective: ClippedObjective, num_iterations: int, *, device: torch.device, grad_clip: float,
                    world: World, spike_guard: GradSpikeGuard | None) -> Iterations:
    """`num_iterations` optimizer steps of `objective` over the micro-batches; a skipped one's NaN
    figures are not summed in."""
    done = Iterations()
    for iteration in range(num_iterations):
        objective.iteration = iteration
        outcome = optimizer_step(optimizer, scheduler, micro_batches, objective, device=device,
                                 grad_clip=grad_clip, world=world, spike_guard=spike_guard)
        if outcome.spiked:
            done.spikes.append(outcome.grad_norm)
        if not outcome.applied:
            done.skipped += 1
            continue
        done.grad_norms.append(outcome.grad_norm)
        for name, value in outcome.sums.items():
            done.sums[name] = value if name not in done.sums else done.sums[name] + value
    return done


def step_metrics(done: Iterations, objective: ClippedObjective, micro_batches: list[MicroBatch], totals: LossCounts,
                 scheduler, *, world: World, device: torch.device, guarded: bool) -> dict[str, float]:
    """The step's metrics: the applied iterations' means of the loss's figures, summed over this rank's
    micro-batches, then over the ranks (the grad norm is global already), with the first pass's
    measures (`ClippedObjective`), the token counts, the lr and the skips. `guarded`: a spike guard ran."""
    real = [mb for mb in micro_batches if mb.num_samples]  # not the padding micro-batches
    summed = sorted(done.sums)
    counts = ["micro_batches", "train_tokens", "forward_tokens"]
    # Every rank sends the routing split, zeros or not (a rank's padding micro-batches have no
    # engine routing): the collective is the same on every rank.
    reduced = all_reduce_sum(
        [done.sums[k] for k in summed] + objective.lag_gaps.reshape(-1).tolist() + objective.routing_split.tolist()
        # The samples' tokens (a shared prompt once per sample), and what the forward computed.
        + [float(len(real)), float(sum(mb.num_sample_tokens for mb in real)), float(sum(mb.num_tokens for mb in real))],
        world, device)
    out = {k: v / done.applied for k, v in zip(summed, reduced)}
    at, lag_values = len(summed), objective.lag_gaps.numel()
    lag_gaps = torch.tensor(reduced[at:at + lag_values], dtype=torch.float64).view_as(objective.lag_gaps)
    at += lag_values
    split_sums = reduced[at:at + 4]
    if done.grad_norms:
        out["grad_norm"] = sum(done.grad_norms) / done.applied
    out.update(zip(counts, reduced[at + 4:]))
    out.update(skipped_steps=float(done.skipped), lr=scheduler.get_last_lr()[0])
    if guarded:
        out["grad_spike_skipped"] = float(len(done.spikes))
        if done.spikes:
            out["grad_norm_spike"] = max(done.spikes)
    out["loss_tokens"] = totals.tokens  # the step's, not a mean over micro-batches (that depends on the packing)
    if objective.current_version is not None:
        out.update(lag_gap_figures(lag_gaps))
    if objective.router_counts is not None:  # a MoE: the load balance over every rank's loss tokens
        counts_YE = objective.router_counts
        summed = all_reduce_sum(counts_YE.reshape(-1).tolist(), world, device)
        out.update(load_figures(torch.tensor(summed, dtype=torch.float64).view_as(counts_YE)))
    out.update(routing_split_figures(split_sums))  # {} unless the engine reported its routing
    return out


def lag_gap_sums(gap_N: torch.Tensor, mb: MicroBatch, current_version: int, lags: int) -> torch.Tensor:
    """(lags, 2, 2) float64 on the device: per lag 0..lags-1 (the trainer's version minus the
    token's sample's), for text-only tokens (0) and tokens after an image (1), the sum of |gap_N|
    over the micro-batch's loss tokens and their count. A token at a lag past the bound counts nowhere."""
    lag_N = current_version - mb.policy_versions
    image_N = mb.after_image if mb.after_image is not None else torch.zeros_like(mb.loss_mask)
    kept_N = mb.loss_mask & (lag_N >= 0) & (lag_N < lags)
    slot_N = (lag_N.clamp(0, lags - 1) * 2 + image_N.long()).reshape(-1)
    gap_N = torch.where(kept_N, gap_N.abs(), torch.zeros_like(gap_N)).double().reshape(-1)
    sums = torch.zeros(lags * 2, dtype=torch.float64, device=gap_N.device).index_add(0, slot_N, gap_N)
    counts = torch.zeros(lags * 2, dtype=torch.float64, device=gap_N.device).index_add(
        0, slot_N, kept_N.double().reshape(-1))
    return torch.stack([sums, counts], dim=-1).view(lags, 2, 2)


def lag_gap_figures(lag_gaps: torch.Tensor) -> dict[str, float]:
    """`lag_gap_sums` summed over a step, as figures: `mismatch_abs_lag0` (every lag-0 token), and
    `mismatch_abs_image_lag{k}` / `mismatch_abs_text_lag{k}`, each where the step has such tokens."""
    out = {}
    gap_sum, tokens = lag_gaps[0].sum(0).tolist()
    if tokens:
        out["mismatch_abs_lag0"] = gap_sum / tokens
    for lag, rows in enumerate(lag_gaps.tolist()):
        for kind, (gap_sum, tokens) in zip(("text", "image"), rows):
            if tokens:
                out[f"mismatch_abs_{kind}_lag{lag}"] = gap_sum / tokens
    return out


def engine_routing_split(routing: Routing, mb: MicroBatch, logprobs_N: torch.Tensor) -> torch.Tensor:
    """`routing_split_sums` over the micro-batch's loss tokens: the experts this forward routed
    each one's predecessor to (the position its logits come from), against the engine's
    (`mb.routed_experts`), and |trainer - engine| logprob. Rows are picked on the host."""
    host = mb.on_host
    loss_rows_T = host.loss_mask.cpu().nonzero().squeeze(1)
    source_T = predecessors(host)[loss_rows_T]
    scored_T = source_T >= 0  # a sample's first token is never scored (it has no predecessor)
    device = logprobs_N.device
    source = to_device(source_T[scored_T], device)
    trainer_TYK = torch.stack([chosen_NK.index_select(0, source) for chosen_NK in routing.chosen], dim=1)
    engine_TYK = mb.routed_experts.index_select(0, to_device(scored_T.nonzero().squeeze(1), device))
    rows = to_device(loss_rows_T[scored_T], device)
    gap_T = logprobs_N.detach().index_select(0, rows) - mb.inference_logprobs.index_select(0, rows)
    return routing_split_sums(routing_differs(trainer_TYK, engine_TYK), gap_T)


def _accumulate(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    sums[name] = value.double() if name not in sums else sums[name] + value.double()
