"""The embedded engine: samples what the trainer would compute, never a vision token, shares weights."""

from __future__ import annotations

import pytest
import torch

from saccade.models.sampling import SampledDistribution
from saccade.tools.bench.engine import trainer_logprob_diffs
from saccade.inference.engine import ChatRequest, SamplingParams
from saccade.inference.local import LocalEngine
from saccade.config import LoraConfig
from saccade.models.families import FAMILIES
from saccade.models.presets import preset_path, tiny_preset
from saccade.models.families.interface import no_routing
from saccade.models.lm import apply_lora, load_policy_lm
from saccade.orchestrator.samples import completion_to_sample
from saccade.tools.parity import parity_conversations
from saccade.models.lm import unwrap_policy
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import pack

MISMATCH_MEAN = 1e-4  # fp32, mean |engine - trainer| over sampled tokens
MISMATCH_MAX = 1e-3


def _requests():
    # Prompts without the assistant answers: one image, three, mixed sizes, text only, multi-turn.
    return [
        ChatRequest(name, [m for m in msgs if m["role"] != "assistant"] if name != "multi_turn" else msgs[:3])
        for name, msgs in parity_conversations().items()
    ]


@pytest.fixture()
def lora_engine(tiny_path, processor, encoder):
    model = apply_lora(load_policy_lm(tiny_path), LoraConfig(rank=4))
    # Move the adapters off zero so the LoRA path really contributes.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    return LocalEngine(model, processor, encoder, seed=0)


def _trainer_logprobs(engine, completions, temperature_or_distribution):
    distribution = temperature_or_distribution
    if not isinstance(distribution, SampledDistribution):
        distribution = SampledDistribution(temperature=distribution)
    return trainer_logprob_diffs(
        engine.model, completions, cache_get=engine.encoder.cache.get,
        image_token_id=unwrap_policy(engine.model).image_token_id, banned_token_ids=engine.banned_token_ids,
        distribution=distribution,
    )


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family_parts(request):
    """(family, its tiny preset's processor, tower) for every registered family."""
    from saccade.models.loading import load_processor, load_vision_tower

    family = request.param
    path = preset_path(tiny_preset(family))
    return family, path, load_processor(path), load_vision_tower(path)


