"""The lease's first stage: in seconds, whether the lent machine can run the rest.

A GPU lease is short (15 minutes in all, the machine's start included) and nothing built on it
survives. Before any model is built, this stage answers what would otherwise waste the lease
stage by stage: which software the machine really has, whether the GPU computes the matmuls the
policy's head relies on (`torch.mm` / `torch.addmm` with `out_dtype=float32` from bf16 operands,
against float64), what precision flash-linear-attention's gated-delta kernels will use, and
whether every saccade module the GPU stages import loads. Each answer is a figure in the record,
and `passed` is false only for what breaks later stages (a matmul off its bar, a module that
does not import for a reason other than an optional package this machine is known to lack).
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import time
from typing import Any

# Packages the lent machines lack and saccade imports only where they are used (docs/gpu-runs.md):
# a module failing on one of these is expected there, not a defect.
OPTIONAL = ("vllm", "flash_attn", "datasets", "math_verify", "mathruler", "trimesh", "verifiers", "wandb",
            "tensorboard", "fastapi", "uvicorn", "openai", "prime_cli")

# bf16 operands summed in float32: relative error against float64 on a K=4096 product. One bf16
# rounding of each operand is exact here (the operands are made bf16 first); what remains is the
# float32 accumulation, about sqrt(K) * 6e-8 ~ 4e-6 relative; 1e-4 leaves a margin for split-K
# reductions and would still catch a TF32 or bf16 accumulation (1e-3 and more).
MATMUL_REL_BAR = 1e-4


def versions() -> dict[str, Any]:
    """Python, torch, CUDA, transformers and the optional kernels' packages as installed here."""
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "peft", "triton", "fla", "pydantic", "vllm", "flash_attn"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "installed")
        except Exception:  # noqa: BLE001 - absent, or failing to import: both mean "not usable"
            out[name] = None
    return out


