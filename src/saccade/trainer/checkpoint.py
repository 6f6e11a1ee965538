"""Checkpoints that resume a run exactly, and weights the inference engine can load.

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
`PeftModel.from_pretrained(Qwen3VLForConditionalGeneration..., step/adapter)` works, and
`AutoPeftModel.from_pretrained(step/adapter)` too (its `auto_mapping` is pointed at the full
model class and `base_model_name_or_path` at the base folder). `model.safetensors` has
`model.language_model.*` and `lm_head.weight` (absent when tied to the embeddings, as in HF).

Crash safety: everything is written into `checkpoints/.tmp-step_000012-<pid>/` (rank 0's pid,
broadcast, when sharded), fsynced, `COMPLETE` is written last, then the directory is renamed
to `step_000012` in one step. `latest_checkpoint` only looks at `step_*` directories that hold
`COMPLETE`, so a save that dies anywhere leaves at worst a `.tmp-*` directory, which a later
save deletes once the pid that wrote it is gone (pids are per machine: on a filesystem shared
between machines a live writer elsewhere could look dead; give each run its own run_dir).
Re-saving a step that exists swaps the two directories atomically (Linux
`renameat2(RENAME_EXCHANGE)`), falling back to rename-aside-then-rename where that is not
supported. Saves from several threads of one process into one run_dir at once are not supported.

`merge_full_weights_for_engine` writes an ordinary Hugging Face folder (the base folder's
config, tokenizer and processor files, and all its tensors with the language-model ones
replaced by the trained ones, LoRA merged in as W + scale * B @ A): what a vLLM server reloads.
It streams: one tensor at a time is gathered (from the shards), merged and written.
"""

from __future__ import annotations

import ctypes
import itertools
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

