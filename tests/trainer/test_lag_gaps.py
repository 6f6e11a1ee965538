"""The trainer-engine gap by lag and by whether a token follows an image (`saccade.trainer.step.
lag_gap_sums`, `lag_gap_figures`, `saccade.trainer.samples.after_image`), and the clipped share of
sequences weighed by sequences over a step's micro-batches, by hand."""

from __future__ import annotations

import pytest
import torch

from saccade.trainer.samples import MicroBatch, after_image
from saccade.trainer.step import lag_gap_figures, lag_gap_sums

PAD = 9  # the image pad's id in these rows


def test_after_image_is_true_from_the_token_after_the_first_pad_on():
    ids = torch.tensor([1, 2, PAD, PAD, 3, 4])
    assert after_image(ids, PAD).tolist() == [False, False, False, True, True, True]
    assert after_image(torch.tensor([1, 2, 3]), PAD).tolist() == [False, False, False]


def micro_batch(samples, mask, versions, engine):
    """One row of the samples (lists of ids) side by side, as packing lays them out."""
    ids_N = torch.tensor([i for ids in samples for i in ids])
    n, bounds = len(ids_N), [0]
    for ids in samples:
        bounds.append(bounds[-1] + len(ids))
    return MicroBatch(
        input_ids=ids_N.unsqueeze(0), position_ids=torch.zeros(4, 1, n, dtype=torch.long),
        loss_mask=torch.tensor(mask), inference_logprobs=torch.tensor(engine), advantages=torch.zeros(n),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32), image_embeds=None, deepstack=None,
        image_grid_thw=torch.zeros(0, 3, dtype=torch.long), sample_ids=[f"s{i}" for i in range(len(samples))],
        policy_versions=torch.tensor(versions),
        after_image=torch.cat([after_image(torch.tensor(ids), PAD) for ids in samples]))


def test_the_gap_by_lag_and_kind_by_hand():
    # sample 1: prompt 1, PAD (masked), then loss tokens 5, 6 (after the image), sampled at version
    # 7 (lag 1 at version 8); sample 2, text only: a loss token at lag 0 and one at lag 3 (past the
    # bound 2: counted nowhere; one sample's tokens share a version in a real batch).
    mb = micro_batch([[1, PAD, 5, 6], [2, 3, 4]], [False, False, True, True, False, True, True],
                     [7, 7, 7, 7, 8, 8, 5], [0.0, 0.0, -1.0, -2.0, 0.0, -3.0, -4.0])
    trainer = torch.tensor([0.0, 0.0, -1.5, -1.0, 0.0, -3.25, 0.0])
    sums = lag_gap_sums(trainer - mb.inference_logprobs, mb, current_version=8, lags=3)
    assert sums.shape == (3, 2, 2)
    assert sums[1, 1].tolist() == [0.5 + 1.0, 2.0]  # after the image, lag 1
    assert sums[0, 0].tolist() == [0.25, 1.0]  # text, lag 0
    assert sums.sum(dim=(0, 1)).tolist() == [1.75, 3.0]  # the lag-3 token: nowhere
    figures = lag_gap_figures(sums)
    assert figures == {"mismatch_abs_lag0": 0.25, "mismatch_abs_text_lag0": 0.25, "mismatch_abs_image_lag1": 0.75}


def test_a_train_step_weighs_the_clipped_share_of_sequences_by_sequences(tiny_path):
    """Two micro-batches, one of 3 sequences all clipped and one of 1 long sequence clipped nowhere:
    clip_frac_seq is 3 / 4 of the step's sequences (weighed by tokens it would not be). The engine's
    logprobs far under the trainer's (ratio >> 1.28, advantage > 0) clip every token of the first."""
    from saccade.config import PpoClipLossConfig
    from saccade.models.families import family_of
    from saccade.models.lm import load_policy_lm, set_full_finetune
    from saccade.models.sampling import SampledDistribution
    from saccade.trainer.packing import collate
    from saccade.trainer.samples import make_sample
    from saccade.trainer.step import build_optimizer, train_step

    positions = family_of({"model_type": "qwen3_vl"}).positions(2)
    gen = torch.Generator().manual_seed(5)

    def sample(name, length, engine_logprob, advantage):
        ids = torch.randint(10, 200, (length,), generator=gen)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[2:] = True
        return make_sample(name, ids, torch.zeros(length, dtype=torch.long), None, [], positions=positions,
                           loss_mask=mask, inference_logprobs=torch.where(mask, engine_logprob, 0.0),
                           advantage=advantage, policy_version=0)

    # The first three: the engine said -30 (ratio e^20: clipped, A > 0); the last: the engine said 0
    # (ratio < 1, A > 0: below the band with a positive advantage is never clipped).
    clipped = collate([sample(f"c{i}", 6, -30.0, 1.0) for i in range(3)], lambda key: None, image_token_id=-1,
                      spatial_merge_size=2)
    kept = collate([sample("k", 40, 0.0, 1.0)], lambda key: None, image_token_id=-1, spatial_merge_size=2)
    model = set_full_finetune(load_policy_lm(tiny_path))
    optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.0, schedule=lambda s: 1.0)
    metrics = train_step(model, optimizer, scheduler, [clipped, kept], loss=PpoClipLossConfig(), num_iterations=1,
                         grad_clip=1.0, distribution=SampledDistribution(), banned_token_ids=[], current_version=0)
    assert metrics["clip_frac_seq"] == pytest.approx(3 / 4)
    assert metrics["clip_frac"] == pytest.approx(12 / 50)  # tokens: 3 x 4 of 12 + 38
    assert "mismatch_abs_text_lag0" in metrics and "mismatch_abs_image_lag0" not in metrics
