"""Mixed into every vLLM worker (`--worker-extension-cls saccade.serving.worker.SaccadeWorker`).

Reached from the API server with `engine_client.collective_rpc(name, args=...)`. Tensors
do not survive that RPC, so arguments and results travel as safetensors bytes. Names are
prefixed `saccade_` so they never shadow a worker's own methods (e.g. `reload_weights`).
Imports stay light: this module is imported in every worker process.
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
