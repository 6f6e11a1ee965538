"""Token-in/token-out trajectories: the trainer computes exactly what the engine sampled from."""

from __future__ import annotations

import pytest
import torch

from saccade.models.sampling import SampledDistribution
from saccade.tools.bench.engine import sample_logprob_diffs
from saccade.data.messages import messages_to_inputs
from saccade.envs.examples import AsyncLookAgainEnv, LookAgainEnv
from saccade.envs.rollout import run_episodes
from saccade.envs.trajectory import (
    ChatContinuation,
    ConsistencyError,
    add_completion,
    add_forced_turn,
    add_messages,
    check_consistency,
    loss_token_experts,
    marker_mask,
    start_trajectory,
    to_training_sample,
)
from saccade.inference.engine import Completion, SamplingParams
from saccade.inference.local import LocalEngine
from saccade.models.lm import load_policy_lm
from saccade.models.lm import unwrap_policy
from saccade.models.families import family_of
from saccade.trainer.samples import make_sample

MISMATCH_MEAN = 1e-4  # fp32, mean |engine - trainer| over every sampled token of the trajectories
MISMATCH_MAX = 1e-3  # fp32, the worst single token (the engine-parity bench's max bar)
POSITIONS = family_of({"model_type": "qwen3_vl"}).positions(2)  # the tiny model's (the engine's own: a test below)


@pytest.fixture(scope="module")
def local_engine(tiny_path, processor, limits):
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    encoder = VisionEncoder(load_vision_tower(tiny_path), processor, limits=limits, cache=EmbeddingCache())
    return LocalEngine(load_policy_lm(tiny_path).eval(), processor, encoder, seed=3)


@pytest.fixture(scope="module")
def continuation(processor, limits):
    return ChatContinuation(processor, limits=limits)


def episodes(engine, continuation, n=4, env_cls=LookAgainEnv, max_tokens=6):
    envs = [env_cls(max_turns=3, seed=i) for i in range(n)]
    return run_episodes(engine, envs, list(range(n)), [f"ep{i}" for i in range(n)],
                        SamplingParams(temperature=1.0, max_tokens=max_tokens), continuation=continuation)


def test_three_turn_trajectories_match_the_engine(local_engine, continuation):
    trajectories = episodes(local_engine, continuation)
    positions = local_engine.encoder.positions
    samples = []
    for t in trajectories:
        assert len(t.turns) == 3 and t.done
        # 1 image at the start, then 1 or 2 per environment reply: 3..5, in order
        assert len(t.image_keys) == 1 + sum(1 + (k + int(t.sample_id[2:])) % 2 for k in (1, 2))
        assert t.rewards[:2] == [0.1, 0.1]
        sample = to_training_sample(t, positions=positions)
        check_consistency(sample, t.turns, positions=positions)
        samples.append(sample)
    diff = sample_logprob_diffs(local_engine.model, samples, cache_get=local_engine.encoder.cache.get,
                                image_token_id=unwrap_policy(local_engine.model).image_token_id,
                                banned_token_ids=local_engine.banned_token_ids, distribution=SampledDistribution(),
                                merge=positions.merge)
    assert diff.numel() == sum(int(s.loss_mask.sum()) for s in samples) >= 4 * 3
    assert float(diff.mean()) <= MISMATCH_MEAN
    assert float(diff.max()) <= MISMATCH_MAX, float(diff.max())


def test_async_environments_give_the_same_episodes(local_engine, continuation):
    local_engine.reseed(7)
    sync = episodes(local_engine, continuation, n=2)
    local_engine.reseed(7)
    asynchronous = episodes(local_engine, continuation, n=2, env_cls=AsyncLookAgainEnv)
    for a, b in zip(sync, asynchronous, strict=True):
        assert a.input_ids == b.input_ids and a.rewards == b.rewards and a.image_keys == b.image_keys


def test_the_check_catches_a_retokenized_trajectory(local_engine, continuation, processor, limits):
    """The classic mistake: rebuild the training sample by re-rendering the conversation from text.
    Seeded so that a reply does not survive decode + re-tokenize (about 3 seeds in 5 here; with
    the others only the logprobs are lost, which the check also refuses)."""
    local_engine.reseed(12)
    envs = [LookAgainEnv(max_turns=3, seed=0)]
    [t] = run_episodes(local_engine, envs, [0], ["ep0"], SamplingParams(temperature=1.0, max_tokens=6),
                       continuation=continuation)
    # Replay the conversation as messages: the environment's messages and the decoded texts.
    env = LookAgainEnv(max_turns=3, seed=0)
    messages = env.reset(0)
    for text in t.texts:
        messages.append({"role": "assistant", "content": text})
        result = env.step({"role": "assistant", "content": text})
        messages += result.messages
    inputs = messages_to_inputs(messages, processor, limits=limits)
    keys = [local_engine.key_for_hash(h) for h in inputs.image_hashes]
    retokenized = make_sample("ep0", inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw, keys,
                              positions=POSITIONS)
    assert keys == t.image_keys  # same images, same order: only the token ids differ
    with pytest.raises(ConsistencyError, match="re-tokenized"):
        check_consistency(retokenized, t.turns, positions=POSITIONS)
    check_consistency(to_training_sample(t, positions=POSITIONS), t.turns, positions=POSITIONS)