@pytest.fixture()
def family_lora_engine(family_parts, limits):
    """The family's tiny model with LoRA on the family's own targets (Qwen3.5: the Gated DeltaNet's
    linears too), adapters moved off zero so the LoRA path contributes. Every 7th token id stops
    a row, so rows finish at different steps and leave the decode batch (and its cache) midway."""
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    family, path, processor, tower = family_parts
    model = apply_lora(load_policy_lm(path), LoraConfig(rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    engine = LocalEngine(model, processor, VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache()), seed=0)
    engine.stop_token_ids = list(range(0, unwrap_policy(model).lm_head.weight.shape[0], 7))
    return engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_are_what_the_trainer_computes(family_lora_engine, temperature):
    """Every family, fp32, LoRA on: the five parity prompts (one image, three, mixed sizes, text only,
    multi-turn: padded rows of different lengths), n = 3, rows finishing at different steps; the
    trainer's logprob of every sampled token against the engine's, the samples packed into rows
    (a hybrid's linear layers restart at each sample: saccade.models.linear_attention)."""
    engine = family_lora_engine
    family = unwrap_policy(engine.model).family
    max_tokens = 12
    groups = engine.generate(_requests(), SamplingParams(temperature=temperature, max_tokens=max_tokens, n=3))
    assert [len(g) for g in groups] == [3] * 5
    completions = [c for g in groups for c in g]
    lengths = sorted(c.completion_ids.numel() for c in completions)
    # Some rows left the batch before others. (Not also "one ran to max_tokens": with every 7th
    # id a stop, 15 rows all stop early about 1 time in 14, and a float-level flip of one sampled
    # token between runs decides it; that failed once on Qwen2.5-VL at T=0.7.)
    assert lengths[0] < lengths[-1] <= max_tokens
    diff = _trainer_logprobs(engine, completions, temperature)
    print(f"{family.name} T={temperature}: {diff.numel()} tokens, "
          f"mismatch mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}")
    assert diff.numel() == sum(lengths)
    assert float(diff.mean()) <= MISMATCH_MEAN and float(diff.max()) <= MISMATCH_MAX
    for c in completions:
        assert 1 <= c.completion_ids.numel() <= max_tokens
        assert c.finish_reason in ("stop", "length")
        assert c.prompt_ids.numel() == c.mm_token_type_ids.numel()
        assert len(c.image_keys) == c.image_grid_thw.shape[0]
        assert (c.routed_experts is None) == (family.record_routing is no_routing)  # only a MoE records routing


def test_vision_tokens_are_never_sampled(tiny_path, processor, encoder):
    policy = load_policy_lm(tiny_path)
    engine = LocalEngine(policy, processor, encoder, seed=1)
    # Make the model adore the vision tokens: without the ban it would sample little else.
    with torch.no_grad():
        policy.lm_head.weight[engine.banned_token_ids] *= 400.0
    plain = policy.lm_head.weight.clone()
    groups = engine.generate(_requests()[:2], SamplingParams(temperature=1.5, max_tokens=12, n=8))
    sampled = torch.cat([c.completion_ids for g in groups for c in g])
    assert sampled.numel() > 50
    assert not torch.isin(sampled, torch.tensor(engine.banned_token_ids)).any()
    assert torch.equal(plain, policy.lm_head.weight)  # the ban is applied to logits, not weights
    # And the ban is what stops them: unbanned, the same model samples vision tokens.
    engine.banned_token_ids = []
    groups = engine.generate(_requests()[:1], SamplingParams(temperature=1.5, max_tokens=4, n=8))
    unbanned = torch.cat([c.completion_ids for g in groups for c in g])
    assert torch.isin(unbanned, torch.tensor(vision_ids(processor))).any()


def vision_ids(processor):
    from saccade.inference.engine import vision_token_ids

    return vision_token_ids(processor.tokenizer)


def test_weights_are_shared_so_the_sync_costs_nothing(lora_engine, encoder):
    """After an optimizer step the engine samples from the new weights, with no copy at all."""
    model = lora_engine.model
    requests = _requests()[:2]
    groups = lora_engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=6, n=2))
    completions = [c for g in groups for c in g]
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    policy = unwrap_policy(model)
    samples = [completion_to_sample(c, sample_id=str(i), advantage=1.0, reward=0.0, positions=encoder.positions)
               for i, c in enumerate(completions)]
    mb = pack(samples, encoder.cache.get, max_tokens=4096, image_token_id=policy.image_token_id,
              spatial_merge_size=encoder.merge)[0]
    lp, _ = forward_logprobs(model, mb, only_loss_tokens=True, banned_token_ids=lora_engine.banned_token_ids)
    (-(lp * mb.loss_mask).sum()).backward()
    opt.step()

    lora_engine.update_weights()
    assert lora_engine.policy_version == 1
    # Nothing was copied: the engine samples from the very tensors the optimizer updated.
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == pointers
    # Sample again with the same prompts: logprobs now follow the updated weights exactly.
    after = lora_engine.generate(requests, SamplingParams(temperature=1.0, max_tokens=6, n=2))
    new = [c for g in after for c in g]
    assert all(c.policy_version == 1 for c in new)
    diff = _trainer_logprobs(lora_engine, new, 1.0)
    assert float(diff.mean()) <= MISMATCH_MEAN and float(diff.max()) <= MISMATCH_MAX
    # And the old completions' logprobs did change under the new weights (the step was real).
    stale = _trainer_logprobs(lora_engine, completions, 1.0)
    assert float(stale.mean()) > 1e-3


