"""A flat config's fields as command-line options: how each `saccade bench` is configured.

`add_options(parser, Model)` gives every field of the model an option: `--field-name VALUE`
(the field's name, underscores as dashes), its help the field's description with its default
and bounds; a bool field is a flag (`--lora`; `--no-vllm` for one that is on by default), a
list field's option may be repeated (`--stage a --stage b`). The parser only collects what was
given; `load_options` then reads it the way a run config is read (`load_config`): the
defaults, a TOML file of the model's keys, the options, then any dotted overrides (`--lora
false` works too), each value JSON when it parses, else text, validated and bounded by the
model, every mistake a `ConfigError` naming the option. No argparse type, choice or default
decides a value: the model does, so `--help`, `--dry-run` and what a bench runs with agree.

This module imports nothing of saccade above `saccade.config`.
"""

from __future__ import annotations

import argparse
import json
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from saccade.config.sections import union_members

M = TypeVar("M", bound=BaseModel)

# The namespace attribute the options collect into: [(option as given, field, raw value)].
GIVEN = "config_options"


class _Collect(argparse.Action):
    """Records an option as given, its raw text (or a flag's value); the model reads it later."""

    def __init__(self, option_strings, dest, *, field: str, flag_value: str | None = None, **kwargs):
        self.field, self.flag_value = field, flag_value
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        raw = self.flag_value if self.flag_value is not None else values
        given = [*(getattr(namespace, GIVEN, None) or []), (option_string or self.option_strings[0], self.field, raw)]
        setattr(namespace, GIVEN, given)


def option_name(name: str, info: FieldInfo) -> str:
    """The field's option: --max-tokens for max_tokens; --no-vllm for a bool field on by default."""
    flag = name.replace("_", "-")
    return f"--no-{flag}" if _is_bool(info) and info.default is True else f"--{flag}"


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel], *, skip: Sequence[str] = ()) -> None:
    """An option for every field of `model` (but those in `skip`), in the field order."""
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        default = info.get_default(call_default_factory=True)
        kwargs: dict[str, Any] = {"dest": f"option.{name}", "field": name, "help": option_help(info)}
        if _is_bool(info):
            kwargs.update(nargs=0, flag_value="false" if default is True else "true")
        else:
            kwargs["metavar"] = _metavar(name, info)
            # Shown as the default (`--help`, docs/cli.md); never read: the model's is.
            kwargs["default"] = None if default is None or default in ((), []) else _shown(default)
        parser.add_argument(option_name(name, info), action=_Collect, **kwargs)
    parser.set_defaults(**{GIVEN: None})


def given_options(args: argparse.Namespace, model: type[BaseModel]) -> list[tuple[str, str, str]]:
    """The options given, as `load_config`'s (source, field, raw value) triples, in the order
    given; a repeated list option's values become one JSON list."""
    out: list[tuple[str, str, str]] = []
    lists: dict[str, tuple[str, list[str]]] = {}
    for source, name, raw in getattr(args, GIVEN, None) or []:
        if _is_list(model.model_fields[name]):
            lists.setdefault(name, (source, []))[1].append(raw)
        else:
            out.append((source, name, raw))
    out += [(source, name, json.dumps(items)) for name, (source, items) in lists.items()]
    return out


def load_options(model: type[M], args: argparse.Namespace, *, path: str | Path | None = None,
                 overrides: Sequence[str] = (), extra: Sequence[tuple[str, str, str]] = ()) -> M:
    """`model` from its defaults, the TOML file at `path`, the options `add_options` collected
    into `args`, `extra` (source, field, raw) values, then dotted `overrides`."""
    from saccade.config.loading import load_config

    return load_config(model, path, overrides, options=[*given_options(args, model), *extra])


def option_help(info: FieldInfo) -> str:
    """The field's description, its bounds, and its default (a flag says what it turns)."""
    text = info.description or ""
    default = info.get_default(call_default_factory=True)
    if _is_bool(info):
        return f"turn off (on by default): {text}" if default is True else text
    bounds = _bounds(info)
    if bounds:
        text += f"; {bounds}"
    if _is_list(info):
        return text
    if default is not None:
        text += f" (default {_shown(default)})"
    return text


def _bounds(info: FieldInfo) -> str:
    words = {"ge": "at least", "gt": "more than", "le": "at most", "lt": "less than"}
    found = []
    for item in info.metadata:
        for key, word in words.items():
            value = getattr(item, key, None)
            if value is not None:
                found.append(f"{word} {value:g}" if isinstance(value, float) else f"{word} {value}")
    return ", ".join(found)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _metavar(name: str, info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "metavar" in extra:
        return str(extra["metavar"])
    for member in union_members(info.annotation):
        if typing.get_origin(member) is Literal:
            return "{" + ",".join(map(str, typing.get_args(member))) + "}"
    return name.upper()


def _is_bool(info: FieldInfo) -> bool:
    return info.annotation is bool


def _is_list(info: FieldInfo) -> bool:
    return any(typing.get_origin(m) is list for m in union_members(info.annotation))
