"""The spike guard (saccade.trainer.spike): the rule on its own, and a poisoned batch in a real
train step skipped and counted while the run goes on."""

from __future__ import annotations

import math

import pytest
import torch

from saccade.config import GradSpikeConfig, PpoClipLossConfig, RunConfig, load_config
from saccade.models.lm import load_policy_lm, set_full_finetune
from saccade.models.sampling import SampledDistribution
from saccade.trainer.spike import GradSpikeGuard
from saccade.trainer.step import build_optimizer, train_step


def guard(**kw) -> GradSpikeGuard:
    return GradSpikeGuard.of(GradSpikeConfig(**kw))


def test_a_norm_far_above_the_recent_median_is_a_spike_after_the_warmup():
    g = guard(factor=10.0, window=6, warmup=3)
    assert [g.is_spike(x) for x in (0.2, 100.0, 0.3)] == [False, False, False]  # warming up: not judged
    assert g.median() == 0.3
    assert g.is_spike(2.9) is False and g.is_spike(3.1) is False  # 10x the median 0.3 (then 1.6) is the line
    g = guard(factor=10.0, window=6, warmup=3)
    for x in (0.2, 0.3, 0.25):
        g.is_spike(x)
    assert g.is_spike(2.6) is True and g.is_spike(0.3) is False
    # Not finite: not judged here (the step is skipped for that) and kept out of the window.
    assert g.is_spike(float("nan")) is False and g.is_spike(float("inf")) is False and len(g.norms) == 5


def test_a_lasting_change_of_scale_is_accepted_once_it_fills_half_the_window():
    g = guard(factor=10.0, window=8, warmup=3)
    for _ in range(8):
        g.is_spike(0.1)
    verdicts = [g.is_spike(5.0) for _ in range(8)]
    assert verdicts[:4] == [True] * 4 and not any(verdicts[5:])  # the median moves up to the new scale


def test_the_window_survives_a_checkpoint():
    g = guard(window=4, warmup=2)
    for x in (0.1, 0.2, 0.3, 0.4, 0.5):
        g.is_spike(x)
    again = guard(window=4, warmup=2)
    again.restore(g.saved())
    assert list(again.norms) == [0.2, 0.3, 0.4, 0.5] and again.median() == g.median()
    again.restore(None)  # a checkpoint from before the guard: an empty window
    assert list(again.norms) == []


def test_the_guard_is_off_by_default_and_true_turns_it_on():
    assert load_config(RunConfig).trainer.grad_spike is None
    assert load_config(RunConfig, None, ["--trainer.grad_spike", "true"]).trainer.grad_spike == GradSpikeConfig()
    on = load_config(RunConfig, None, ["--trainer.grad_spike", "true", "--trainer.grad_spike.factor", "20"])
    assert on.trainer.grad_spike.factor == 20.0
    assert load_config(RunConfig, None, ["--trainer.grad_spike", "false"]).trainer.grad_spike is None
    assert GradSpikeGuard.of(None) is None


def micro_batches(advantage_scale: float, seed: int):
    """Text-only samples with 5-token completions, advantages +-advantage_scale, in one micro-batch."""
    from saccade.trainer.packing import pack
    from saccade.models.families import family_of
    from saccade.trainer.samples import make_sample

    positions = family_of({"model_type": "qwen3_vl"}).positions(2)  # text only: 0..L-1 on every row
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(4):
        L = 12 + i
        ids = torch.randint(10, 200, (L,), generator=gen)
        mask = torch.zeros(L, dtype=torch.bool)
        mask[-5:] = True
        samples.append(make_sample(f"s{i}", ids, torch.zeros(L, dtype=torch.long), None, [], positions=positions,
                                   loss_mask=mask, inference_logprobs=torch.where(mask, -2.0, 0.0),
                                   advantage=advantage_scale * (-1.0) ** i))
    return pack(samples, lambda key: None, max_tokens=256, image_token_id=-1, spatial_merge_size=2)


def run_steps(tiny_path, batches: list[tuple[int, float]], spike: GradSpikeConfig | None):
    """Train steps of the tiny model, one per (seed, advantage scale); each step's metrics and the
    weights after it."""
    torch.manual_seed(0)
    model = set_full_finetune(load_policy_lm(tiny_path))
    optimizer, scheduler = build_optimizer(model, lr=1e-2, weight_decay=0.0, schedule=lambda s: 1.0)
    guard_ = GradSpikeGuard.of(spike)
    out = []
    for seed, scale in batches:
        metrics = train_step(model, optimizer, scheduler, micro_batches(scale, seed=seed), loss=PpoClipLossConfig(),
                             num_iterations=1, grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[],
                             spike_guard=guard_)
        out.append((metrics, torch.cat([p.detach().flatten().clone() for p in model.parameters()])))
    return out


def test_one_poisoned_batch_is_skipped_and_counted_and_the_run_goes_on(tiny_path):
    """Clipping bounds a poisoned step's size, not its harm: AdamW's moments take a gradient ~1e4x
    the others', and the next steps follow the poison's direction whatever their own batches say.
    Skipped, the run is exactly the run without that batch."""
    batches = [(k, 1.0) for k in range(6)] + [(6, 1e4)] + [(k, 1.0) for k in range(7, 12)]
    guarded = run_steps(tiny_path, batches, GradSpikeConfig(factor=10.0, window=20, warmup=5))
    plain = run_steps(tiny_path, batches, None)
    clean = run_steps(tiny_path, batches[:6] + batches[7:], None)  # the same run without the poisoned batch
    norms = [m["grad_norm"] for m, _ in plain]
    assert norms[6] > 1000 * max(norms[:6])
    spiked, weights = guarded[6]
    assert spiked["grad_spike_skipped"] == 1 and spiked["skipped_steps"] == 1 and "grad_norm" not in spiked
    assert spiked["grad_norm_spike"] == pytest.approx(norms[6], rel=1e-6)
    assert torch.equal(weights, guarded[5][1])  # nothing applied
    # ...the run goes on, and is bit for bit the run that never saw the batch.
    assert all(m["grad_spike_skipped"] == 0 and math.isfinite(m["grad_norm"]) for m, _ in guarded[7:])
    assert all(torch.equal(g, c) for (_, g), (_, c) in zip(guarded[:6] + guarded[7:], clean, strict=True))
    # Unguarded, AdamW's moments carry the poison: the next step moves where it pointed, whatever its own
    # batch says (cosine 0.996 measured; the clean run's consecutive steps 0.85), and after five steps the
    # weights are 0.76x as far from the clean run's as the clean run moved in them.
    update = lambda run, k: run[k][1] - run[k - 1][1]  # noqa: E731
    assert torch.nn.functional.cosine_similarity(update(plain, 7), update(plain, 6), dim=0) > 0.98
    drift = float((plain[-1][1] - clean[-1][1]).norm())
    assert drift > 0.5 * float((clean[-1][1] - clean[5][1]).norm())
    assert all("grad_spike_skipped" not in m for m, _ in plain)  # off: no figure
