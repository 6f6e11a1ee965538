"""`VLLMEngine`: the engine protocol over one or more `saccade serve` (vLLM) servers.

For each request it:
1. turns PIL images into data URLs and hashes them (the same hash the embedded engine uses);
2. asks a server's `/encode_images` for the embeddings of images not yet in the cache, so
   the trainer gets the served tower's own features (DeepStack included, where the family has it) without a tower;
3. samples n completions with `/v1/chat/completions`, asking for the sampled token ids,
   their logprobs (the server runs with `--logprobs-mode processed_logprobs`, so these are
   under the temperature and truncation actually sampled with) and the prompt ids with the image pads
   expanded, exactly as vLLM ran them; vision tokens are banned with a logit bias.

The HTTP side (one event loop and client, the choice of server, retries, the health check
that brings servers back, the weights each must hold) is `saccade.inference.server_client`.

Weights: `update_weights()` hands them to the engine's transport (`saccade.transports`: a folder
of full weights or of the LoRA adapter that every live server loads, or a broadcast over a
process group, no folder; with an adapter, requests then name it as their model). Sampling goes
on meanwhile: a
server finishes the requests it is running on the old weights and queues the rest (see
`saccade.serving.server`). Each completion carries the version its server reported in the
response's `x-saccade-policy-version` header (`saccade.serving.wire.VERSION_HEADER`): the
weights it was sampled under, or older.

Prompts for training without sampling (SFT): `prepare_all` tokenizes with saccade's own
messages -> inputs (the ids the server produces, a test holds them equal) and fetches the
images' embeddings from a server, so the trainer never needs a vision tower.

Sampling is seeded per request: a request carries its prompt's stream seed (ChatRequest.seed,
a function of the run seed, the step and the prompt's place in the data alone), and vLLM draws
completion j of it from seed + j. So the same prompts sample the same completions however
the requests are spread over ranks and servers, after a retry on another server, and on a
resume, as far as the servers' float results do not depend on what else is in their batch
(on the CPU they did not, in tests/serving/test_vllm_async_distributed.py). The streams are
not the embedded engine's (it draws completion j from stream_seed(seed, j)): the two engines
sample different completions. A request without a seed is unseeded. vLLM samples seeded
requests with a generator each, a little slower than its batched sampler; `reseed` and the
RNG state are no-ops kept for the protocol (nothing but the seeds shapes the draws).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import torch

from saccade.config import ImagesConfig
from saccade.data.images import data_url_size, image_to_data_url
from saccade.inference.engine import (
    ChatRequest, Completion, SamplingParams, TokenPrompt, WeightTransport, stop_token_ids, vision_token_ids,
)
from saccade.inference.openai_messages import (
    OpenAIMessages, clip_refs, clip_request_fields, encode_video_bodies, to_openai_messages,
)
from saccade.inference.server_client import Server, ServerClient, ServerError, head_dtype_problem
from saccade.inference.replies import check_completions, reply_json, reply_version
from saccade.model_match import fingerprint_mismatch
from saccade.models.vision import EmbeddingCache, ImageEmbedding, image_cache_key
from saccade.serving.wire import (
    CHAT_COMPLETIONS, ENCODE_IMAGES, ENCODE_VIDEOS, GENERATE_TOKENS, LORA_NAME, MAX_IMAGES_PER_REQUEST,
    MAX_PIXELS_PER_REQUEST,
    VERSION_HEADER,
)

if TYPE_CHECKING:
    from saccade.inference.local import PreparedPrompt
    from saccade.models.families import ModelFamily

# One /encode_images request carries at most this many bytes of data URLs (saccade serve
# refuses bodies over 64 MB by default); a batch's images go in as few requests as that allows.
ENCODE_CHUNK_BYTES = 8 * 2**20
DATA_URL_MEMO_BYTES = 256 * 2**20  # the data URLs of multi-turn images kept for their next turn
# ... and at most as many images as saccade serve takes in one request.
ENCODE_CHUNK_IMAGES = MAX_IMAGES_PER_REQUEST

# OpenAI's logit_bias range is [-100, 100]: -100 makes a token's probability e^-100 relative.
BAN_BIAS = -100


# Clips reach a server through the chat route (`saccade.inference.openai_messages`); the token route
# (/inference/v1/generate: multi-turn rollouts) takes no per-request media settings in vLLM 0.32, so
# a clip's frame rate and frame numbers, which its timestamps and positions are computed from,
# cannot go with it. A token prompt with a clip is refused by name.
NO_CLIPS_IN_TOKEN_PROMPTS = (
    "{where}: a multi-turn prompt with a clip cannot be sampled through vLLM's token route (vLLM 0.32's "
    "/inference/v1/generate takes no clip frame rate or frame numbers, so the server would place the clip's "
    "timestamps and positions otherwise than the trainer); sample multi-turn episodes with clips with the "
    "embedded engine (engine.kind = 'embedded'), or single-turn ones through the chat route")


def encode_chunks(urls: dict[str, str]) -> list[dict[str, str]]:
    """key -> data URL, cut into /encode_images requests the server takes: at most
    ENCODE_CHUNK_BYTES of URLs, ENCODE_CHUNK_IMAGES images and MAX_PIXELS_PER_REQUEST decoded
    pixels each (read from the images' headers), in order."""
    chunks: list[dict[str, str]] = []
    size = pixels = 0
    for key, url in urls.items():
        width, height = data_url_size(url)
        if (not chunks or size + len(url) > ENCODE_CHUNK_BYTES or len(chunks[-1]) >= ENCODE_CHUNK_IMAGES
                or pixels + width * height > MAX_PIXELS_PER_REQUEST):
            chunks.append({})
            size = pixels = 0
        chunks[-1][key] = url
        size += len(url)
        pixels += width * height
    return chunks


def collapse_image_pads(input_ids: list[int], pad_id: int) -> list[int]:
    """One pad per image: vLLM expands each pad of a token prompt to the image's full count, so
    sending the trajectory's expanded pads would multiply them (measured on vLLM 0.32)."""
    out: list[int] = []
    for token in input_ids:
        if token == pad_id and out and out[-1] == pad_id:
            continue
        out.append(token)
    return out


def parse_embeddings(data: bytes, count: int) -> list[ImageEmbedding]:
    from safetensors.torch import load

    tensors = load(data)
    grid = tensors["image_grid_thw"].long()
    if grid.shape[0] != count:
        raise ServerError(f"/encode_images returned {grid.shape[0]} images for {count} sent")
    # As served; the cache stores them in the trainer's dtype.
    return [ImageEmbedding(tensors[f"embeds.{i}"], tensors[f"deepstack.{i}"], grid[i].clone()) for i in range(count)]


class VLLMEngine:
    """The `Engine` the loops call (generate, generate_tokens, prepare_all, encode_images,
    update_weights) over `saccade serve` servers; `self.client` does the HTTP."""

    def __init__(
        self,
        urls: list[str],
        processor,
        *,
        cache: EmbeddingCache | None = None,
        limits: ImagesConfig | None = None,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        transport: WeightTransport | None = None,
        model: str | None = None,
        family: ModelFamily | None = None,
        health_interval_s: float = 2.0,
        no_server_wait_s: float = 60.0,
        hang_after_s: float = 60.0,
        vocab_size: int | None = None,
        positions=None,
    ):
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL (engine.urls)")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.vocab_size = vocab_size  # the model's rows: a sampled id at or past it is a server fault
        self.cache = cache if cache is not None else EmbeddingCache()
        self.limits = limits or ImagesConfig()
        self.client = ServerClient(urls, limits=self.limits, lora=False, api_key=api_key,
                                   max_concurrency=max_concurrency, timeout_s=timeout_s, retries=retries,
                                   backoff_s=backoff_s, health_interval_s=health_interval_s,
                                   no_server_wait_s=no_server_wait_s, hang_after_s=hang_after_s)
        # How the trainer's weights reach the servers (saccade.transports, built on self.client);
        # None: this engine only samples (update_weights refuses).
        self.transport = transport
        self.model = model
        self.family = family  # the served model's: its M-RoPE rule for prepared prompts
        # The trainer's `Positions` (`PolicyLM.positions`): the rule with the model's own clip rate
        # (Qwen2.5-VL's tokens_per_second), which prepared prompts with clips need; None: the family's
        # rule at the processor's merge size, enough for images.
        self.positions = positions
        self._adapter_loaded = False
        self.banned_token_ids = vision_token_ids(self.tokenizer)
        self.image_pad_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.video_pad_id = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self._urls_by_key: dict[str, str] = {}
        self._urls_bytes = 0
        self.policy_version = 0
        # The highest version handed to the servers so far, raised before the export (on ranks
        # other than 0 too: rank 0 cannot push before every rank has joined the export's gather),
        # so no reply sampled under a push in flight is taken for a foreign version. None until
        # the first push: before it the engine has not claimed the servers (a run always pushes
        # before it samples: `saccade.loops.weight_sync.push_start_weights`).
        self.newest_version: int | None = None

    @property
    def urls(self) -> list[str]:
        return self.client.urls

    @property
    def transport(self) -> WeightTransport | None:
        """How the trainer's weights reach the servers (saccade.transports), or None."""
        return self._transport

    @transport.setter
    def transport(self, transport: WeightTransport | None) -> None:
        # The client must know: with an adapter, a server put back must have LoRA and gets the
        # adapter; with a collective, a server that answers again gets the whole model from the
        # next sync before it is put back, and the health check only notes that it answers.
        self._transport = transport
        self.client.lora = bool(transport and transport.adapter)
        self.client.weights_by_collective = bool(transport and transport.rejoins_at_sync)

    @property
    def lora(self) -> bool:
        """The servers sample with the trainer's LoRA adapter (pushed by the transport)."""
        return bool(self._transport and self._transport.adapter)

    # The trainer's weights live elsewhere: each update is exported and loaded by the servers.
    shares_weights = False

    @classmethod
    def for_servers(cls, urls: list[str], processor, *, limits: ImagesConfig | None = None,
                    model: tuple[str, str] | None = None, **kwargs) -> VLLMEngine:
        """An engine on these servers, with image limits that match theirs.

        Without `limits`, the first server's own resize bounds (from /saccade/info) are used.
        With them, every server must resize to the same bounds, or the trainer's prompts
        would not be the ones the servers sample after: that is refused with what to change.
        Whether they take the trainer's weights is the transport's to check (`saccade.transports.
        choose`). `model`: the trainer's model (its
        path or hub id, its fingerprint: `saccade.models.checkpoint_layout.fingerprint`); a server
        serving another is refused (`saccade.model_match`). Servers that do not answer now
        start out of the pool (the health check brings them in once they do); none answering
        is an error.
        """
        engine = cls(urls, processor, limits=limits, **kwargs)
        engine.client.model = model  # a server that rejoins must serve it too
        infos = engine.info()
        if limits is None:
            limits = ImagesConfig(min_pixels=infos[0]["min_pixels"], max_pixels=infos[0]["max_pixels"])
            engine.limits = engine.client.limits = limits
        for url, info in zip([s.url for s in engine.client.pool.alive], infos, strict=True):
            other_model = model and fingerprint_mismatch(url, info, *model)
            if other_model:
                raise ValueError(other_model)
            problem = head_dtype_problem(info)
            if problem:
                raise ValueError(f"the server at {url} {problem}")
            served = (info["min_pixels"], info["max_pixels"])
            if served != (limits.min_pixels, limits.max_pixels):
                raise ValueError(
                    f"the server at {url} resizes images to {served[0]}..{served[1]} pixels, but this run uses "
                    f"{limits.min_pixels}..{limits.max_pixels}; set images.min_pixels = {served[0]} and "
                    f"images.max_pixels = {served[1]}, or start the server with the run's bounds: --mm-processor-kwargs "
                    f"'{{\"size\": {{\"shortest_edge\": {limits.min_pixels}, \"longest_edge\": {limits.max_pixels}}}}}' "
                    f"(`saccade launch` passes them)"
                )
        return engine

    # --- the servers (saccade.inference.server_client) ----------------------------------------
    def close(self) -> None:
        """Stop the health check, close the HTTP client and its loop's thread."""
        self.client.close()

    def _version_of(self, response, server: Server) -> int:
        """The policy version a completion was sampled under: its server's header (see the
        module note), else what the engine last confirmed that server loaded."""
        value = reply_version(response.headers.get(VERSION_HEADER), newest=self.newest_version)
        if value is not None:
            return value
        return server.version if server.version is not None else self.policy_version

    async def served_name(self) -> str:
        """The model requests name: the trainer's adapter once one is loaded, else the served model."""
        if self._adapter_loaded:
            return LORA_NAME
        if self.model is None:
            self.model = await self.client.served_model()
        return self.model

    def add_server(self, url: str) -> None:
        """Bring a new server into the run: the health check gives it the current weights and
        puts it in (within health_interval_s of its answering)."""
        self.client.add_server(url)

    def stats(self) -> dict[str, float]:
        """Counters since the engine was made (a step's figures are differences)."""
        return self.client.stats()

    def info(self) -> list[dict]:
        """The /saccade/info of every server that answers (see `ServerClient.info`)."""
        return self.client.info()

    # --- images ---------------------------------------------------------------------------
    def key_for_hash(self, content_hash: str) -> str:
        return image_cache_key(content_hash, self.limits)

    async def _ensure_embeddings(self, keys: list[str], urls: list[str]) -> None:
        """Encode (once, on the servers) the images whose keys are not cached yet: in chunks of
        at most ENCODE_CHUNK_BYTES of data URLs, sent concurrently (so spread over the servers)."""
        missing: dict[str, str] = {}
        for key, url in zip(keys, urls, strict=True):
            if key not in missing and self.cache.get(key) is None:
                missing[key] = url
        chunks = encode_chunks(missing)
        await asyncio.gather(*(self._encode_chunk(chunk) for chunk in chunks))

    async def _encode_chunk(self, chunk: dict[str, str]) -> None:
        response, _ = await self.client.post(ENCODE_IMAGES, json_body={"images": list(chunk.values())})
        for key, emb in zip(chunk, parse_embeddings(response.content, len(chunk)), strict=True):
            self.cache.put(key, emb)

    async def _ensure_clip_embeddings(self, keys: list[str], clips: list, sampling,
                                      urls: list[str] | None = None) -> None:
        """Encode (once, on the servers' towers) the clips whose keys are not cached yet: whole clips
        in /encode_videos requests of at most ENCODE_VIDEO_CHUNK_BYTES of frames, sent concurrently
        (`urls`: their frame-sequence URLs where the chat request made them already)."""
        missing = {k: c for k, c in zip(keys, clips, strict=True) if self.cache.get(k) is None}
        if missing:
            made = dict(zip(keys, urls, strict=True)) if urls is not None else None
            await asyncio.gather(*(self._encode_clips(chunk_keys, body)
                                   for chunk_keys, body in encode_video_bodies(missing, sampling, made)))

    async def _encode_clips(self, keys: list[str], body: dict) -> None:
        response, _ = await self.client.post(ENCODE_VIDEOS, json_body=body)
        for key, emb in zip(keys, parse_embeddings(response.content, len(keys)), strict=True):
            self.cache.put(key, emb)

    # --- prompts without sampling (SFT) -------------------------------------------------------
    def prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        """Tokenized prompts with the generation prompt; their images' embeddings come from a
        server (one /encode_images call for the batch) into the cache the trainer reads."""
        return self.client.run(self._prepare_all(requests))

    async def _prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        from saccade.data.messages import messages_to_inputs
        from saccade.inference.local import PreparedPrompt

        if self.family is None:
            raise ValueError("prepare_all computes the prompts' M-RoPE positions by the model's family: build the "
                             "engine with family= (saccade.models.loading.load_family(model))")
        inputs = [
            messages_to_inputs(r.messages, self.processor, limits=self.limits, add_generation_prompt=True,
                               sample=r.request_id)
            for r in requests
        ]
        keys = [[self.key_for_hash(h) for h in x.image_hashes] for x in inputs]
        urls = [image_to_data_url(im) for x in inputs for im in x.images]
        await self._ensure_embeddings([k for ks in keys for k in ks], urls)
        with_clips = [x for x in inputs if x.clips]
        if with_clips:
            from saccade.data.messages import video_sampling

            await self._ensure_clip_embeddings([k for x in with_clips for k in x.videos.keys],
                                               [c for x in with_clips for c in x.clips],
                                               video_sampling(self.processor, self.limits))
        positions = self.positions or self.family.positions(self.processor.image_processor.merge_size)
        if with_clips and self.positions is None:
            raise ValueError("prepare_all places clips by the model's own temporal rate: build the engine with "
                             "positions= (the trainer's PolicyLM.positions)")
        out = []
        for request, x, ks in zip(requests, inputs, keys, strict=True):
            embeddings = [self.cache.get(k) for k in ks]
            for i, emb in enumerate(embeddings):
                if not torch.equal(emb.grid_thw, x.image_grid_thw[i]):
                    raise ServerError(
                        f"{request.request_id}: image {i} has grid {x.image_grid_thw[i].tolist()} here but "
                        f"{emb.grid_thw.tolist()} on the server: the image limits differ"
                    )
            clips = [self.cache.get(k) for k in x.videos.keys]
            for i, emb in enumerate(clips):
                if not torch.equal(emb.grid_thw, x.videos.grid_thw[i]):
                    raise ServerError(f"{request.request_id}: clip {i} has grid {x.videos.grid_thw[i].tolist()} here "
                                      f"but {emb.grid_thw.tolist()} on the server: the video settings differ")
            mrope = positions.mrope(x.mm_token_type_ids, x.image_grid_thw, x.videos)
            out.append(PreparedPrompt(request, x, ks, embeddings, mrope, clips))
        return out

    # --- sampling -------------------------------------------------------------------------
    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        return self.client.run(self.agenerate(requests, params))

    async def agenerate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        # Every image and clip of the batch encoded first, in a few requests, not one per prompt.
        converted = [to_openai_messages(r.messages, self.limits, r.request_id, self.processor) for r in requests]
        await self._ensure_embeddings([self.key_for_hash(h) for c in converted for h in c.image_hashes],
                                      [u for c in converted for u in c.image_urls])
        with_clips = [c for c in converted if c.clips]
        if with_clips:
            await self._ensure_clip_embeddings([k for c in with_clips for k in c.clip_keys()],
                                               [x for c in with_clips for x in c.clips], with_clips[0].sampling,
                                               [u for c in with_clips for u in c.clip_urls])
        return await self._gather(list(zip(requests, converted, strict=True)), self._complete, params)

    async def _gather(self, items: list, complete, params: SamplingParams) -> list[list[Completion]]:
        """complete(model, item, params) for every item; at most max_concurrency requests of the
        engine (every caller's together) in flight at once."""
        self.client.http()  # made on first use, with the gate
        model = await self.served_name()

        async def one(item) -> list[Completion]:
            async with self.client.gate:
                return await complete(model, item, params)

        return list(await asyncio.gather(*(one(item) for item in items)))

    def _sampling(self, params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
        """The sampling fields both routes share; vision tokens banned with a logit bias; the
        request's `seed` (else params.seed, else none: unseeded).

        Every field that shapes the distribution is sent, even at its "off" value: a field left
        out takes the model's generation_config.json default (Qwen's VL models set top_k = 20), and
        the trainer would then score another distribution than the one sampled. No penalties:
        the trainer does not model them."""
        fields: dict[str, Any] = {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,  # 0: off, in vLLM as here
            "min_p": params.min_p,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "max_tokens": params.max_tokens,
            "logit_bias": {str(t): BAN_BIAS for t in self.banned_token_ids},
        }
        seed = params.seed if seed is None else seed
        if seed is not None:
            fields["seed"] = seed
        return fields

    def _body(self, model: str, messages, params: SamplingParams, seed: int | None = None) -> dict[str, Any]:
        return {"model": model, "messages": messages, **self._sampling(params, seed), "logprobs": True,
                "return_token_ids": True, "skip_special_tokens": True}

    async def _complete(self, model: str, item: tuple[ChatRequest, OpenAIMessages], params: SamplingParams
                        ) -> list[Completion]:
        request, converted = item
        keys = [self.key_for_hash(h) for h in converted.image_hashes]
        # No-ops unless the cache evicted them since the batch's encoding.
        await self._ensure_embeddings(keys, converted.image_urls)
        if converted.clips:
            await self._ensure_clip_embeddings(converted.clip_keys(), converted.clips, converted.sampling,
                                               converted.clip_urls)
        body = {**self._body(model, converted.messages, params, request.seed),
                **clip_request_fields(converted.clips, converted.sampling, request.request_id)}
        (data, version), _ = await self.client.post(CHAT_COMPLETIONS, json_body=body, parse=self._reply)
        return self._completions(request, data, keys, version, converted)

    def _reply(self, response, server: Server) -> tuple[dict, int]:
        """A completions reply checked (`saccade.inference.replies`), and its policy version."""
        data = reply_json(response)
        check_completions(data, vocab_size=self.vocab_size)
        return data, self._version_of(response, server)

    def _completions(self, request: ChatRequest, data: dict, keys: list[str], version: int,
                     converted: OpenAIMessages | None = None) -> list[Completion]:
        prompt_ids = torch.tensor(data["prompt_token_ids"], dtype=torch.long)
        mm_types = (prompt_ids == self.image_pad_id).long() + 2 * (prompt_ids == self.video_pad_id).long()
        grids = [self.cache.get(k).grid_thw for k in keys]
        grid = torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
        videos = self._served_clips(request, mm_types, converted)
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids = torch.tensor(choice["token_ids"], dtype=torch.long)
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = torch.tensor([c["logprob"] for c in content], dtype=torch.float32)
            if logprobs.numel() != ids.numel():
                raise ServerError(
                    f"{request.request_id}: {ids.numel()} sampled ids but {logprobs.numel()} logprobs from the server"
                )
            out.append(Completion(
                request_id=request.request_id,
                prompt_ids=prompt_ids.clone(),
                mm_token_type_ids=mm_types.clone(),
                completion_ids=ids,
                logprobs=logprobs,
                image_keys=list(keys),
                image_grid_thw=grid.clone(),
                finish_reason="stop" if choice["finish_reason"] == "stop" else "length",
                # Decoded here, as the embedded engine does: vLLM's own text holds back a
                # trailing incomplete UTF-8 sequence, so a reward would see other text.
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                policy_version=version,
                videos=videos.clone(),
            ))
        return out

    def _served_clips(self, request: ChatRequest, mm_types: torch.Tensor, converted: OpenAIMessages | None):
        """The served prompt's clips as the trainer reads them (`ClipRefs`), their pads checked
        against the grids the servers' towers gave: a server whose video processing differs is refused."""
        from saccade.data.videos import ClipRefs

        if converted is None or not converted.clips:
            return ClipRefs()
        keys = converted.clip_keys()
        refs = clip_refs(keys, converted.clips, [self.cache.get(k).grid_thw for k in keys], converted.sampling)
        merge = self.processor.video_processor.merge_size
        expected, served = int((refs.grid_thw.prod(-1) // merge**2).sum()), int((mm_types == 2).sum())
        if served != expected:
            raise ServerError(f"{request.request_id}: the server's prompt holds {served} video pads but its tower's "
                              f"grids need {expected}: the server processes clips otherwise than /encode_videos")
        return refs

    def encode_images(self, images: list, keys: list[str]) -> None:
        """Put these images' embeddings (a server's) in the cache the trainer reads."""
        if keys:
            self.client.run(self._ensure_embeddings(keys, [self._data_url(k, im) for k, im in zip(keys, images, strict=True)]))

    def encode_videos(self, clips: list, keys: list[str]) -> None:
        """Put these clips' (`VideoClip`) embeddings (a server's) in the cache the trainer reads."""
        if keys:
            from saccade.data.messages import video_sampling

            sampling = video_sampling(self.processor, self.limits)
            self.client.run(self._ensure_clip_embeddings(keys, clips, sampling))

    # --- sampling after token prompts (multi-turn) -------------------------------------------
    def generate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        """Sample after prompts given as token ids, through vLLM's /inference/v1/generate
        (`saccade serve` enables it): nothing is re-tokenized or re-rendered. Each image pad
        run goes as one pad, and the server's expanded prompt must equal ours exactly."""
        return self.client.run(self._agenerate_tokens(prompts, params))

    async def _agenerate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        with_images = [p for p in prompts if p.image_keys and p.images]  # the rest fail in _complete_tokens
        await self._ensure_embeddings(
            [k for p in with_images for k in p.image_keys],
            [self._data_url(k, im) for p in with_images for k, im in zip(p.image_keys, p.images, strict=True)])
        return await self._gather(prompts, self._complete_tokens, params)

    def _data_url(self, key: str, image) -> str:
        url = self._urls_by_key.get(key)
        if url is None:
            # A trajectory's images recur turn after turn, not forever: the memo is emptied once it
            # holds DATA_URL_MEMO_BYTES (bounded by bytes: a count bound let large images hold GBs).
            if self._urls_bytes > DATA_URL_MEMO_BYTES:
                self._urls_by_key.clear()
                self._urls_bytes = 0
            url = self._urls_by_key[key] = image_to_data_url(image)
            self._urls_bytes += len(url)
        return url

    async def _complete_tokens(self, model: str, prompt: TokenPrompt, params: SamplingParams) -> list[Completion]:
        if len(prompt.videos):
            raise ValueError(NO_CLIPS_IN_TOKEN_PROMPTS.format(where=prompt.request_id))
        if prompt.image_keys and not prompt.images:
            raise ValueError(f"{prompt.request_id}: a vLLM server needs the images themselves, not only their keys")
        urls = [self._data_url(k, im) for k, im in zip(prompt.image_keys, prompt.images, strict=True)]
        await self._ensure_embeddings(list(prompt.image_keys), urls)
        # vLLM's own SamplingParams here: logprobs=0 is the sampled token's; stops are not implied.
        sampling = {**self._sampling(params, prompt.seed), "logprobs": 0, "stop_token_ids": self.stop_token_ids}
        body = {
            "model": model, "token_ids": collapse_image_pads(prompt.input_ids.tolist(), self.image_pad_id),
            "content_parts": [{"type": "image_url", "url": u} for u in urls],
            "sampling_params": sampling, "return_token_ids": True,
        }
        (data, version), _ = await self.client.post(GENERATE_TOKENS, json_body=body, parse=self._reply)
        served = data.get("prompt_token_ids")
        if served != prompt.input_ids.tolist():
            raise ServerError(
                f"{prompt.request_id}: the server ran other prompt ids than the trajectory's "
                f"({len(served or [])} vs {prompt.input_ids.numel()} tokens): its image token counts differ"
            )
        return self._completions(ChatRequest(prompt.request_id, []), data, list(prompt.image_keys), version)

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, version: int | None = None) -> float:
        """Export the trainer's weights and load them into every live server; returns seconds
        spent. Sampling goes on meanwhile (see the module note). The servers then report
        `version` (default: the next one). A server that does not answer is taken out (it gets
        these weights when it is back); NoServerError when none took them."""
        if self.transport is None:
            raise ValueError("VLLMEngine.update_weights needs a transport (saccade.transports: how the weights reach "
                             "the servers)")
        start = time.perf_counter()
        version = self.policy_version + 1 if version is None else version
        self.newest_version = max(self.newest_version or 0, version)
        self.transport.send(version)  # every rank: a sharded model's gathers; rank 0 talks to the servers
        self.policy_version = version
        self._adapter_loaded = self.lora
        return time.perf_counter() - start

    def confirm_weights(self, version: int) -> None:
        """Every rank has seen the push of `version` return: a server answering a later request
        under an older version missed it (`ServerClient.confirm`)."""
        self.client.confirm(version)

    # --- sampling randomness: not seeded (see the module note) --------------------------------
    def reseed(self, seed: int) -> None:
        pass

    def rng_state(self) -> None:
        return None

    def set_rng_state(self, state) -> None:
        pass
