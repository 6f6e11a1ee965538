"""Checkpoints that resume a run exactly, and weights the inference engine can load.

Layout (one directory per saved step, newest `keep_last` kept):
```
run_dir/checkpoints/step_000012/
  adapter/            LoRA: peft `save_pretrained` (adapter_model.safetensors, adapter_config.json)
  model.safetensors   full fine-tuning: the PolicyLM state dict under the full Qwen3-VL names
  optimizer.pt  scheduler.pt  rng.pt  state.json
  COMPLETE            written last; lists every file and its size
```
Adapter keys are `base_model.model.model.language_model...`, the full model's names, so
`PeftModel.from_pretrained(Qwen3VLForConditionalGeneration..., step/adapter)` works, and
`AutoPeftModel.from_pretrained(step/adapter)` too (its `auto_mapping` is pointed at the full
model class and `base_model_name_or_path` at the base folder). `model.safetensors` has
`model.language_model.*` and `lm_head.weight` (absent when tied to the embeddings, as in HF).

Crash safety: everything is written into `checkpoints/.tmp-step_000012-<pid>/`, fsynced,
`COMPLETE` is written last, then the directory is renamed to `step_000012` in one step.
`latest_checkpoint` only looks at `step_*` directories that hold `COMPLETE`, so a save that
dies anywhere leaves at worst a `.tmp-*` directory, which a later save deletes once the pid
that wrote it is gone (pids are per machine: on a filesystem shared between machines a
live writer elsewhere could look dead; give each machine its own run_dir). Re-saving a step
that exists swaps the two directories atomically (Linux `renameat2(RENAME_EXCHANGE)`),
falling back to rename-aside-then-rename where that is not supported. Saves from several
threads of one process into one run_dir at once are not supported.

`merge_full_weights_for_engine` writes an ordinary Hugging Face folder (the base folder's
config, tokenizer and processor files, and all its tensors with the language-model ones
replaced by the trained ones, LoRA merged in as W + scale * B @ A): what a vLLM server reloads.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from saccade.models.loading import LM_HEAD_KEY, LM_PREFIX, resolve_model_path, safetensors_files

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "COMPLETE"
ADAPTER_DIR = "adapter"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FULL_WEIGHTS = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"
STATE_FILE = "state.json"
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-.*-(\d+)$")
# LoRA hyperparameters that change what the adapter computes: a resume must not change them.
_LORA_FIELDS = ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "rank_pattern", "alpha_pattern")


@dataclass
class TrainState:
    """Everything besides weights and optimizer that a run needs to resume exactly."""

    step: int
    data_position: int  # how far through the data stream (e.g. prompts consumed)
    policy_version: int
    extra: dict = field(default_factory=dict)  # JSON-serialisable: metrics tail, config hash, ...


# ---------------------------------------------------------------------------- save


def save_checkpoint(
    run_dir: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    state: TrainState,
    keep_last: int,
    base_model_path: str | os.PathLike | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step_{state.step:06d}` atomically; keep the newest `keep_last`."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(state.step, int) or state.step < 0:
        raise ValueError(f"state.step must be a non-negative int, got {state.step!r}")
    # The RNG state first, before anything here could draw from it.
    rng = _rng_state()
    peft = _is_peft(model)
    if base_model_path is None:  # the folder load_policy_lm read, when transformers recorded it
        inner = model.get_base_model() if peft else model
        base_model_path = getattr(getattr(inner, "config", None), "_name_or_path", None) or None
    base = None if base_model_path is None else str(base_model_path)
    payload = {
        **asdict(state),
        "checkpoint": {"format": FORMAT_VERSION, "kind": "lora" if peft else "full", "base_model_path": base},
    }
    try:  # refuse a non-JSON `extra` before writing anything
        state_text = json.dumps(payload, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"TrainState is not JSON-serialisable: {e}") from e

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"step_{state.step:06d}"
    with _atomic_dir(final) as tmp:
        if peft:
            _save_adapter(tmp / ADAPTER_DIR, model, base)
        else:
            _save_full(tmp / FULL_WEIGHTS, model, masters=_masters(optimizer))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        torch.save(rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(state_text)
        _fsync_tree(tmp)  # everything is on disk before COMPLETE says so
        manifest = {"step": state.step, "files": {str(p.relative_to(tmp)): p.stat().st_size for p in _files(tmp)}}
        (tmp / COMPLETE).write_text(json.dumps(manifest, indent=2) + "\n")
    _prune(root, state.step, keep_last)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete `step_*` directory with the highest step, or None."""
    complete = [(s, p) for s, p in _step_dirs(Path(run_dir) / CHECKPOINTS_DIR) if (p / COMPLETE).is_file()]
    return complete[-1][1] if complete else None


