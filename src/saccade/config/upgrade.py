"""Config files in an older format: one small upgrade step, and the refusal of the oldest one.

`upgrade` reads a file written with an earlier day's keys (a run folder's config.toml, the
output of `--dry-run`) as today's: each old key in `MOVES` goes to its new key, each move with
its date and its reason, and a `LegacyConfigWarning` names what moved. A field that a section
split into variants no longer has in the file's variant (old files carried every field:
`--dry-run` wrote them all) is dropped, named in the warning when it was not its default. An
old key on the command line is read as its new key too (`moved`), with the same warning.

The format from before the `[task]` union (2026-11-24: `[data] task = "..."`, the sampling
options in `[engine]`) is no longer read: a file with its keys is refused, each named with its
new key (`RETIRED`), and so is such a key on the command line (`retired_key`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from saccade.config.run import RunConfig
from saccade.config.sections import union_members, union_variants

RETIRED_ON = "2026-11-24"
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "max_tokens")
_TASK_FROM_DATA = ("question_kinds", "num_choices", "image_size", "blank_images", "dataset", "columns",
                   "prompt_template", "system_prompt", "split", "subsets", "eval_dataset", "eval_split",
                   "eval_subsets", "max_skip_fraction")
_TASK_FROM_ENV = ("max_turns", "turn_cost", "places", "image_size", "distractors", "require_seen", "look_reward",
                  "colors", "scene_dir", "eval_scenes", "render_size", "fov_deg", "start_poses", "start_turn",
                  "say_side", "view_fill", "start_clear", "view_reward", "seen_fraction", "describe_actions",
                  "correct_metric")
# The keys of the format before the [task] union, each with what replaced it.
RETIRED: dict[str, str] = {
    "data.task": "task.kind (task.kind = \"verifiers\" and task.env_id for \"verifiers:ENV_ID\", task.kind = "
                 "\"plugin\" and task.make_task for \"package.module:make_task\")",
    "data.task_args": "task.env_args (verifiers) or task.args (plugin)",
    "data.eval_size": "eval.prompts",
    "images.cache_bytes": "image_cache.budget_bytes",
    "images.cache_dir": "image_cache.dir",
    **{f"engine.{name}": f"sampling.{name}" for name in _SAMPLING},
    **{f"data.{name}": f"task.{name}" for name in _TASK_FROM_DATA},
    **{f"env.{name}": f"task.{name}" for name in _TASK_FROM_ENV},
}


class LegacyConfigWarning(UserWarning):
    """A config used an earlier day's keys; they were read as today's (`MOVES`)."""


@dataclass(frozen=True)
class Move:
    """One key of an earlier format, and where its value goes now."""

    old: str  # the old dotted key
    new: str  # the dotted key its value goes to, as it is
    date: str  # the day the key moved
    why: str
    applies: Callable[[Any], bool] = lambda value: True  # the old key's value, not the new key's (same path)
    convert: Callable[[Any], Any] | None = None  # the old value -> the new key's (None: the same value)
    wins: bool = False  # the old key decided over the new key's value then: it replaces it now


MODES_DAY = "2026-11-28"  # issue 45: modes as unions, not flags
_STALL = "the stall watch is a section of its own, its action a union: only 'rollback' has lr_factor and max_rollbacks"
_DECAY = "the lr decay is a union: only 'linear' and 'cosine' have min_lr_ratio"
OBJECTIVES_DAY = "2026-11-28"  # issue 47: the advantage's baseline and scaling are choices, not a flag
ENGINE_DAY = "2026-12-06"  # issue 59: the engine is a union, and vLLM's weight sync a union under it
_SYNC = ("the engine is a union (embedded, or vllm with its servers' fields), and the weight sync a union under "
         "it, each way with its own fields: files (weights_dir), adapter (weights_dir), collective (backend, "
         "transfer_address), auto (transfer_address, weights_dir)")
_ADAPTER = "pushing only the LoRA adapter is a kind of weight sync (engine.weight_sync.kind = \"adapter\"), not a flag"
_SCALING = "the advantage scaling is a choice of three: true is 'group' (the group's std), false 'none'"
MOVES: tuple[Move, ...] = (
    Move("lora.enabled", "lora", MODES_DAY, "LoRA or not is a mode, not a flag beside LoRA's settings: a [lora] table "
         "(the default) or lora = false"),
    Move("rollout.on_stall", "stall.action", MODES_DAY, _STALL),
    Move("rollout.stall_steps", "stall.steps", MODES_DAY, _STALL),
    Move("rollout.stall_truncated_frac", "stall.truncated_frac", MODES_DAY, _STALL),
    Move("rollout.stall_lr_factor", "stall.lr_factor", MODES_DAY, _STALL),
    Move("rollout.max_rollbacks", "stall.max_rollbacks", MODES_DAY, _STALL),
    Move("trainer.lr_decay", "trainer.lr_decay.kind", MODES_DAY, _DECAY, applies=lambda value: isinstance(value, str)),
    Move("trainer.min_lr_ratio", "trainer.lr_decay.min_lr_ratio", MODES_DAY, _DECAY),
    Move("rollout.scale_advantages_by_std", "rollout.advantage_scaling", OBJECTIVES_DAY, _SCALING,
         convert=lambda value: _std_scaling(value)),
    # In this order: the weight sync's table is made first (from its old string), then filled.
    Move("engine.weight_sync", "engine.weight_sync.kind", ENGINE_DAY, _SYNC, applies=lambda value: isinstance(value, str)),
    Move("engine.transfer_address", "engine.weight_sync.transfer_address", ENGINE_DAY, _SYNC),
    Move("engine.weights_dir", "engine.weight_sync.weights_dir", ENGINE_DAY, _SYNC),
    # An adapter was pushed whatever weight_sync said: it wins over it.
    Move("engine.sync_lora_adapter", "engine.weight_sync.kind", ENGINE_DAY, _ADAPTER, applies=lambda value: _flag(value),
         convert=lambda value: "adapter", wins=True),
)
# Old keys whose value meant what today's default means: dropped, and said.
DROPPED: tuple[Move, ...] = (
    Move("engine.sync_lora_adapter", "", ENGINE_DAY, _ADAPTER, applies=lambda value: _flag(value) is False),
)
MOVED = {move.old: move for move in MOVES}


def _flag(value: Any) -> Any:
    """A bool as a file or the command line writes it (true/false); anything else as it is."""
    return {"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str) else value


def _std_scaling(value: Any) -> Any:
    """scale_advantages_by_std's true or false (a file's bool, the command line's text) as the
    scaling it meant; anything else as it is, for validation to refuse under the new key."""
    flag = {"true": True, "false": False}.get(value.lower(), value) if isinstance(value, str) else value
    return ("group" if flag else "none") if isinstance(flag, bool) else value
# Sections that a day split into variants: an old file carried every field of the section, and
# the fields its variant does not have are dropped.
SPLIT: tuple[str, ...] = ("stall", "trainer.lr_decay", "loss",  # loss: 'reinforce' has no eps_low, eps_high
                          "engine", "engine.weight_sync")  # engine: 'embedded' has no urls, timeout_s, ...


def retired_key(old: str) -> str | None:
    """The key that replaced `old` (dotted) of the format before the [task] union; None when
    `old` was no key of it."""
    parts = old.split(".")
    new = RETIRED.get(".".join(parts[:2]))
    if new is None or len(parts) == 2:
        return new
    return f"{new}.{'.'.join(parts[2:])}" if " " not in new else new  # data.columns.images -> task.columns.images


def refuse_retired(data: dict[str, Any]) -> None:
    """ValueError, naming each old key's new one, for a file in the format before the [task] union."""
    found = [f"{section}.{key}" for section, table in data.items() if isinstance(table, dict) for key in table
             if f"{section}.{key}" in RETIRED]
    if not found and "data" not in data:
        return
    moves = "; ".join(f"{old} is now {RETIRED[old]}" for old in found) or "[data] is now [task]"
    raise ValueError(f"written in the format from before the [task] section ({RETIRED_ON}), which is no longer "
                     f"read: {moves}. Rename these keys (docs/config.md#older-config-files)")


