"""The train step and its helpers: the optimizer step's accumulation and skip, the learning-rate
schedule by hand, and float32 master weights for full fine-tuning in bf16 (gradients
accumulated in float32, the model updated from them, checkpoints that keep them)."""

from __future__ import annotations

import math

import pytest
import torch

from saccade.models.sampling import SampledDistribution
from saccade.config import TrainerConfig
from saccade.models.lm import load_policy_lm, set_full_finetune
from saccade.trainer.step import build_optimizer, lr_schedule, optimized_params, set_peak_lr


@pytest.mark.parametrize(
    ("decay", "expected"),
    [
        ("constant", [0.5, 1.0, 1.0, 1.0, 1.0]),
        # after the warm-up, progress (step - 2) / (10 - 2) runs from 0 to 1
        ("linear", [0.5, 1.0, 1.0, 1.0 - 0.9 * 1 / 8, 1.0 - 0.9 * 2 / 8]),
        ("cosine", [0.5, 1.0, *(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in (0, 1, 2))]),
    ],
)
def test_lr_schedule_by_hand(decay, expected):
    to_min = {} if decay == "constant" else {"min_lr_ratio": 0.1}  # only a decay has an lr to end at
    schedule = lr_schedule(TrainerConfig(steps=10, warmup_steps=2, lr_decay={"kind": decay, **to_min}))
    assert [schedule(k) for k in range(5)] == pytest.approx(expected)


def test_a_new_peak_lr_takes_over_at_the_schedules_place():
    """set_peak_lr after 3 steps of a warm-up-then-linear schedule: the next step's lr is the new
    peak times the schedule's factor there, and so is every lr after it; the same peak changes
    nothing, bit for bit. Through a state dict and back, as a checkpoint does."""
    def run(steps: int, peak: float | None = None) -> list[float]:
        model = torch.nn.Linear(2, 1)
        optimizer, scheduler = build_optimizer(model, lr=0.1, weight_decay=0.0, schedule=schedule)
        lrs = []
        for k in range(steps):
            if k == 3 and peak is not None:
                saved = optimizer.state_dict(), scheduler.state_dict()
                optimizer.load_state_dict(saved[0])
                scheduler.load_state_dict(saved[1])
                assert set_peak_lr(optimizer, scheduler, peak) == pytest.approx(peak * schedule(3))
            lrs.append(optimizer.param_groups[0]["lr"])
            model(torch.ones(2)).sum().backward()
            optimizer.step()
            scheduler.step()
        return lrs

    schedule = lr_schedule(TrainerConfig(steps=8, warmup_steps=2, lr_decay={"kind": "linear", "min_lr_ratio": 0.1}))
    straight = run(8)
    assert straight == pytest.approx([0.1 * schedule(k) for k in range(8)])
    assert run(8, peak=0.1) == straight  # bit for bit
    lowered = run(8, peak=0.02)
    assert lowered[:3] == straight[:3]
    assert lowered[3:] == pytest.approx([0.02 * schedule(k) for k in range(3, 8)])


def _linear_step(micro_batches, *, poison_k: int | None = None):
    """One `optimizer_step` of a linear model over these micro-batches (plain tensors: anything
    with `.to(device)`), each loss normalised by all their rows. Returns (outcome, weights)."""
    from saccade.trainer.step import optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer, scheduler = build_optimizer(model, lr=0.1, weight_decay=0.0, schedule=lambda k: 1.0)
    rows = sum(len(x) for x in micro_batches)

    def loss(k, x):
        value = (model(x) ** 2).sum() / rows
        if k == poison_k:
            value = value * float("nan")
        return value, {"rows": torch.tensor(float(len(x)))}

    outcome = optimizer_step(optimizer, scheduler, micro_batches, loss, device=torch.device("cpu"), grad_clip=1e9)
    return outcome, [p.detach().clone() for p in model.parameters()]


def _initial_linear() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [p.detach().clone() for p in torch.nn.Linear(3, 1).parameters()]


def test_an_optimizer_step_over_micro_batches_is_the_step_over_their_whole():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    whole, whole_weights = _linear_step([x])
    split, split_weights = _linear_step([x[:1], x[1:4], x[4:]])
    assert whole.applied and split.applied and whole.sums["rows"] == split.sums["rows"] == 6.0
    assert split.sums["loss"] == pytest.approx(whole.sums["loss"]) and split.grad_norm == pytest.approx(whole.grad_norm)
    assert all(torch.allclose(a, b) for a, b in zip(split_weights, whole_weights, strict=True))
    assert all(not torch.equal(a, b) for a, b in zip(whole_weights, _initial_linear(), strict=True))


