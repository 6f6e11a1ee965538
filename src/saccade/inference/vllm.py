"""`VLLMEngine`: the engine protocol over one or more `saccade serve` (vLLM) servers.

For each request it:
1. turns PIL images into data URLs and hashes them (the same hash the embedded engine uses);
2. asks a server's `/encode_images` for the embeddings of images not yet in the cache, so
   the trainer gets the served tower's own features (DeepStack included) without a tower;
3. samples n completions with `/v1/chat/completions`, asking for the sampled token ids,
   their logprobs (the server runs with `--logprobs-mode processed_logprobs`, so these are
   under the temperature actually sampled with) and the prompt ids with the image pads
   expanded, exactly as vLLM ran them; vision tokens are banned with a logit bias.

Requests run concurrently under a limit, with timeouts and retries with exponential
backoff on connection errors and 5xx; with several servers each request goes to the one
with the fewest requests in flight (ties: round-robin).

Weights: `update_weights()` calls the exporter given at construction (it writes a
safetensors folder the servers can read) and POSTs it to every server's /update_weights:
full weights (LoRA merged), or with `lora=True` only the adapter, which the servers load
in place and requests then name as their model.

Prompts for training without sampling (SFT): `prepare_all` tokenizes with saccade's own
messages -> inputs (the ids the server produces, a test holds them equal) and fetches the
images' embeddings from a server, so the trainer never needs a vision tower.

Sampling is not seeded per request (vLLM samples seeded requests one by one), so runs on
vLLM are not bit-reproducible; `reseed` and the RNG state are no-ops kept for the protocol.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_hash, image_to_data_url, load_image
from saccade.inference.engine import (
    ChatRequest, Completion, SamplingParams, TokenPrompt, stop_token_ids, vision_token_ids,
)
from saccade.models.vision import EmbeddingCache, ImageEmbedding, image_cache_key

if TYPE_CHECKING:
    from saccade.inference.local import PreparedPrompt

# OpenAI's logit_bias range is [-100, 100]: -100 makes a token's probability e^-100 relative.
BAN_BIAS = -100


class ServerError(RuntimeError):
    """A server answered with an error that retrying will not fix (a 4xx), or kept failing."""


def to_openai_messages(messages: list[dict[str, Any]], limits: ImagesConfig, sample: str):
    """Messages with every image as an image_url data URL, plus the images' content hashes in order."""
    out, hashes = [], []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            kind = part.get("type")
            if kind in ("image", "image_url"):
                source = part.get("image") if kind == "image" else part.get("image_url")
                image = load_image(source, limits=limits, sample=sample)
                hashes.append(image_hash(image))
                parts.append({"type": "image_url", "image_url": {"url": image_to_data_url(image)}})
            else:
                parts.append(dict(part))
        out.append({**message, "content": parts})
    return out, hashes


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
        exporter: Callable[[int], str] | None = None,
        model: str | None = None,
        lora: bool = False,
        pushes_weights: bool = True,
    ):
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL (engine.urls)")
        self.urls = [u.rstrip("/") for u in urls]
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.cache = cache if cache is not None else EmbeddingCache()
        self.limits = limits or ImagesConfig()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.exporter = exporter
        # False on ranks other than 0 of a sharded trainer: they take part in the export (a
        # collective gather) but only rank 0 tells the servers to load it.
        self.pushes_weights = pushes_weights
        self.model = model
        # lora: the exporter writes a PEFT adapter folder; the servers load it as an adapter
        # and requests name it as their model. Otherwise it writes full weights.
        self.lora = lora
        self._adapter_loaded = False
        self.banned_token_ids = vision_token_ids(self.tokenizer)
        self.image_pad_id = self.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self._urls_by_key: dict[str, str] = {}
        self.policy_version = 0
        self._in_flight = {u: 0 for u in self.urls}
        self._turn = itertools.count()

    # The trainer's weights live elsewhere: each update is exported and loaded by the servers.
    shares_weights = False

    @classmethod
    def for_servers(cls, urls: list[str], processor, *, limits: ImagesConfig | None = None, **kwargs) -> VLLMEngine:
        """An engine on these servers, with image limits that match theirs.

        Without `limits`, the first server's own resize bounds (from /saccade/info) are used.
        With them, every server must resize to the same bounds, or the trainer's prompts
        would not be the ones the servers sample after: that is refused with what to change.
        With `lora=True`, every server must have LoRA enabled.
        """
        engine = cls(urls, processor, limits=limits, **kwargs)
        infos = engine.info()
        if limits is None:
            limits = ImagesConfig(min_pixels=infos[0]["min_pixels"], max_pixels=infos[0]["max_pixels"])
            engine.limits = limits
        for url, info in zip(engine.urls, infos, strict=True):
            if engine.lora and not info.get("lora_enabled"):
                raise ValueError(f"the server at {url} has no LoRA support, so it cannot load the trainer's adapter; "
                                 "restart it with --enable-lora --max-lora-rank R (R >= lora.rank)")
            served = (info["min_pixels"], info["max_pixels"])
            if served != (limits.min_pixels, limits.max_pixels):
                raise ValueError(
                    f"the server at {url} resizes images to {served[0]}..{served[1]} pixels, but this run uses "
                    f"{limits.min_pixels}..{limits.max_pixels}; set images.min_pixels = {served[0]} and "
                    f"images.max_pixels = {served[1]}, or serve a model whose preprocessor_config.json has "
                    f"the run's bounds"
                )
        return engine

    # --- server choice and HTTP ---------------------------------------------------------
    def _pick(self) -> str:
        least = min(self._in_flight.values())
        candidates = [u for u in self.urls if self._in_flight[u] == least]
        return candidates[next(self._turn) % len(candidates)]

    async def _post(self, client, path: str, *, json_body: Any, url: str | None = None) -> Any:
        """POST with retries on connection errors and 5xx; 4xx raise at once with the server's reason."""
        import httpx

        last: Exception | None = None
        for attempt in range(self.retries + 1):
            base = url or self._pick()
            self._in_flight[base] += 1
            try:
                response = await client.post(base + path, json=json_body, headers=self.headers)
            except (httpx.TransportError, httpx.TimeoutException) as err:
                last = err
            else:
                if response.status_code < 400:
                    return response
                if response.status_code < 500:
                    raise ServerError(f"{base}{path}: HTTP {response.status_code}: {response.text[:500]}")
                last = ServerError(f"{base}{path}: HTTP {response.status_code}: {response.text[:500]}")
            finally:
                self._in_flight[base] -= 1
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise ServerError(f"{path} failed after {self.retries + 1} attempts: {last}") from last

    def _client(self):
        import httpx

        limits = httpx.Limits(max_connections=self.max_concurrency)
        return httpx.AsyncClient(timeout=self.timeout_s, limits=limits)

    async def _model_name(self, client) -> str:
        """The model requests name: the trainer's adapter once one is loaded, else the served model."""
        from saccade.serving.server import LORA_NAME

        if self._adapter_loaded:
            return LORA_NAME
        if self.model is None:
            response = await client.get(self.urls[0] + "/v1/models", headers=self.headers)
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self.model

    # --- images ---------------------------------------------------------------------------
    def key_for_hash(self, content_hash: str) -> str:
        return image_cache_key(content_hash, self.limits)

    async def _ensure_embeddings(self, client, keys: list[str], urls: list[str]) -> None:
        """Encode (once, on a server) the images whose keys are not cached yet."""
        missing: dict[str, str] = {}
        for key, url in zip(keys, urls, strict=True):
            if key not in missing and self.cache.get(key) is None:
                missing[key] = url
        if not missing:
            return
        response = await self._post(client, "/encode_images", json_body={"images": list(missing.values())})
        for key, emb in zip(missing, parse_embeddings(response.content, len(missing)), strict=True):
            self.cache.put(key, emb)

    # --- prompts without sampling (SFT) -------------------------------------------------------
    def prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        """Tokenized prompts with the generation prompt; their images' embeddings come from a
        server (one /encode_images call for the batch) into the cache the trainer reads."""
        return asyncio.run(self._prepare_all(requests))

    async def _prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        from saccade.data.messages import messages_to_inputs
        from saccade.inference.local import PreparedPrompt
        from saccade.models.positions import mrope_positions

        inputs = [
            messages_to_inputs(r.messages, self.processor, limits=self.limits, add_generation_prompt=True,
                               sample=r.request_id)
            for r in requests
        ]
        keys = [[self.key_for_hash(h) for h in x.image_hashes] for x in inputs]
        urls = [image_to_data_url(im) for x in inputs for im in x.images]
        async with self._client() as client:
            await self._ensure_embeddings(client, [k for ks in keys for k in ks], urls)
        merge = self.processor.image_processor.merge_size
        out = []
        for request, x, ks in zip(requests, inputs, keys, strict=True):
            embeddings = [self.cache.get(k) for k in ks]
            for i, emb in enumerate(embeddings):
                if not torch.equal(emb.grid_thw, x.image_grid_thw[i]):
                    raise ServerError(
                        f"{request.request_id}: image {i} has grid {x.image_grid_thw[i].tolist()} here but "
                        f"{emb.grid_thw.tolist()} on the server: the image limits differ"
                    )
            mrope = mrope_positions(x.mm_token_type_ids, x.image_grid_thw, spatial_merge_size=merge)
            out.append(PreparedPrompt(request, x, ks, embeddings, mrope))
        return out

    # --- sampling -------------------------------------------------------------------------
    def generate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        return asyncio.run(self.agenerate(requests, params))

    async def agenerate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        return await self._gather(requests, self._complete, params)

    async def _gather(self, items: list, complete, params: SamplingParams) -> list[list[Completion]]:
        """complete(client, model, item, params) for every item, at most max_concurrency at once."""
        gate = asyncio.Semaphore(self.max_concurrency)
        async with self._client() as client:
            model = await self._model_name(client)

            async def one(item) -> list[Completion]:
                async with gate:
                    return await complete(client, model, item, params)

            return list(await asyncio.gather(*(one(item) for item in items)))

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        """The sampling fields both routes share; vision tokens banned with a logit bias."""
        fields: dict[str, Any] = {
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "logit_bias": {str(t): BAN_BIAS for t in self.banned_token_ids},
        }
        if params.seed is not None:
            fields["seed"] = params.seed
        return fields

    def _body(self, model: str, messages, params: SamplingParams) -> dict[str, Any]:
        return {"model": model, "messages": messages, **self._sampling(params), "logprobs": True,
                "return_token_ids": True, "skip_special_tokens": True}

    async def _complete(self, client, model: str, request: ChatRequest, params: SamplingParams) -> list[Completion]:
        messages, hashes = to_openai_messages(request.messages, self.limits, request.request_id)
        keys = [self.key_for_hash(h) for h in hashes]
        urls = [p["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image_url"]
        await self._ensure_embeddings(client, keys, urls)
        version = self.policy_version
        response = await self._post(client, "/v1/chat/completions", json_body=self._body(model, messages, params))
        return self._completions(request, response.json(), keys, version)

    def _completions(self, request: ChatRequest, data: dict, keys: list[str], version: int) -> list[Completion]:
        prompt_ids = torch.tensor(data["prompt_token_ids"], dtype=torch.long)
        mm_types = (prompt_ids == self.image_pad_id).long()
        grids = [self.cache.get(k).grid_thw for k in keys]
        grid = torch.stack(grids) if grids else torch.zeros(0, 3, dtype=torch.long)
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
            ))
        return out

    def encode_images(self, images: list, keys: list[str]) -> None:
        """Put these images' embeddings (a server's) in the cache the trainer reads."""
        if keys:
            asyncio.run(self._encode_images(images, keys))

    async def _encode_images(self, images: list, keys: list[str]) -> None:
        async with self._client() as client:
            await self._ensure_embeddings(client, keys, [self._data_url(k, im) for k, im in zip(keys, images, strict=True)])

    # --- sampling after token prompts (multi-turn) -------------------------------------------
    def generate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        """Sample after prompts given as token ids, through vLLM's /inference/v1/generate
        (`saccade serve` enables it): nothing is re-tokenized or re-rendered. Each image pad
        run goes as one pad, and the server's expanded prompt must equal ours exactly."""
        return asyncio.run(self._gather(prompts, self._complete_tokens, params))

    def _data_url(self, key: str, image) -> str:
        url = self._urls_by_key.get(key)
        if url is None:
            if len(self._urls_by_key) > 4096:  # a trajectory's images recur turn after turn, not forever
                self._urls_by_key.clear()
            url = self._urls_by_key[key] = image_to_data_url(image)
        return url

    async def _complete_tokens(self, client, model: str, prompt: TokenPrompt, params: SamplingParams) -> list[Completion]:
        if prompt.image_keys and not prompt.images:
            raise ValueError(f"{prompt.request_id}: a vLLM server needs the images themselves, not only their keys")
        urls = [self._data_url(k, im) for k, im in zip(prompt.image_keys, prompt.images, strict=True)]
        await self._ensure_embeddings(client, list(prompt.image_keys), urls)
        # vLLM's own SamplingParams here: logprobs=0 is the sampled token's; stops are not implied.
        sampling = {**self._sampling(params), "logprobs": 0, "stop_token_ids": self.stop_token_ids}
        body = {
            "model": model, "token_ids": collapse_image_pads(prompt.input_ids.tolist(), self.image_pad_id),
            "content_parts": [{"type": "image_url", "url": u} for u in urls],
            "sampling_params": sampling, "return_token_ids": True,
        }
        version = self.policy_version
        data = (await self._post(client, "/inference/v1/generate", json_body=body)).json()
        served = data.get("prompt_token_ids")
        if served != prompt.input_ids.tolist():
            raise ServerError(
                f"{prompt.request_id}: the server ran other prompt ids than the trajectory's "
                f"({len(served or [])} vs {prompt.input_ids.numel()} tokens): its image token counts differ"
            )
        return self._completions(ChatRequest(prompt.request_id, []), data, list(prompt.image_keys), version)

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, version: int | None = None) -> float:
        """Export the trainer's weights and load them into every server; returns seconds spent.
        The servers then report `version` (default: the next one) as their policy version."""
        if self.exporter is None:
            raise ValueError("VLLMEngine.update_weights needs an exporter (a function writing the weights folder)")
        start = time.perf_counter()
        version = self.policy_version + 1 if version is None else version
        folder = self.exporter(version)
        if self.pushes_weights:
            asyncio.run(self._push(folder, version))
        self.policy_version = version
        self._adapter_loaded = self.lora
        return time.perf_counter() - start

    async def _push(self, folder: str, version: int) -> None:
        async with self._client() as client:
            if self.lora and not self._adapter_loaded:
                await self._restore_base_where_modified(client, version)
            await asyncio.gather(*(
                self._post(client, "/update_weights", json_body={"path": str(folder), "version": version,
                                                                 "lora": self.lora}, url=u)
                for u in self.urls
            ))

    async def _restore_base_where_modified(self, client, version: int) -> None:
        """An adapter only means something on the weights it was trained on: a server that
        loaded full weights since it started (another run's) first reloads its checkpoint."""
        for url in self.urls:
            info = (await client.get(url + "/saccade/info", headers=self.headers)).json()
            if info.get("base_modified"):
                await self._post(client, "/update_weights", json_body={"restore_base": True, "version": version}, url=url)

    # --- sampling randomness: not seeded (see the module note) --------------------------------
    def reseed(self, seed: int) -> None:
        pass

    def rng_state(self) -> None:
        return None

    def set_rng_state(self, state) -> None:
        pass

    def info(self) -> list[dict]:
        """Each server's /saccade/info; a server that is down, or is not `saccade serve`, is named."""
        import httpx

        out = []
        for url in self.urls:
            try:
                response = httpx.get(url + "/saccade/info", headers=self.headers, timeout=30)
            except httpx.HTTPError as err:
                raise ValueError(
                    f"no server answers at {url} ({err}); start one with `saccade serve MODEL`, or fix engine.urls"
                ) from None
            if response.status_code != 200:
                raise ValueError(
                    f"{url}/saccade/info: HTTP {response.status_code} {response.text[:200]}; is it `saccade serve` "
                    "(plain `vllm serve` lacks /encode_images and /update_weights), with the right API key?"
                )
            out.append(response.json())
        return out