def upgrade(data: dict[str, Any], label: str) -> dict[str, Any]:
    """`data` (a parsed TOML file) with each old key of `MOVES` moved to its new key, and the
    fields their sections no longer read dropped; warns what changed."""
    found = [move for move in MOVES if _has(data, move.old) and move.applies(_get(data, move.old))]
    gone = [move for move in DROPPED if _has(data, move.old) and move.applies(_get(data, move.old))]
    if not found and not gone:
        return data
    out = _copy(data)
    notes, dropped = [], []
    for move in gone:
        notes.append(f"{move.old} = {_toml(_pop(out, move.old))} needs no key now (today's default)")
    for move in found:
        value = _pop(out, move.old)
        inside = move.old.startswith(move.new + ".")  # lora.enabled: the new key is the table it was in
        if _has(out, move.new) and not inside and not move.wins:
            raise ValueError(f"has both {move.old} (before {move.date}) and {move.new}, its new key: remove {move.old}")
        off = _get(out, move.new) if inside and value is False else None
        if move.convert is not None:
            value, was = move.convert(value), value
            notes.append(f"{move.old} = {_toml(was)} -> {move.new} = {_toml(value)}")
        else:
            notes.append(f"{move.old} -> {move.new}" if not inside else f"{move.old} = false -> {move.new} = false"
                         if value is False else f"{move.old} = true -> [{move.new}]")
        _put(out, move.new, value)
        if off:  # a section turned off (lora = false): its fields were not read
            dropped += _set_fields(move.new, off, _model_at(move.new))
    for path in SPLIT:
        table = _get(out, path)
        if isinstance(table, dict):
            variant, variants = _variant_at(path, table)
            # Another variant's fields; a key no variant has is left for validation to refuse.
            owners = {key: next((v for v in variants if key in v.model_fields), None) for key in table}
            unread = {key: table.pop(key) for key, owner in owners.items() if owner and key not in variant.model_fields}
            dropped += [f"{path}.{key} = {_toml(value)}" for key, value in unread.items()
                        if value != owners[key].model_fields[key].get_default(call_default_factory=True)]
    if dropped:
        notes.append(f"dropped, as nothing in use reads them: {', '.join(dropped)}")
    warnings.warn(f"{label}: keys from an earlier day, read as today's: {'; '.join(notes)}. `saccade rl {label} "
                  "--dry-run` writes the config with today's keys (docs/config.md#older-config-files)",
                  LegacyConfigWarning, stacklevel=3)
    return out