def _save_adapter(adapter_dir: Path, model, base_model_path: str | None) -> None:
    name = _single_adapter(model)
    model.save_pretrained(str(adapter_dir), selected_adapters=[name])
    if name != "default":  # peft puts non-default adapters in a subfolder: keep one layout
        for p in (adapter_dir / name).iterdir():
            os.replace(p, adapter_dir / p.name)
        (adapter_dir / name).rmdir()
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_model_path
    # peft records the class it wrapped (PolicyLM) for AutoPeftModel; point it at the full model
    # class, the one the adapter is meant to load onto.
    architectures = getattr(getattr(model.get_base_model(), "config", None), "architectures", None)
    if architectures:
        config["auto_mapping"] = {"base_model_class": architectures[0], "parent_library": "transformers"}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _masters(optimizer) -> dict[str, torch.Tensor] | None:
    """The float32 master weights of full fine-tuning in bf16 (`saccade.trainer.step.MasterWeights`), by name."""
    masters = getattr(optimizer, "master_weights", None)
    return masters.named if masters is not None else None


def _save_full(path: Path, model: nn.Module, masters: dict[str, torch.Tensor] | None = None) -> None:
    """The model's state dict; where float32 master weights exist, those (not the rounded
    bf16 copies the model computes with), so a resume continues from exactly them."""
    from safetensors.torch import save_file

    state = model.state_dict()
    lora_keys = [k for k in state if ".lora_" in k or ".base_layer." in k]
    if lora_keys:
        raise ValueError(
            f"{type(model).__name__} holds LoRA layers ({lora_keys[0]}) but is not a peft PeftModel: "
            "pass the PeftModel that get_peft_model returned"
        )
    kept, _ = _dedupe(state)
    for name, master in (masters or {}).items():
        if name in kept:
            kept[name] = master
    save_file({k: v.detach().to("cpu").contiguous() for k, v in kept.items()}, str(path), metadata={"format": "pt"})


# ---------------------------------------------------------------------------- load


def load_checkpoint(path: Path, *, model: nn.Module, optimizer=None, scheduler=None) -> TrainState:
    """Restore weights (in place), optimizer, scheduler and RNG states; return the TrainState."""
    path = Path(path)
    manifest = _check_complete(path)
    payload = json.loads((path / STATE_FILE).read_text())
    kind = payload.get("checkpoint", {}).get("kind") or ("lora" if (path / ADAPTER_DIR).is_dir() else "full")
    peft = _is_peft(model)
    if kind == "lora" and not peft:
        raise ValueError(f"{path} is a LoRA checkpoint but the model is not a peft model: apply_lora first")
    if kind == "full" and peft:
        raise ValueError(f"{path} is a full fine-tuning checkpoint but the model is a peft (LoRA) model")
    needed = [ADAPTER_DIR + "/" + ADAPTER_WEIGHTS if peft else FULL_WEIGHTS, RNG_FILE]
    needed += [OPTIMIZER_FILE] * (optimizer is not None) + [SCHEDULER_FILE] * (scheduler is not None)
    missing = [f for f in needed if f not in manifest["files"] or not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")

    if peft:
        _load_adapter(path / ADAPTER_DIR, model)
    else:
        _load_full(path / FULL_WEIGHTS, model, masters=_masters(optimizer))
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    if scheduler is not None:
        # LambdaLR and friends save callable objects' __dict__: allow any pickle (our own file).
        scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=False))
    _set_rng_state(torch.load(path / RNG_FILE, map_location="cpu", weights_only=True))
    fields = {k: payload[k] for k in ("step", "data_position", "policy_version", "extra")}
    return TrainState(**fields)


def _load_adapter(adapter_dir: Path, model) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    name = _single_adapter(model)
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    live = model.peft_config[name].to_dict()
    differ = [f for f in _LORA_FIELDS if _norm(saved.get(f)) != _norm(live.get(f))]
    if differ:
        pairs = ", ".join(f"{f}: saved {saved.get(f)!r} vs model {live.get(f)!r}" for f in differ)
        raise ValueError(f"{adapter_dir}: the LoRA settings differ from the model's ({pairs})")
    device = next(model.parameters()).device
    weights = load_file(str(adapter_dir / ADAPTER_WEIGHTS), device=str(device))
    result = set_peft_model_state_dict(model, weights, adapter_name=name)
    not_loaded = [k for k in result.missing_keys if ".lora_" in k and f".{name}." in k]
    if result.unexpected_keys or not_loaded:
        raise ValueError(
            f"{adapter_dir} does not fit the model: unexpected {result.unexpected_keys[:3]}, "
            f"not loaded {not_loaded[:3]}"
        )


