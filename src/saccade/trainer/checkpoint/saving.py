"""Checkpoints that resume a run exactly: weights, optimizer, scheduler, RNG and `TrainState`.

Two layouts, one directory per saved step (newest `keep_last` kept). A single process with a
plain model writes the first; an FSDP2-sharded model (`saccade.trainer.sharding.shard_model`, every
rank calling `save_checkpoint`) writes the second:
```
run_dir/checkpoints/step_000012/              run_dir/checkpoints/step_000012/
  adapter/           LoRA (peft folder)          dcp/               torch.distributed.checkpoint:
  model.safetensors  full fine-tuning              .metadata          model + optimizer, FQN-keyed,
  optimizer.pt                                     __0_0.distcp ...   one file per rank
  scheduler.pt  rng.pt  state.json               adapter/           LoRA: gathered, the same peft folder
  COMPLETE                                       scheduler.pt  state.json  rng.pt (rank 0's)
                                                 rng_rank0.pt  rng_rank1.pt ...
                                                 optimizer.pt       only when the optimizer had no state yet
                                                 COMPLETE
```
`load_checkpoint` reads either layout into either kind of model, at any world size: a sharded
checkpoint is resharded by DCP (world 2 -> 2, 2 -> 1, or into a plain model with no process
group at all), a plain one is read whole on every rank and scattered into the shards.
docs/checkpoints.md has the details.

Adapter keys are `base_model.model.model.language_model...`, the full model's names, so
`PeftModel.from_pretrained(<the family's full model>..., step/adapter)` works, and
`AutoPeftModel.from_pretrained(step/adapter)` too (its `auto_mapping` is pointed at the full
model class and `base_model_name_or_path` at the base folder). `model.safetensors` has
`model.language_model.*` and `lm_head.weight` (absent when tied to the embeddings, as in HF).

Crash safety (`saccade.atomic`): everything is written into `checkpoints/.tmp-step_000012-<pid>/`
(rank 0's pid, broadcast, when sharded), fsynced, `COMPLETE` is written last, then the directory
is renamed to `step_000012` in one step. `latest_checkpoint` only looks at `step_*` directories
that hold `COMPLETE`, so a save that dies anywhere leaves at worst a `.tmp-*` directory, which a
later save deletes once the pid that wrote it is gone (pids are per machine: on a filesystem
shared between machines a live writer elsewhere could look dead; give each run its own run_dir).
Re-saving a step that exists swaps the two directories atomically (Linux
`renameat2(RENAME_EXCHANGE)`), falling back to rename-aside-then-rename where that is not
supported. Saves from several threads of one process into one run_dir at once are not supported.

Where things live: the folder's file names, its manifest and which step folders count in
`checkpoint_folder`; the sharded layout in `checkpoint_dcp`; a model's state (peft or not, tied
names, gathering) in `model_state`; the temp-folder-and-rename in `saccade.atomic`. Weights for
the inference engine and `saccade export` are `saccade.trainer.checkpoint.engine_weights`.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from saccade.atomic import atomic_dir
from saccade.distributed import is_sharded
from saccade.trainer.checkpoint.dcp import (
    dcp_has,
    load_dcp_plain,
    load_dcp_sharded,
    load_plain_into_sharded,
    save_sharded,
)
from saccade.trainer.checkpoint.folder import (
    ADAPTER_CONFIG,
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    CHECKPOINTS_DIR,
    DCP_DIR,
    DCP_FORMAT_VERSION,
    DCP_METADATA,
    FORMAT_VERSION,
    FULL_WEIGHTS,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    check_complete,
    complete_checkpoints,
    prune,
    write_manifest,
)
from saccade.trainer.checkpoint.model_state import (
    is_peft,
    load_plain_values,
    master_weights,
    process_world,
    save_adapter,
    single_adapter,
    tied_aliases,
)

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
    """Write `run_dir/checkpoints/step_{state.step:06d}` atomically; keep the newest `keep_last`.

    For a sharded model (`saccade.distributed.is_sharded`) this is a collective: every rank
    calls it with the same arguments (rank 0's `state` is the one written) and every rank
    returns the path, or raises, once the checkpoint is published."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    if not isinstance(state.step, int) or state.step < 0:
        raise ValueError(f"state.step must be a non-negative int, got {state.step!r}")
    sharded = is_sharded(model)
    # The RNG state first, before anything here could draw from it.
    rng = _rng_state(current_device_only=sharded)
    peft = is_peft(model)
    if base_model_path is None:  # the folder load_policy_lm read, when transformers recorded it
        inner = model.get_base_model() if peft else model
        base_model_path = getattr(getattr(inner, "config", None), "_name_or_path", None) or None
    base = None if base_model_path is None else str(base_model_path)
    checkpoint = {"format": FORMAT_VERSION, "kind": "lora" if peft else "full", "base_model_path": base}
    if sharded:
        if master_weights(optimizer) is not None:
            raise ValueError("a sharded model trains its float32 DTensor parameters directly: "
                             "its optimizer must not hold MasterWeights")
        checkpoint.update(format=DCP_FORMAT_VERSION, layout="dcp", world_size=process_world().size,
                          tied=tied_aliases(model))
    payload = {**asdict(state), "checkpoint": checkpoint}
    try:  # refuse a non-JSON `extra` before writing anything
        state_text = json.dumps(payload, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"TrainState is not JSON-serialisable: {e}") from e

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"step_{state.step:06d}"
    if sharded:
        return save_sharded(root, final, model=model, optimizer=optimizer, scheduler=scheduler, step=state.step,
                            keep_last=keep_last, base=base, peft=peft, rng=rng, state_text=state_text)
    with atomic_dir(final) as tmp:
        if peft:
            save_adapter(tmp / ADAPTER_DIR, model, base)
        else:
            _save_full(tmp / FULL_WEIGHTS, model, masters=master_weights(optimizer))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scheduler is not None:
            torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        torch.save(rng, tmp / RNG_FILE)
        (tmp / STATE_FILE).write_text(state_text)
        write_manifest(tmp, state.step)
    prune(root, state.step, keep_last)
    return final


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


def load_latest_checkpoint(run_dir: Path, *, model: nn.Module, optimizer=None,
                           scheduler=None) -> tuple[Path, TrainState] | None:
    """The newest of the run's complete checkpoints that loads (into `model`, `optimizer`,
    `scheduler`), and its state; None when the run has none. One that fails to load (a changed
    file, a torn safetensors header) is passed over with a warning for the one before it: a
    resume goes on from a few steps earlier rather than not at all. The next save of that step
    replaces it. ValueError, listing each failure, when none loads; a failed attempt may have
    loaded part of itself, which the next attempt's load overwrites whole."""
    failures = []
    for _, path in reversed(complete_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler)
        except Exception as err:  # noqa: BLE001 - any failure to load is this checkpoint's; all are listed
            failures.append(f"{path.name}: {err}")
            warnings.warn(f"{path} cannot be loaded ({err}); trying the checkpoint before it", stacklevel=2)
    if failures:
        raise ValueError(f"no checkpoint under {run_dir} loads:\n" + "\n".join(failures))
    return None


def load_checkpoint(path: Path, *, model: nn.Module, optimizer=None, scheduler=None) -> TrainState:
    """Restore weights (in place), optimizer, scheduler and RNG states; return the TrainState.

    Either layout into either kind of model: for a sharded model every rank calls it (the
    loads are collectives); a plain model needs no process group, whatever world size wrote
    the checkpoint. The RNG restored is this rank's (`rng_rank{r}.pt`), else rank 0's."""
    path = Path(path)
    manifest = check_complete(path, contents=True)
    payload = json.loads((path / STATE_FILE).read_text())
    info = payload.get("checkpoint", {})
    kind = info.get("kind") or ("lora" if (path / ADAPTER_DIR).is_dir() else "full")
    peft = is_peft(model)
    if kind == "lora" and not peft:
        raise ValueError(f"{path} is a LoRA checkpoint but the model is not a peft model: apply_lora first")
    if kind == "full" and peft:
        raise ValueError(f"{path} is a full fine-tuning checkpoint but the model is a peft (LoRA) model")
    files = manifest["files"]
    layout_dcp = DCP_METADATA in files
    if layout_dcp:
        needed = [DCP_METADATA] + [ADAPTER_DIR + "/" + ADAPTER_CONFIG] * peft
    else:
        needed = [ADAPTER_DIR + "/" + ADAPTER_WEIGHTS if peft else FULL_WEIGHTS]
        needed += [OPTIMIZER_FILE] * (optimizer is not None)
    needed += [RNG_FILE] + [SCHEDULER_FILE] * (scheduler is not None)
    missing = [f for f in needed if f not in files or not (path / f).is_file()]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}")
    if peft:
        _check_lora_settings(path / ADAPTER_DIR, model)
    saved_optimizer = None
    if layout_dcp and optimizer is not None:
        if dcp_has(path / DCP_DIR, "optim."):
            saved_optimizer = "dcp"
        elif OPTIMIZER_FILE in files:  # saved before the optimizer's first step
            saved_optimizer = OPTIMIZER_FILE
        else:
            raise ValueError(f"checkpoint {path} lacks ['optimizer state'] (saved without an optimizer)")

    sharded = is_sharded(model)
    if layout_dcp:
        if sharded:
            load_dcp_sharded(path / DCP_DIR, model, optimizer if saved_optimizer == "dcp" else None, peft)
        else:
            load_dcp_plain(path / DCP_DIR, model, optimizer if saved_optimizer == "dcp" else None, peft)
        if saved_optimizer == OPTIMIZER_FILE:  # saved before its first step: no state, only param groups
            optimizer.load_state_dict(load_plain_values(path / OPTIMIZER_FILE))
    elif sharded:
        load_plain_into_sharded(path, model, optimizer, peft)
    else:
        if peft:
            _load_adapter(path / ADAPTER_DIR, model)
        else:
            _load_full(path / FULL_WEIGHTS, model, masters=master_weights(optimizer))
        if optimizer is not None:
            optimizer.load_state_dict(load_plain_values(path / OPTIMIZER_FILE))
    if scheduler is not None:
        # Plain values only: a LambdaLR's state is numbers and lists (a callable object's __dict__
        # of numbers at most), and a checkpoint from elsewhere must not run code when loaded.
        scheduler.load_state_dict(load_plain_values(path / SCHEDULER_FILE))
    rank_rng = f"rng_rank{process_world().rank}.pt"
    _set_rng_state(load_plain_values(path / (rank_rng if rank_rng in files else RNG_FILE)))
    fields = {k: payload[k] for k in ("step", "data_position", "policy_version", "extra")}
    return TrainState(**fields)


