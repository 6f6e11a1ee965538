"""What saccade's routes inside vLLM share: the server's state (`SaccadeState`, built once per
server process) and the two error replies every route gives.

The route groups take the state as an argument (`saccade.serving.server`: images, folder updates,
info; `saccade.serving.transfer_routes`: the collective weight transfer's phases), so each group
reads alone and none reaches into another's closure.
"""

# No `from __future__ import annotations`, as in the route modules: FastAPI must see real types.

import os
from typing import TYPE_CHECKING, Any

from saccade.serving.validation import RequestError, parse_json_body, resolve_weights_root
from saccade.serving.weights import reference_shapes

if TYPE_CHECKING:
    import torch


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
        self.devices: list[dict] | None = None  # each worker's device (saccade_device), asked once
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

    def preprocess_clip(self, frames, metadata: dict, settings: dict) -> tuple["torch.Tensor", "torch.Tensor"]:
        """One clip's sampled frames ((n, H, W, 3) uint8) as the chat route feeds vLLM's tower: the
        video processor's resize and patches under the request's settings (`settings`: size bounds,
        cap_pixels_per_frame), frames not sampled again, not normalised (as `preprocess`)."""
        video = getattr(self.processor, "video_processor", None)
        if video is None:
            from saccade.serving.validation import RequestError

            raise RequestError("this model reads no clips (its processor has no video processor)")
        out = video(videos=[frames], video_metadata=[metadata], **{**settings, "do_sample_frames": False},
                    do_rescale=False, do_normalize=False, return_tensors="pt")
        return out["pixel_values_videos"].float(), out["video_grid_thw"].long()

    def lock(self):
        """The one weight update at a time (a folder's, or a collective one from start to finish);
        made on first use, on the server's event loop."""
        import asyncio

        if self.update_lock is None:
            self.update_lock = asyncio.Lock()
        return self.update_lock

    def weight_updates_refusal(self, request) -> str | None:
        """Why this server cannot reload weights in place (the family's word for a CPU server), or None."""
        device = str(request.app.state.vllm_config.device_config.device_type)
        return self.family.vllm_cpu_weight_updates if device == "cpu" else None

    async def vision_info(self, request) -> dict:
        """The served tower's layout (merge size, DeepStack levels), asked of a worker once."""
        if self.vision is None:
            infos = await request.app.state.engine_client.collective_rpc("saccade_vision_info")
            self.vision = infos[0]
        return self.vision

    async def worker_devices(self, request) -> list[dict]:
        """Each worker's device (type, and a GPU's UUID), asked of the workers once."""
        if self.devices is None:
            self.devices = list(await request.app.state.engine_client.collective_rpc("saccade_device"))
        return self.devices

    async def read_json(self, request) -> Any:
        """The request's JSON body; RequestError if too large or not JSON."""
        return parse_json_body(await request.body(), self.max_body_bytes)

    async def read_optional_json(self, request) -> Any:
        """`read_json`, or None for an empty body."""
        raw = await request.body()
        return parse_json_body(raw, self.max_body_bytes) if raw.strip() else None


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


def error(err: RequestError):
    """A refused request: {"error": reason} with the error's status (4xx, or 501 for what this server
    cannot do)."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": str(err)}, status_code=err.status)


async def failed(message: str, err: BaseException):
    """The engine failed at what the request asked: a 500 that names the failure."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": f"{message}: {type(err).__name__}: {str(err)[:500]}"}, status_code=500)
