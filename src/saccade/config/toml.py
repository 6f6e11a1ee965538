"""Writing a config as TOML that loads back to an equal one: `config_to_toml`, and `describe`
for --dry-run (every value in effect, each with its description as a comment)."""

from __future__ import annotations

import json
import math
import re
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if value is None:
        raise ValueError("TOML has no null; a None value can only be written by leaving its key out")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise ValueError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _comment(text: str | None) -> list[str]:
    if not text:
        return []
    return [f"# {line.strip()}".rstrip() for line in text.strip().splitlines()]  # docstrings are indented


def _write_model(model: BaseModel, prefix: str, comments: bool, out: list[str]) -> None:
    fields = type(model).model_fields
    dumped = model.model_dump(mode="json")
    tables: list[tuple[str, BaseModel]] = []
    for name, info in fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            tables.append((_toml_key(name), value))
            continue
        if isinstance(value, dict) and value and all(isinstance(v, BaseModel) for v in value.values()):
            # A table of sections (eval.sets): one sub-table each, [eval.sets.<key>].
            if comments:
                out.extend(_comment(info.description))
            tables.extend((f"{_toml_key(name)}.{_toml_key(str(key))}", sub) for key, sub in value.items())
            continue
        if value is None and _may_be_off(info):  # a section that is off: `lora = false`
            if comments:
                out.extend(_comment(info.description))
            out.append(f"{_toml_key(name)} = false")
            continue
        if value is None:
            if info.default is not None:
                raise ValueError(
                    f"{prefix + '.' if prefix else ''}{name} is None but its default is not: TOML cannot say so"
                )
            if comments:
                out.extend(_comment(info.description))
                out.append(f"# {_toml_key(name)}: unset")
            continue
        if comments:
            out.extend(_comment(info.description))
        out.append(f"{_toml_key(name)} = {_toml_value(dumped[name])}")
    for name, sub in tables:
        table = f"{prefix}.{name}" if prefix else name
        if out:
            out.append("")
        if comments:
            doc = type(sub).__doc__ or ""
            out.extend(_comment(doc.strip().split("\n\n")[0]))
        out.append(f"[{table}]")
        _write_model(sub, table, comments, out)


def _may_be_off(info: FieldInfo) -> bool:
    """A section field that is on by default and may be off (`lora: LoraConfig | None`)."""
    members = typing.get_args(info.annotation)
    return info.default_factory is not None and type(None) in members and \
        any(isinstance(m, type) and issubclass(m, BaseModel) for m in members)


def config_to_toml(model: BaseModel, *, comments: bool = False) -> str:
    """The model as TOML text that `load_config(type(model), ...)` reads back to an equal model.

    Nested models become tables; None values are left out (they must be the defaults), but a
    section that is off is `false` (`lora = false`: TOML has no null). With
    `comments`, each table and key is preceded by its docstring / description.
    """
    out: list[str] = []
    _write_model(model, "", comments, out)
    return "\n".join(out) + "\n"


def describe(model: BaseModel) -> str:
    """The resolved config as commented TOML, for --dry-run (it loads back like any config file)."""
    header = f"# resolved {type(model).__name__} (saccade --dry-run); every value below is in effect\n\n"
    return header + config_to_toml(model, comments=True)


def config_changes(before: str, after: str) -> list[str]:
    """What differs between two resolved configs (`describe`'s TOML), one 'key: old -> new' per
    dotted key, sorted: what a resume says when it goes on with a config other than the run's."""
    import tomllib

    def flat(table: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in table.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    old, new = flat(tomllib.loads(before)), flat(tomllib.loads(after))
    unset = "(unset)"
    return [f"{k}: {old.get(k, unset)!r} -> {new.get(k, unset)!r}" for k in sorted(old.keys() | new.keys())
            if old.get(k, unset) != new.get(k, unset)]
