"""The sharded checkpoint layout: FSDP2 models saved and loaded with torch.distributed.checkpoint.

`save_sharded` is `save_checkpoint`'s collective half (each rank writes its shards into `dcp/`,
rank 0 the rest); the loaders read a `dcp/` folder into a sharded model (DCP reshards: world
2 -> 2, 2 -> 1) or into a plain one with no process group, and the plain layout into a sharded
model. Optimizer states are mapped between torch's positions and the model's parameter names.
"""

from __future__ import annotations

import itertools
import re
import shutil
import warnings
from pathlib import Path

import torch

from saccade.atomic import fresh_tmp, fsync_file, fsync_tree, publish
from saccade.distributed import World, all_gather, broadcast
from saccade.trainer.checkpoint.folder import (
    ADAPTER_DIR,
    ADAPTER_WEIGHTS,
    DCP_DIR,
    FULL_WEIGHTS,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    STATE_FILE,
    prune,
    write_manifest,
)
from saccade.trainer.checkpoint.model_state import (
    gather_lora_state,
    load_plain_values,
    master_weights,
    process_world,
    save_adapter,
    single_adapter,
    tied_aliases,
)


# ---------------------------------------------------------------------------- save


def save_sharded(root: Path, final: Path, *, model, optimizer, scheduler, step: int, keep_last: int,
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

    world = process_world()
    tmp = None
    failure: BaseException | None = None
    if world.is_main:
        try:
            tmp = fresh_tmp(final)
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
        for alias in tied_aliases(model):
            model_sd.pop(alias, None)
        to_save = {"model": model_sd}
        # get_optimizer_state_dict would first step a state-less optimizer once (lr 0) to create its
        # state, which changes AdamW's step count: such an optimizer goes to optimizer.pt instead.
        optimizer_state = optimizer is not None and bool(optimizer.state)
        if optimizer_state:
            to_save["optim"] = get_optimizer_state_dict(model, optimizer)
        dcp.save(to_save, checkpoint_id=str(tmp / DCP_DIR))
        adapter = gather_lora_state(model, keep=world.is_main) if peft else None
    except BaseException:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    failure = None
    try:  # local writes only: no collective may be skipped by a rank that fails here
        rank_rng = tmp / f"rng_rank{world.rank}.pt"
        torch.save(rng, rank_rng)
        fsync_file(rank_rng)
        if world.is_main:
            if peft:
                save_adapter(tmp / ADAPTER_DIR, model, base, state_dict=adapter)
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
            write_manifest(tmp, step)
            fsync_tree(tmp)
            publish(tmp, final)
            published = True
            prune(root, step, keep_last)
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


# ---------------------------------------------------------------------------- load


def dcp_metadata(dcp_dir: Path):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(dcp_dir)).read_metadata()


def dcp_load_here(state: dict, dcp_dir: Path) -> None:
    """dcp.load in this process alone (no collective, whether or not a process group exists):
    each tensor in `state` is filled whole, in place."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # it warns that it loads in a single process, which is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(dcp_dir), no_dist=True)


def dcp_has(dcp_dir: Path, prefix: str) -> bool:
    return any(k.startswith(prefix) for k in dcp_metadata(dcp_dir).state_dict_metadata)


def _saved_model_keys(dcp_dir: Path) -> set[str]:
    return {k[len("model."):] for k in dcp_metadata(dcp_dir).state_dict_metadata if k.startswith("model.")}


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
    aliases = tied_aliases(model)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in model.state_dict() if k not in aliases and not (peft and k in frozen)]


def load_dcp_sharded(dcp_dir: Path, model, optimizer, peft: bool) -> None:
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
    aliases = tied_aliases(model)
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


def load_dcp_plain(dcp_dir: Path, model, optimizer, peft: bool) -> None:
    """DCP into a plain model, no process group needed: every tensor read whole (the model's in place)."""
    _check_saved_keys(dcp_dir, model, peft)
    masters = master_weights(optimizer) or {}
    own = model.state_dict()
    keys = _model_keys(model, peft)
    with torch.no_grad():
        # Straight into the parameters (or their float32 masters, for bf16 full fine-tuning).
        dcp_load_here({f"model.{k}": masters.get(k, own[k]) for k in keys}, dcp_dir)
        for k, master in masters.items():
            own[k].copy_(master)
    if optimizer is not None:
        saved = _read_dcp_whole(dcp_dir, "optim.")["optim"]
        optimizer.load_state_dict(_optimizer_state_by_id(saved, model, optimizer))


def dcp_entries(dcp_dir: Path, prefix: str) -> dict:
    """Every entry whose flattened key starts with `prefix` ("model.": the weights), whole, read in
    this process: flattened key -> tensor (or the saved value, for non-tensors)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat = {k: torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
            for k, v in dcp_metadata(dcp_dir).state_dict_metadata.items() if k.startswith(prefix)}
    dcp_load_here(flat, dcp_dir)  # non-tensors (param groups) replace the Nones
    return flat


def _read_dcp_whole(dcp_dir: Path, prefix: str) -> dict:
    """Every entry whose flattened key starts with `prefix`, whole, as the nested dict that was saved."""
    paths = dcp_metadata(dcp_dir).planner_data  # the path DCP flattened, e.g. ("optim", "state", fqn, "exp_avg")
    nested: dict = {}
    for k, v in dcp_entries(dcp_dir, prefix).items():
        _set_path(nested, paths[k], v)
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
    masters = master_weights(optimizer)
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


def load_plain_into_sharded(path: Path, model, optimizer, peft: bool) -> None:
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
        name = single_adapter(model)
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
    for alias, kept in tied_aliases(model).items():
        if kept in full:
            full[alias] = full[kept]
    result = set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=not peft))
    _check_loaded(result, model, peft, where)
    if optimizer is not None:
        saved_opt = load_plain_values(path / OPTIMIZER_FILE)
        if not saved_opt["state"]:  # saved before the first step
            optimizer.load_state_dict(saved_opt)
        else:
            set_optimizer_state_dict(model, optimizer, _optimizer_state_by_name(saved_opt, model, optimizer),
                                     options=StateDictOptions(full_state_dict=True))