from saccade.distributed import SINGLE, World, all_gather, broadcast, is_sharded
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
DCP_DIR = "dcp"  # torch.distributed.checkpoint folder of a sharded save
DCP_METADATA = DCP_DIR + "/.metadata"
FORMAT_VERSION = 1  # the plain layout
DCP_FORMAT_VERSION = 2  # the sharded layout (state.json "checkpoint": {"format": 2, "layout": "dcp", ...})

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
    peft = _is_peft(model)
    if base_model_path is None:  # the folder load_policy_lm read, when transformers recorded it
        inner = model.get_base_model() if peft else model
        base_model_path = getattr(getattr(inner, "config", None), "_name_or_path", None) or None
    base = None if base_model_path is None else str(base_model_path)
    checkpoint = {"format": FORMAT_VERSION, "kind": "lora" if peft else "full", "base_model_path": base}
    if sharded:
        if _masters(optimizer) is not None:
            raise ValueError("a sharded model trains its float32 DTensor parameters directly: "
                             "its optimizer must not hold MasterWeights")
        checkpoint.update(format=DCP_FORMAT_VERSION, layout="dcp", world_size=_world().size,
                          tied=_tied_aliases(model))
    payload = {**asdict(state), "checkpoint": checkpoint}
    try:  # refuse a non-JSON `extra` before writing anything
        state_text = json.dumps(payload, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ValueError(f"TrainState is not JSON-serialisable: {e}") from e

    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / f"step_{state.step:06d}"
    if sharded:
        return _save_sharded(root, final, model=model, optimizer=optimizer, scheduler=scheduler, step=state.step,
                             keep_last=keep_last, base=base, peft=peft, rng=rng, state_text=state_text)
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
        _write_manifest(tmp, state.step)
    _prune(root, state.step, keep_last)
    return final


def _write_manifest(tmp: Path, step: int) -> None:
    _fsync_tree(tmp)  # everything is on disk before COMPLETE says so
    manifest = {"step": step, "files": {str(p.relative_to(tmp)): p.stat().st_size for p in _files(tmp)}}
    (tmp / COMPLETE).write_text(json.dumps(manifest, indent=2) + "\n")


def _save_sharded(root: Path, final: Path, *, model, optimizer, scheduler, step: int, keep_last: int,
                  base: str | None, peft: bool, rng: dict, state_text: str) -> Path:
    """The collective save: DCP for model and optimizer (each rank its shards), rank 0 for the rest.

    1. rank 0 makes the temp folder and broadcasts its name (its pid: the same folder everywhere);
    2. every rank: `get_state_dict` + `dcp.save` into `dcp/` (DCP raises on every rank if one
       fails), the LoRA tensors gathered for `adapter/`, its own `rng_rank{r}.pt`;
    3. rank 0: adapter/, scheduler.pt, rng.pt, state.json; then every rank reports how it went;
    4. rank 0 fsyncs, writes COMPLETE last, renames, prunes; the outcome is broadcast, so no
       rank returns (or goes on training) before the checkpoint is published or has failed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    world = _world()
    tmp = None
    failure: BaseException | None = None
    if world.is_main:
        try:
            tmp = _fresh_tmp(final)
        except BaseException as e:  # noqa: BLE001 - reported to every rank below
            failure = e
    name = broadcast(None if tmp is None else tmp.name, world)
    if name is None:
        _raise_on_every_rank(failure, world, "could not create the checkpoint folder")
    tmp = final.parent / name
    try:
        # Model: FQN-keyed DTensors (this rank's shards). LoRA: only the adapters (the frozen base
        # comes from the base model folder). Tied names (lm_head -> embed_tokens) are saved once.
        model_sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=peft))
        for alias in _tied_aliases(model):
            model_sd.pop(alias, None)
        to_save = {"model": model_sd}
        # get_optimizer_state_dict would first step a state-less optimizer once (lr 0) to create its
        # state, which changes AdamW's step count: such an optimizer goes to optimizer.pt instead.
        optimizer_state = optimizer is not None and bool(optimizer.state)
        if optimizer_state:
            to_save["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.save(to_save, checkpoint_id=str(tmp / DCP_DIR))
        adapter = _gather_lora_state(model, keep=world.is_main) if peft else None
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    failure = None
    try:  # local writes only: no collective may be skipped by a rank that fails here
        rank_rng = tmp / f"rng_rank{world.rank}.pt"
        torch.save(rng, rank_rng)
        _fsync_file(rank_rng)
        if world.is_main:
            if peft:
                _save_adapter(tmp / ADAPTER_DIR, model, base, state_dict=adapter)
            if optimizer is not None and not optimizer_state:
                torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            if scheduler is not None:
                torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
            torch.save(rng, tmp / RNG_FILE)  # rank 0's, for readers of the plain layout
            (tmp / STATE_FILE).write_text(state_text)
    except BaseException as e:  # noqa: BLE001
        failure = e
    reports = all_gather(None if failure is None else f"{type(failure).__name__}: {failure}", world)
    if any(reports):
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_on_every_rank(failure, world, f"{_first_report(reports)}; nothing was published")

    failure, published = None, False
    if world.is_main:
        try:
            _write_manifest(tmp, step)
            _fsync_tree(tmp)
            _publish(tmp, final)
            published = True
            _prune(root, step, keep_last)
        except BaseException as e:  # noqa: BLE001
            if not published:
                shutil.rmtree(tmp, ignore_errors=True)
            failure = e
    report = broadcast(None if failure is None else
                       f"rank 0: {type(failure).__name__}: {failure}; {final.name} "
                       f"{'was published, pruning failed' if published else 'was not published'}", world)
    if report is not None:
        _raise_on_every_rank(failure, world, report)
    return final


def _first_report(reports: list[str | None]) -> str:
    rank, text = next((r, t) for r, t in enumerate(reports) if t)
    return f"rank {rank}: {text}"


def _raise_on_every_rank(failure: BaseException | None, world: World, report: str):
    """Re-raise this rank's own error, or tell the ranks that had none what went wrong elsewhere."""
    if failure is not None:
        raise failure
    raise RuntimeError(f"checkpoint save failed on another rank ({report})")


def _gather_lora_state(model, *, keep: bool) -> dict[str, torch.Tensor] | None:
    """The LoRA tensors of a sharded PeftModel, whole, on CPU (`keep`: rank 0) or dropped.

    One all-gather per tensor, in state-dict order (the same on every rank). Adapters are small:
    rank 0 holding all of them is a few MB, never the base model."""
    out = {}
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if ".lora_" not in key:
                continue
            full = _full(value)
            if keep:
                out[key] = full.detach().to("cpu").clone()
    return out if keep else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The complete `step_*` directory with the highest step, or None."""
    complete = [(s, p) for s, p in _step_dirs(Path(run_dir) / CHECKPOINTS_DIR) if (p / COMPLETE).is_file()]
    return complete[-1][1] if complete else None


def _save_adapter(adapter_dir: Path, model, base_model_path: str | None,
                  state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """peft's folder for the model's one adapter; `state_dict` (the PeftModel's keys, whole tensors)
    stands in for the model's own when it is sharded (peft cannot write DTensors)."""
    name = _single_adapter(model)
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(adapter_dir), selected_adapters=[name], **kwargs)
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
    """Restore weights (in place), optimizer, scheduler and RNG states; return the TrainState.

    Either layout into either kind of model: for a sharded model every rank calls it (the
    loads are collectives); a plain model needs no process group, whatever world size wrote
    the checkpoint. The RNG restored is this rank's (`rng_rank{r}.pt`), else rank 0's."""
    path = Path(path)
    manifest = _check_complete(path)
    payload = json.loads((path / STATE_FILE).read_text())
    info = payload.get("checkpoint", {})
    kind = info.get("kind") or ("lora" if (path / ADAPTER_DIR).is_dir() else "full")
    peft = _is_peft(model)
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
        if _dcp_has(path / DCP_DIR, "optim."):
            saved_optimizer = "dcp"
        elif OPTIMIZER_FILE in files:  # saved before the optimizer's first step
            saved_optimizer = OPTIMIZER_FILE
        else:
            raise ValueError(f"checkpoint {path} lacks ['optimizer state'] (saved without an optimizer)")

    sharded = is_sharded(model)
    if layout_dcp:
        if sharded:
            _load_dcp_sharded(path / DCP_DIR, model, optimizer if saved_optimizer == "dcp" else None, peft)
        else:
            _load_dcp_plain(path / DCP_DIR, model, optimizer if saved_optimizer == "dcp" else None, peft)
        if saved_optimizer == OPTIMIZER_FILE:  # saved before its first step: no state, only param groups
            optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    elif sharded:
        _load_plain_into_sharded(path, model, optimizer, peft)
    else:
        if peft:
            _load_adapter(path / ADAPTER_DIR, model)
        else:
            _load_full(path / FULL_WEIGHTS, model, masters=_masters(optimizer))
        if optimizer is not None:
            optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True))
    if scheduler is not None:
        # LambdaLR and friends save callable objects' __dict__: allow any pickle (our own file).
        scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=False))
    rank_rng = f"rng_rank{_world().rank}.pt"
    _set_rng_state(torch.load(path / (rank_rng if rank_rng in files else RNG_FILE), map_location="cpu",
                              weights_only=True))
    fields = {k: payload[k] for k in ("step", "data_position", "policy_version", "extra")}
    return TrainState(**fields)


