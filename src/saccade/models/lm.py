"""The trainer's model: a vision-language model's language model and lm_head, without the tower.

Image and clip features arrive precomputed (the frozen tower's output, cached by content
hash); `PolicyLM` scatters them into the token embeddings at the image-pad and video-pad
positions (`visual_positions`: the image pads, then the video pads, each row-major) and hands
the family's extra visual inputs (DeepStack levels, where the family has them, added by
position whatever their order) to the language model, exactly as the full model's forward
does, then runs the decoder. What is particular
to an architecture is asked of its family (`saccade.models.families`). Module names mirror
the full model (`model.language_model.*`, `lm_head.*`), so state dicts, LoRA adapters and
checkpoints written from here load into the full model and into vLLM unchanged.

Precision (docs/precision.md): the weights are stored and computed in the model's dtype,
as an inference engine runs them. LoRA adapters stay float32 (peft keeps them so on a bf16
base); full fine-tuning in bf16 keeps float32 master weights in the optimizer
(`saccade.trainer.step.MasterWeights`). The trainer's logprobs and the embedded engine's
sampling distribution are float32 either way.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from saccade.config import LoraConfig
from saccade.models.attention import NO_MASK, PACKED_SDPA, PackedLayout, resolve_attention
from saccade.models.families import ModelFamily, family_of
from saccade.models.linear_attention import has_linear_attention, is_packing_exact
from saccade.models.checkpoint_layout import LANGUAGE_MODEL, to_keeping_rotary_fp32
from saccade.models.loading import load_layout


# A token the engine must never sample gets this logit: exp(-1e4) is exactly 0 in float32 and
# bfloat16, yet stays finite, so p * log p = 0 and no NaN. The engine and the trainer both use it.
BANNED_LOGIT = -1e4


class _Container(nn.Module):
    """Stands where the full model's `model` stands, holding only `language_model`."""

    def __init__(self, language_model: nn.Module):
        super().__init__()
        self.language_model = language_model


