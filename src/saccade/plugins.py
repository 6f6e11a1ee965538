"""A user's own code, named in a config: "package.module:function" import paths.

`saccade.run.tasks.check_user_code` resolves every path a config names before the run builds
anything (`--dry-run` included), so a bad name fails first. Nothing here imports torch, nor
any other part of saccade; a user's module is imported when its path is resolved (that is how
we know the function exists).

A module is found on `sys.path`. The `saccade` command puts only its own install there, not
the current folder: run ``PYTHONPATH=. saccade rl ...`` for a module next to the config, or
install the package.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# "pkg.mod:attr" or "pkg.mod:Class.attr": dotted identifiers on both sides of one colon.
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def is_import_path(value: str) -> bool:
    """Does `value` look like "package.module:function" (rather than a built-in's name)?"""
    return ":" in value


def load_callable(path: str, *, field: str | None = None) -> Any:
    """The callable a "package.module:function" path names. A ValueError that names the bad
    value (after `field`, when given: config validation names the field itself) and what to do
    when the module does not import, lacks the attribute, or the attribute is not callable."""
    where = f"{field}: " if field else ""
    if not IMPORT_PATH.match(path):
        raise ValueError(f"{where}{path!r} is not an import path; write 'package.module:function' "
                         "(dotted module, one colon, the function's name)")
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"{where}{path!r}: no module named {err.name!r} on sys.path. A file next to the "
                             f"config needs its folder on the path (PYTHONPATH=. saccade rl ...); a package "
                             "must be installed in this environment") from None
        raise ValueError(f"{where}{path!r}: importing {module_name!r} failed: {err} (a module it imports "
                         "is missing)") from None
    except Exception as err:  # noqa: BLE001 - a user's module may fail any way at import
        raise ValueError(f"{where}{path!r}: importing {module_name!r} raised {type(err).__name__}: {err}") \
            from None
    target: Any = module
    for i, part in enumerate(attribute.split(".")):
        if not hasattr(target, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attribute.split('.')[:i])}"
            offered = _public_callables(target)
            listing = f"; it has {', '.join(offered)}" if offered else ""
            raise ValueError(f"{where}{path!r}: {owner!r} has no attribute {part!r}{listing}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{where}{path!r} is a {type(target).__name__}, not a function")
    return target


def _public_callables(obj: Any, limit: int = 12) -> list[str]:
    names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
    return names[:limit] + (["..."] if len(names) > limit else [])