def test_a_non_finite_micro_batch_loss_skips_the_whole_step():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    skipped, weights = _linear_step([x[:3], x[3:]], poison_k=1)
    assert not skipped.applied and math.isnan(skipped.sums["loss"])
    assert all(torch.equal(a, b) for a, b in zip(weights, _initial_linear(), strict=True))


def _bf16_model(tiny_path):
    return set_full_finetune(load_policy_lm(tiny_path, dtype=torch.bfloat16))


def _loss(model, ids):
    from saccade.models.lm import unwrap_policy

    policy = unwrap_policy(model)
    positions = torch.arange(ids.shape[1]).expand(4, 1, ids.shape[1])
    hidden = policy.hidden_states(ids, positions)
    return policy.lm_head(hidden).float().logsumexp(-1).mean()


def test_bf16_full_finetuning_keeps_float32_master_weights(tiny_path):
    model = _bf16_model(tiny_path)
    optimizer, scheduler = build_optimizer(model, lr=1e-2, weight_decay=0.0, schedule=lambda k: 1.0)
    masters = optimizer.master_weights
    assert masters is not None and all(m.dtype == torch.float32 for m in optimized_params(optimizer))
    assert len(masters.pairs) == sum(1 for p in model.parameters() if p.requires_grad)

    # Two micro-batches: each bf16 gradient lands in float32 and is dropped from the model.
    first, second = torch.randint(0, 400, (1, 12)), torch.randint(0, 400, (1, 9))
    _loss(model, first).backward()
    once = {id(m): m.grad.clone() for m in masters.params}
    assert all(p.grad is None for p, _ in masters.pairs)
    _loss(model, second).backward()
    for param, master in masters.pairs[:3]:
        assert master.grad.dtype == torch.float32 and not torch.equal(master.grad, once[id(master)])

    before = {n: m.detach().clone() for n, m in masters.named.items()}
    optimizer.step()
    scheduler.step()
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    master = masters.named[name]
    param = dict(model.named_parameters())[name]
    assert not torch.equal(master, before[name])  # the step moved the float32 weights...
    assert torch.equal(param, master.to(torch.bfloat16))  # ...and the model computes with them, rounded
    # Updates smaller than bf16's resolution accumulate in the masters instead of vanishing.
    assert (master - before[name]).abs().min() < (param.float() - before[name].to(torch.bfloat16).float()).abs().max()


def test_a_new_optimizer_takes_the_gradients_over(tiny_path):
    model = _bf16_model(tiny_path)
    old, _ = build_optimizer(model, lr=1e-2, weight_decay=0.0, schedule=lambda k: 1.0)
    new, _ = build_optimizer(model, lr=1e-2, weight_decay=0.0, schedule=lambda k: 1.0)
    _loss(model, torch.randint(0, 400, (1, 8))).backward()
    assert all(m.grad is None for m in optimized_params(old))
    assert all(m.grad is not None for m in optimized_params(new))


def test_float32_parameters_get_no_masters(tiny_path):
    model = set_full_finetune(load_policy_lm(tiny_path))
    optimizer, _ = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda k: 1.0)
    assert optimizer.master_weights is None
    assert optimized_params(optimizer) == [p for p in model.parameters() if p.requires_grad]


def test_a_checkpoint_keeps_the_master_weights_exactly(tiny_path, tmp_path):
    from saccade.trainer.checkpoint.saving import TrainState, load_checkpoint, save_checkpoint

    model = _bf16_model(tiny_path)
    optimizer, scheduler = build_optimizer(model, lr=1e-2, weight_decay=0.0, schedule=lambda k: 1.0)
    _loss(model, torch.randint(0, 400, (1, 8))).backward()
    optimizer.step()
    saved = {n: m.detach().clone() for n, m in optimizer.master_weights.named.items()}
    save_checkpoint(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=1, data_position=0, policy_version=1), keep_last=1)

    fresh = _bf16_model(tiny_path)
    fresh_optimizer, fresh_scheduler = build_optimizer(fresh, lr=1e-2, weight_decay=0.0, schedule=lambda k: 1.0)
    load_checkpoint(tmp_path / "checkpoints" / "step_000001", model=fresh, optimizer=fresh_optimizer,
                    scheduler=fresh_scheduler)
    restored = fresh_optimizer.master_weights.named
    assert all(torch.equal(restored[n], saved[n]) for n in saved)  # float32, not rounded through bf16
    assert all(p.dtype == torch.bfloat16 for p in fresh.parameters())
    assert torch.equal(dict(fresh.named_parameters())["model.language_model.norm.weight"],
                       dict(model.named_parameters())["model.language_model.norm.weight"])


