"""Loading a config: a TOML file, then dotted command-line overrides, validated, every mistake a
`ConfigError` that names where the bad value came from (see `saccade.config` for the rules).

A union of sections picked by a tag (`[task]`, `[loss]` and `[trainer.lr_decay]` by their
`kind`, `[stall]` by its `action`) is walked through the variant its tag names: the file's or
an earlier override's, else the default's. An override that changes the tag keeps, of the
table so far, only the fields every variant has (the others were the old variant's; `[stall]`
keeps `steps`, `[task]`'s variants share none): give the new variant's fields as overrides
after it. A key of another variant is refused, naming the variant that has it.

A section that may be off (`lora: LoraConfig | None`) is turned off with `--lora false` and on
with `--lora true` (keeping its table so far); a field of it while it is off is refused.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import tomllib
import typing
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from saccade.config.run import RunConfig
from saccade.config.sections import ConfigError, union_members, union_variants
from saccade.config.upgrade import LegacyConfigWarning, moved, refuse_retired, retired_key, upgrade

M = TypeVar("M", bound=BaseModel)

_OVERRIDE = re.compile(r"^--([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+)(=.*)?$", re.DOTALL)


def _nullable_section(info: FieldInfo) -> bool:
    """A section that may be off (`lora: LoraConfig | None`, written `lora = false`)."""
    members = union_members(info.annotation)
    return type(None) in members and any(isinstance(m, type) and issubclass(m, BaseModel) for m in members)


# The sections that may be off, whose override has no dot: --lora false, --lora=true.
_ON_OFF = re.compile(rf"^--({'|'.join(n for n, i in RunConfig.model_fields.items() if _nullable_section(i))})(=.*)?$",
                     re.DOTALL)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into (tokens for argparse, dotted override tokens).

    ``--a.b value`` and ``--a.b=value`` (any option whose name has a dot) are overrides; the
    token after ``--a.b`` is its value, even if it starts with '-' (``--trainer.lr -1``),
    unless it is itself an option (``--x``). So are ``--lora false`` and ``--lora=false``, a
    section that may be off, but ``--lora`` with no value after it stays an option (`saccade
    bench step --lora`). Everything after a bare ``--`` goes to argparse.
    """
    known: list[str] = []
    overrides: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        if token == "--":
            known.extend(argv[i:])
            break
        m = _OVERRIDE.match(token)
        if m is None and _ON_OFF.match(token) and ("=" in token or argv[i + 1:i + 2] and
                                                   not argv[i + 1].startswith("-")):
            m = _ON_OFF.match(token)
        if m is None:
            known.append(token)
        elif m.group(2) is not None:
            overrides.append(token)
        else:
            overrides.append(token)
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        i += 1
    return known, overrides


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, str, str]]:
    """argv-style override tokens -> [(source, dotted path, raw value)].

    Accepts ``--a.b value``, ``--a.b=value`` and, for top-level fields of a flat model,
    ``--a value``. `source` is how the override is named in errors (``--a.b``).
    """
    out: list[tuple[str, str, str]] = []
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"{token!r}: expected an override such as --trainer.lr 1e-5 or --trainer.lr=1e-5")
        name, eq, value = token[2:].partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", name):
            raise ConfigError(f"{token!r}: not a valid override name (expected --section.field)")
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(f"--{name}: needs a value (--{name} VALUE or --{name}=VALUE)")
            value = tokens[i + 1]
            i += 1
        out.append((f"--{name}", name, value))
        i += 1
    return out


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the optional CONFIG positional (a TOML file) and --dry-run to `parser`.

    Dotted overrides are not argparse options: split them off with `split_overrides` before
    `parser.parse_args` (see the module docstring for the whole pattern).
    """
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help="a TOML config file (default: the built-in defaults); then any number of dotted "
        "overrides such as --trainer.lr 1e-5 or --lora.target_modules '[\"q_proj\"]'",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved config as TOML and exit without running"
    )
    return parser



def _model_class(annotation: Any) -> type[BaseModel] | None:
    for member in union_members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_dict(annotation: Any) -> bool:
    return any(typing.get_origin(m) in (dict, Mapping) or m is dict for m in union_members(annotation))


def _admits(annotation: Any, kind: type) -> bool:
    """Does the annotation accept a plain `kind` (str or NoneType), directly or in a union?"""
    for member in union_members(annotation):
        if member is kind or member is Any:
            return True
        if kind is str and typing.get_origin(member) is Literal:
            if any(isinstance(a, str) for a in typing.get_args(member)):
                return True
    return False


def _unknown_key(cls: type[BaseModel], prefix: str, key: str) -> str:
    """'unknown key 'trainer.lrr'; did you mean 'trainer.lr'? Valid keys in [trainer]: ...'."""
    valid = list(cls.model_fields)
    dotted = f"{prefix}." if prefix else ""
    msg = f"unknown key {dotted + key!r}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {dotted + close[0]!r}?"
    where = f"in [{prefix}]" if prefix else "at the top level"
    return msg + f" Valid keys {where}: {', '.join(valid)}"


def _variant(info: FieldInfo, value: Any) -> tuple[type[BaseModel], str]:
    """The variant of a union field whose value (a dict, from the file and the overrides so far)
    names it, else the default's; and its tag."""
    variants = union_variants(info)
    assert variants is not None
    tag = value.get(info.discriminator) if isinstance(value, dict) else None
    if tag not in variants:
        tag = getattr(info.get_default(call_default_factory=True), str(info.discriminator))
    return variants[tag], tag


