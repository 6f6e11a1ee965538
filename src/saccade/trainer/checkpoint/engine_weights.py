"""Weights the inference engine loads, and the folders `saccade export` writes.

`merge_full_weights_for_engine` writes an ordinary Hugging Face folder (the base folder's
config, tokenizer and processor files, and all its tensors with the language-model ones
replaced by the trained ones, LoRA merged in as W + scale * B @ A): what a vLLM server reloads.
It streams: one tensor at a time is gathered (from the shards), merged and written.
`save_adapter_for_engine` writes only a live model's LoRA adapter, `copy_checkpoint_adapter` a
checkpoint's. Every folder is written atomically (`saccade.atomic`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from saccade.atomic import atomic_dir
from saccade.distributed import World, broadcast, is_sharded
from saccade.models.checkpoint_layout import INDEX_FILE
from saccade.models.loading import LM_HEAD_KEY, LM_PREFIX, resolve_model_path, safetensors_files
from saccade.trainer.checkpoint.dcp import dcp_load_here, dcp_metadata
from saccade.trainer.checkpoint.folder import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    DCP_DIR,
    FULL_WEIGHTS,
    STATE_FILE,
    check_complete,
    checkpoint_record,
)
from saccade.trainer.checkpoint.model_state import (
    full_tensor,
    gather_lora_state,
    is_peft,
    process_world,
    save_adapter,
    single_adapter,
    tied_aliases,
)


def merge_full_weights_for_engine(
    checkpoint_or_model: Path | str | nn.Module, base_model_path: str | os.PathLike, out_dir: Path
) -> Path:
    """Write a full HF folder of the base's family with the trained language model (LoRA merged in).

    `checkpoint_or_model` is a checkpoint directory (either layout) or a live model (PolicyLM or
    its PeftModel, plain or sharded); a live model is read, never changed. Trained tensors are
    cast to the base tensors' dtype; every other tensor (the vision tower) is copied byte for
    byte. Written atomically.

    It streams: base file by base file, tensor by tensor in the file's order, each trained tensor
    is fetched alone (a sharded parameter all-gathered, a LoRA module merged as W + scale * B @ A),
    written at its place in the output file and dropped; the file's header comes first, from the
    base's shapes and dtypes. Rank 0's extra memory is about one parameter and its merge.

    With a process group (torchrun) every rank calls this (for a sharded model the gathers are
    collectives, in the same order on every rank); only rank 0 writes; every rank returns out_dir
    or raises.
    """
    base = resolve_model_path(base_model_path)
    out_dir = Path(out_dir)
    if out_dir.resolve() == base.resolve():
        raise ValueError(f"out_dir {out_dir} is the base model folder")
    world = process_world()
    live = isinstance(checkpoint_or_model, nn.Module)
    collective = live and is_sharded(checkpoint_or_model)
    if not (world.is_main or collective):  # rank 0 alone reads a checkpoint or an unsharded model
        return _outcome(None, world, out_dir)
    source, failure = None, None
    try:  # the same on every rank: a model that cannot be merged fails everywhere, before any gather
        source = _LiveWeights(checkpoint_or_model, compute=world.is_main) if live else None
    except BaseException as e:  # noqa: BLE001
        failure = e
    if failure is not None:
        pass
    elif world.is_main:
        streamed = False
        try:
            if source is None:
                source = _checkpoint_weights(Path(checkpoint_or_model), base)
            with atomic_dir(out_dir) as tmp:
                streamed = True
                _stream_engine_weights(source, base, tmp)
                for p in base.iterdir():  # config, generation config, tokenizer, processor, chat template
                    if (p.is_file() and not p.name.endswith(".safetensors") and not p.name.startswith(".")
                            and not (tmp / p.name).exists()):  # the index: written with the files
                        shutil.copy2(p, tmp / p.name)
        except BaseException as e:  # noqa: BLE001 - every rank learns of it below
            failure = e
            if collective and not streamed:  # the other ranks are in the gathers: see them through
                try:
                    _stream_engine_weights(source, base, None)
                except BaseException:  # noqa: BLE001, S110 - the first failure is the one reported
                    pass
    else:
        try:
            _stream_engine_weights(source, base, None)  # the same gathers, nothing kept
        except BaseException as e:  # noqa: BLE001
            failure = e
    return _outcome(failure, world, out_dir)


def _outcome(failure: BaseException | None, world: World, out_dir: Path) -> Path:
    """Every rank returns out_dir, or raises when rank 0 failed (its own error on rank 0)."""
    report = broadcast(None if failure is None else f"{type(failure).__name__}: {failure}", world)
    if failure is not None:
        raise failure
    if report is not None:
        raise RuntimeError(f"writing {out_dir} failed on rank 0 ({report})")
    return out_dir


def save_adapter_for_engine(model: nn.Module, base_model_path: str | os.PathLike, out_dir: Path) -> Path:
    """Write the live PEFT model's adapter as a PEFT folder under the full model's names
    (what vLLM's LoRA loader maps onto its modules), atomically. A few MB where
    `merge_full_weights_for_engine` writes the whole model. With a process group every rank
    calls it (a sharded adapter is gathered tensor by tensor); rank 0 writes."""
    if not is_peft(model):
        raise ValueError("save_adapter_for_engine needs a LoRA (PEFT) model; full fine-tuning exports full weights")
    out_dir = Path(out_dir)
    world = process_world()
    sharded = is_sharded(model)
    state = gather_lora_state(model, keep=world.is_main) if sharded else None
    failure = None
    if world.is_main:
        try:
            with atomic_dir(out_dir) as tmp:
                save_adapter(tmp, model, str(resolve_model_path(base_model_path)), state_dict=state)
        except BaseException as e:  # noqa: BLE001
            failure = e
    return _outcome(failure, world, out_dir)


def copy_checkpoint_adapter(path: Path | str, out_dir: Path, *, base_model_name_or_path: str | None = None) -> Path:
    """A LoRA checkpoint's PEFT folder (either layout: a sharded save gathers it too), copied to
    `out_dir` atomically: the same files `save_adapter_for_engine` writes for a live model.
    `base_model_name_or_path`, when given, replaces the base recorded in adapter_config.json
    (e.g. a hub id instead of the training machine's folder)."""
    path = Path(path)
    if checkpoint_record(path)["kind"] != "lora":
        raise ValueError(f"{path} is a full fine-tuning checkpoint: it has no LoRA adapter")
    source = path / ADAPTER_DIR
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (source / f).is_file()]
    if missing:
        raise ValueError(f"{source} lacks {missing}: not a complete adapter folder")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        for p in sorted(source.iterdir()):
            if p.is_file():
                shutil.copy2(p, tmp / p.name)
        if base_model_name_or_path is not None:
            config = json.loads((tmp / ADAPTER_CONFIG).read_text())
            config["base_model_name_or_path"] = str(base_model_name_or_path)
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


class _LiveWeights:
    """A live model's trained language-model tensors under the full model's (canonical) names, one at a time.

    `get(key)` returns the whole tensor (LoRA merged in) on the rank that `compute`s, None on
    the others; for a sharded model it is a collective (one all-gather per tensor it reads), so
    every rank must ask for the same keys in the same order."""

    def __init__(self, model: nn.Module, *, compute: bool = True):
        self.compute = compute
        self.plain: dict[str, torch.Tensor] = {}  # full name -> the model's tensor (maybe a DTensor)
        # full name -> (W or bias, A, B, scaling, fan_in_fan_out or an expert layout, is_bias)
        self.lora: dict[str, tuple] = {}
        if not is_peft(model):
            state = model.state_dict(keep_vars=True)
            lora_keys = [k for k in state if ".lora_" in k or ".base_layer." in k]
            if lora_keys:
                raise ValueError(f"{type(model).__name__} holds LoRA layers ({lora_keys[0]}) but is not a peft "
                                 "PeftModel: pass the PeftModel that get_peft_model returned")
            aliases = tied_aliases(model)
            self.plain = {k: v for k, v in state.items() if k not in aliases}
            return
        from peft.tuners.lora import LoraLayer, ParamWrapper

        name = single_adapter(model)
        policy = model.get_base_model()
        state = policy.state_dict(keep_vars=True)
        odd = [k for k in state if any(s in k for s in ("modules_to_save", "trainable_tokens", "lora_magnitude"))]
        if odd:
            raise ValueError(f"only plain LoRA adapters can be merged; found {odd[:3]}")
        aliases = tied_aliases(policy)
        self.plain = {_unwrapped(k): v for k, v in state.items() if ".lora_" not in k and k not in aliases}
        for module_name, module in policy.named_modules():
            if not isinstance(module, LoraLayer) or name not in module.lora_A:
                continue
            if name in getattr(module, "lora_variant", {}):
                raise ValueError(f"{module_name}: LoRA variants (DoRA, ...) are not supported by the merge")
            if name in module.merged_adapters:
                continue  # already folded into the base weight
            if isinstance(module, ParamWrapper):  # a parameter, not a linear: MoE experts (target_parameters)
                key = f"{_unwrapped(module_name)}.{module.parameter_name}"
                self.lora[key] = (self.plain[key], state[f"{module_name}.lora_A.{name}.weight"],
                                  state[f"{module_name}.lora_B.{name}.weight"], module.scaling[name],
                                  _ExpertLayout(module.num_experts, module._did_swap_in_out_features), False)
                continue
            a = state[f"{module_name}.lora_A.{name}.weight"]
            b = state[f"{module_name}.lora_B.{name}.weight"]
            scaling, fan_in_fan_out = module.scaling[name], bool(getattr(module, "fan_in_fan_out", False))
            self.lora[f"{module_name}.weight"] = (state[f"{module_name}.base_layer.weight"], a, b, scaling,
                                                  fan_in_fan_out, False)
            if module.lora_bias.get(name, False):
                self.lora[f"{module_name}.bias"] = (state[f"{module_name}.base_layer.bias"],
                                                    None, state[f"{module_name}.lora_B.{name}.bias"], scaling,
                                                    False, True)
        for key in self.lora:  # the merged tensor replaces the base layer's
            del self.plain[key]

    @property
    def keys(self) -> set[str]:
        return set(self.plain) | set(self.lora)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple((self.plain[key] if key in self.plain else self.lora[key][0]).shape)  # a DTensor's is global

    @torch.no_grad()
    def get(self, key: str) -> torch.Tensor | None:
        if key in self.plain:
            t = full_tensor(self.plain[key])
            return t if self.compute else None
        base, a, b, scaling, fan_in_fan_out, is_bias = self.lora[key]
        w, a, b = full_tensor(base), None if a is None else full_tensor(a), full_tensor(b)
        if not self.compute:
            return None
        if is_bias:
            return w + b * scaling
        if isinstance(fan_in_fan_out, _ExpertLayout):
            return w + _expert_lora_delta(a, b, scaling, fan_in_fan_out).to(w.dtype)
        return w + _lora_delta(a, b, scaling, fan_in_fan_out).to(w.dtype)


def _unwrapped(name: str) -> str:
    """A name inside peft's wrappers as the bare model has it: every `base_layer` step dropped
    (nested ParamWrappers, one per MoE expert parameter, put two in a row)."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


@dataclass(frozen=True)
class _ExpertLayout:
    """How peft's ParamWrapper stacks a 3-D parameter's adapter: rank x experts rows, and whether
    the parameter is (E, out, in) (`swapped`, transformers' fused experts) or (E, in, out)."""

    num_experts: int
    swapped: bool


def _expert_lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, layout: _ExpertLayout) -> torch.Tensor:
    """peft's `ParamWrapper.get_delta_weight` for E > 1 experts, on whole (gathered) tensors:
    A (r*E, in) -> (E, r, in), B (out, r*E) -> (out, r, E), delta (E, out, in) or (E, in, out),
    in float32 (a test holds it equal to peft's own on the live module)."""
    a_ERI = a.float().reshape(layout.num_experts, -1, a.shape[-1])
    b_ORE = b.float().reshape(b.shape[0], -1, layout.num_experts)
    pattern = "o r e, e r i -> e o i" if layout.swapped else "o r e, e r i -> e i o"
    return torch.einsum(pattern, b_ORE, a_ERI) * scaling


def _lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool) -> torch.Tensor:
    """peft's `Linear.get_delta_weight`, on whole tensors: (B @ A) * scaling, in float32 on the CPU
    for half-precision adapters."""
    dtype = b.dtype
    cast_to_fp32 = b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    if cast_to_fp32:
        a, b = a.float(), b.float()
    delta = b @ a
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    return delta.to(dtype) if cast_to_fp32 else delta


