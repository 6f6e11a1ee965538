"""The embedded engine: samples in-process from the trainer's own model, with a KV cache.

It is the default engine and needs nothing beyond saccade. In single-process mode it
holds a reference to the very module the trainer optimises (LoRA adapters included),
so after an optimizer step there is nothing to copy: `update_weights` only bumps the
policy version. Prompts run the same LM-only path as the trainer: image and clip features
come from the VisionEncoder's cache (the tower runs once per distinct image or clip:
`VisionEncoder.encode`, `encode_videos`) and are scattered into the token embeddings,
DeepStack included, with M-RoPE positions from the model family's (`VisionEncoder.positions`,
clips included).

Batching: the distinct prompts are left-padded into one batch and prefilled once; each
prompt's KV cache is then repeated for its n samples, and one token per step is decoded for
every row that has not stopped (finished rows leave the batch). A hybrid's cache (Qwen3.5: a
conv and a recurrent state in each Gated DeltaNet layer, keys and values in the full-attention
ones) is repeated and cut the same way (`take_rows`); left padding leaves those states exact,
as transformers zeroes the pads' inputs to the linear layers (tests/models/test_qwen3_5.py).
Simplified on purpose: no paged attention, no continuous batching, no speculative decoding;
that is vLLM's job.

Logprobs: the engine reports log softmax(logits / temperature) with the vision tokens
masked out and, with top_k, top_p or min_p set, renormalised over the kept set
(`saccade.models.sampling.kept_tokens`, vLLM's rule): the distribution the token was drawn
from, i.e. exactly what `forward_logprobs(..., distribution, banned_token_ids)` computes in
the trainer.
Like the trainer's, the logits are the lm_head's model-dtype products summed in float32, never
rounded to bf16 (`saccade.models.head`: vLLM's lm_head with head_dtype float32), and the banned
tokens get the same bias row, built once per engine; so both score the same distribution in
any precision, and nothing is rebuilt per token (the head's float32 copy on the CPU is made
once per rollout; on CUDA there is none).

Randomness: every completion draws from its own stream, a generator seeded with
`stream_seed(request.seed, j)` for completion j of a request (a request without a seed gets
one from the engine's generator). A token is drawn by the exponential race (argmax of
p / E, E ~ Exp(1) from the row's stream, which samples p exactly), so a completion does not
depend on which other rows share its batch: the same request samples the same completion
alone, in another chunk, or on another rank of a sharded trainer.

Mixture of experts: while sampling, the family's `record_routing` (a hook on each router; dense
families have none and pay nothing) records the experts every sampled token's logits were
computed with, which each `Completion` carries as `routed_experts` (T, Y, K: tokens, MoE layers, top_k) for the
train step to compare with its own (`saccade.trainer.routing`).

Device: the engine runs where the model is. Sampled tokens, logprobs and stop flags stay
on that device during decoding, drawn with generators on it; the host learns whether
every row has stopped only every `stop_check_every` tokens (every token on the CPU, where
reading it costs nothing), so a GPU decode loop does not wait on the host token by token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from saccade.timing import timed
from saccade.config import ImagesConfig
from saccade.data.messages import ModelInputs, messages_to_inputs
from saccade.inference.engine import (
    ChatRequest, Completion, SamplingParams, TokenPrompt, stop_token_ids, stream_seed, vision_token_ids,
)
from saccade.models.attention import PACKED_SDPA
from saccade.models.head import head_logits, matmul_weight
from saccade.models.lm import ban_bias, unwrap_policy
from saccade.models.sampling import kept_tokens
from saccade.models.vision import ImageEmbedding, VisionEncoder


@dataclass
class PreparedPrompt:
    request: ChatRequest | TokenPrompt
    inputs: ModelInputs  # its `videos` are the prompt's clips (keys, grids, seconds per temporal patch)
    image_keys: list[str]
    embeddings: list[ImageEmbedding]
    mrope_3L: torch.Tensor
    video_embeddings: list[ImageEmbedding] = field(default_factory=list)  # one per clip, in order

    @property
    def length(self) -> int:
        return int(self.inputs.input_ids.shape[0])


class LocalEngine:
    def __init__(
        self,
        model: nn.Module,
        processor,
        encoder: VisionEncoder,
        *,
        limits: ImagesConfig | None = None,
        seed: int = 0,
        max_batch_rows: int = 512,
    ):
        self.model = model  # shared with the trainer: the same tensors, not a copy
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.encoder = encoder
        self.limits = limits or encoder.limits
        self.max_batch_rows = max_batch_rows
        self.banned_token_ids = vision_token_ids(self.tokenizer)  # also builds ban_bias_V
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id or self.stop_token_ids[0]
        self.device = unwrap_policy(model).lm_head.weight.device
        # Seeds for requests that bring none; each completion then draws from its own stream.
        self.generator = torch.Generator().manual_seed(seed)
        # CPU: checking every token is free. GPU: one host read per 16 tokens, not one per token.
        self.stop_check_every = 1 if self.device.type == "cpu" else 16
        self.policy_version = 0

    @property
    def banned_token_ids(self) -> list[int]:
        return self._banned_token_ids

    @banned_token_ids.setter
    def banned_token_ids(self, ids: list[int]) -> None:
        # The lm_head's bias row with these tokens at BANNED_LOGIT, built here, once, on the
        # device: no decoded token copies a list of ids from the host.
        self._banned_token_ids = list(ids)
        self.ban_bias_V = ban_bias(unwrap_policy(self.model).lm_head, self._banned_token_ids)

    # The engine samples from the trainer's module itself: new weights need no copy.
    shares_weights = True

    # --- weights ---------------------------------------------------------------------
    def update_weights(self, version: int | None = None) -> float:
        """Nothing to move; only the policy version advances (to `version` when given)."""
        start = time.perf_counter()
        self.policy_version = self.policy_version + 1 if version is None else version
        return time.perf_counter() - start

    def confirm_weights(self, version: int) -> None:
        """One engine, no servers: nothing can have missed an update."""

    # --- sampling randomness ---------------------------------------------------------
    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def rng_state(self) -> list[int]:
        """The sampler's state, for a checkpoint: a resumed run draws the same samples."""
        return self.generator.get_state().tolist()

    def set_rng_state(self, state: list[int] | None) -> None:
        if state is not None:
            self.generator.set_state(torch.tensor(state, dtype=torch.uint8))

    # --- counters ----------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """None: in-process, nothing is retried, rerouted or taken out, and the engine never
        waits for a server (its sampling time is the step's `rollout_s`)."""
        return {}

    # --- prompts ---------------------------------------------------------------------
    def prepare(self, request: ChatRequest) -> PreparedPrompt:
        inputs = messages_to_inputs(
            request.messages, self.processor, limits=self.limits, add_generation_prompt=True, sample=request.request_id
        )
        keys = [self.encoder.key_for_hash(h) for h in inputs.image_hashes]
        # The processor's pixels are reused for the tower when the limits agree: no second resize.
        pixels = (inputs.pixel_values, inputs.image_grid_thw) if self.limits == self.encoder.limits else None
        embeddings = self.encoder.encode(inputs.images, keys, pixels=pixels) if inputs.images else []
        clips = []
        if inputs.clips:
            same = self.limits == self.encoder.limits
            clip_pixels = (inputs.pixel_values_videos, inputs.videos.grid_thw) if same else None
            clips = self.encoder.encode_videos(inputs.clips, inputs.videos.keys, pixels=clip_pixels)
        mrope = self.encoder.positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw, inputs.videos)
        return PreparedPrompt(request, inputs, keys, embeddings, mrope, clips)

    def prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        return [self.prepare(r) for r in requests]

    def key_for_hash(self, content_hash: str) -> str:
        return self.encoder.key_for_hash(content_hash)

    def encode_images(self, images: list, keys: list[str]) -> None:
        """Put these images' embeddings in the cache the trainer reads (SFT on trajectories)."""
        if keys:
            self.encoder.encode(images, keys)

    def encode_videos(self, clips: list, keys: list[str]) -> None:
        """Put these clips' (`VideoClip`) embeddings in the cache the trainer reads."""
        if keys:
            self.encoder.encode_videos(clips, keys)

    def prepare_tokens(self, prompt: TokenPrompt) -> PreparedPrompt:
        """A token prompt as it stands: its ids are used, never re-tokenized; images whose
        embeddings are not cached are encoded (the pixels must then be in `prompt.images`)."""
        if prompt.image_keys and not prompt.images and any(self.encoder.cache.get(k) is None for k in prompt.image_keys):
            raise ValueError(f"{prompt.request_id}: image embeddings not cached and no images given to encode")
        images = prompt.images or [None] * len(prompt.image_keys)
        embeddings = self.encoder.encode(images, prompt.image_keys) if prompt.image_keys else []
        grid = prompt.image_grid_thw.long()
        for i, emb in enumerate(embeddings):
            if not torch.equal(emb.grid_thw, grid[i]):
                raise ValueError(f"{prompt.request_id}: image {i} has grid {grid[i].tolist()} in the prompt but "
                                 f"{emb.grid_thw.tolist()} when encoded: the image limits differ")
        clips = []
        if len(prompt.videos):
            clips = self.encoder.encode_videos(prompt.clips or [None] * len(prompt.videos), prompt.videos.keys)
            for i, emb in enumerate(clips):
                if not torch.equal(emb.grid_thw, prompt.videos.grid_thw[i].long()):
                    raise ValueError(f"{prompt.request_id}: clip {i} has grid {prompt.videos.grid_thw[i].tolist()} in "
                                     f"the prompt but {emb.grid_thw.tolist()} when encoded: the video settings differ")
        inputs = ModelInputs(input_ids=prompt.input_ids.long(), mm_token_type_ids=prompt.mm_token_type_ids.long(),
                             pixel_values=None, image_grid_thw=grid if prompt.image_keys else None,
                             videos=prompt.videos)
        mrope = self.encoder.positions.mrope(inputs.mm_token_type_ids, inputs.image_grid_thw, inputs.videos)
        return PreparedPrompt(prompt, inputs, list(prompt.image_keys), embeddings, mrope, clips)

    # --- sampling --------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        return self._generate_prepared([self.prepare(r) for r in requests], params)

    @torch.no_grad()
    def generate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        """Sample after prompts given as token ids (multi-turn rollouts): nothing is re-tokenized."""
        # New images of all prompts through the tower in one call, not one call per prompt.
        missing = {k: im for p in prompts for k, im in zip(p.image_keys, p.images) if self.encoder.cache.get(k) is None}
        if missing:
            self.encoder.encode(list(missing.values()), list(missing))
        new_clips = {k: c for p in prompts for k, c in zip(p.videos.keys, p.clips) if self.encoder.cache.get(k) is None}
        if new_clips:
            self.encoder.encode_videos(list(new_clips.values()), list(new_clips))
        return self._generate_prepared([self.prepare_tokens(p) for p in prompts], params)

    def _generate_prepared(self, prepared: list[PreparedPrompt], params: SamplingParams) -> list[list[Completion]]:
        """n completions of each prompt: prompts in chunks of at most `max_batch_rows` decode rows."""
        per_chunk = max(1, self.max_batch_rows // params.n)
        out: list[list[Completion]] = []
        for start in range(0, len(prepared), per_chunk):
            out.extend(self._generate_chunk(prepared[start : start + per_chunk], params))
        return out

    def _request_seed(self, prompt: PreparedPrompt) -> int:
        seed = prompt.request.seed
        return int(torch.randint(0, 2**62, (1,), generator=self.generator)) if seed is None else seed

    def _row_generators(self, prompts: list[PreparedPrompt], params: SamplingParams) -> list[torch.Generator]:
        """Row b's stream (sample b % n of prompt b // n): stream_seed(request seed, b % n)."""
        if params.temperature == 0:
            return []
        seeds = [self._request_seed(p) for p in prompts]
        return [torch.Generator(device=self.device).manual_seed(stream_seed(seed, j))
                for seed in seeds for j in range(params.n)]

    def _generate_chunk(self, prompts: list[PreparedPrompt], params: SamplingParams) -> list[list[Completion]]:
        policy = unwrap_policy(self.model)
        was_training = self.model.training
        generators = self._row_generators(prompts, params)
        self.model.eval()
        try:
            tokens_BT, logprobs_BT, lengths_B, stopped_B, experts_BTYK = self._sample(policy, prompts, params, generators)
        finally:
            self.model.train(was_training)
        out = []
        for p, prompt in enumerate(prompts):
            group = []
            for b in range(p * params.n, (p + 1) * params.n):  # row b is sample b % n of prompt b // n
                n = int(lengths_B[b])
                ids = tokens_BT[b, :n].clone()
                experts = experts_BTYK[b, :n].clone() if experts_BTYK is not None else None
                group.append(self._completion(prompt, ids, logprobs_BT[b, :n].clone(), bool(stopped_B[b]), experts))
            out.append(group)
        return out

    def _completion(self, prompt: PreparedPrompt, ids: torch.Tensor, logprobs: torch.Tensor, stopped: bool,
                    routed_experts: torch.Tensor | None = None) -> Completion:
        return Completion(
            request_id=prompt.request.request_id,
            prompt_ids=prompt.inputs.input_ids.clone(),
            mm_token_type_ids=prompt.inputs.mm_token_type_ids.clone(),
            completion_ids=ids,
            logprobs=logprobs,
            image_keys=list(prompt.image_keys),
            image_grid_thw=(
                prompt.inputs.image_grid_thw.clone()
                if prompt.inputs.image_grid_thw is not None
                else torch.zeros(0, 3, dtype=torch.long)
            ),
            finish_reason="stop" if stopped else "length",
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            policy_version=self.policy_version,
            extra={"mrope_positions": prompt.mrope_3L},  # the positions the prompt ran at
            routed_experts=routed_experts,
            videos=prompt.inputs.videos.clone(),
        )

    def _prefill_inputs(self, policy, rows: list[PreparedPrompt]):
        """Left-padded batch: embeddings with images scattered in, DeepStack, positions, mask."""
        device = policy.lm_head.weight.device
        B, L = len(rows), max(r.length for r in rows)
        input_ids_BL = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        position_ids_3BL = torch.zeros(3, B, L, dtype=torch.long)
        attention_mask_BL = torch.zeros(B, L, dtype=torch.long)
        for b, row in enumerate(rows):
            pad = L - row.length
            input_ids_BL[b, pad:] = row.inputs.input_ids
            position_ids_3BL[:, b, pad:] = row.mrope_3L
            attention_mask_BL[b, pad:] = 1
        # Rows' images in row order, then rows' clips in row order: the order of `visual_positions`
        # (image pads row-major, then video pads row-major).
        images = [e for row in rows for e in row.embeddings] + [e for row in rows for e in row.video_embeddings]
        main_MH = torch.cat([e.embeds for e in images]).to(device) if images else None
        deepstack_ZMH = torch.cat([e.deepstack for e in images], dim=1).to(device) if images else None
        positions_M = policy.visual_positions(input_ids_BL)  # on the host
        embeds_BLH, visual_pos_masks, deepstack = policy.embed_inputs(input_ids_BL.to(device), main_MH, deepstack_ZMH,
                                                                     positions_M)
        next_pos_B = torch.tensor([int(r.mrope_3L.max()) + 1 if r.length else 0 for r in rows])
        return embeds_BLH, position_ids_3BL.to(device), attention_mask_BL.to(device), visual_pos_masks, deepstack, next_pos_B

    def _logits(self, weight_VH: torch.Tensor, hidden_AH: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """float32 logits with the banned tokens at BANNED_LOGIT, as the trainer computes them
        (`saccade.trainer.logprobs`): the lm_head's `dtype` products summed in float32
        (`weight_VH`: the head's `matmul_weight`, made once per rollout)."""
        return head_logits(hidden_AH, weight_VH, dtype=dtype, bias_V=self.ban_bias_V)

    def _next_token(self, logits_AV: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]):
        """One token per row, row a drawn from its own stream `generators[a]` (banned tokens are
        already at BANNED_LOGIT)."""
        if params.temperature == 0:  # greedy; the logprob reported is the untempered one
            logprobs_AV = torch.log_softmax(logits_AV, dim=-1)
            token_A = logprobs_AV.argmax(dim=-1)
            return token_A, logprobs_AV.gather(1, token_A.unsqueeze(1)).squeeze(1)
        z_AV = logits_AV / params.temperature
        distribution = params.distribution
        if distribution.truncates:  # drawn from, and scored under, the renormalised kept set
            z_AV = z_AV.masked_fill(~kept_tokens(z_AV, distribution), float("-inf"))
        logprobs_AV = torch.log_softmax(z_AV, dim=-1)
        probs_AV = logprobs_AV.exp()
        # The exponential race: argmax p / E with E ~ Exp(1) is a draw from p (vLLM samples
        # seeded requests the same way), and each row's E comes from that row's stream alone.
        race_AV = torch.stack([torch.empty_like(probs_AV[0]).exponential_(generator=g) for g in generators])
        token_A = (probs_AV / race_AV).argmax(dim=-1)
        return token_A, logprobs_AV.gather(1, token_A.unsqueeze(1)).squeeze(1)

    def _sample(self, policy, prompts: list[PreparedPrompt], params: SamplingParams,
                generators: list[torch.Generator]):
        """Decode n samples of each prompt: rows [p*n, (p+1)*n) belong to prompt p.

        Each distinct prompt is prefilled once; its KV cache and last hidden state are then
        repeated for its n samples. Rows that have stopped leave the batch (their cache rows
        dropped) at every stop check, so the batch shrinks as rows finish; each row draws from
        its own stream, so dropping rows changes no sample.

        A mixture of experts (`family.record_routing` yields a `Routing`; dense families yield
        None and record nothing) also returns, per row and sampled token, the experts its
        logits were computed with: (B, T, MoE layers, top_k), read from the routers' output.
        """
        lm = policy.language_model
        with policy.family.record_routing(lm) as routing:
            return self._prefill_and_decode(policy, prompts, params, generators, routing)

    def _prefill_and_decode(self, policy, prompts: list[PreparedPrompt], params: SamplingParams,
                            generators: list[torch.Generator], routing):
        from transformers import DynamicCache

        lm = policy.language_model
        device = policy.lm_head.weight.device
        n = params.n
        with timed("prefill"):
            embeds, positions, mask, visual_mask, deepstack, next_pos_P = self._prefill_inputs(policy, prompts)
            cache = DynamicCache(config=lm.config)
            out = lm(
                inputs_embeds=embeds,
                position_ids=positions,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                **policy.family.language_model_kwargs(visual_mask, deepstack),
            )
            hidden_AH = out.last_hidden_state[:, -1].repeat_interleave(n, dim=0)
            if n > 1:  # row a of the decode batch is prompt a // n's
                take_rows(cache, torch.arange(len(prompts), device=device).repeat_interleave(n))
            # The first sampled token's logits come from each prompt's last position (left
            # padding: the last column of the (prompts x L) rows the routers saw).
            first_experts_AYK = None
            if routing is not None:
                L = embeds.shape[1]
                first_experts_AYK = routing.take()[L - 1::L].repeat_interleave(n, dim=0)
        with timed("decode"):
            return self._decode(policy, cache, hidden_AH, mask.repeat_interleave(n, dim=0),
                                next_pos_P.to(device).repeat_interleave(n), params, generators,
                                routing, first_experts_AYK)

    def _decode(self, policy, cache, hidden_AH: torch.Tensor, mask: torch.Tensor, next_pos_A: torch.Tensor,
                params: SamplingParams, generators: list[torch.Generator], routing=None,
                first_experts_AYK: torch.Tensor | None = None):
        """Sample up to max_tokens for every row from its prefilled cache (row b: sample b % n of
        prompt b // n); returns tokens, logprobs, lengths, stop flags and, with `routing` (a
        MoE), each token's experts (B, T, layers, top_k), else None; all on the host.

        Token t + 1's logits come from the forward that feeds token t, so that forward's routing
        is token t + 1's; token 0's is the prefill's (`first_experts_AYK`). The last token is
        never fed: nothing is recorded for its successor."""
        lm = policy.language_model
        device = policy.lm_head.weight.device
        dtype = policy.lm_head.weight.dtype
        weight_VH = matmul_weight(policy.lm_head.weight)  # once per rollout, never per token
        B, T = hidden_AH.shape[0], params.max_tokens
        # Padded rows need a mask while decoding; a batch without padding needs none. Deciding
        # here, once, keeps transformers from checking the mask on the host at every token.
        padded = bool((mask == 0).any())
        # On the model's device for the whole decode: nothing goes to the host token by token.
        # Index A runs over the rows still decoding; alive_A maps them to their row in B (and
        # `alive`, the same on the host, to their streams).
        alive = list(range(B))
        alive_A = torch.arange(B, device=device)
        row_generators = generators
        tokens_BT = torch.full((B, T), self.pad_token_id, dtype=torch.long, device=device)
        logprobs_BT = torch.zeros(B, T, device=device)
        lengths_B = torch.zeros(B, dtype=torch.long, device=device)
        stopped_B = torch.zeros(B, dtype=torch.bool, device=device)
        stop_ids = torch.tensor(self.stop_token_ids, device=device)
        # A MoE's experts per row and token, filled on the device like the tokens: (B, T, Y, K)
        # bytes (uint8 up to 256 experts), e.g. 384 per token for 48 layers of top-8.
        experts_BTYK = None
        if routing is not None:
            experts_BTYK = first_experts_AYK.new_zeros((B, T, *first_experts_AYK.shape[1:]))
            experts_BTYK[:, 0] = first_experts_AYK
        for t in range(T):
            token_A, logprob_A = self._next_token(self._logits(weight_VH, hidden_AH, dtype), params, row_generators)
            # Rows that stopped since the last check decode on harmlessly: nothing recorded.
            active_A = ~stopped_B[alive_A]
            tokens_BT[alive_A, t] = torch.where(active_A, token_A, tokens_BT[alive_A, t])
            logprobs_BT[alive_A, t] = torch.where(active_A, logprob_A, logprobs_BT[alive_A, t])
            lengths_B[alive_A] += active_A
            stopped_B[alive_A] |= torch.isin(token_A, stop_ids) & active_A
            if t == T - 1:
                break
            if (t + 1) % self.stop_check_every == 0:
                keep_A = ~stopped_B[alive_A]
                if not bool(keep_A.any()):
                    break
                if not bool(keep_A.all()):  # drop the finished rows from the batch and the cache
                    kept = keep_A.nonzero().squeeze(1)
                    token_A, alive_A, mask, next_pos_A = token_A[kept], alive_A[kept], mask[kept], next_pos_A[kept]
                    alive = [alive[a] for a in kept.tolist()]
                    row_generators = [generators[b] for b in alive] if generators else []
                    take_rows(cache, kept)
            # Feed each live row its sampled token.
            A = alive_A.shape[0]
            mask = torch.cat([mask, torch.ones(A, 1, dtype=mask.dtype, device=device)], dim=1)
            step_positions = (next_pos_A + t).view(1, A, 1).expand(3, A, 1)
            out = lm(
                inputs_embeds=lm.embed_tokens(token_A.unsqueeze(1)),
                position_ids=step_positions,
                attention_mask=decode_mask(mask, padded, lm.config._attn_implementation),
                past_key_values=cache,
                use_cache=True,
            )
            hidden_AH = out.last_hidden_state[:, -1]
            if experts_BTYK is not None:  # rows that stopped since the last check: past their length, never read
                experts_BTYK[alive_A, t + 1] = routing.take()
        return (tokens_BT.cpu(), logprobs_BT.cpu(), lengths_B.cpu(), stopped_B.cpu(),
                experts_BTYK.cpu() if experts_BTYK is not None else None)


def take_rows(cache, rows_A: torch.Tensor) -> None:
    """Keep the cache's rows `rows_A` (repeated or dropped ones alike), in every layer whatever
    it holds: keys and values (attention), or a convolution and a recurrent state (a hybrid's
    linear-attention layers, e.g. Qwen3.5's Gated DeltaNet). transformers' `reorder_cache` (beam
    search's) index-selects the batch of every tensor each kind of layer holds; its
    `batch_repeat_interleave` / `batch_select_indices` exist for attention layers only."""
    cache.reorder_cache(rows_A)


def decode_mask(mask_AL: torch.Tensor, padded: bool, attn_implementation: str) -> torch.Tensor | None:
    """The attention mask of one decode step (one new query per row over K cached keys).

    Without padding: none (every row attends to all its keys). With padding under sdpa: the
    4-D boolean mask transformers would build from the 2-D one, built here, because
    transformers first asks the host whether the 2-D mask is all ones (a device sync at
    every token). Other kernels get the 2-D mask as it is. A hybrid's linear-attention layers
    take no mask while decoding, whichever this is (`create_recurrent_attention_mask`: None for
    a one-token step or a 4-D mask): a decoded token is never padding."""
    if not padded:
        return None
    if attn_implementation in ("sdpa", PACKED_SDPA):
        return mask_AL.bool()[:, None, None, :]
    return mask_AL