def test_the_check_catches_dropped_or_reordered_images(local_engine, continuation):
    local_engine.reseed(5)
    [t] = episodes(local_engine, continuation, n=1)
    sample = to_training_sample(t, positions=POSITIONS)
    sample.image_keys = [sample.image_keys[1], sample.image_keys[0], *sample.image_keys[2:]]
    with pytest.raises(ConsistencyError, match="images"):
        check_consistency(sample, t.turns, positions=POSITIONS)
    shifted = to_training_sample(t, positions=POSITIONS)
    shifted.position_ids = shifted.position_ids.clone()
    shifted.position_ids[1:, 5:] += 1
    with pytest.raises(ConsistencyError, match="positions"):
        check_consistency(shifted, t.turns, positions=POSITIONS)


def test_loss_falls_on_sampled_tokens_only(local_engine, continuation):
    local_engine.reseed(2)
    [t] = episodes(local_engine, continuation, n=1)
    sample = to_training_sample(t, positions=POSITIONS)
    sampled = sum(turn.completion_ids.numel() for turn in t.turns)
    assert int(sample.loss_mask.sum()) == sampled
    bad = to_training_sample(t, positions=POSITIONS)
    bad.loss_mask = torch.ones_like(bad.loss_mask)  # e.g. the environment's tokens trained on too
    with pytest.raises(ConsistencyError, match="did not sample"):
        check_consistency(bad, t.turns, positions=POSITIONS)


def test_marker_mask_selects_spans_inside_markers(processor):
    tok = processor.tokenizer
    text = "I think. [ACTION]turn left[/ACTION] then [ACTION]look"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = marker_mask(ids, tok, "[ACTION]", "[/ACTION]")
    kept = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "turn left" in kept and "look" in kept
    assert "I think" not in kept and "then" not in kept


def test_continuation_is_the_templates_incremental_form(processor, limits, continuation):
    """Rendering the whole conversation and tokenizing it once gives the same ids as the
    opening + kept assistant ids + continuation, when the assistant text round-trips."""
    from saccade.envs.trajectory import Trajectory, add_forced_turn, add_messages, start_trajectory

    env = LookAgainEnv(max_turns=3, seed=1)
    messages = env.reset(0)
    t = start_trajectory("x", messages, processor, limits=limits, key_for_hash=lambda h: h)
    eot = continuation.end_of_turn_id
    for answer in ("It is red.", "Now blue."):
        add_forced_turn(t, answer, processor.tokenizer, end_of_turn_id=eot)
        reply = env.step({"role": "assistant", "content": answer}).messages
        add_messages(t, reply, continuation, key_for_hash=lambda h: h)
        messages += [{"role": "assistant", "content": answer}, *reply]
    whole = messages_to_inputs(messages, processor, limits=limits, add_generation_prompt=True)
    assert t.input_ids == whole.input_ids.tolist()
    assert isinstance(t, Trajectory) and t.image_keys == whole.image_hashes


def _turn(ids: list[int], first_mark: int) -> Completion:
    """An engine's answer whose experts (2 MoE layers, top-2) mark each sampled token in order."""
    C = len(ids)
    marks = torch.arange(first_mark, first_mark + C, dtype=torch.uint8)
    return Completion(request_id="r", prompt_ids=torch.zeros(0, dtype=torch.long),
                      mm_token_type_ids=torch.zeros(0, dtype=torch.long), completion_ids=torch.tensor(ids),
                      logprobs=torch.zeros(C), image_keys=[], image_grid_thw=torch.zeros(0, 3, dtype=torch.long),
                      finish_reason="stop", routed_experts=marks.view(C, 1, 1).expand(C, 2, 2).clone())


def test_the_engines_experts_follow_the_loss_tokens_across_turns(processor, limits, continuation):
    """Each turn's sampled tokens keep the engine's experts, into the sample's loss tokens (a turn
    cut by max_tokens is closed by a token nobody sampled, which has none); a forced turn, which
    no engine sampled, leaves the sample without them."""
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    t = start_trajectory("ep", [{"role": "user", "content": "Look."}], processor, limits=limits, key_for_hash=str)
    add_completion(t, _turn([11, 12, end], 0), end_of_turn_id=end)
    add_messages(t, [{"role": "user", "content": "Again."}], continuation, key_for_hash=str)
    add_completion(t, _turn([13, 14], 3), end_of_turn_id=end)  # cut: closed by an unsampled end
    sample = to_training_sample(t, positions=POSITIONS)
    assert sample.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 4]
    assert int(sample.loss_mask.sum()) == 5
    # A loss on part of the sampled tokens (markers): the experts of those tokens only.
    sampled_at = torch.tensor(t.sampled).nonzero().squeeze(1).tolist()
    part = torch.tensor(t.sampled) & (torch.arange(t.num_tokens) % 2 == 0)
    assert loss_token_experts(t, part)[:, 0, 0].tolist() == [i for i, at in enumerate(sampled_at) if at % 2 == 0]
    add_forced_turn(t, "done", processor.tokenizer, end_of_turn_id=end)
    assert to_training_sample(t, positions=POSITIONS).routed_experts is None