class PolicyLM(nn.Module):
    # What transformers' PreTrainedModel calls the attribute holding the model; peft (transformers
    # 5) scopes a submodule's weight conversions with the root module's (Qwen3.5's text model has
    # one: `qwen3_5_text`), so apply_lora fails without it.
    base_model_prefix = "model"

    def __init__(self, config, language_model: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.config = config
        self.model = _Container(language_model)
        self.lm_head = lm_head
        self.image_token_id = int(config.image_token_id)
        self.video_token_id = int(config.video_token_id)
        self.family = family_of(config)
        # The model's M-RoPE rule at its tower's merge size: what its samples' positions are computed with.
        self.positions = self.family.positions_of(config)
        self.num_deepstack_levels = self.family.deepstack_levels(config)
        self.family.prepare_language_model(language_model)
        # Linear-attention layers (Gated DeltaNet) carry a state across a packed row unless their
        # family reset it at sample boundaries (`saccade.models.linear_attention.make_packing_exact`).
        self.linear_attention = has_linear_attention(language_model)
        assert not self.linear_attention or is_packing_exact(language_model), (
            f"{self.family.name}: prepare_language_model must call make_packing_exact (linear attention)")

    @property
    def language_model(self) -> nn.Module:
        return self.model.language_model

    def enable_activation_checkpointing(self) -> None:
        """Recompute each decoder layer in backward instead of keeping its activations
        (transformers' per-layer checkpointing, non-reentrant: gradients equal those without
        it; module names, and so checkpoints and adapters, are unchanged). Inactive in eval
        mode, so the embedded engine's sampling is unaffected."""
        self.language_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def embed_inputs(
        self,
        input_ids_BL: torch.Tensor,
        image_embeds_NH: torch.Tensor | None = None,
        deepstack_KNH: torch.Tensor | None = None,
        image_positions_N: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor] | None]:
        """Token embeddings with the visual features scattered into the image-pad and video-pad
        positions.

        The rows of image_embeds_NH go to `visual_positions`: every image pad row-major (the
        images of row 0 first, then row 1, ...), then every video pad row-major (the clips').
        Returns (inputs_embeds, image positions, DeepStack levels), the
        last two None without images, the levels [] for a family without DeepStack; the
        family's `language_model_kwargs` turns the last two into the language model's arguments.

        `image_positions_N`: the pads' flat indices into (B x L), best worked out on the host
        (`visual_positions`): then nothing here depends on the device's data. Without them they
        are found here, from input_ids on their device (on a GPU, finding them waits for it). The
        features go in with index_copy, and the positions go on to the family (DeepStack).
        """
        inputs_embeds_BLH = self.language_model.embed_tokens(input_ids_BL)
        if image_positions_N is None:
            image_positions_N = self.visual_positions(input_ids_BL)
        n_image_tokens = int(image_positions_N.shape[0])
        if not n_image_tokens and image_embeds_NH is None:
            return inputs_embeds_BLH, None, None
        if image_embeds_NH is None or image_embeds_NH.shape[0] != n_image_tokens:
            got = None if image_embeds_NH is None else image_embeds_NH.shape[0]
            raise ValueError(f"{n_image_tokens} image-pad tokens but {got} image embedding rows (video pads and "
                             "clips' rows counted in)")
        positions_N = to_device(image_positions_N, inputs_embeds_BLH.device)
        H = inputs_embeds_BLH.shape[-1]
        inputs_embeds_BLH = inputs_embeds_BLH.reshape(-1, H).index_copy(
            0, positions_N, image_embeds_NH.to(inputs_embeds_BLH.dtype)).view_as(inputs_embeds_BLH)
        deepstack = None
        if deepstack_KNH is not None:
            assert deepstack_KNH.shape[0] == self.num_deepstack_levels, (deepstack_KNH.shape, self.num_deepstack_levels)
            deepstack = list(deepstack_KNH.to(inputs_embeds_BLH.dtype).unbind(0))
        return inputs_embeds_BLH, positions_N, deepstack

    def visual_positions(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        """(N,) int64 flat indices into (B x L): the image pads row-major, then the video pads
        row-major: where `embed_inputs` puts a micro-batch's or a prefill's visual rows (images'
        then clips', each in token order, as `collate` and the engine gather them). Give it host ids."""
        return image_positions(input_ids_BL, self.image_token_id, self.video_token_id)

    def hidden_states(
        self,
        input_ids_BL: torch.Tensor,
        position_ids_4BL: torch.Tensor,
        image_embeds_NH: torch.Tensor | None = None,
        deepstack_KNH: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        context: list[tuple[int, int]] | None = None,
        image_positions_N: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, L, H) after the last norm.

        position_ids_4BL holds [text; t; h; w]. With several samples packed into one row,
        the text row restarts at 0 for each and attention stays inside each sample. `context`
        (packed_sdpa only): per segment, the row range of a shared prompt it continues.
        `image_positions_N`: see `embed_inputs`.
        """
        inputs_embeds_BLH, positions_N, deepstack = self.embed_inputs(
            input_ids_BL, image_embeds_NH, deepstack_KNH, image_positions_N
        )
        attention_mask, attn_kwargs = None, {}
        implementation = self.config.text_config._attn_implementation
        if context is not None and implementation != PACKED_SDPA:
            raise ValueError(f"shared prompts need attn_implementation 'packed_sdpa', not {implementation!r}: "
                             "pack without share_prompts for this kernel")
        if cu_seqlens is not None:
            # Sample boundaries go in explicitly where a kernel reads them: packed_sdpa's layout (and no
            # mask at all: NO_MASK, so transformers builds none), flash-attention's varlen arguments.
            # Plain sdpa and eager get the block-diagonal mask transformers derives from the restarting
            # text row. Linear-attention layers read the layout whatever the kernel: they have no mask.
            if implementation == PACKED_SDPA or self.linear_attention:
                attn_kwargs["packed_layout"] = PackedLayout.from_cu_seqlens(cu_seqlens, input_ids_BL.device, context)
            if implementation == PACKED_SDPA:
                attention_mask = NO_MASK
            elif implementation.startswith("flash"):
                longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # read before the copy: no device sync
                cu = cu_seqlens.to(device=input_ids_BL.device, dtype=torch.int32, non_blocking=True)
                attn_kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        out = self.language_model(
            inputs_embeds=inputs_embeds_BLH,
            position_ids=position_ids_4BL,
            attention_mask=attention_mask,
            use_cache=False,
            **self.family.language_model_kwargs(positions_N, deepstack),
            **attn_kwargs,
        )
        return out.last_hidden_state


def image_positions(input_ids_BL: torch.Tensor, image_token_id: int, video_token_id: int | None = None) -> torch.Tensor:
    """(N,) int64: the flat indices into (B x L) of the image pads, row-major (the order the
    images' features are concatenated in), then those of the video pads when `video_token_id`
    is given, on input_ids' device. Give it host ids: its size depends on the data, so on a GPU
    it would wait for the device."""
    flat_N = input_ids_BL.reshape(-1)
    images_N = (flat_N == image_token_id).nonzero().squeeze(1)
    if video_token_id is None:
        return images_N
    return torch.cat([images_N, (flat_N == video_token_id).nonzero().squeeze(1)])


def to_device(t_host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, asynchronously (through page-locked memory on CUDA)."""
    if device.type == "cuda" and t_host.device.type == "cpu":
        return t_host.pin_memory().to(device, non_blocking=True)
    return t_host.to(device)


def ban_bias(head: nn.Linear, banned_token_ids: list[int] | None) -> torch.Tensor | None:
    """The lm_head's bias as a float32 row on its device, the banned tokens at BANNED_LOGIT
    (probability 0), or the head's own bias when nothing is banned. Built once per engine, and
    once per train step: indexing with a list of ids copies it from the host each time."""
    if not banned_token_ids:
        return None if head.bias is None else head.bias.float()
    bias_V = torch.zeros(head.out_features, device=head.weight.device, dtype=torch.float32)
    bias_V[torch.tensor(sorted(set(banned_token_ids)), device=head.weight.device)] = BANNED_LOGIT
    if head.bias is not None:
        bias_V = bias_V + head.bias.float()
    return bias_V


def unwrap_policy(model: nn.Module) -> PolicyLM:
    """The PolicyLM inside a peft wrapper (LoRA layers are injected in place, so it runs them)."""
    inner = model
    while not isinstance(inner, PolicyLM):
        if hasattr(inner, "base_model") and inner.base_model is not inner:
            inner = inner.base_model
        elif hasattr(inner, "model"):
            inner = inner.model
        else:
            raise TypeError(f"no PolicyLM inside {type(model).__name__}")
    return inner


def shares_prompts(model: nn.Module) -> bool:
    """Whether this model's attention kernel takes shared prompts (`pack(..., share_prompts=True)`)."""
    return unwrap_policy(model).config.text_config._attn_implementation == PACKED_SDPA


def load_policy_lm(
    model: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "auto",
    device: str | torch.device = "cpu",
) -> PolicyLM:
    """The language model and lm_head of a checkpoint of a known family, read as transformers'
    `from_pretrained` reads them (any layout it reads; lm_head tied as it ties it); the vision
    weights are never read. `attn_implementation` "auto" is the measured default
    (`saccade.models.attention`)."""
    layout = load_layout(model)
    layout.config.text_config._attn_implementation = resolve_attention(attn_implementation, device)
    layout.load(LANGUAGE_MODEL, dtype=dtype, device=device)
    language_model, lm_head = layout.language_model_and_head()
    policy = to_keeping_rotary_fp32(PolicyLM(layout.config, language_model, lm_head), device=device, dtype=dtype)
    assert_no_vision_tower(policy)
    return policy


def assert_no_vision_tower(module: nn.Module) -> None:
    """The trainer must never hold the vision tower: fail loudly if any of it is here."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_modules()]
    vision = [n for n in names if "visual" in n.split(".")]
    assert not vision, f"vision tower found in the trainer's model: {vision[:3]}"


def lora_target_modules(lora: LoraConfig, family: ModelFamily) -> tuple[str, ...]:
    """The linears LoRA wraps: the config's list when it gives one, else the family's own (which
    for Qwen3.5 adds the Gated DeltaNet's projections to the attention and MLP ones)."""
    return tuple(lora.target_modules or family.lora_target_modules)


def apply_lora(policy: PolicyLM, lora: LoraConfig):
    """Wrap the language model's linears with LoRA (peft). Only the adapters train.

    The adapter keys come out as `base_model.model.model.language_model.layers.N...`, the
    names the full model uses, so the adapter loads onto it with peft as usual. The family's
    `lora_target_parameters` (MoE experts: parameters, not linears) are wrapped too. The
    adapters are float32 whatever the base's dtype (`autocast_adapter_dtype`).
    """
    import peft

    # Only the language model's linears: anchor the patterns so nothing else can match.
    targets = rf"model\.language_model\..*\.({'|'.join(lora_target_modules(lora, policy.family))})"
    parameters = list(policy.family.lora_target_parameters)
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias="none",
        **({"target_parameters": parameters} if parameters else {}),  # dense families: peft's own default
    )
    return peft.get_peft_model(policy, config, autocast_adapter_dtype=True)


def set_full_finetune(policy: PolicyLM) -> PolicyLM:
    """Full fine-tuning: every language-model parameter trains."""
    policy.requires_grad_(True)
    return policy
