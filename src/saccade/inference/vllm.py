"""`VLLMEngine`: the engine protocol over one or more `saccade serve` (vLLM) servers.

For each request it:
1. turns PIL images into data URLs and hashes them (the same hash the embedded engine uses);
2. asks a server's `/encode_images` for the embeddings of images not yet in the cache, so
   the trainer gets the served tower's own features (DeepStack included) without a tower;
3. samples n completions with `/v1/chat/completions`, asking for the sampled token ids,
   their logprobs (the server runs with `--logprobs-mode processed_logprobs`, so these are
   under the temperature and truncation actually sampled with) and the prompt ids with the image pads
   expanded, exactly as vLLM ran them; vision tokens are banned with a logit bias.

All HTTP runs on one event loop, in a thread of its own, with one persistent client: the
synchronous methods (`generate`, `update_weights`, ...) hand it coroutines and wait, from
whichever thread calls them, so an async rollout thread and the trainer share it.

Servers (`saccade.inference.servers.ServerPool`): each request goes to the live server with
the fewest requests in flight. A server that refuses or drops a connection, or times out, is
taken out and the request is sent again to another; a 5xx is retried with backoff. A health
check probes servers that are out every `health_interval_s`: one that answers gets the
current weights before it is put back (`add_server` brings in a new one the same way). With
no server left, a request waits `no_server_wait_s` for one, then raises `NoServerError`.

Weights: `update_weights()` calls the exporter given at construction (it writes a
safetensors folder the servers can read) and POSTs it to every live server's
/update_weights: full weights (LoRA merged), or with `lora=True` only the adapter, which the
servers load in place and requests then name as their model. Sampling goes on meanwhile: a
server finishes the requests it is running on the old weights and queues the rest (see
`saccade.serving.server`). Each completion carries the version its server reported in the
response's `x-saccade-policy-version` header: the weights it was sampled under, or older.

Prompts for training without sampling (SFT): `prepare_all` tokenizes with saccade's own
messages -> inputs (the ids the server produces, a test holds them equal) and fetches the
images' embeddings from a server, so the trainer never needs a vision tower.

Sampling is not seeded per request (vLLM samples seeded requests one by one), so runs on
vLLM are not bit-reproducible; `reseed` and the RNG state are no-ops kept for the protocol.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from saccade.config import ImagesConfig
from saccade.data.images import image_hash, image_to_data_url, load_image
from saccade.inference.engine import (
    ChatRequest, Completion, SamplingParams, TokenPrompt, stop_token_ids, vision_token_ids,
)
from saccade.inference.servers import NoServerError, Server, ServerPool
from saccade.serving.validation import MAX_IMAGES_PER_REQUEST
from saccade.models.vision import EmbeddingCache, ImageEmbedding, image_cache_key

if TYPE_CHECKING:
    from saccade.inference.local import PreparedPrompt

# One /encode_images request carries at most this many bytes of data URLs (saccade serve
# refuses bodies over 64 MB by default); a batch's images go in as few requests as that allows.
KEEPALIVE_EXPIRY_S = 2.0  # below the servers' 5 s keep-alive timeout (see VLLMEngine._http)
ENCODE_CHUNK_BYTES = 8 * 2**20
DATA_URL_MEMO_BYTES = 256 * 2**20  # the data URLs of multi-turn images kept for their next turn
# ... and at most as many images as saccade serve takes in one request.
ENCODE_CHUNK_IMAGES = MAX_IMAGES_PER_REQUEST

# OpenAI's logit_bias range is [-100, 100]: -100 makes a token's probability e^-100 relative.
BAN_BIAS = -100


class ServerError(RuntimeError):
    """A server answered with an error that retrying will not fix (a 4xx), or kept failing."""


class Unreachable(ConnectionError):
    """One named server did not answer (a push or a health probe aimed at it)."""


class LoopThread:
    """One asyncio event loop in a daemon thread; `run` executes a coroutine on it from any
    other thread and returns its result (or raises its exception)."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro):
        if threading.current_thread() is self.thread:
            raise RuntimeError("a synchronous engine method was called from the engine's own event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


def say(message: str) -> None:
    """A line for the person running the job: servers leaving and coming back."""
    print(f"saccade: {message}", file=sys.stderr, flush=True)


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


def head_dtype_problem(info: dict) -> str | None:
    """Why a server's logits are not the trainer's (`saccade.models.head`), from its /saccade/info,
    or None. A low-precision model whose lm_head rounds the logits to its own dtype samples from a
    coarser distribution than the one the trainer scores."""
    dtype, head = info.get("dtype"), info.get("head_dtype")
    if dtype is None or head is None or head == "float32" or dtype == "float32":
        return None  # an older server that does not say; or nothing is rounded
    return (f"computes its {dtype} model's logits in {head}, rounded to about 3 significant digits, while the "
            f"trainer sums the lm_head in float32; restart it with `saccade serve` (which sets --hf-overrides "
            f"'{{\"head_dtype\": \"float32\"}}'), or pass that flag to vLLM yourself")


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
        health_interval_s: float = 2.0,
        no_server_wait_s: float = 60.0,
    ):
        if not urls:
            raise ValueError("VLLMEngine needs at least one server URL (engine.urls)")
        self.pool = ServerPool([u.rstrip("/") for u in urls])
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
        self._urls_bytes = 0
        self.policy_version = 0
        self.health_interval_s = health_interval_s
        self.no_server_wait_s = no_server_wait_s
        self._pushed: tuple[str, int] | None = None  # the weights folder every server must hold, and its version
        # Made on first use, on the loop: the thread, the client, the request gate, the lock
        # that keeps pushes and rejoins apart, the health check.
        self._loop: LoopThread | None = None
        self._loop_guard = threading.Lock()
        self._http_client = None
        self._gate: asyncio.Semaphore | None = None
        self._weights_lock: asyncio.Lock | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def urls(self) -> list[str]:
        return list(self.pool.servers)

    # The trainer's weights live elsewhere: each update is exported and loaded by the servers.
    shares_weights = False

    @classmethod
    def for_servers(cls, urls: list[str], processor, *, limits: ImagesConfig | None = None, **kwargs) -> VLLMEngine:
        """An engine on these servers, with image limits that match theirs.

        Without `limits`, the first server's own resize bounds (from /saccade/info) are used.
        With them, every server must resize to the same bounds, or the trainer's prompts
        would not be the ones the servers sample after: that is refused with what to change.
        With `lora=True`, every server must have LoRA enabled. Servers that do not answer now
        start out of the pool (the health check brings them in once they do); none answering
        is an error.
        """
        engine = cls(urls, processor, limits=limits, **kwargs)
        infos = engine.info()
        if limits is None:
            limits = ImagesConfig(min_pixels=infos[0]["min_pixels"], max_pixels=infos[0]["max_pixels"])
            engine.limits = limits
        for url, info in zip([s.url for s in engine.pool.alive], infos, strict=True):
            if engine.lora and not info.get("lora_enabled"):
                raise ValueError(f"the server at {url} has no LoRA support, so it cannot load the trainer's adapter; "
                                 "restart it with --enable-lora --max-lora-rank R (R >= lora.rank)")
            problem = head_dtype_problem(info)
            if problem:
                raise ValueError(f"the server at {url} {problem}")
            served = (info["min_pixels"], info["max_pixels"])
            if served != (limits.min_pixels, limits.max_pixels):
                raise ValueError(
                    f"the server at {url} resizes images to {served[0]}..{served[1]} pixels, but this run uses "
                    f"{limits.min_pixels}..{limits.max_pixels}; set images.min_pixels = {served[0]} and "
                    f"images.max_pixels = {served[1]}, or serve a model whose preprocessor_config.json has "
                    f"the run's bounds"
                )
        return engine

    # --- the event loop, server choice and HTTP ------------------------------------------
    def _run(self, coro):
        """Run a coroutine on the engine's event loop (started on first use) and wait for it."""
        with self._loop_guard:
            if self._loop is None:
                self._loop = LoopThread("saccade-vllm-engine")
        return self._loop.run(coro)

    def _http(self):
        """The engine's one HTTP client, with the gate and lock that live on its loop."""
        import httpx

        if self._http_client is None:
            # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn's
            # and vLLM's default: 5 s) closes them: a request sent on a connection the server is
            # closing at that instant fails with ReadError, which would take a healthy server out
            # (seen on the vLLM demo between the GRPO and the control runs).
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency,
                                  keepalive_expiry=KEEPALIVE_EXPIRY_S)
            self._http_client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            self._gate = asyncio.Semaphore(self.max_concurrency)
            self._weights_lock = asyncio.Lock()
            if self.health_interval_s > 0:
                self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        return self._http_client

    def close(self) -> None:
        """Stop the health check, close the client and the loop's thread."""
        if self._loop is None:
            return

        async def shut():
            if self._health_task is not None:
                self._health_task.cancel()
            if self._http_client is not None:
                await self._http_client.aclose()
        try:
            self._loop.run(shut())
        finally:
            self._loop.close()
            self._loop = self._http_client = None

    async def _live_server(self, tried: set[str]) -> Server:
        """The least-loaded live server, preferring ones this request has not failed on; with
        none live, wait up to no_server_wait_s for the health check to bring one back."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            try:
                return self.pool.pick(exclude=tried)
            except NoServerError as err:
                if time.monotonic() >= deadline:
                    raise NoServerError(
                        f"{err}, for {self.no_server_wait_s:.0f} s. Start them again (saccade serve MODEL ...) "
                        "at the run's engine.urls"
                    ) from None
                await asyncio.sleep(min(0.5, self.health_interval_s or 0.5))

    async def _post(self, path: str, *, json_body: Any, server: Server | None = None) -> tuple[Any, Server]:
        """POST to the least-loaded live server, or to `server` only; returns the response and
        the server that gave it. A connection refused, dropped or timed out takes the server
        out and sends the request to another (aimed at one server: raises Unreachable); a 5xx
        is retried with backoff; a 4xx raises at once with the server's reason."""
        import httpx

        client = self._http()
        tried: set[str] = set()
        attempt = reroutes = 0
        while True:
            target = server or await self._live_server(tried)
            self.pool.begin(target)
            try:
                response = await client.post(target.url + path, json=json_body, headers=self.headers)
            except httpx.TransportError as err:  # timeouts included
                failure = f"{type(err).__name__} on {path}: {err}".strip()
                if server is not None:
                    raise Unreachable(f"{target.url}: {failure}") from err
                if self.pool.take_out(target, failure):
                    say(f"server {target.url} taken out ({failure}); its requests go to the others")
                tried.add(target.url)
                self.pool.counters.rerouted += 1
                reroutes += 1
                if reroutes > 4 * len(self.pool.servers) + self.retries:
                    raise ServerError(f"{path}: every server failed, last {failure}") from err
                continue
            finally:
                self.pool.end(target)
            if response.status_code < 400:
                return response, target
            if response.status_code < 500:
                raise ServerError(f"{target.url}{path}: HTTP {response.status_code}: {response.text[:500]}")
            if attempt >= self.retries:
                raise ServerError(f"{target.url}{path}: HTTP {response.status_code} after {attempt + 1} attempts: "
                                  f"{response.text[:500]}")
            self.pool.counters.retried += 1
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    def _version_of(self, response, server: Server) -> int:
        """The policy version a completion was sampled under: its server's header (see the
        module note), else what the engine last confirmed that server loaded."""
        from saccade.serving.server import VERSION_HEADER

        value = response.headers.get(VERSION_HEADER)
        if value is not None:
            return int(value)
        return server.version if server.version is not None else self.policy_version

    async def _model_name(self) -> str:
        """The model requests name: the trainer's adapter once one is loaded, else the served model."""
        from saccade.serving.server import LORA_NAME

        if self._adapter_loaded:
            return LORA_NAME
        if self.model is None:
            server = await self._live_server(set())
            response = await self._http().get(server.url + "/v1/models", headers=self.headers)
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self.model

    # --- servers that leave and come back ------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for server in self.pool.down:
                try:
                    await self._rejoin(server)
                except Exception as err:  # still out; probed again next round
                    server.last_error = f"{type(err).__name__}: {err}"[:300]

    async def _rejoin(self, server: Server) -> None:
        """Put a server back that answers again (or a new one): same image limits, LoRA when
        the run pushes adapters, a float32 lm_head, and the current weights loaded first."""
        import httpx

        client = self._http()
        try:
            health = await client.get(server.url + "/health", headers=self.headers, timeout=5)
            info = (await client.get(server.url + "/saccade/info", headers=self.headers, timeout=10)).json()
        except httpx.HTTPError as err:
            raise Unreachable(f"{server.url}: {err}") from None
        if health.status_code != 200:
            raise Unreachable(f"{server.url}/health: HTTP {health.status_code}")
        served = (info["min_pixels"], info["max_pixels"])
        if served != (self.limits.min_pixels, self.limits.max_pixels):
            raise ServerError(f"{server.url} resizes images to {served}, the run to "
                              f"{(self.limits.min_pixels, self.limits.max_pixels)}: not put back")
        if self.lora and not info.get("lora_enabled"):
            raise ServerError(f"{server.url} has no LoRA support (--enable-lora): not put back")
        problem = head_dtype_problem(info)
        if problem:
            raise ServerError(f"{server.url} {problem}: not put back")
        async with self._weights_lock:
            version = info.get("policy_version")
            if self._pushed is not None:
                folder, version = self._pushed
                await self._load(server, folder, version)
            self.pool.put_back(server, version)
        say(f"server {server.url} is back in, with weights version {version}")

    def add_server(self, url: str) -> None:
        """Bring a new server into the run: the health check gives it the current weights and
        puts it in (within health_interval_s of its answering)."""
        self.pool.add(url.rstrip("/"))
        self._run(self._started())

    async def _started(self) -> None:
        self._http()  # the client, and the health check with it

    def stats(self) -> dict[str, float]:
        """Counters since the engine was made (a step's figures are differences)."""
        c = self.pool.counters
        return {"requests_retried": float(c.retried), "requests_rerouted": float(c.rerouted),
                "servers_taken_out": float(c.taken_out), "servers_rejoined": float(c.rejoined),
                "engine_idle_s": self.pool.idle_seconds() / max(1, len(self.pool.servers)),
                "servers_alive": float(len(self.pool.alive))}

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
        chunks: list[dict[str, str]] = []
        size = ENCODE_CHUNK_BYTES
        for key, url in missing.items():
            if not chunks or size + len(url) > ENCODE_CHUNK_BYTES or len(chunks[-1]) >= ENCODE_CHUNK_IMAGES:
                chunks.append({})
                size = 0
            chunks[-1][key] = url
            size += len(url)
        await asyncio.gather(*(self._encode_chunk(chunk) for chunk in chunks))

    async def _encode_chunk(self, chunk: dict[str, str]) -> None:
        response, _ = await self._post("/encode_images", json_body={"images": list(chunk.values())})
        for key, emb in zip(chunk, parse_embeddings(response.content, len(chunk)), strict=True):
            self.cache.put(key, emb)

    # --- prompts without sampling (SFT) -------------------------------------------------------
    def prepare_all(self, requests: list[ChatRequest]) -> list[PreparedPrompt]:
        """Tokenized prompts with the generation prompt; their images' embeddings come from a
        server (one /encode_images call for the batch) into the cache the trainer reads."""
        return self._run(self._prepare_all(requests))

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
        await self._ensure_embeddings([k for ks in keys for k in ks], urls)
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
        return self._run(self.agenerate(requests, params))

    async def agenerate(self, requests: list[ChatRequest], params: SamplingParams) -> list[list[Completion]]:
        # Every image of the batch encoded first, in a few requests, not one request per prompt.
        converted = [self._openai_messages(r) for r in requests]
        await self._ensure_embeddings([k for c in converted for k in c[1]], [u for c in converted for u in c[2]])
        return await self._gather(list(zip(requests, converted, strict=True)), self._complete, params)

    def _openai_messages(self, request: ChatRequest) -> tuple[list, list[str], list[str]]:
        """The request's messages with data-URL images, their cache keys and their URLs."""
        messages, hashes = to_openai_messages(request.messages, self.limits, request.request_id)
        urls = [p["image_url"]["url"] for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if p.get("type") == "image_url"]
        return messages, [self.key_for_hash(h) for h in hashes], urls

    async def _gather(self, items: list, complete, params: SamplingParams) -> list[list[Completion]]:
        """complete(model, item, params) for every item; at most max_concurrency requests of the
        engine (every caller's together) in flight at once."""
        self._http()
        model = await self._model_name()

        async def one(item) -> list[Completion]:
            async with self._gate:
                return await complete(model, item, params)

        return list(await asyncio.gather(*(one(item) for item in items)))

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        """The sampling fields both routes share; vision tokens banned with a logit bias.

        Every field that shapes the distribution is sent, even at its "off" value: a field left
        out takes the model's generation_config.json default (Qwen3-VL's sets top_k = 20), and
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
        if params.seed is not None:
            fields["seed"] = params.seed
        return fields

    def _body(self, model: str, messages, params: SamplingParams) -> dict[str, Any]:
        return {"model": model, "messages": messages, **self._sampling(params), "logprobs": True,
                "return_token_ids": True, "skip_special_tokens": True}

    async def _complete(self, model: str, item: tuple[ChatRequest, tuple], params: SamplingParams) -> list[Completion]:
        request, (messages, keys, urls) = item
        await self._ensure_embeddings(keys, urls)  # a no-op unless the cache evicted them since
        response, server = await self._post("/v1/chat/completions", json_body=self._body(model, messages, params))
        return self._completions(request, response.json(), keys, self._version_of(response, server))

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
            self._run(self._ensure_embeddings(keys, [self._data_url(k, im) for k, im in zip(keys, images, strict=True)]))

    # --- sampling after token prompts (multi-turn) -------------------------------------------
    def generate_tokens(self, prompts: list[TokenPrompt], params: SamplingParams) -> list[list[Completion]]:
        """Sample after prompts given as token ids, through vLLM's /inference/v1/generate
        (`saccade serve` enables it): nothing is re-tokenized or re-rendered. Each image pad
        run goes as one pad, and the server's expanded prompt must equal ours exactly."""
        return self._run(self._agenerate_tokens(prompts, params))

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
        if prompt.image_keys and not prompt.images:
            raise ValueError(f"{prompt.request_id}: a vLLM server needs the images themselves, not only their keys")
        urls = [self._data_url(k, im) for k, im in zip(prompt.image_keys, prompt.images, strict=True)]
        await self._ensure_embeddings(list(prompt.image_keys), urls)
        # vLLM's own SamplingParams here: logprobs=0 is the sampled token's; stops are not implied.
        sampling = {**self._sampling(params), "logprobs": 0, "stop_token_ids": self.stop_token_ids}
        body = {
            "model": model, "token_ids": collapse_image_pads(prompt.input_ids.tolist(), self.image_pad_id),
            "content_parts": [{"type": "image_url", "url": u} for u in urls],
            "sampling_params": sampling, "return_token_ids": True,
        }
        response, server = await self._post("/inference/v1/generate", json_body=body)
        data = response.json()
        served = data.get("prompt_token_ids")
        if served != prompt.input_ids.tolist():
            raise ServerError(
                f"{prompt.request_id}: the server ran other prompt ids than the trajectory's "
                f"({len(served or [])} vs {prompt.input_ids.numel()} tokens): its image token counts differ"
            )
        return self._completions(ChatRequest(prompt.request_id, []), data, list(prompt.image_keys),
                                 self._version_of(response, server))

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, version: int | None = None) -> float:
        """Export the trainer's weights and load them into every live server; returns seconds
        spent. Sampling goes on meanwhile (see the module note). The servers then report
        `version` (default: the next one). A server that does not answer is taken out (it gets
        these weights when it is back); NoServerError when none took them."""
        if self.exporter is None:
            raise ValueError("VLLMEngine.update_weights needs an exporter (a function writing the weights folder)")
        start = time.perf_counter()
        version = self.policy_version + 1 if version is None else version
        folder = self.exporter(version)
        if self.pushes_weights:
            self._run(self._push(folder, version))
        self.policy_version = version
        self._adapter_loaded = self.lora
        return time.perf_counter() - start

    async def _push(self, folder: str, version: int) -> None:
        self._http()
        async with self._weights_lock:
            self._pushed = (str(folder), version)
            live = self.pool.alive
            results = await asyncio.gather(*(self._load(s, str(folder), version) for s in live), return_exceptions=True)
            for server, result in zip(live, results, strict=True):
                if isinstance(result, Unreachable):
                    if self.pool.take_out(server, str(result)):
                        say(f"server {server.url} taken out while loading weights v{version} ({result})")
                elif isinstance(result, BaseException):
                    raise result
            if not self.pool.alive:
                raise NoServerError(f"{self.pool.describe_down()}; weights v{version} reached none. Start them "
                                    "again (saccade serve MODEL ...) at the run's engine.urls")

    async def _load(self, server: Server, folder: str, version: int) -> None:
        """One server loads the folder. An adapter only means something on the weights it was
        trained on: a server that loaded full weights since it started (another run's) first
        reloads its checkpoint."""
        if self.lora and server.version is None:
            info = (await self._http().get(server.url + "/saccade/info", headers=self.headers, timeout=30)).json()
            if info.get("base_modified"):
                await self._post("/update_weights", json_body={"restore_base": True, "version": version}, server=server)
        await self._post("/update_weights", json_body={"path": folder, "version": version, "lora": self.lora},
                         server=server)
        server.version = version
        server.versions_loaded.append(version)

    # --- sampling randomness: not seeded (see the module note) --------------------------------
    def reseed(self, seed: int) -> None:
        pass

    def rng_state(self) -> None:
        return None

    def set_rng_state(self, state) -> None:
        pass

    def info(self) -> list[dict]:
        """The /saccade/info of every server that answers; those that do not are taken out (the
        health check brings them back). None answering, or an answer that is not `saccade
        serve`'s, is an error that says what to do."""
        import httpx

        out, failures = [], []
        for server in list(self.pool.servers.values()):
            try:
                response = httpx.get(server.url + "/saccade/info", headers=self.headers, timeout=30)
            except httpx.HTTPError as err:
                failures.append(f"{server.url} ({err})")
                self.pool.take_out(server, str(err))
                continue
            if response.status_code != 200:
                raise ValueError(
                    f"{server.url}/saccade/info: HTTP {response.status_code} {response.text[:200]}; is it `saccade "
                    "serve` (plain `vllm serve` lacks /encode_images and /update_weights), with the right API key?"
                )
            out.append(response.json())
        if not out:
            raise ValueError(
                f"no server answers at {', '.join(failures)}; start one with `saccade serve MODEL`, or fix engine.urls"
            )
        if failures:
            say(f"{', '.join(failures)} not answering: out until the health check finds it up")
        return out
