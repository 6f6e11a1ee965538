"""The trainer benchmark's batch: varied lengths, and a padded layout whose pads never count."""

from __future__ import annotations


def test_padded_layout_pads_at_the_end_only(processor, encoder, limits):
    """Varied lengths give pads; pads come after each sample's tokens and never enter the loss."""
    from saccade.tools.bench.trainer_data import bench_conversations, pad_batches, pad_fraction, prepare_batch

    conversations = bench_conversations(4, seed=0, max_side=128)
    batch, timings = prepare_batch(
        processor, encoder, conversations, seed=0, limits=limits, max_tokens=None, padded_rows=2, full_layout="packed"
    )
    assert set(batch.embeddings) == {key for s in batch.samples for key in s.image_keys}
    assert timings["encode_once_s"] > 0 and timings["preprocess_once_s"] > 0
    lengths = [s.num_tokens for s in batch.samples]
    assert len(set(lengths)) > 1, f"the bench data must have varied lengths, got {lengths}"
    rows = [row for pb in pad_batches(batch) for row in zip(pb.input_ids_BL, pb.loss_mask_BL, strict=True)]
    for sample, (ids, mask) in zip(batch.samples, rows, strict=True):
        n = sample.num_tokens
        assert ids[:n].tolist() == sample.input_ids.tolist()
        assert (ids[n:] == batch.pad_token_id).all() and not mask[n:].any()
    padded, packed = pad_fraction(batch)
    assert padded > 0 and packed == 0