def _load_full(path: Path, model: nn.Module, masters: dict[str, torch.Tensor] | None = None) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    own = model.state_dict()
    _, aliases = _dedupe(own)  # tied names -> the name kept on disk
    missing = [k for k in own if k not in saved and aliases.get(k) not in saved]
    unexpected = [k for k in saved if k not in own]
    if missing or unexpected:
        raise ValueError(f"{path} does not fit {type(model).__name__}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    try:
        model.load_state_dict({k: saved[k] if k in saved else saved[aliases[k]] for k in own}, strict=True)
    except RuntimeError as e:  # shape mismatches
        raise ValueError(f"{path} does not fit {type(model).__name__}: {e}") from e
    with torch.no_grad():
        for name, master in (masters or {}).items():
            master.copy_(saved[name] if name in saved else saved[aliases[name]])


def _check_complete(path: Path) -> dict:
    if not path.is_dir():
        raise ValueError(f"no checkpoint directory at {path}")
    if not (path / COMPLETE).is_file():
        raise ValueError(f"{path} has no {COMPLETE} marker: an unfinished save, or not a checkpoint")
    try:
        manifest = json.loads((path / COMPLETE).read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}/{COMPLETE} is not a checkpoint manifest: {e}") from e
    missing = [f for f in files if not (path / f).is_file()] + [STATE_FILE] * (STATE_FILE not in files)
    if missing:
        raise ValueError(f"checkpoint {path} is missing files: {missing}")
    truncated = [f for f, size in files.items() if (path / f).stat().st_size != size]
    if truncated:
        raise ValueError(f"checkpoint {path} has files whose size changed since the save: {truncated}")
    return manifest


# ---------------------------------------------------------------------------- engine weights


def merge_full_weights_for_engine(
    checkpoint_or_model: Path | str | nn.Module, base_model_path: str | os.PathLike, out_dir: Path
) -> Path:
    """Write a full HF Qwen3-VL folder with the trained language model (LoRA merged in).

    `checkpoint_or_model` is a checkpoint directory or a live model (PolicyLM or its PeftModel);
    a live model is read, never changed. Trained tensors are cast to the base tensors' dtype;
    every other tensor (the vision tower) is copied byte for byte. Written atomically.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    base = resolve_model_path(base_model_path)
    out_dir = Path(out_dir)
    if out_dir.resolve() == base.resolve():
        raise ValueError(f"out_dir {out_dir} is the base model folder")
    trained = _trained_lm_weights(checkpoint_or_model, base)
    bad = [k for k in trained if not (k.startswith(LM_PREFIX) or k == LM_HEAD_KEY)]
    if bad:
        raise ValueError(f"trained weights have names outside the language model: {bad[:3]}")

    with _atomic_dir(out_dir) as tmp:
        replaced: set[str] = set()
        for file in safetensors_files(base):
            tensors = {}
            with safe_open(str(file), framework="pt") as f:
                metadata = f.metadata() or {"format": "pt"}
                for key in f.keys():
                    t = f.get_tensor(key)
                    if key in trained:
                        new = trained[key].detach().to(device="cpu", dtype=t.dtype).contiguous()
                        if new.shape != t.shape:
                            raise ValueError(f"{key}: trained shape {tuple(new.shape)} != base {tuple(t.shape)}")
                        t = new
                        replaced.add(key)
                    elif key.startswith(LM_PREFIX) or key == LM_HEAD_KEY:
                        raise ValueError(f"the trained weights lack {key}, which the base model has")
                    tensors[key] = t
            save_file(tensors, str(tmp / file.name), metadata=metadata)
            del tensors
        extra = sorted(set(trained) - replaced)
        if extra:
            raise ValueError(f"trained tensors not in the base model {base}: {extra[:3]}")
        for p in base.iterdir():  # config, generation config, tokenizer, processor, chat template, index
            if p.is_file() and not p.name.endswith(".safetensors") and not p.name.startswith("."):
                shutil.copy2(p, tmp / p.name)
    return out_dir


def save_adapter_for_engine(model: nn.Module, base_model_path: str | os.PathLike, out_dir: Path) -> Path:
    """Write the live PEFT model's adapter as a PEFT folder under the full Qwen3-VL names
    (what vLLM's LoRA loader maps onto its modules), atomically. A few MB where
    `merge_full_weights_for_engine` writes the whole model."""
    if not _is_peft(model):
        raise ValueError("save_adapter_for_engine needs a LoRA (PEFT) model; full fine-tuning exports full weights")
    out_dir = Path(out_dir)
    with _atomic_dir(out_dir) as tmp:
        _save_adapter(tmp, model, str(resolve_model_path(base_model_path)))
    return out_dir


def _trained_lm_weights(source, base: Path) -> dict[str, torch.Tensor]:
    """Full-model key -> trained tensor, LoRA merged, tied duplicates left out."""
    if isinstance(source, nn.Module):
        return _merged_state_dict(source) if _is_peft(source) else _dedupe(source.state_dict())[0]
    path = Path(source)
    _check_complete(path)
    if (path / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        from saccade.models.lm import load_policy_lm

        # peft reads the adapter config (rank, alpha, rslora, patterns) for us.
        model = PeftModel.from_pretrained(load_policy_lm(base), str(path / ADAPTER_DIR))
        return _merged_state_dict(model)
    from safetensors.torch import load_file

    return load_file(str(path / FULL_WEIGHTS))


@torch.no_grad()
def _merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The base model's state dict with each LoRA delta added: W + scale * B @ A, the live model untouched."""
    from peft.tuners.lora import LoraLayer

    name = _single_adapter(model)
    policy = model.get_base_model()
    state, _ = _dedupe(policy.state_dict())
    odd = [k for k in state if any(s in k for s in ("modules_to_save", "trainable_tokens", "lora_magnitude"))]
    if odd:
        raise ValueError(f"only plain LoRA adapters can be merged; found {odd[:3]}")
    out = {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}
    for module_name, module in policy.named_modules():
        if not isinstance(module, LoraLayer) or name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}):
            raise ValueError(f"{module_name}: LoRA variants (DoRA, ...) are not supported by the merge")
        if name in module.merged_adapters:
            continue  # already folded into the base weight
        base_layer = module.get_base_layer()
        weight = base_layer.weight
        out[f"{module_name}.weight"] = weight + module.get_delta_weight(name).to(weight.dtype)
        if module.lora_bias.get(name, False):
            out[f"{module_name}.bias"] = base_layer.bias + module.lora_B[name].bias * module.scaling[name]
    return out