def device_facts(device: str) -> dict[str, Any]:
    import torch

    if device != "cuda":
        return {"name": platform.processor() or "CPU", "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30,
            "count": torch.cuda.device_count(), "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}


def matmul_check(device: str, k: int = 4096) -> dict[str, Any]:
    """`mm` and `addmm` with bf16 operands and a float32 result, against float64: the relative max
    error of each, whether addmm takes `out_dtype` here (models.head's probe), and a bf16 matmul's
    TFLOP/s (the denominator an MFU figure should be read against)."""
    import torch

    from saccade.models.head import addmm_takes_out_dtype

    dev = torch.device(device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(256, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, 512, generator=gen).to(torch.bfloat16)
    want = a.double() @ b.double()
    scale = float(want.abs().max())

    def rel(got: torch.Tensor) -> float:
        return float((got.double().cpu() - want).abs().max()) / scale

    out: dict[str, Any] = {"k": k, "bar": MATMUL_REL_BAR}
    try:
        out["mm_out_dtype_rel"] = rel(torch.mm(a.to(dev), b.to(dev), out_dtype=torch.float32))
    except (TypeError, RuntimeError, NotImplementedError) as err:
        out["mm_out_dtype_rel"], out["mm_error"] = None, f"{type(err).__name__}: {err}"
    out["addmm_takes_out_dtype"] = addmm_takes_out_dtype(dev, torch.bfloat16)
    if out["addmm_takes_out_dtype"]:
        acc = torch.zeros(256, 512, device=dev)
        torch.addmm(acc, a.to(dev), b.to(dev), out_dtype=torch.float32, out=acc)
        out["addmm_out_dtype_rel"] = rel(acc)
    out["upcast_rel"] = rel(a.to(dev).float() @ b.to(dev).float())  # the fallback's path
    out["tflops_bf16"] = _bf16_tflops(dev) if device == "cuda" else None
    errors = [v for key, v in out.items() if key.endswith("_rel") and v is not None]
    out["passed"] = bool(errors) and max(errors) <= MATMUL_REL_BAR
    return out


def _bf16_tflops(dev, n: int = 8192, repeats: int = 10) -> float:
    import torch

    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    x @ x  # warm-up: cuBLAS picks its kernel
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        x @ x
    torch.cuda.synchronize()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def fla_precision() -> dict[str, Any]:
    """What flash-linear-attention's gated-delta forward will compute its triangular solve in:
    fla's own setting (TF32 on sm >= 80), and what saccade's exactness check sets it to."""
    from saccade.models.linear_attention import FLA_PRECISION_MODULE, fla_solve_precision

    if importlib.util.find_spec("fla") is None:
        return {"installed": False}
    try:
        own = fla_solve_precision()
    except Exception as err:  # noqa: BLE001 - fla installed but not importable here (no GPU, old triton)
        return {"installed": True, "imports": False, "error": f"{type(err).__name__}: {err}"}
    return {"installed": True, "imports": True, "module": FLA_PRECISION_MODULE, "fla_default": own}


def import_everything() -> dict[str, Any]:
    """Import every saccade module, in a fresh interpreter (importing vLLM and the rest changes
    process-wide settings, which must not reach the stages run after this one in-process); those
    that fail, each with the module it lacked. A failure on an OPTIONAL package is expected on the
    lent machines and does not fail the stage."""
    import json
    import sys

    from saccade.parent_death import run_child

    code = f"""
import importlib, json, pkgutil, saccade
failed, optional = {{}}, {{}}
names = [m.name for m in pkgutil.walk_packages(saccade.__path__, "saccade.") if not m.name.endswith("__main__")]
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        (optional if (err.name or "").split(".")[0] in {OPTIONAL!r} else failed)[name] = f"no module {{err.name}}"
    except Exception as err:
        failed[name] = f"{{type(err).__name__}}: {{err}}"
print(json.dumps({{"modules": len(names), "failed": failed, "optional_missing": optional}}))
"""
    done = run_child([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"modules": 0, "failed": {"saccade": done.stderr.strip()[-500:]}, "optional_missing": {}}
    return json.loads(done.stdout.strip().splitlines()[-1])


def smoke(device: str) -> dict[str, Any]:
    start = time.perf_counter()
    result = {"versions": versions(), "device": device_facts(device), "matmul": matmul_check(device),
              "fla": fla_precision(), "imports": import_everything()}
    result["seconds"] = time.perf_counter() - start
    result["passed"] = result["matmul"]["passed"] and not result["imports"]["failed"]
    return result


def smoke_summary(r: dict) -> str:
    v, d, m, f, i = r["versions"], r["device"], r["matmul"], r["fla"], r["imports"]
    gpu = f"{d['name']} (sm {d['capability']}, {d['memory_gib']:.0f} GiB)" if "capability" in d else d["name"]
    worst = max((m[k] for k in m if k.endswith("_rel") and m[k] is not None), default=float("nan"))
    fla = ("fla absent" if not f.get("installed") else f"fla {v.get('fla')}: solve in {f['fla_default']}"
           if f.get("imports") else f"fla does not import ({f.get('error', '')[:60]})")
    tflops = f", bf16 {m['tflops_bf16']:.0f} TFLOP/s" if m.get("tflops_bf16") else ""
    return (f"{gpu}; Python {v['python']}, torch {v['torch']}, transformers {v['transformers']}; bf16->fp32 "
            f"mm/addmm vs fp64 {worst:.1e} (bar {m['bar']:g}; addmm out_dtype {'yes' if m['addmm_takes_out_dtype'] else 'no'})"
            f"{tflops}; {fla}; {i['modules'] - len(i['failed']) - len(i['optional_missing'])}/{i['modules']} modules "
            f"import ({len(i['optional_missing'])} lack an optional package"
            + (f"; FAILED: {', '.join(i['failed'])}" if i["failed"] else "") + f"): {'pass' if r['passed'] else 'FAIL'}")
