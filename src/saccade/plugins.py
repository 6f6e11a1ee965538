"""A user's own code, named in a config: "package.module:function" import paths and verifiers env ids.

Config validation calls these (`saccade.config`), so a bad name fails when the config loads,
before any model is built, and `--dry-run` catches it. Nothing here imports torch; a user's
module is imported when the config that names it loads (that is how we know the function
exists).

A module is found on `sys.path`. The `saccade` command puts only its own install there, not
the current folder: run ``PYTHONPATH=. saccade rl ...`` for a module next to the config, or
install the package.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Any

# "pkg.mod:attr" or "pkg.mod:Class.attr": dotted identifiers on both sides of one colon.
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
VERIFIERS_PREFIX = "verifiers:"


def is_import_path(value: str) -> bool:
    """Does `value` look like "package.module:function" (and not "verifiers:ENV_ID")?"""
    return ":" in value and not value.startswith(VERIFIERS_PREFIX)


def load_callable(path: str, *, field: str | None = None) -> Any:
    """The callable a "package.module:function" path names. A ValueError that names the bad
    value (after `field`, when given: config validation names the field itself) and what to do
    when the module does not import, lacks the attribute, or the attribute is not callable."""
    where = f"{field}: " if field else ""
    if not _IMPORT_PATH.match(path):
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


def verifiers_module_name(env_id: str) -> str:
    """The module verifiers' `load_environment(env_id)` imports (verifiers 0.1.10,
    utils/env_utils.py): the id with '-' as '_', after any "owner/" prefix."""
    return env_id.replace("-", "_").split("/")[-1]


def check_verifiers_env(env_id: str, *, field: str | None = None) -> None:
    """That `verifiers` and the env's module can be found, without importing either (verifiers
    takes seconds to import; the env's module imports it). ValueError saying what to install."""
    from saccade.envs.verifiers_env import VERIFIERS_VERSION  # a light module: verifiers is imported lazily

    where = f"{field}: " if field else ""
    if not env_id:
        raise ValueError(f"{where}'verifiers:' needs an environment id, e.g. 'verifiers:my-env'")
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"{where}{VERIFIERS_PREFIX}{env_id} needs the `verifiers` package: pip install "
                         f"verifiers=={VERIFIERS_VERSION} (in a saccade checkout: uv sync --group dev)")
    module = verifiers_module_name(env_id)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"{where}verifiers environment {env_id!r}: no module {module!r} on sys.path. "
                         f"Install the environment's package (verifiers' `vf-install {env_id}`), or put the "
                         f"folder holding {module}.py on PYTHONPATH")
