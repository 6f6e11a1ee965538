"""A checkpoint read the way transformers reads it, one part at a time.

saccade's trainer holds the language model and lm_head, its engine the vision tower; neither
loads the other half. Both go through transformers' own loader (`from_pretrained`'s
`convert_and_load_state_dict_in_model`) on the family's whole model built on the meta device, fed
only the tensors of the part at hand. So every rule transformers applies on load is applied here
by transformers itself, never restated per family:
- key renames (Qwen2.5-VL's hub names `model.layers.*`, `visual.*`),
- experts stored one tensor per expert merged into the fused parameters (Qwen3.5-MoE saved by
  `save_pretrained`'s default), and fused experts transposed when their shape says so
  (Qwen3-VL-MoE's hub layout (E, H, 2I) against its memory layout (E, 2I, H)),
- the tie of lm_head to the embeddings, decided as `from_pretrained` decides it (the top-level
  config's `tie_word_embeddings`, then which of the two tensors the files hold and whether they
  differ),
- tensors the model declares it does not read (`_keys_to_ignore_on_load_unexpected`: Qwen3.5's
  multi-token-prediction head `mtp.*`, whatever layout it is stored in).

What saccade adds on top is strictness, because a tensor that slips through silently means the
trainer holds another model than the engine and the reference:
- every tensor in the files is consumed by a part or declared unused by the model; any other is
  an error naming it (`classify`),
- every parameter of the part is loaded or tied; any other is an error naming it,
- a shape that cannot tell the stored orientation apart (a square fused expert, where
  transformers would read it as stored and vLLM transposed) is refused, naming the folder.

The way back (what saccade writes for vLLM and exports) is the family's `checkpoint.to_hub`: the
hub's layout, which this same reader takes again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from saccade.models.families import LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, family_of

LANGUAGE_MODEL = "language model"  # the trainer's part: LM_PREFIX and lm_head
VISION_TOWER = "vision tower"  # the engine's part: VISION_PREFIX
PARTS = (LANGUAGE_MODEL, VISION_TOWER)


def part_of(name: str) -> str | None:
    """The part a canonical (full-model) parameter name belongs to, None for anything else."""
    if name.startswith(LM_PREFIX) or name == LM_HEAD_KEY:
        return LANGUAGE_MODEL
    if name.startswith(VISION_PREFIX):
        return VISION_TOWER
    return None


INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: the index's shards when there is one, else every *.safetensors."""
    index = path / INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def stored_keys(path: Path) -> dict[str, Path]:
    """Every tensor name the checkpoint's files hold -> its file (headers only)."""
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[key] = file
    return out


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init: the
    checkpoint's tensors are assigned next) and their buffers for real. Buffers that are not in
    the checkpoint (rotary inverse frequencies) are so computed by the family's own constructor,
    whatever its signature, instead of rebuilt here by hand."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@dataclass
class Classified:
    """Where each tensor of a checkpoint goes: `parts[file key] = (canonical name, part)` for the
    tensors a part loads, `unused[file key]` = why the others are left unread."""

    parts: dict[str, tuple[str, str]]
    unused: dict[str, str]

    def keys_of(self, part: str) -> list[str]:
        return [key for key, (_, p) in self.parts.items() if p == part]