def _check_lora_settings(adapter_dir: Path, model) -> None:
    name = _single_adapter(model)
    saved = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    live = model.peft_config[name].to_dict()
    differ = [f for f in _LORA_FIELDS if _norm(saved.get(f)) != _norm(live.get(f))]
    if differ:
        pairs = ", ".join(f"{f}: saved {saved.get(f)!r} vs model {live.get(f)!r}" for f in differ)
        raise ValueError(f"{adapter_dir}: the LoRA settings differ from the model's ({pairs})")


def _load_adapter(adapter_dir: Path, model) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    name = _single_adapter(model)
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


# --- the sharded layout (DCP) and the plain layout into a sharded model


def _dcp_metadata(dcp_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(dcp_dir)).read_metadata()


def _dcp_load_here(state: dict, dcp_dir: Path) -> None:
    """dcp.load in this process alone (no collective, whether or not a process group exists):
    each tensor in `state` is filled whole, in place."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # it warns that it loads in a single process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)


def _dcp_has(dcp_dir: Path, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in _dcp_metadata(dcp_dir).state_dict_metadata)


def _saved_model_keys(dcp_dir: Path) -> set[str]:
    return {k[len("model."):] for k in _dcp_metadata(dcp_dir).state_dict_metadata if k.startswith("model.")}


def _check_saved_keys(dcp_dir: Path, model, peft: bool) -> None:
    """The checkpoint's model tensors are exactly the ones this model saves (clear error, not DCP's)."""
    expected = set(_model_keys(model, peft))
    saved = _saved_model_keys(dcp_dir)
    if saved != expected:
        raise ValueError(f"{dcp_dir.parent} does not fit {type(model).__name__}: missing "
                         f"{sorted(expected - saved)[:3]}, unexpected {sorted(saved - expected)[:3]}")


def _model_keys(model, peft: bool) -> list[str]:
    """The names a sharded save writes (get_model_state_dict's, LoRA's frozen parameters left out as
    `ignore_frozen_params` does), tied duplicates left out."""
    aliases = _tied_aliases(model)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in model.state_dict() if k not in aliases and not (peft and k in frozen)]


def _load_dcp_sharded(dcp_dir: Path, model, optimizer, peft: bool) -> None:
    """DCP into the shards: each rank reads the pieces of its own shards, whatever world size wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _check_saved_keys(dcp_dir, model, peft)
    # The state dicts hold the live DTensors: dcp.load fills them in place, set_* then runs the
    # modules' and the optimizer's own loading (FSDP's hooks, dtype/device policy).
    model_sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=peft))
    aliases = _tied_aliases(model)
    for alias in aliases:
        model_sd.pop(alias, None)
    to_load = {"model": model_sd}
    if optimizer is not None:
        # On a fresh optimizer this first steps once with lr 0 and zero gradients to create its
        # state (torch's _init_optim_state): no parameter changes, and the state is overwritten.
        to_load["optim"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(to_load, checkpoint_id=str(dcp_dir))
    for alias, kept in aliases.items():
        if kept in model_sd:
            model_sd[alias] = model_sd[kept]
    result = set_model_state_dict(model, model_sd, options=StateDictOptions(strict=not peft))
    _check_loaded(result, model, peft, dcp_dir)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, to_load["optim"])