@pytest.mark.parametrize("options", [{"top_k": 4}, {"min_p": 0.3}, {"top_p": 0.5}],
                         ids=["top_k", "min_p", "top_p"])
def test_truncated_sampling_logprobs_are_what_the_trainer_computes(lora_engine, options):
    """The engine draws from, and reports the logprob under, the truncated distribution; the
    trainer, recomputing each token's kept set from its own logits, scores the same one. The
    plain softmax (what the trainer computed before the truncation was modelled) is far off."""
    params = SamplingParams(temperature=0.8, max_tokens=6, n=3, **options)
    groups = lora_engine.generate(_requests()[:3], params)
    completions = [c for g in groups for c in g]
    diff = _trainer_logprobs(lora_engine, completions, params.distribution)
    untruncated = _trainer_logprobs(lora_engine, completions, SampledDistribution(temperature=0.8))
    assert diff.numel() >= 9
    assert float(diff.mean()) <= MISMATCH_MEAN and float(diff.max()) <= MISMATCH_MAX, float(diff.max())
    assert float(untruncated.mean()) > 100 * MISMATCH_MEAN, float(untruncated.mean())
    print(f"{options}: mismatch mean {float(diff.mean()):.2e} max {float(diff.max()):.2e}; "
          f"untruncated mean {float(untruncated.mean()):.2e} max {float(untruncated.max()):.2e}")


def test_tiny_top_p_is_greedy_and_greedy_is_deterministic(lora_engine):
    requests = _requests()[:3]
    greedy = lora_engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=6))
    again = lora_engine.generate(requests, SamplingParams(temperature=0.0, max_tokens=6))
    nucleus = lora_engine.generate(requests, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=6))
    for a, b, c in zip(greedy, again, nucleus, strict=True):
        assert torch.equal(a[0].completion_ids, b[0].completion_ids)
        assert torch.equal(a[0].completion_ids, c[0].completion_ids)


def test_sampling_params_are_checked():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.0)


def test_the_decode_mask_built_here_equals_transformers_own(policy, processor, encoder, monkeypatch):
    """Padded rows (prompts of different lengths): decoding with the 4-D mask the engine builds
    (so transformers never asks the host whether the mask is all ones) gives bit for bit the
    tokens and logprobs of transformers' own mask from the 2-D one."""
    import saccade.inference.local as local

    requests = _requests()
    lengths = {len(r.messages) for r in requests}
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2)

    def sample(decode_mask):
        monkeypatch.setattr(local, "decode_mask", decode_mask)
        groups = LocalEngine(policy, processor, encoder, seed=3).generate(requests, params)
        return [c for g in groups for c in g]

    ours = sample(local.decode_mask)
    theirs = sample(lambda mask, padded, implementation: mask)  # the 2-D mask, every token
    assert len(lengths) > 1 or len({c.prompt_ids.numel() for c in ours}) > 1  # padding is there
    assert [c.completion_ids.tolist() for c in ours] == [c.completion_ids.tolist() for c in theirs]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(ours, theirs, strict=True))


def test_each_prompt_is_prefilled_once_and_finished_rows_leave_the_batch(tiny_path, processor, encoder):
    """Prefill runs on the distinct prompts only (not n copies); a row that stops leaves the decode
    batch; and neither changes a sample: the tokens equal those of a run where no row stops early."""
    engine = LocalEngine(load_policy_lm(tiny_path), processor, encoder, seed=3)
    batch_rows: list[int] = []
    hook = engine.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_rows.append(int(kwargs["inputs_embeds"].shape[0])), with_kwargs=True)
    real_next = engine._next_token
    stop = engine.stop_token_ids[0]
    steps = {"t": 0}

    def rows_0_to_3_stop_first(logits_BV, params, generators):
        token_B, logprob_B = real_next(logits_BV, params, generators)
        if steps["t"] == 0:
            token_B = token_B.clone()
            token_B[:4] = stop  # prompt 0's four samples end at once
        steps["t"] += 1
        return token_B, logprob_B

    params = SamplingParams(temperature=1.0, max_tokens=5, n=4)
    requests = _requests()[:2]
    try:
        engine.reseed(3)
        plain = engine.generate(requests, params)
        batch_rows.clear()
        engine._next_token = rows_0_to_3_stop_first
        engine.reseed(3)
        stopped = engine.generate(requests, params)
    finally:
        hook.remove()
    assert batch_rows[0] == 2  # the prefill: 2 prompts, not 8 rows
    assert batch_rows[1:] == [4] * (params.max_tokens - 1)  # decode: only prompt 1's 4 rows go on
    assert all(c.finish_reason == "stop" and c.completion_ids.tolist() == [stop] for c in stopped[0])
    for a, b in zip(plain[1], stopped[1], strict=True):  # the rows that went on drew the same tokens
        assert torch.equal(a.completion_ids, b.completion_ids)