class _FileWeights:
    """A checkpoint's full fine-tuning weights read one tensor at a time: model.safetensors (the
    plain layout) or the dcp/ folder (the sharded one: each tensor read whole, no process group)."""

    def __init__(self, path: Path):
        self.path = path
        if (path / FULL_WEIGHTS).is_file():
            from safetensors import safe_open

            with safe_open(str(path / FULL_WEIGHTS), framework="pt") as f:
                self.shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
            self.dcp = None
            return
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dcp = path / DCP_DIR
        tied = json.loads((path / STATE_FILE).read_text()).get("checkpoint", {}).get("tied", {})
        metadata = dcp_metadata(self.dcp)
        self.shapes, self.dtypes = {}, {}
        for k, v in metadata.state_dict_metadata.items():
            name = k[len("model."):]
            if k.startswith("model.") and isinstance(v, TensorStorageMetadata) and name not in tied:
                self.shapes[name], self.dtypes[name] = tuple(v.size), v.properties.dtype

    @property
    def keys(self) -> set[str]:
        return set(self.shapes)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.shapes[key]

    def get(self, key: str) -> torch.Tensor:
        if self.dcp is None:
            from safetensors import safe_open

            with safe_open(str(self.path / FULL_WEIGHTS), framework="pt") as f:
                return f.get_tensor(key)
        t = torch.empty(self.shapes[key], dtype=self.dtypes[key])
        dcp_load_here({f"model.{key}": t}, self.dcp)
        return t