def _text_samples(n_samples: int = 4, advantages: list[float] | None = None):
    """Text-only samples with a 5-token completion each (advantages +1, -1, ... unless given)."""
    from saccade.models.families import family_of
    from saccade.trainer.samples import make_sample

    positions = family_of({"model_type": "qwen3_vl"}).positions(2)  # text only: 0..L-1 on every row
    gen = torch.Generator().manual_seed(3)
    samples = []
    for i in range(n_samples):
        L = 12 + i
        ids = torch.randint(10, 200, (L,), generator=gen)
        mask = torch.zeros(L, dtype=torch.bool)
        mask[-5:] = True
        samples.append(make_sample(f"s{i}", ids, torch.zeros(L, dtype=torch.long), None, [], positions=positions,
                                   loss_mask=mask, inference_logprobs=torch.where(mask, -2.0, 0.0),
                                   advantage=(-1.0) ** i if advantages is None else advantages[i]))
    return samples


def _text_micro_batches(n_samples: int = 4, advantages: list[float] | None = None):
    """`_text_samples`, packed into one micro-batch."""
    from saccade.trainer.packing import pack

    return pack(_text_samples(n_samples, advantages), lambda key: None, max_tokens=256, image_token_id=-1,
                spatial_merge_size=2)


def test_a_padding_micro_batch_changes_nothing_but_runs_a_full_forward_and_backward(tiny_path):
    """What a rank with fewer micro-batches runs (FSDP needs the same number of calls on every
    rank): the same metrics and weights as without it, and a gradient (of zeros) for every
    parameter, so every layer's backward, hence its gradient reduction, takes place."""
    from saccade.config import PpoClipLossConfig
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import padding_micro_batch
    from saccade.trainer.step import train_step

    def step(micro_batches):
        torch.manual_seed(0)
        model = set_full_finetune(load_policy_lm(tiny_path))
        optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
        metrics = train_step(model, optimizer, scheduler, micro_batches, loss=PpoClipLossConfig(), num_iterations=1,
                             grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[])
        return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}

    real = _text_micro_batches()
    plain, plain_weights = step(real)
    padded, padded_weights = step(real + [padding_micro_batch(), padding_micro_batch()])
    assert plain["grad_norm"] > 0 and plain["micro_batches"] == padded["micro_batches"] == 1
    assert {k: v for k, v in padded.items()} == plain
    assert all(torch.equal(plain_weights[n], padded_weights[n]) for n in plain_weights)

    model = set_full_finetune(load_policy_lm(tiny_path))
    logprobs, entropy = forward_logprobs(model, padding_micro_batch(), only_loss_tokens=True)
    (logprobs.sum() + entropy.sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and not g.any() for g in grads.values()), [n for n, g in grads.items() if g is None]


