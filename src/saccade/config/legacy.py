"""Config files written before the `[task]` union: their keys read as the new ones.

Until then a run's task was `[data] task = "..."`, its fields spread over `[data]` (shapes, data
sets) and `[env]` (views, scenes, verifiers); the sampling options sat in `[engine]` and the
embedding cache in `[images]`. `migrate` maps such a file's keys to today's and says which it
mapped (a `LegacyConfigWarning`), so an old run folder's config.toml still resumes. A moved
field the file's task does not read is dropped (old files carried every field: `--dry-run`
wrote them all), with a warning when it differs from its old default. A command-line override
is not mapped: an old key there is refused with its new name (`new_key`), docs/config.md.
"""

from __future__ import annotations

import warnings
from typing import Any

from saccade.config.task import DEFAULT_PROMPT_TEMPLATE, TASK_CONFIGS, VIEW_COLORS, VIEW_PLACES, ColumnsConfig

# Old key -> new key, where the value moves as it is.
RENAMED = {
    **{f"engine.{name}": f"sampling.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens")},
    "images.cache_bytes": "image_cache.budget_bytes",
    "images.cache_dir": "image_cache.dir",
    "data.eval_size": "eval.prompts",
}
# The fields that moved into [task], with their old defaults: a task that does not read one
# drops it (with a warning when the file changed it).
OLD_DATA_DEFAULTS: dict[str, Any] = {
    "question_kinds": ["color"], "num_choices": 4, "image_size": 64, "blank_images": False, "dataset": None,
    "columns": ColumnsConfig().model_dump(), "prompt_template": DEFAULT_PROMPT_TEMPLATE, "system_prompt": None,
    "split": "train", "subsets": None, "eval_dataset": None, "eval_split": None, "eval_subsets": None,
    "max_skip_fraction": 0.05, "task_args": {},
}
OLD_ENV_DEFAULTS: dict[str, Any] = {
    "max_turns": 3, "turn_cost": 0.0, "places": list(VIEW_PLACES), "image_size": 64, "distractors": 2,
    "require_seen": True, "look_reward": 0.0, "colors": list(VIEW_COLORS), "scene_dir": None, "eval_scenes": 1,
    "render_size": 128, "fov_deg": 60.0, "start_poses": 4, "start_turn": 0.0, "say_side": False, "view_fill": 0.9,
    "start_clear": 1.0, "view_reward": 0.0, "seen_fraction": 0.01, "describe_actions": True, "correct_metric": None,
}
# image_size was the shapes' image in [data] and the views' render in [env].
IMAGE_SIZE_OF = {"data": "shapes", "env": "views"}
VERIFIERS_PREFIX = "verifiers:"


class LegacyConfigWarning(UserWarning):
    """A config file used keys from before the [task] section; they were read as the new ones."""


def _fields_of(kind: str) -> set[str]:
    for cls in TASK_CONFIGS:
        if kind in cls.model_fields["kind"].annotation.__args__:
            return set(cls.model_fields)
    return set()


def _old_task(name: str) -> dict[str, Any]:
    """data.task's value as [task] keys: a built-in name, "verifiers:ENV_ID" or an import path."""
    if name.startswith(VERIFIERS_PREFIX):
        return {"kind": "verifiers", "env_id": name[len(VERIFIERS_PREFIX):]}
    if ":" in name:
        return {"kind": "plugin", "make_task": name}
    return {"kind": name}


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, dict) and isinstance(value, dict):
        return {**default, **value} == default
    return value == default


def migrate(data: dict[str, Any], label: str) -> dict[str, Any]:
    """`data` (a parsed TOML file) with the old keys moved to the new ones; warns which moved."""
    old_data, old_env = data.get("data"), data.get("env")
    renamed = [old for old in RENAMED if isinstance(data.get(old.split(".")[0]), dict)
               and old.split(".")[1] in data[old.split(".")[0]]]
    moved_task = isinstance(old_data, dict) or (isinstance(old_env, dict) and set(old_env) & set(OLD_ENV_DEFAULTS))
    if not renamed and not moved_task:
        return data
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in data.items()}
    notes: list[str] = []
    for old in renamed:
        section, name = old.split(".")
        new_section, new_name = RENAMED[old].split(".")
        out.setdefault(new_section, {}).setdefault(new_name, out[section].pop(name))
        notes.append(f"{old} -> {RENAMED[old]}")
    if moved_task:
        kind = (out.get("task") or {}).get("kind", "shapes")  # a file half migrated names its kind in [task]
        task, dropped = _moved_task(out.pop("data", None) or {}, out.get("env") or {}, kind, notes)
        for key, value in task.items():
            out.setdefault("task", {}).setdefault(key, value)
        if dropped:
            notes.append(f"dropped, as task kind {task['kind']!r} does not read them: {', '.join(dropped)}")
    if "env" in out and not out["env"]:
        del out["env"]
    warnings.warn(f"{label}: keys from before the [task] section, read as the new ones: {'; '.join(notes)}. "
                  f"`saccade rl {label} --dry-run` writes the config with today's keys (docs/config.md)",
                  LegacyConfigWarning, stacklevel=3)
    return out


def _moved_task(old_data: dict[str, Any], env: dict[str, Any], kind: str,
                notes: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The [task] table that [data] and [env]'s task fields make (popping those from `env`), and
    the changed fields the task does not read. `kind`: the task's when [data] names none."""
    if "task" in old_data:
        task = _old_task(str(old_data.pop("task")))
        notes.append(f"data.task -> task.kind = {task['kind']!r}")
    else:
        task = {"kind": kind}
    fields = _fields_of(task["kind"])
    args = old_data.pop("task_args", None)
    if args:
        key = {"verifiers": "env_args", "plugin": "args"}.get(task["kind"])
        if key is None:
            raise ValueError(f"data.task_args: task kind {task['kind']!r} reads no arguments; remove them")
        task[key] = args
        notes.append(f"data.task_args -> task.{key}")
    dropped: list[str] = []
    for section, table, defaults in (("data", old_data, OLD_DATA_DEFAULTS), ("env", env, OLD_ENV_DEFAULTS)):
        for name in [n for n in table if n in defaults]:
            value = table.pop(name)
            read = name in fields and (name != "image_size" or IMAGE_SIZE_OF[section] == task["kind"])
            if read:
                task[name] = value
                notes.append(f"{section}.{name} -> task.{name}")
            elif not _same(value, defaults[name]):
                dropped.append(f"{section}.{name}")
    unknown = sorted(old_data)
    if unknown:
        raise ValueError(f"[data] has no key {unknown[0]!r} (and [data] itself is now [task]: docs/config.md)")
    return task, dropped


def new_key(old: str) -> str | None:
    """The key that replaced `old` (dotted), for a message; None when `old` was never a key."""
    if old in RENAMED:
        return RENAMED[old]
    section, _, name = old.partition(".")
    if old == "data.task":
        return "task.kind (with task.env_id for a verifiers env, task.make_task for your own)"
    if old == "data.task_args":
        return "task.env_args (verifiers) or task.args (plugin)"
    if (section == "data" and name.split(".")[0] in OLD_DATA_DEFAULTS) or (section == "env" and name in OLD_ENV_DEFAULTS):
        return f"task.{name}"
    return None