def moved(dotted: str, value: Any) -> Move | None:
    """The move of an old key given on the command line (its value parsed), or None. A move whose
    `new` is "" drops the key (its value meant today's default)."""
    for move in (*MOVES, *DROPPED):
        if move.old == dotted and move.applies(value):
            return move
    return None


def _field_info(dotted: str) -> FieldInfo:
    """The field at `dotted`; inside a union of sections, the variant's that has the next key."""
    model: type[BaseModel] = RunConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        members = [m for m in union_members(model.model_fields[part].annotation)
                   if isinstance(m, type) and issubclass(m, BaseModel)]
        model = next((m for m in members if parts[i + 1] in m.model_fields), members[0])
    return model.model_fields[parts[-1]]


def _model_at(dotted: str) -> type[BaseModel]:
    return next(m for m in union_members(_field_info(dotted).annotation)
                if isinstance(m, type) and issubclass(m, BaseModel))


def _variant_at(path: str, table: dict) -> tuple[type[BaseModel], list[type[BaseModel]]]:
    """The variant of the union at `path` that `table` names (else the default's), and all of them."""
    info = _field_info(path)
    variants = union_variants(info)
    assert variants is not None, path
    tag = table.get(info.discriminator, getattr(info.get_default(call_default_factory=True), str(info.discriminator)))
    return variants.get(tag, next(iter(variants.values()))), list(variants.values())


def _set_fields(path: str, table: dict, model: type[BaseModel]) -> list[str]:
    """'path.key = value' for each key of `table` that is not `model`'s default."""
    defaults = model().model_dump()
    return [f"{path}.{key} = {_toml(value)}" for key, value in table.items() if value != defaults.get(key)]


def _toml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _has(data: dict, dotted: str) -> bool:
    *parents, key = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return isinstance(node, dict) and key in node


def _get(data: dict, dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _pop(data: dict, dotted: str) -> Any:
    *parents, key = dotted.split(".")
    return _get(data, ".".join(parents)).pop(key) if parents else data.pop(key)


def _put(data: dict, dotted: str, value: Any) -> None:
    """Set the value at `dotted`, making the tables on the way; `true` for a table that is there
    (a section that may be off, `lora`) keeps it."""
    *parents, key = dotted.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if not (value is True and isinstance(node.get(key), dict)):
        node[key] = value


def _copy(data: Any) -> Any:
    return {key: _copy(value) for key, value in data.items()} if isinstance(data, dict) else data