def test_at_most_two_micro_batches_are_on_the_device_at_once(tiny_path, monkeypatch):
    """Every pass of a train step (the TIS pass, then two optimizer iterations) sends its
    micro-batches to the device one ahead of the one it computes: while micro-batch k is
    computed, k + 1 may be there, k - 1 must be gone. `saccade memory` counts exactly two.
    Counted as the micro-batches `MicroBatch.to` made that are still alive at each forward; the
    old way (the whole step's moved up front) counts all five, and the check says so."""
    import weakref

    from saccade.config import PpoClipLossConfig
    from saccade.trainer import step as step_module
    from saccade.trainer.samples import MicroBatch
    from saccade.trainer.step import train_step

    made: list[weakref.ref] = []  # every micro-batch `to` made (a dataclass with eq: not hashable)
    seen: list[int] = []
    original_to, original_forward = MicroBatch.to, step_module.forward_logprobs

    def to(self, device):
        moved = original_to(self, device)
        made.append(weakref.ref(moved))
        return moved

    def forward(model, mb, **kwargs):
        seen.append(sum(ref() is not None for ref in made))
        return original_forward(model, mb, **kwargs)

    monkeypatch.setattr(MicroBatch, "to", to)
    monkeypatch.setattr(step_module, "forward_logprobs", forward)
    micro_batches = [mb for k in range(5) for mb in _text_micro_batches(2 + k)]
    assert len(micro_batches) == 5

    def run(batches):
        seen.clear()
        model = set_full_finetune(load_policy_lm(tiny_path))
        optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
        return train_step(model, optimizer, scheduler, batches, loss=PpoClipLossConfig(tis_cap=2.0), num_iterations=2,
                          grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[5, 6])

    made.clear()
    metrics = run(micro_batches)
    assert len(seen) == 3 * 5 and max(seen) == 2, seen  # one pass for TIS, two optimizer iterations
    assert metrics["micro_batches"] == 5 and metrics["skipped_steps"] == 0

    made.clear()
    up_front = [mb.to("cpu") for mb in micro_batches]  # what rl.py did before: the whole step moved first
    run(up_front)
    assert max(seen) >= 5


def test_masked_is_keeps_the_engines_ratio_and_masks_by_the_trainers_logprobs(tiny_path):
    """Masked IS without TIS: no pass of its own, the clipped ratio stays pi / mu (against the
    engine's logprobs: the trust region over the lag), and the mask is taken by this forward's
    logprobs. The engine said -2 for every completion token and the random model says about
    -7: pi / mu ~ e^-5 leaves [0.5, 2], every token is masked, no policy gradient at all. With TIS
    on the ratio is the trainer's own (1 at the first optimizer step), the mask the same."""
    from saccade.config import PpoClipLossConfig
    from saccade.trainer.step import train_step

    def run(loss):
        model = set_full_finetune(load_policy_lm(tiny_path))
        optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
        return train_step(model, optimizer, scheduler, _text_micro_batches(), loss=loss, num_iterations=1,
                          grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[5, 6])

    masked = run(PpoClipLossConfig(is_mask="on"))
    assert masked["is_masked_frac"] == 1.0 and masked["grad_norm"] == 0.0
    assert masked["ratio_mean"] < 0.05  # pi / mu, about e^-5: not the trainer's own ratio, 1
    with_tis = run(PpoClipLossConfig(is_mask="on", tis_cap=2.0))
    assert with_tis["is_masked_frac"] == 1.0 and with_tis["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    wide = run(PpoClipLossConfig(is_mask="on", is_mask_low=1e-4))  # e^-5 = 0.0067 is inside
    assert wide["is_masked_frac"] == 0.0 and wide["grad_norm"] > 0


@pytest.mark.parametrize("normalization", ["token", "sequence", "constant"])
def test_counting_the_filtered_groups_trains_the_unfiltered_batch(tiny_path, normalization):
    """loss.denominator 'sampled': the kept samples with the dropped ones' loss tokens and
    samples counted take the gradient of the whole batch, the dropped ones at advantage 0 (what
    a group without reward spread carries); 'kept' scales it up by sampled / kept (here 2x)."""
    from saccade.config import PpoClipLossConfig
    from saccade.trainer.packing import pack
    from saccade.trainer.step import train_step

    def grad_norm(samples, denominator, filtered=(0, 0)):
        model = set_full_finetune(load_policy_lm(tiny_path))
        optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
        batches = pack(samples, lambda key: None, max_tokens=256, image_token_id=-1, spatial_merge_size=2)
        loss = PpoClipLossConfig(normalization=normalization, denominator=denominator)
        return train_step(model, optimizer, scheduler, batches, loss=loss, num_iterations=1, grad_clip=1e9,
                          distribution=SampledDistribution(), banned_token_ids=[], filtered=filtered)["grad_norm"]

    everything = _text_samples(4, advantages=[1.0, -1.0, 0.0, 0.0])
    unfiltered = grad_norm(everything, "kept")
    counted = grad_norm(everything[:2], "sampled", filtered=(10, 2))
    assert counted == pytest.approx(unfiltered, rel=1e-5)
    assert grad_norm(everything[:2], "kept", filtered=(10, 2)) == pytest.approx(2 * unfiltered, rel=1e-5)