def _check_lora_settings(adapter_dir: Path, model) -> None:
    name = single_adapter(model)
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    live = model.peft_config[name].to_dict()
    differ = [f for f in _LORA_FIELDS if _norm(saved.get(f)) != _norm(live.get(f))]
    if differ:
        pairs = ", ".join(f"{f}: saved {saved.get(f)!r} vs model {live.get(f)!r}" for f in differ)
        raise ValueError(f"{adapter_dir}: the LoRA settings differ from the model's ({pairs})")


def _load_adapter(adapter_dir: Path, model) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    name = single_adapter(model)
    _check_lora_settings(adapter_dir, model)
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


# ---------------------------------------------------------------------------- RNG


def _rng_state(current_device_only: bool = False) -> dict:
    """Python, numpy, torch and CUDA generator states. `current_device_only` (a sharded run, one
    GPU per rank): only this rank's GPU, restored onto the loading rank's current GPU."""
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
        if current_device_only:
            state["cuda"] = [torch.cuda.get_rng_state()]
            state["cuda_device"] = torch.cuda.current_device()
        else:
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
        if "cuda_device" in state:  # one rank's GPU: onto this rank's
            torch.cuda.set_rng_state(cuda[0])
            return
        if len(cuda) != torch.cuda.device_count():
            warnings.warn(f"checkpoint has {len(cuda)} CUDA RNG states, this machine {torch.cuda.device_count()} GPUs")
        for i, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# ---------------------------------------------------------------------------- helpers


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