def _common_fields(info: FieldInfo) -> set[str]:
    """The fields every variant of a union has, its tag aside: they mean the same in each."""
    variants = list((union_variants(info) or {}).values())
    common = set.intersection(*(set(v.model_fields) for v in variants)) if variants else set()
    return common - {str(info.discriminator)}


def _elsewhere(info: FieldInfo, prefix: str, tag: str, key: str) -> str:
    """'. stall.lr_factor is a field of action 'rollback', and stall.action is 'warn': ...' when
    another variant of the union has `key`, else ''."""
    owners = [t for t, v in (union_variants(info) or {}).items() if key in v.model_fields and t != tag]
    if not owners:
        return ""
    tag_key = f"{prefix}.{info.discriminator}"
    return (f". {prefix}.{key} is a field of {info.discriminator} {' or '.join(repr(t) for t in owners)}, and "
            f"{tag_key} is {tag!r}: remove it, or set {tag_key} = {owners[0]!r}")


def _unknown_tag(tag: str, discriminator: str, tags: list[str]) -> str:
    """'unknown kind 'mathvist'; did you mean 'mathvista'? Choose from ...'."""
    close = difflib.get_close_matches(tag, tags, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown {discriminator} {tag!r}{hint} Choose from {', '.join(tags)}"


class _Target(NamedTuple):
    """What a dotted override names."""

    annotation: Any  # of the value at the path
    dict_field: FieldInfo | None  # the dict field, when the path is one key of it
    union: FieldInfo | None  # the union field, when the path is its tag
    section: FieldInfo | None  # the field, when the path is a section that may be off (lora)


def _field_at(cls: type[BaseModel], path: str, source: str, data: dict) -> _Target:
    """What the override at `path` sets. ConfigError for an unknown key, with the valid keys at
    that level (and, in a union's variant, which other variant has it), or for a field of a
    section that is off."""
    parts = path.split(".")
    current: type[BaseModel] = cls
    where, union = "", None
    entry_key = -1  # the index of a table-of-sections key (eval.sets.<name>), passed over
    for i, part in enumerate(parts):
        if i == entry_key:
            continue
        prefix = ".".join(parts[:i])
        if part not in current.model_fields:
            hint = retired_key(path)
            if hint:
                raise ConfigError(f"{source}: {path} is now {hint} (docs/config.md)")
            elsewhere = _elsewhere(union[0], prefix, union[1], part) if union else ""
            raise ConfigError(f"{source}: {_unknown_key(current, prefix, part)}{where}{elsewhere}")
        info = current.model_fields[part]
        rest = parts[i + 1 :]
        here = ".".join(parts[: i + 1])
        variants = union_variants(info)
        if variants is not None and rest:
            if rest == [info.discriminator]:
                return _Target(Literal[tuple(variants)], None, info, None)
            current, tag = _variant(info, _get_path(data, parts[: i + 1]))
            where, union = f" ({here} {info.discriminator} {tag!r}; set {here}.{info.discriminator} first)", (info, tag)
            continue
        if not rest:
            return _Target(info.annotation, None, None, info if _nullable_section(info) else None)
        sub = _model_class(info.annotation)
        if sub is not None:
            if _nullable_section(info) and _is_off(data, parts[: i + 1]):
                raise ConfigError(f"{source}: {here} is false here (off), so it has no key {rest[0]!r}: turn it "
                                  f"on first with --{here} true, before --{path} (docs/config.md#unions)")
            current, where, union = sub, "", None
            continue
        entry_variants = _entry_variants(info)
        if entry_variants is not None and len(rest) >= 2:
            # A table of sections picked by a tag (eval.sets.<name>.<field>): the entry's variant.
            tag_key, variants = entry_variants
            entry = _get_path(data, parts[: i + 2])
            tag = entry.get(tag_key) if isinstance(entry, dict) else None
            if rest[1] == tag_key and len(rest) == 2:
                return _Target(Literal[tuple(variants)], None, None, None)
            if tag not in variants:
                raise ConfigError(f"{source}: {here}.{rest[0]} has no {tag_key} yet: give --{here}.{rest[0]}."
                                  f"{tag_key} first (one of {', '.join(variants)})")
            current, where, union = variants[tag], f" ({here}.{rest[0]} {tag_key} {tag!r})", None
            entry_key = i + 1
            continue
        if _is_dict(info.annotation) and len(rest) == 1:
            for member in union_members(info.annotation):
                args = typing.get_args(member)
                if len(args) == 2:
                    return _Target(args[1], info, None, None)
            return _Target(Any, info, None, None)
        raise ConfigError(f"{source}: {here} is a value, not a section; it has no key {rest[0]!r}")
    raise AssertionError("unreachable")


def _entry_variants(info: FieldInfo) -> tuple[str, dict[str, type[BaseModel]]] | None:
    """(tag key, {tag: variant}) of a dict field whose values are a union of sections picked by
    a tag (eval.sets); None for any other field."""
    if not _is_dict(info.annotation):
        return None
    for member in union_members(info.annotation):
        args = typing.get_args(member)
        if len(args) != 2:
            continue
        value = args[1]
        discriminator = next((m.discriminator for m in getattr(value, "__metadata__", ())
                              if isinstance(getattr(m, "discriminator", None), str)), None)
        if discriminator is None:
            continue
        variants = {}
        for variant in union_members(typing.get_args(value)[0]):
            for tag in typing.get_args(variant.model_fields[discriminator].annotation):
                variants[tag] = variant
        return discriminator, variants
    return None


def _is_off(data: dict, parts: list[str]) -> bool:
    """Did the file or an override turn the section at `parts` off (`lora = false`)?"""
    table = _get_path(data, parts[:-1])
    return isinstance(table, dict) and parts[-1] in table and table[parts[-1]] in (False, None)


def _parse_value(raw: str, annotation: Any) -> Any:
    """JSON when it parses, else the raw string; a string field keeps the raw text."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str):
        return value
    if value is None:
        return None if _admits(annotation, type(None)) or not _admits(annotation, str) else raw
    if _admits(annotation, str) and not isinstance(value, list | dict):
        return raw  # "--log.name 123" is the string "123"
    return value


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _get_path(data: dict, parts: list[str]) -> Any:
    node: Any = data
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _deep_merge(base: Any, update: dict) -> dict:
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in update.items():
        merged[key] = _deep_merge(merged.get(key), value) if isinstance(value, dict) else value
    return merged


class _Where(NamedTuple):
    """Where an error's loc points: the loc without the tags pydantic puts after a union field,
    the model that holds its last item (None where the schema does not say), and the union and
    tag when that model is one variant of a union."""

    loc: tuple
    model: type[BaseModel] | None
    union: tuple[FieldInfo, str] | None


def _walk_loc(cls: type[BaseModel], loc: tuple) -> _Where:
    clean: list = []
    current: type[BaseModel] | None = cls
    union: tuple[FieldInfo, str] | None = None
    items = list(loc)
    while items:
        item = items.pop(0)
        clean.append(item)
        if not items:
            break
        if current is None or not isinstance(item, str) or item not in current.model_fields:
            current, union = None, None
            continue
        info = current.model_fields[item]
        variants = union_variants(info)
        if variants is not None:
            tag = items.pop(0) if items and items[0] in variants else None
            current = variants.get(tag) if tag is not None else None
            union = (info, tag) if tag is not None else None
        else:
            current, union = _model_class(info.annotation), None
    return _Where(tuple(clean), current, union)


def _loc_to_path(loc: tuple) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out += f".{item}" if out else str(item)
    return out


def _touches(override: tuple[str, str, bool], error_path: str) -> bool:
    """Could the override be the cause of an error at `error_path`? (A union's tag, `task.kind`,
    picks every field of its table.)"""
    _, o, is_tag = override
    e = error_path
    table = o.rpartition(".")[0]
    return not e or e == o or e.startswith((o + ".", o + "[")) or o.startswith(e + ".") or \
        (is_tag and e.startswith(table + "."))


def _format_error(cls: type[BaseModel], err: dict, file_label: str | None,
                  overrides: list[tuple[str, str, bool]]) -> str:
    loc, current, union = _walk_loc(cls, tuple(err["loc"]))
    path = _loc_to_path(loc)
    if err["type"] == "extra_forbidden" and loc:
        key = str(loc[-1])
        prefix = _loc_to_path(loc[:-1])
        what = _unknown_key(current, prefix, key) if current is not None else f"unknown key {path!r}"
        if union is not None:
            what += f" ({prefix} {union[0].discriminator} {union[1]!r}){_elsewhere(union[0], prefix, union[1], key)}"
    elif err["type"] == "union_tag_invalid":
        what = _unknown_tag(err["ctx"]["tag"], err["ctx"]["discriminator"].strip("'"),
                            [t.strip(" '") for t in err["ctx"]["expected_tags"].split(",")])
    else:
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        msg = msg[:1].lower() + msg[1:]
        if err["type"] not in ("value_error", "assertion_error", "missing") and "input" in err:
            shown = err["input"]
            if not isinstance(shown, dict | BaseModel):
                msg += f" (got {json.dumps(shown) if not isinstance(shown, str) else repr(shown)})"
        what = msg
    # Name the source: the last override touching this path, else the file, else the defaults.
    source = None
    for override in reversed(overrides):
        if _touches(override, path):
            source = override[0]
            break
    if source is None:
        source = file_label or "config"
    if source.startswith("--") and source[2:].replace("-", "_") == path:  # --max-tokens names max_tokens
        return f"{source}: {what}"
    if err["type"] == "extra_forbidden":
        return f"{source}: {what}"
    return f"{source}: {path or '(top level)'}: {what}"


def load_config(cls: type[M], path: str | Path | None = None, overrides: Sequence[str] = (), *,
                options: Sequence[tuple[str, str, str]] = ()) -> M:
    """Defaults of `cls`, then the TOML file at `path` (if any), then `options`, then the
    override tokens.

    `overrides` are argv-style tokens (``["--trainer.lr", "1e-5", "--lora.rank=8"]``), e.g.
    the second value of `split_overrides`. `options` are values a parser already split off, as
    (source, dotted path, raw value) triples: the options `saccade.config.options` makes of a
    flat config's fields (``("--max-tokens", "max_tokens", "512")``), each read like an override
    and named by its source in errors. A `RunConfig` file or override with an earlier day's keys
    is read as today's, and one from before the [task] section refused, naming the new keys
    (`saccade.config.upgrade`). Raises ConfigError for any mistake.
    """
    data: dict[str, Any] = {}
    file_label = None
    if path is not None:
        file_label = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{file_label}: config file not found")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file_label}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file_label}: not UTF-8 text: {e}") from None
        if issubclass(cls, RunConfig):
            try:
                refuse_retired(data)
                data = upgrade(data, file_label)
            except ValueError as e:
                raise ConfigError(f"{file_label}: {e}") from None

    applied: list[tuple[str, str, bool]] = []  # (source, dotted path, whether it is a union's tag)
    for source, dotted, raw in [*options, *parse_overrides(overrides)]:
        move = moved(dotted, _parse_value(raw, Any)) if issubclass(cls, RunConfig) else None
        if move is not None and not move.new:
            warnings.warn(f"{source} is no longer read: today's default means it (since {move.date}: {move.why})",
                          LegacyConfigWarning, stacklevel=2)
            continue
        if move is not None:
            warnings.warn(f"{source} is now --{move.new} (since {move.date}: {move.why}); read as it",
                          LegacyConfigWarning, stacklevel=2)
            dotted = move.new
            if move.convert is not None:
                new = move.convert(_parse_value(raw, Any))
                raw = new if isinstance(new, str) else json.dumps(new)
        target = _field_at(cls, dotted, source, data)
        value = _parse_value(raw, target.annotation)
        parts = dotted.split(".")
        table = _get_path(data, parts[:-1])
        if target.union is not None and _get_path(data, parts) not in (None, value):
            # Another kind than the table's: of its fields, only those every kind has stay.
            common = _common_fields(target.union)
            _set_path(data, parts[:-1], {k: v for k, v in table.items() if k in common})
        if target.section is not None and value is True:
            value = _get_path(data, parts) if isinstance(_get_path(data, parts), dict) else {}  # on, as it was
        if target.dict_field is not None and not isinstance(table, dict):
            # One key of a dict field: the other keys keep their default values.
            default = target.dict_field.get_default(call_default_factory=True)
            _set_path(data, parts[:-1], dict(default) if isinstance(default, dict) else {})
        if _model_class(target.annotation) is not None and isinstance(value, dict):
            value = _deep_merge(_get_path(data, parts), value)  # a section as JSON merges into the file's
        _set_path(data, parts, value)
        applied.append((source, dotted, target.union is not None))

    try:
        return cls.model_validate(data)
    except ValidationError as e:
        lines = [_format_error(cls, err, file_label, applied) for err in e.errors()]
        if len(lines) == 1:
            raise ConfigError(lines[0]) from None
        raise ConfigError(f"{len(lines)} errors in the config:\n  " + "\n  ".join(lines)) from None