class CheckpointLayout:
    """One model folder's layout as transformers reads it: its whole model on the meta device
    (no memory) and transformers' conversion mapping for that model. Built from config.json
    alone; `load` then reads a part's tensors into the meta model."""

    def __init__(self, path: Path, config, family: ModelFamily | None = None):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.path = Path(path)
        self.config = config
        self.family = family or family_of(config)
        with parameters_on_meta():
            self.model = self.family.full_model_class()._from_config(config)
        self.mapping = get_model_conversion_mapping(self.model)
        self.renamings = [t for t in self.mapping if isinstance(t, WeightRenaming)]
        self.converters = [t for t in self.mapping if isinstance(t, WeightConverter)]
        self.meta_state = self.model.state_dict()
        ignore = getattr(self.model, "_keys_to_ignore_on_load_unexpected", None) or ()
        self.ignore = [re.compile(p) for p in ignore]

    def canonical(self, key: str) -> tuple[str, str | None]:
        """A stored key's name in the model (transformers' renames), and the source pattern of the
        converter that takes it (None: the tensor goes in as stored)."""
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(key, self.renamings, self.converters, self.model.base_model_prefix,
                                 self.meta_state)

    def classify(self, keys) -> Classified:
        """Every stored key consumed by a part or declared unused by the model; a ValueError naming
        the ones that are neither (a tensor nobody reads is a model nobody meant)."""
        parts: dict[str, tuple[str, str]] = {}
        unused: dict[str, str] = {}
        stray: list[str] = []
        for key in keys:
            name, _ = self.canonical(key)
            part = part_of(name) if name in self.meta_state else None
            if part is not None:
                parts[key] = (name, part)
            elif any(p.search(key) or p.search(name) for p in self.ignore):
                unused[key] = f"{type(self.model).__name__} does not read it (transformers ignores it on load)"
            else:
                stray.append(key)
        if stray:
            raise ValueError(
                f"{self.path}: {len(stray)} tensors in the checkpoint belong to no part of the "
                f"{self.family.name} model transformers builds from its config.json, e.g. {sorted(stray)[:3]}; "
                "the folder was saved from another architecture or config, or in a layout transformers 5.19 "
                "does not read. Check config.json against the weights (`saccade bench parity --model PATH` "
                "compares with transformers' own load)")
        return Classified(parts, unused)

    def refuse_ambiguous_orientation(self, keys: list[str]) -> None:
        """A converter that transposes only when the stored shape differs from the parameter's
        (transformers' `Transpose(check_dims=True)`: Qwen3-VL-MoE's fused experts) cannot tell a
        square tensor's orientation: transformers would read it as stored, vLLM transposed."""
        from transformers.core_model_loading import Transpose

        for key in keys:
            name, pattern = self.canonical(key)
            if pattern is None:
                continue
            converter = next(c for c in self.converters if pattern in c.source_patterns)
            for op in converter.operations:
                if isinstance(op, Transpose) and op.check_dims:
                    shape = self.meta_state[name].shape
                    if shape[op.dim0] == shape[op.dim1]:
                        raise ValueError(
                            f"{self.path}: {key} has shape {tuple(shape)}, square in the two dims its layouts swap "
                            f"(dims {op.dim0} and {op.dim1}), so the shape cannot say whether it is stored in "
                            "transformers' memory layout or the hub's transposed one: transformers reads it as stored, "
                            "vLLM transposes it, and the two would hold different models. No published checkpoint "
                            "has such a shape; build the model with moe_intermediate_size different from "
                            "hidden_size and from hidden_size / 2")

    def load(self, part: str, *, dtype: torch.dtype, device: str | torch.device = "cpu",
             classified: Classified | None = None) -> nn.Module:
        """The meta model with `part`'s parameters read from the files, as `from_pretrained` reads
        them (the other part stays on meta); for the language model, lm_head tied as
        `from_pretrained` ties it. ValueError for a parameter left unread."""
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging as hf_logging

        stored = stored_keys(self.path)
        classified = classified or self.classify(stored)
        keys = classified.keys_of(part)
        self.refuse_ambiguous_orientation(keys)
        to_dtype_keeping_rotary_fp32(self.model, dtype)
        files: dict[Path, object] = {}
        with contextlib.ExitStack() as stack:
            state = {}
            for key in keys:
                file = stored[key]
                if file not in files:
                    files[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                state[key] = files[file].get_slice(key)  # read when transformers materialises it
            load_config = LoadStateDictConfig(dtype=dtype, device_map={"": torch.device(device)},
                                              weight_mapping=self.mapping)
            with quiet_progress(hf_logging):
                info, _ = convert_and_load_state_dict_in_model(self.model, state, load_config)
        problems = [f"{k}: stored {tuple(s)}, the model's {tuple(e)}" for k, s, e in sorted(info.mismatched_keys)]
        problems += [f"{k}: {e}" for k, e in sorted(info.conversion_errors.items())]
        problems += [f"{k}: renamed to no parameter of the model" for k in sorted(info.unexpected_keys)]
        if problems:
            raise ValueError(f"{self.path}: transformers could not load the {part} as stored: {problems[:3]}")
        missing = {k for k in info.missing_keys if part_of(k) == part}
        if part == LANGUAGE_MODEL:
            self.model.tie_weights(missing_keys=missing, recompute_mapping=False)
        if missing:
            raise ValueError(f"{self.path}: the checkpoint lacks {len(missing)} tensors of the {part}, e.g. "
                             f"{sorted(missing)[:3]}" + (" (lm_head is not tied: tie_word_embeddings is false in the "
                                                         "top-level config.json)" if LM_HEAD_KEY in missing else ""))
        return self.model

    def language_model_and_head(self) -> tuple[nn.Module, nn.Module]:
        return self.model.get_submodule(LM_PREFIX.rstrip(".")), self.model.lm_head

    def vision_tower(self) -> nn.Module:
        return self.model.get_submodule(VISION_PREFIX.rstrip("."))

    def is_tied(self) -> bool:
        """Whether lm_head is the embeddings' tensor (after `load` of the language model)."""
        lm, head = self.language_model_and_head()
        return head.weight is lm.embed_tokens.weight

    def engine_shapes(self) -> dict[str, list[int]]:
        """Every parameter's shape in the layout saccade writes for vLLM (the family's
        `checkpoint.to_hub`: the hub's), under its canonical name: what an uploaded weights folder is
        checked against."""
        return {name: list(self.family.checkpoint.to_hub(name, t).shape) for name, t in self.meta_state.items()}


@contextlib.contextmanager
def quiet_progress(hf_logging) -> Iterator[None]:
    """transformers' "Loading weights" bar off for the call: saccade loads parts many times, and its
    own logs say what loaded."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


# Rotary embeddings' inverse frequencies: non-persistent buffers that transformers computes in
# float32 and only upcasts at use. `module.to(dtype=bf16)` would round them first: an angle error of
# about 1e-3 x position radians at rope_theta 5e6, which grows with the context (docs/precision.md).
ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def to_dtype_keeping_rotary_fp32(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype=dtype)` (on the device each tensor is on), except the rotary inverse frequencies."""
    return to_keeping_rotary_fp32(module, device=None, dtype=dtype)


def to_keeping_rotary_fp32(module: nn.Module, *, device, dtype: torch.dtype) -> nn.Module:
    """`module.to(device=device, dtype=dtype)`, except the rotary inverse frequencies: moved to
    `device`, never rounded. They must be float32 when this is called (built from the config)."""
    rotary = {name: buf for name, buf in module.named_buffers() if name.rpartition(".")[2] in ROTARY_BUFFERS}
    assert all(buf.dtype == torch.float32 for buf in rotary.values()), {n: b.dtype for n, b in rotary.items()}
    module.to(device=device, dtype=dtype)
    for name, buf in rotary.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buf.to(device=device)
    return module


# ------------------------------------------------------------------ the model's fingerprint

# The rows of the embeddings (and of an untied head) a fingerprint reads: a few at each end, so a
# vocabulary of 152k rows costs kilobytes, not a pass over gigabytes.
FINGERPRINT_ROWS = 8


FINGERPRINTED = (f"{LM_PREFIX}embed_tokens.weight", f"{LM_PREFIX}norm.weight", LM_HEAD_KEY)


def fingerprint(layout: CheckpointLayout) -> str:
    """A short hash that two processes holding the same checkpoint agree on, whatever the folder's
    path, layout or file dtype: config.json's text and vision fields and its tie flag, and a few
    rows of the embeddings, of lm_head when the files hold one, and of the final norm, rounded to
    bf16 (a bf16 copy of an fp32 folder is the same model). What `saccade serve` reports in
    /saccade/info and the trainer compares with its own at start."""
    from safetensors import safe_open

    config = json.loads((layout.path / "config.json").read_text())
    digest = hashlib.sha256()
    for section in ("text_config", "vision_config"):
        fields = {k: v for k, v in (config.get(section) or {}).items() if k not in ("dtype", "torch_dtype")}
        digest.update(json.dumps(fields, sort_keys=True).encode())
    digest.update(json.dumps(config.get("tie_word_embeddings")).encode())
    picked: dict[str, torch.Tensor] = {}
    for key, file in stored_keys(layout.path).items():
        name, _ = layout.canonical(key)
        if name in FINGERPRINTED:
            with safe_open(str(file), framework="pt") as f:
                part = f.get_slice(key)
                rows = part.get_shape()[0]
                picked[name] = part[:] if rows <= 2 * FINGERPRINT_ROWS else torch.cat(
                    [part[:FINGERPRINT_ROWS], part[rows - FINGERPRINT_ROWS:]])
    for name in sorted(picked):
        digest.update(name.encode())
        digest.update(picked[name].to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]