def _check_loaded(result, model, peft: bool, where: Path) -> None:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    not_loaded = [k for k in getattr(result, "missing_keys", []) if k in trainable]
    unexpected = list(getattr(result, "unexpected_keys", []))
    if not_loaded or unexpected:
        raise ValueError(f"{where} does not fit the model: not loaded {not_loaded[:3]}, unexpected {unexpected[:3]}")


def _load_dcp_plain(dcp_dir: Path, model, optimizer, peft: bool) -> None:
    """DCP into a plain model, no process group needed: every tensor read whole (the model's in place)."""
    _check_saved_keys(dcp_dir, model, peft)
    masters = _masters(optimizer) or {}
    own = model.state_dict()
    keys = _model_keys(model, peft)
    with torch.no_grad():
        # Straight into the parameters (or their float32 masters, for bf16 full fine-tuning).
        _dcp_load_here({f"model.{k}": masters.get(k, own[k]) for k in keys}, dcp_dir)
        for k, master in masters.items():
            own[k].copy_(master)
    if optimizer is not None:
        saved = _read_dcp_whole(dcp_dir, "optim.")["optim"]
        optimizer.load_state_dict(_optimizer_state_by_id(saved, model, optimizer))


def _read_dcp_whole(dcp_dir: Path, prefix: str) -> dict:
    """Every entry whose flattened key starts with `prefix`, whole, as the nested dict that was saved."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _dcp_metadata(dcp_dir)
    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    _dcp_load_here(flat, dcp_dir)  # non-tensors (param groups) replace the Nones
    nested: dict = {}
    for k, v in flat.items():  # planner_data: the path DCP flattened, e.g. ("optim", "state", fqn, "exp_avg")
        _set_path(nested, metadata.planner_data[k], v)
    return nested


def _set_path(root: dict, path: tuple, value) -> None:
    """root[path[0]][path[1]]... = value, making dicts (str keys) and lists (int keys) on the way."""
    node = root
    for p, child in itertools.pairwise(path):
        empty = [] if isinstance(child, int) else {}
        if isinstance(node, list):
            while len(node) <= p:
                node.append(None)
            if node[p] is None:
                node[p] = empty
            node = node[p]
        else:
            node = node.setdefault(p, empty)
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append(None)
    node[path[-1]] = value


def _optimizer_names(model, optimizer) -> list[list[str]]:
    """The model's name of every tensor the optimizer steps, group by group (masters by their
    parameter's name)."""
    masters = _masters(optimizer)
    by_id = {id(t): n for n, t in (masters.items() if masters else model.named_parameters())}
    names = [[by_id.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if any(n is None for group in names for n in group):
        raise ValueError("the optimizer steps tensors that are not the model's parameters")
    return names


def _optimizer_state_by_id(saved: dict, model, optimizer) -> dict:
    """An FQN-keyed optimizer state dict (get_optimizer_state_dict's form) as this optimizer's own,
    keyed by position."""
    names = _optimizer_names(model, optimizer)
    groups = saved.get("param_groups", [])
    if [list(g["params"]) for g in groups] != names:
        raise ValueError("the saved optimizer's parameter groups do not match this optimizer's: "
                         f"{[len(g['params']) for g in groups]} vs {[len(n) for n in names]} parameters")
    ids = {n: i for i, n in enumerate(n for group in names for n in group)}
    state = {ids[n]: s for n, s in saved.get("state", {}).items()}
    return {"state": state, "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in groups]}


def _optimizer_state_by_name(saved: dict, model, optimizer) -> dict:
    """The plain optimizer.pt (keyed by position) in get_optimizer_state_dict's form, keyed by FQN."""
    names = _optimizer_names(model, optimizer)
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(n) for n in names]:
        raise ValueError("the saved optimizer's parameter groups do not match this optimizer's: "
                         f"{[len(g['params']) for g in groups]} vs {[len(n) for n in names]} parameters")
    fqn = {i: n for g, group in zip(groups, names) for i, n in zip(g["params"], group)}
    return {"state": {fqn[i]: s for i, s in saved["state"].items()},
            "param_groups": [{**g, "params": list(group)} for g, group in zip(groups, names)]}


def _load_plain_into_sharded(path: Path, model, optimizer, peft: bool) -> None:
    """The plain layout into a sharded model: every rank reads the whole tensors and keeps its
    shards (set_*_state_dict with full_state_dict=True)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = _model_keys(model, peft)
    if peft:
        name = _single_adapter(model)
        saved = load_file(str(path / ADAPTER_DIR / ADAPTER_WEIGHTS))
        # peft writes `...q_proj.lora_A.weight`; the live name has the adapter's: `...lora_A.default.weight`
        on_disk = {k: re.sub(rf"\.(lora_[A-Za-z_]+)\.{re.escape(name)}\.", r".\1.", k) for k in keys}
        where = path / ADAPTER_DIR / ADAPTER_WEIGHTS
    else:
        saved = load_file(str(path / FULL_WEIGHTS))
        on_disk = {k: k for k in keys}
        where = path / FULL_WEIGHTS
    missing = [k for k, d in on_disk.items() if d not in saved]
    unexpected = sorted(set(saved) - set(on_disk.values()))
    if missing or unexpected:
        raise ValueError(f"{where} does not fit {type(model).__name__}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    full = {k: saved[d] for k, d in on_disk.items()}
    for alias, kept in _tied_aliases(model).items():
        if kept in full:
            full[alias] = full[kept]
    result = set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=not peft))
    _check_loaded(result, model, peft, where)
    if optimizer is not None:
        saved_opt = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        if not saved_opt["state"]:  # saved before the first step
            optimizer.load_state_dict(saved_opt)
        else:
            set_optimizer_state_dict(model, optimizer, _optimizer_state_by_name(saved_opt, model, optimizer),
                                     options=StateDictOptions(full_state_dict=True))


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
    world = _world()
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
            with _atomic_dir(out_dir) as tmp:
                streamed = True
                _stream_engine_weights(source, base, tmp)
                for p in base.iterdir():  # config, generation config, tokenizer, processor, chat template, index
                    if p.is_file() and not p.name.endswith(".safetensors") and not p.name.startswith("."):
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
    """Write the live PEFT model's adapter as a PEFT folder under the full Qwen3-VL names
    (what vLLM's LoRA loader maps onto its modules), atomically. A few MB where
    `merge_full_weights_for_engine` writes the whole model. With a process group every rank
    calls it (a sharded adapter is gathered tensor by tensor); rank 0 writes."""
    if not _is_peft(model):
        raise ValueError("save_adapter_for_engine needs a LoRA (PEFT) model; full fine-tuning exports full weights")
    out_dir = Path(out_dir)
    world = _world()
    sharded = is_sharded(model)
    state = _gather_lora_state(model, keep=world.is_main) if sharded else None
    failure = None
    if world.is_main:
        try:
            with _atomic_dir(out_dir) as tmp:
                _save_adapter(tmp, model, str(resolve_model_path(base_model_path)), state_dict=state)
        except BaseException as e:  # noqa: BLE001
            failure = e
    return _outcome(failure, world, out_dir)


def checkpoint_record(path: Path | str) -> dict:
    """What a complete checkpoint folder holds, for readers that load no model (`saccade export`):
    its `state.json` "checkpoint" record with `kind` ("lora" or "full"), `layout` ("plain" or
    "dcp") and `base_model_path` (None when the save did not know it) always present.
    ValueError for a folder that is not a complete checkpoint."""
    path = Path(path)
    manifest = _check_complete(path)
    info = json.loads((path / STATE_FILE).read_text()).get("checkpoint", {})
    kind = info.get("kind") or ("lora" if (path / ADAPTER_DIR).is_dir() else "full")
    layout = "dcp" if DCP_METADATA in manifest["files"] else "plain"
    return {**info, "kind": kind, "layout": layout, "base_model_path": info.get("base_model_path")}


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
    with _atomic_dir(out_dir) as tmp:
        for p in sorted(source.iterdir()):
            if p.is_file():
                shutil.copy2(p, tmp / p.name)
        if base_model_name_or_path is not None:
            config = json.loads((tmp / ADAPTER_CONFIG).read_text())
            config["base_model_name_or_path"] = str(base_model_name_or_path)
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


class _LiveWeights:
    """A live model's trained language-model tensors under the full Qwen3-VL names, one at a time.

    `get(key)` returns the whole tensor (LoRA merged in) on the rank that `compute`s, None on
    the others; for a sharded model it is a collective (one all-gather per tensor it reads), so
    every rank must ask for the same keys in the same order."""

    def __init__(self, model: nn.Module, *, compute: bool = True):
        self.compute = compute
        self.plain: dict[str, torch.Tensor] = {}  # full name -> the model's tensor (maybe a DTensor)
        self.lora: dict[str, tuple] = {}  # full name -> (W or bias, A, B, scaling, fan_in_fan_out, is_bias)
        if not _is_peft(model):
            state = model.state_dict(keep_vars=True)
            lora_keys = [k for k in state if ".lora_" in k or ".base_layer." in k]
            if lora_keys:
                raise ValueError(f"{type(model).__name__} holds LoRA layers ({lora_keys[0]}) but is not a peft "
                                 "PeftModel: pass the PeftModel that get_peft_model returned")
            aliases = _tied_aliases(model)
            self.plain = {k: v for k, v in state.items() if k not in aliases}
            return
        from peft.tuners.lora import LoraLayer

        name = _single_adapter(model)
        policy = model.get_base_model()
        state = policy.state_dict(keep_vars=True)
        odd = [k for k in state if any(s in k for s in ("modules_to_save", "trainable_tokens", "lora_magnitude"))]
        if odd:
            raise ValueError(f"only plain LoRA adapters can be merged; found {odd[:3]}")
        aliases = _tied_aliases(policy)
        self.plain = {k.replace(".base_layer.", "."): v for k, v in state.items()
                      if ".lora_" not in k and k not in aliases}
        for module_name, module in policy.named_modules():
            if not isinstance(module, LoraLayer) or name not in module.lora_A:
                continue
            if name in getattr(module, "lora_variant", {}):
                raise ValueError(f"{module_name}: LoRA variants (DoRA, ...) are not supported by the merge")
            if name in module.merged_adapters:
                continue  # already folded into the base weight
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
            t = _full(self.plain[key])
            return t if self.compute else None
        base, a, b, scaling, fan_in_fan_out, is_bias = self.lora[key]
        w, a, b = _full(base), None if a is None else _full(a), _full(b)
        if not self.compute:
            return None
        if is_bias:
            return w + b * scaling
        return w + _lora_delta(a, b, scaling, fan_in_fan_out).to(w.dtype)


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
        metadata = _dcp_metadata(self.dcp)
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
        _dcp_load_here({f"model.{key}": t}, self.dcp)
        return t


def _checkpoint_weights(path: Path, base: Path):
    _check_complete(path)
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


def _stream_engine_weights(source, base: Path, tmp: Path | None) -> None:
    """Every base safetensors file again under tmp (None: only take part in a sharded source's
    gathers), the language model's tensors taken from `source`, one at a time."""
    if sys.byteorder != "little":
        raise RuntimeError("writing safetensors needs a little-endian machine")
    headers = [(file, *_safetensors_header(file)) for file in safetensors_files(base)]
    # Checked before the first gather, identically on every rank: no rank may stop half way.
    base_tensors = {k: info for _, _, _, entries in headers for k, info in entries.items()}
    trained = source.keys
    bad = [k for k in trained if not (k.startswith(LM_PREFIX) or k == LM_HEAD_KEY)]
    if bad:
        raise ValueError(f"trained weights have names outside the language model: {bad[:3]}")
    lacking = sorted(k for k in base_tensors if (k.startswith(LM_PREFIX) or k == LM_HEAD_KEY) and k not in trained)
    if lacking:
        raise ValueError(f"the trained weights lack {lacking[0]}, which the base model has")
    extra = sorted(set(trained) - set(base_tensors))
    if extra:
        raise ValueError(f"trained tensors not in the base model {base}: {extra[:3]}")
    for k in sorted(trained):
        if source.shape(k) != tuple(base_tensors[k]["shape"]):
            raise ValueError(f"{k}: trained shape {source.shape(k)} != base {tuple(base_tensors[k]['shape'])}")

    failure = None
    for file, data_start, metadata, entries in headers:
        out = None
        if tmp is not None and failure is None:
            try:
                out = _SafetensorsWriter(tmp / file.name, entries, metadata or {"format": "pt"})
            except BaseException as e:  # noqa: BLE001 - keep taking part in the gathers, raise at the end
                failure = e
        with open(file, "rb") as src:
            for key, info in entries.items():
                t = source.get(key) if key in trained else None  # every rank, in this order
                if out is None:
                    continue
                try:
                    if key in trained:
                        out.write(key, t.detach().to(device="cpu", dtype=_ST_DTYPES[info["dtype"]]))
                    else:  # the vision tower: its bytes as they are
                        begin, end = info["data_offsets"]
                        out.copy(key, src, data_start + begin, end - begin)
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


class _SafetensorsWriter:
    """A safetensors file written tensor by tensor: the header (known up front from the base file's
    dtypes and shapes) first, then each tensor's bytes in order."""

    def __init__(self, path: Path, entries: dict[str, dict], metadata: dict[str, str]):
        header: dict = {"__metadata__": metadata}
        self.sizes: list[tuple[str, int]] = []
        offset = 0
        for key, info in entries.items():
            begin, end = info["data_offsets"]
            size = end - begin
            header[key] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + size]}
            self.sizes.append((key, size))
            offset += size
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


def _world() -> World:
    """This process's rank and the world size when a process group exists (torchrun), else `World()`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return World(rank=dist.get_rank(), size=dist.get_world_size(), sharded=True)
    return SINGLE


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (a collective), anything else as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # never imported means no DTensor exists
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return t.full_tensor()
    return t


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """State-dict names that are the same tensor as an earlier name: {alias: kept}, e.g.
    {"lm_head.weight": "model.language_model.embed_tokens.weight"} when the head is tied.
    By identity of the tensor objects, which holds for FSDP2's DTensor parameters too (a shared
    parameter is one DTensor); the first name in state-dict order is kept, as HF does."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) in seen:
            aliases[k] = seen[id(v)]
        else:
            seen[id(v)] = k
    return aliases


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
    remove_dead_tmp_dirs(root)


def remove_dead_tmp_dirs(folder: Path, name: str | None = None) -> list[Path]:
    """Delete the `.tmp-*-<pid>` folders in `folder` whose writer is gone: what a save or an
    export killed mid-write leaves behind. `name`: only the temp folders of `folder/name` (in a
    folder that is not ours, leave everything else alone). Returns what was removed."""
    removed = []
    for p in Path(folder).iterdir() if Path(folder).is_dir() else ():
        m = _TMP_RE.match(p.name)
        if name is not None and not (m and p.name == f".tmp-{name}-{m.group(1)}"):
            continue
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


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


def _fresh_tmp(final: Path) -> Path:
    """An empty `.tmp-<name>-<pid>` folder beside `final` (the pid lets a later save tell a dead one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


@contextmanager
def _atomic_dir(final: Path):
    """A fresh `.tmp-<name>-<pid>` folder beside `final` to write into. On a clean exit it is
    fsynced and published as `final` in one step; on any error it is removed, and `final`
    is left as it was."""
    tmp = _fresh_tmp(final)
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