def _checkpoint_weights(path: Path, base: Path):
    check_complete(path)
    if (path / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        from saccade.models.lm import load_policy_lm

        # peft reads the adapter config (rank, alpha, rslora, patterns) for us.
        return _LiveWeights(PeftModel.from_pretrained(load_policy_lm(base), str(path / ADAPTER_DIR)))
    return _FileWeights(path)


# safetensors' dtype names (its format is little-endian, as the machines we run on)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _safetensors_header(file: Path) -> tuple[int, dict, dict[str, dict]]:
    """(where the data starts, __metadata__, {key: {dtype, shape, data_offsets}} in data order)."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", None) or {}
    return 8 + n, metadata, dict(sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]))


@dataclass(frozen=True)
class _Out:
    """One tensor of an output file: written under `key`; the trained tensor `trained` (canonical
    name) in the engine's layout, or else the base's bytes at `offset` copied as they are."""

    key: str
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    nbytes: int
    trained: str | None = None
    offset: int = 0


def engine_file_plan(headers, layout, trained_shapes: dict[str, tuple[int, ...]]) -> list[tuple[Path, list[_Out]]]:
    """What each output file holds, in order: every base file again, the language model's trained
    tensors in the engine's (the hub's) layout, everything else (the vision tower, tensors the
    model does not read) byte for byte. A base that stores a trained tensor as the engine reads it
    keeps its key; one stored otherwise (experts split per expert, or in transformers' memory
    layout: what `save_pretrained` writes) gets the tensor once, under its canonical name, at the
    place of its first stored piece. Checked in full before anything is gathered, identically on
    every rank: no rank may stop half way."""
    to_hub = layout.family.checkpoint.to_hub
    canonical = {k: layout.canonical(k)[0] for _, _, _, entries in headers for k in entries}
    pieces: dict[str, int] = {}
    for name in canonical.values():
        pieces[name] = pieces.get(name, 0) + 1
    in_base = set(canonical.values())
    bad = [k for k in trained_shapes if not (k.startswith(LM_PREFIX) or k == LM_HEAD_KEY)]
    if bad:
        raise ValueError(f"trained weights have names outside the language model: {bad[:3]}")
    lacking = sorted(c for c in in_base if (c.startswith(LM_PREFIX) or c == LM_HEAD_KEY) and c not in trained_shapes)
    if lacking:
        raise ValueError(f"the trained weights lack {lacking[0]}, which the base model has")
    extra = sorted(set(trained_shapes) - in_base)
    if extra:
        raise ValueError(f"trained tensors not in the base model {layout.path}: {extra[:3]}")
    expected = layout.engine_shapes()
    engine_shape = {}
    for c in sorted(trained_shapes):  # the family's conversion run on a shape alone
        engine_shape[c] = tuple(to_hub(c, torch.empty(trained_shapes[c], device="meta")).shape)
        if list(engine_shape[c]) != expected[c]:
            raise ValueError(f"{c}: trained shape {engine_shape[c]} in the engine's layout != the base model's "
                             f"{tuple(expected[c])}")
    plan, placed = [], set()
    for file, data_start, _, entries in headers:
        out = []
        for key, info in entries.items():
            c = canonical[key]
            begin, end = info["data_offsets"]
            if c not in trained_shapes:
                out.append(_Out(key, info["dtype"], tuple(info["shape"]), end - begin, offset=data_start + begin))
            elif c not in placed:
                placed.add(c)
                as_stored = pieces[c] == 1 and tuple(info["shape"]) == engine_shape[c]
                itemsize = torch.empty((), dtype=_ST_DTYPES[info["dtype"]]).element_size()
                nbytes = itemsize * math.prod(engine_shape[c])
                out.append(_Out(key if as_stored else c, info["dtype"], engine_shape[c], nbytes, trained=c))
        plan.append((file, out))
    return plan


def _stream_engine_weights(source, base: Path, tmp: Path | None) -> None:
    """Every base safetensors file again under tmp (None: only take part in a sharded source's
    gathers), the language model's tensors taken from `source`, one at a time (`engine_file_plan`)."""
    from saccade.models.loading import load_layout

    if sys.byteorder != "little":
        raise RuntimeError("writing safetensors needs a little-endian machine")
    headers = [(file, *_safetensors_header(file)) for file in safetensors_files(base)]
    layout = load_layout(base)
    plan = engine_file_plan(headers, layout, {k: tuple(source.shape(k)) for k in source.keys})
    metadata = {file: meta for file, _, meta, _ in headers}

    failure = None
    weight_map: dict[str, str] = {}
    for file, entries in plan:
        out = None
        if tmp is not None and failure is None:
            try:
                out = _SafetensorsWriter(tmp / file.name, entries, metadata[file] or {"format": "pt"})
            except BaseException as e:  # noqa: BLE001 - keep taking part in the gathers, raise at the end
                failure = e
        with open(file, "rb") as src:
            for entry in entries:
                weight_map[entry.key] = file.name
                t = source.get(entry.trained) if entry.trained else None  # every rank, in this order
                if out is None:
                    continue
                try:
                    if entry.trained:
                        t = layout.family.checkpoint.to_hub(entry.trained, t.detach())  # the hub's layout
                        out.write(entry.key, t.to(device="cpu", dtype=_ST_DTYPES[entry.dtype]))
                    else:  # the vision tower: its bytes as they are
                        out.copy(entry.key, src, entry.offset, entry.nbytes)
                except BaseException as e:  # noqa: BLE001
                    failure, out = e, out.abort()
                del t
        if out is not None:
            try:
                out.close()
            except BaseException as e:  # noqa: BLE001
                failure = e
    if failure is not None:
        raise failure
    if tmp is not None and (base / INDEX_FILE).is_file():  # the index names the keys as written
        index = json.loads((base / INDEX_FILE).read_text())
        index["weight_map"] = dict(sorted(weight_map.items()))
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class _SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (known up front from the base file's
    dtypes and shapes) first, then each tensor's bytes in order."""

    def __init__(self, path: Path, entries: list[_Out], metadata: dict[str, str]):
        header: dict = {"__metadata__": metadata}
        self.sizes: list[tuple[str, int]] = []
        offset = 0
        for entry in entries:
            header[entry.key] = {"dtype": entry.dtype, "shape": list(entry.shape),
                                 "data_offsets": [offset, offset + entry.nbytes]}
            self.sizes.append((entry.key, entry.nbytes))
            offset += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.path, self.total, self.next = path, 8 + len(text) + offset, 0
        self.file = open(path, "wb")  # noqa: SIM115 - closed by close() or abort()
        self.file.write(len(text).to_bytes(8, "little") + text)

    def _expect(self, key: str, nbytes: int) -> None:
        want, size = self.sizes[self.next]
        if key != want or nbytes != size:
            raise ValueError(f"{self.path.name}: got {key} ({nbytes} bytes), expected {want} ({size} bytes)")
        self.next += 1

    def write(self, key: str, t: torch.Tensor) -> None:
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self._expect(key, data.nbytes)
        self.file.write(memoryview(data))

    def copy(self, key: str, src, offset: int, length: int) -> None:
        self._expect(key, length)
        src.seek(offset)
        while length:
            chunk = src.read(min(length, 64 << 20))
            if not chunk:
                raise ValueError(f"{src.name} ends before {key} does")
            self.file.write(chunk)
            length -= len(chunk)

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.sizes) or self.path.stat().st_size != self.total:
            raise ValueError(f"{self.path}: wrote {self.next} of {len(self.sizes)} tensors")

    def abort(self) -> None:
        self.file.close()