# ---------------------------------------------------------------------------- RNG


def _rng_state() -> dict:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state as plain values, so rng.pt loads with weights_only=True
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warnings.warn("checkpoint has CUDA RNG states but CUDA is not available: not restored")
            return
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(f"checkpoint has {len(cuda)} CUDA RNG states, this machine {torch.cuda.device_count()} GPUs")
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# ---------------------------------------------------------------------------- helpers


def _is_peft(model) -> bool:
    peft = sys.modules.get("peft")  # never imported means never a PeftModel
    return peft is not None and isinstance(model, peft.PeftModel)


def _single_adapter(model) -> str:
    names = list(model.peft_config)
    if len(names) != 1:
        raise ValueError(f"checkpointing supports one LoRA adapter per model; this one has {names}")
    return names[0]


def _norm(value):
    if isinstance(value, (set, list, tuple)):
        return sorted(value)
    return value


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop names that alias an earlier tensor (tied lm_head -> embed_tokens, as HF does).

    Returns (kept state, dropped name -> kept name). The first name in state-dict order wins,
    which keeps `model.language_model.embed_tokens.weight` (safetensors' `save_model` would
    keep the alphabetically first, `lm_head.weight`, which HF loaders do not expect).
    """
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for k, v in state.items():
        ident = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        if v.numel() and ident in seen:
            aliases[k] = seen[ident]
            continue
        seen[ident] = k
        ptr = v.untyped_storage().data_ptr()
        # A partial view of a storage already kept: safetensors refuses shared storage, so copy it.
        kept[k] = v.clone() if v.numel() and ptr in storages else v
        storages.add(ptr)
    return kept, aliases


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return sorted(found)


def _prune(root: Path, saved_step: int, keep_last: int) -> None:
    """Delete step dirs older than the newest `keep_last` (the one just saved counts), and dead `.tmp-*`.

    Steps newer than the one just saved (a run resumed from an earlier checkpoint) are left alone.
    """
    older = [(s, p) for s, p in _step_dirs(root) if s < saved_step]
    complete_older = [p for _, p in older if (p / COMPLETE).is_file()]
    keep = set(complete_older[max(0, len(complete_older) - (keep_last - 1)) :]) if keep_last > 1 else set()
    for _, p in older:  # incomplete older step dirs are garbage too
        if p not in keep:
            _remove_dir(p)
    for p in root.iterdir():
        m = _TMP_RE.match(p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _remove_dir(p: Path) -> None:
    # Rename first (atomic), so a crash mid-delete never leaves a half-deleted step_* dir.
    trash = p.with_name(f".tmp-del-{p.name}-{os.getpid()}")
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _atomic_dir(final: Path):
    """A fresh `.tmp-<name>-<pid>` folder beside `final` to write into. On a clean exit it is
    fsynced and published as `final` in one step; on any error it is removed, and `final`
    is left as it was."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished `tmp` to `final`, replacing an existing `final` atomically where possible."""
    if not final.exists():
        os.replace(tmp, final)
    else:
        if _exchange(tmp, final):
            old = tmp  # now holds the previous contents
        else:
            old = final.with_name(f".tmp-old-{final.name}-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_file(final.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in _files(root):
        _fsync_file(p)
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        _fsync_file(d)
    _fsync_file(root)
