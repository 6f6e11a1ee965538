"""The reference for `saccade bench step` and `bench rollout`: what TRL's GRPOTrainer runs
inside (without vLLM), with HF transformers alone.

Per step: the processor on every prompt repeated G times (TRL batches each prompt G times),
`generate` on all those rows (the vision tower and the prefill run per row), the processor
again on the same prompts, then one padded forward of the full model from the pixels (the
lm_head on the completion positions only, TRL's `logits_to_keep`), backward, clipping and an
AdamW step. The vision tokens are suppressed in `generate`, as saccade's engines ban them.
"""

from __future__ import annotations

import torch

GROUP, NEW_TOKENS = 8, 8
LORA_RANK = 16


def repeated_prompts(processor, prompts: list[list[dict]], n: int, limits) -> tuple[list[str], list[list]]:
    """Each prompt's chat text and images, n times in a row."""
    from saccade.data.messages import extract_images, render_chat

    texts, images = [], []
    for messages in prompts:
        normalized, ims = extract_images(messages, limits=limits)
        text = render_chat(processor, normalized, add_generation_prompt=True)
        texts += [text] * n
        images += [ims] * n
    return texts, images


def hf_inputs(processor, texts: list[str], images: list[list], limits, device) -> dict[str, torch.Tensor]:
    """The processor's batch: left-padded ids, pixel values and grids, on the device."""
    from saccade.data.messages import processor_size

    flat = [im for row in images for im in row]
    encoded = processor(text=texts, images=flat or None, padding=True, padding_side="left", return_tensors="pt",
                        images_kwargs={"size": processor_size(limits)})
    return {k: v.to(device) for k, v in encoded.items()}


def completion_mask(new_BT: torch.Tensor, stop_ids: list[int]) -> torch.Tensor:
    """(B, T) bool: the tokens generate sampled, each row up to and including its first stop."""
    stops_BT = torch.isin(new_BT, torch.tensor(stop_ids, device=new_BT.device))
    done_BT = stops_BT.long().cumsum(1)
    return (done_BT == 0) | ((done_BT == 1) & stops_BT)


@torch.no_grad()
def hf_generate(model, inputs: dict[str, torch.Tensor], *, max_new_tokens: int, banned: list[int],
                temperature: float = 1.0) -> torch.Tensor:
    """transformers' sampling on the batch: (B, T) new tokens (padded after a stop)."""
    was_training = model.training
    model.eval()
    out = model.generate(**inputs, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, suppress_tokens=banned)
    model.train(was_training)
    return out[:, inputs["input_ids"].shape[1]:]


class ReferenceStep:
    """What TRL's GRPOTrainer runs inside, with transformers alone, on the same prompts."""

    def __init__(self, model_path: str, processor, limits, *, lora: bool, dtype: torch.dtype, device: torch.device,
                 seed: int):
        from saccade.tools.bench.trainer_variants import build_full
        from saccade.inference.engine import stop_token_ids, vision_token_ids

        self.processor, self.limits, self.device = processor, limits, device
        self.model, self.optimizer, _ = build_full(model_path, dtype=dtype, device=device, seed=seed,
                                                   full_finetune=not lora, lora_rank=LORA_RANK)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.banned = vision_token_ids(processor.tokenizer)
        self.stops = stop_token_ids(processor.tokenizer)

    def __call__(self, prompts: list[list[dict]]) -> dict[str, float]:
        """One step on these prompts (chat messages, as the task's environment opens them)."""
        from saccade.timing import timed
        from saccade.trainer.logprobs import token_logprobs_and_entropy

        model = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        with timed("prep"):
            texts, images = repeated_prompts(self.processor, prompts, GROUP, self.limits)
            inputs = hf_inputs(self.processor, texts, images, self.limits, self.device)
        with timed("generate"):
            torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=self.generator)))
            completion_BT = hf_generate(model, inputs, max_new_tokens=NEW_TOKENS, banned=self.banned)
        L = inputs["input_ids"].shape[1]  # the prompts' padded length
        completion_mask_BT = completion_mask(completion_BT, self.stops).float()
        with timed("prep"):  # TRL prepares the prompts (images included) again for the loss forward
            inputs = hf_inputs(self.processor, texts, images, self.limits, self.device)
        T = completion_BT.shape[1]
        with timed("forward"):
            ids = torch.cat([inputs["input_ids"], completion_BT], dim=1)
            mask = torch.cat([inputs["attention_mask"], completion_mask_BT.long()], dim=1)
            types = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(completion_BT)], dim=1)
            hidden = model.model(input_ids=ids, attention_mask=mask, mm_token_type_ids=types,
                                 pixel_values=inputs["pixel_values"],
                                 image_grid_thw=inputs["image_grid_thw"]).last_hidden_state
            hidden_BTH = hidden[:, L - 1 : L - 1 + T]  # logits_to_keep: the completion positions only
            B = hidden_BTH.shape[0]
            logprobs_T, _ = token_logprobs_and_entropy(hidden_BTH.reshape(B * T, -1), model.lm_head.weight,
                                                       completion_BT.reshape(-1))
            advantages_B = torch.zeros(B, device=self.device)  # a random model's rewards: all alike
            loss = -(logprobs_T.view(B, T) * advantages_B[:, None] * completion_mask_BT).sum() / completion_mask_BT.sum()
        with timed("backward"):
            loss.backward()
        with timed("optimizer"):
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return {"train_tokens": float(mask.sum()), "completion_tokens": float(completion_mask_BT.sum()),
                "padded_tokens": float(mask.numel())}