def test_a_seeded_request_samples_the_same_completions_whatever_shares_its_batch(tiny_path, processor, encoder):
    """Completion j of a request draws from stream_seed(request.seed, j) alone: the same
    completions alone, batched with other prompts, in another chunk, or after other draws (how
    a rank of a sharded trainer samples its share of the prompts exactly as one process would)."""
    from dataclasses import replace

    engine = LocalEngine(load_policy_lm(tiny_path), processor, encoder, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3)
    seeded = [replace(r, seed=1000 + i) for i, r in enumerate(_requests())]

    def ids(groups):
        return [[c.completion_ids.tolist() for c in group] for group in groups]

    together = ids(engine.generate(seeded, params))
    alone = [ids(engine.generate([r], params))[0] for r in reversed(seeded)][::-1]
    engine.max_batch_rows = params.n  # one prompt per chunk
    chunked = ids(engine.generate(seeded, params))
    assert together == alone == chunked
    assert len({tuple(map(tuple, g)) for g in together}) == len(seeded)  # the prompts' draws differ
    assert any(len({tuple(c) for c in g}) > 1 for g in together)  # and so do a prompt's n samples
    other = ids(engine.generate([replace(seeded[0], seed=7)], params))[0]
    assert other != together[0]  # another seed, another stream


def test_the_decode_loop_makes_no_host_sync_per_token(tiny_path, processor, encoder):
    """Per decoded token: no tensor made from host data (the banned ids, stop ids, positions),
    nothing data-dependent in size, and a device read only at the stop checks (every 16 tokens,
    as on a GPU). Counted on the CPU with the dispatch mode of `saccade bench gpu`'s syncs stage
    (`saccade.tools.bench.syncs.OpCounter`): the difference between 36 and 4 decoded tokens is the
    per-token cost."""
    from saccade.tools.bench.syncs import OpCounter

    engine = LocalEngine(load_policy_lm(tiny_path), processor, encoder, seed=1)
    engine.stop_check_every = 16  # the GPU's setting; the CPU's 1 reads every token on purpose
    engine.stop_token_ids = [engine.banned_token_ids[0]]  # never sampled: every row runs to max_tokens
    prompts = engine.prepare_all(_requests()[:2])

    def count(max_tokens: int) -> OpCounter:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, n=4)
        with torch.no_grad(), OpCounter() as counter:
            engine._generate_prepared(prompts, params)
        assert all(len(c.completion_ids) == max_tokens for g in engine._generate_prepared(prompts, params) for c in g)
        return counter

    short, long = count(4), count(36)
    extra = {kind: long.kinds[kind] - short.kinds[kind] for kind in ("host_tensors", "dynamic_shapes", "host_reads")}
    assert extra["host_tensors"] == 0, long.ops - short.ops  # tensors made from host data
    assert extra["dynamic_shapes"] == 0, long.ops - short.ops  # nonzero, boolean indexing, ...
    # device values read on the host: "all stopped?" and "any stopped?" at tokens 16 and 32
    assert extra["host_reads"] <= 2 * 2, long.ops - short.ops
