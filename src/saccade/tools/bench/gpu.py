"""`saccade bench gpu`: every GPU check that needs no vLLM, in one command, in stages that resume.

The stages (saccade.tools.bench.gpu_stages) run in order, each in a fresh Python process (`python -m
saccade.tools.bench.gpu JOB.json`: the bench's `GpuBenchConfig` with that one stage, serialized; a
crash, an out-of-memory or a CUDA error in one leaves the next a clean device; `--in-process`
runs them in this one). Each stage's record (status, seconds, the device, its figures or its
error) goes into one JSON in the `--out` folder as soon as it ends, and a markdown table the
README pastes is rewritten beside it (`bench-gpu.json`, `bench-gpu.md`; the output of the
stages' processes is appended to `bench-gpu.log`). Run again, the command skips what finished:

- a stage that is `ok` runs again only with `--force`;
- a stage that `failed` runs again when named (`--stage NAME`) or with `--force`: a failure
  usually needs a fix first, and GPU time is short;
- a stage that was `unavailable` (its code is not in this checkout yet) runs again.

`--budget SECONDS` bounds one invocation: a stage starts only if its estimate (on one H100,
plus building the real-shape models it loads when they are not built yet) fits in what is
left, and a running stage is stopped at the budget's end (`timeout`): it runs again first
in the next invocation, with the whole budget; stopped then too, it has failed. Exit codes:
0 every selected stage is ok; 1 one failed (an error, or a check it makes: parity over its
bar); 3 stages are left for the next invocation: run the same command again.

`--device cpu --quick` runs every stage on its family's tiny preset with few steps and short
lengths; the tests run it so that the command cannot rot.

The stages are Qwen3-VL's (every check, at 2B and 4B shapes) and then two per further family
(`FAMILY_SHAPES`: bf16 parity and `bench trainer` LoRA at one real shape each), Qwen3.5's after
its `linear-attention` check (flash-linear-attention's varlen kernels on packed rows); `--list`
shows them by family with their estimates.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from saccade.tools.bench import gpu_stages as S
from saccade.tools.bench import read_job, write_job
from saccade.config.bench import GpuBenchConfig

JSON_NAME, MD_NAME, LOG_NAME = "bench-gpu.json", "bench-gpu.md", "bench-gpu.log"
EXIT_OK, EXIT_FAILED, EXIT_PENDING = 0, 1, 3


@dataclass(frozen=True)
class Stage:
    name: str
    what: str  # the table's first column: what the stage checks
    run: Callable[[S.Plan], dict]
    summary: Callable[[dict], str]
    gpu_s: int  # estimated seconds on one H100 (80 GB), its models already built
    needs: tuple[str, ...] = ()  # real-shape models it loads (keys of S.BIG): built first if missing
    family: str = "Qwen3-VL"  # whose code it checks: `--list` groups the stages by it


# Qwen3-VL, the family saccade started with: every check, at 2B and 4B shapes.
QWEN3_VL_STAGES = (
    Stage("models", "random models at 2B and 4B shapes built on this machine; the demo's warm start",
          S.models, S.models_summary, 30, needs=("2b", "4b")),
    Stage("parity-2b", "bf16 parity at 2B shapes, LM-only vs the full model, 1k and 8k positions",
          lambda p: S.parity(p, "2b"), S.parity_summary, 100, needs=("2b",)),
    Stage("parity-4b", "bf16 parity at 4B shapes, 1k and 8k positions",
          lambda p: S.parity(p, "4b"), S.parity_summary, 150, needs=("4b",)),
    Stage("syncs", "host syncs per decoded token (embedded engine) and per trainer micro-batch",
          S.syncs, S.syncs_summary, 40),
    Stage("trainer-lora", "`bench trainer` at 2B shapes, LoRA: tokens/s, MFU, peak vs `saccade memory`",
          lambda p: S.trainer(p, "2b", full_finetune=False), S.trainer_summary, 170, needs=("2b",)),
    Stage("trainer-full", "`bench trainer` at 2B shapes, full fine-tuning",
          lambda p: S.trainer(p, "2b", full_finetune=True), S.trainer_summary, 220, needs=("2b",)),
    Stage("step", "`bench step` at 2B shapes, bf16, LoRA, 448 px: one RL step against HF's path",
          S.step, S.step_summary, 120, needs=("2b",)),
    Stage("rl", "RL steps with the embedded engine that train (demo config from tiny-warm)",
          S.rl, S.rl_summary, 150),
    Stage("fsdp-2b", "FSDP2 at world 1 (torchrun, NCCL), 2B shapes, LoRA and full: step, export, peak",
          S.fsdp, S.fsdp_summary, 150, needs=("2b",)),
    Stage("fsdp-bf16", "FSDP2 bf16 mixed precision against fp32: RL steps from tiny-warm",
          S.fsdp_bf16, S.fsdp_bf16_summary, 60),
    Stage("render", "`bench render`: the mesh rasterizer on the device (and the CPU beside it)",
          S.render, S.render_summary, 30),
)

# The other families: bf16 parity and `bench trainer` LoRA, each at one real shape (a key of S.BIG,
# whose first stage builds it), with the estimated H100 seconds of each, the model built. Scaled
# from Qwen3-VL's stages: parity 100 s at 2B, 150 s at 4B; the trainer 170 s at 2B (loading is most
# of a stage; the MoE computes 1B active parameters a token but loads 4.9B, three times for parity).
# Rows: (family, shape key, the shape in words, parity s, trainer s).
FAMILY_SHAPES = (
    ("Qwen2.5-VL", "qwen2.5vl-3b", "Qwen2.5-VL-3B's shapes", 140, 220),
    ("Qwen3-VL-MoE", "qwen3vl-30b-a3b-l6", "Qwen3-VL-30B-A3B's widths (6 of 48 layers)", 160, 240),
    # Qwen3.5-9B (18.8 GB in bf16). Parity: 260 s, the same ~11 s a GB past 50 s as 2B -> 4B; it holds
    # LM-only bf16, full bf16 and full fp32 at once, about 75 GB (70 GiB) of an H100's 79 GiB, ~8 left for
    # activations at 8k positions. Trainer: scaled so from 170 s at 2B and 220 s at 3B it would be ~400 s,
    # and with the 9B's build (260 s) would not fit one 540 s command on a fresh machine; counted part by
    # part instead: five loads of 18.8 GB (the policy, the full VLM, three memory processes) at ~2 GB/s
    # from the page cache 95 s, four Python starts 40 s, 4 variants x 4 steps of 8 samples at 9B with
    # LoRA ~2 s each at 300 TFLOP/s 35 s: 170 s, 270 with a margin. Neither is measured.
    ("Qwen3.5", "qwen3.5-9b", "Qwen3.5-9B's shapes", 260, 270),
)


def family_stages(family: str, size: str, shapes: str, parity_s: int, trainer_s: int) -> tuple[Stage, Stage]:
    """A family's two stages: parity as `parity-2b` runs it, and `bench trainer` with LoRA as
    `trainer-lora` runs it, at `shapes` (--quick: the family's tiny preset)."""
    return (
        Stage(f"parity-{size}", f"bf16 parity at {shapes}, LM-only vs the full model, 1k and 8k positions",
              lambda p: S.parity(p, size), S.parity_summary, parity_s, needs=(size,), family=family),
        Stage(f"trainer-lora-{size}", f"`bench trainer` at {shapes}, LoRA: tokens/s, MFU, peak vs `saccade memory`",
              lambda p: S.trainer(p, size, full_finetune=False), S.trainer_summary, trainer_s, needs=(size,),
              family=family),
    )


# Qwen3.5's packed rows through Gated DeltaNet on the device: flash-linear-attention's varlen kernels
# (never run before this stage) against the torch ones, exactness and speed. 200 s on an H100, a guess
# counted part by part: a Python start and imports 10 s; building qwen3.5-tiny ~5 s; Triton compiling and
# autotuning fla's forward and backward kernels, fp32 and bf16, varlen and not, most of it (~150 s);
# the check (15 samples alone, fp32, 1.4M parameters) a few s; the timing 6 cases x 6 runs of a GRPO
# group of 16 at qwen3.5-small's 65M parameters, ~20 s.
LINEAR_ATTENTION = Stage(
    "linear-attention", "Qwen3.5's Gated DeltaNet on packed rows: fla's varlen kernels vs torch (fp32 "
    "logprobs and gradients, images, shared prompts), then varlen vs padded speed of a GRPO group",
    S.linear_attention, S.linear_attention_summary, 200, needs=("qwen3.5-small",), family="Qwen3.5")


def _family(family: str) -> tuple[Stage, ...]:
    """A family's stages: its parity and trainer, and Qwen3.5's linear-attention check first."""
    row = next(r for r in FAMILY_SHAPES if r[0] == family)
    return ((LINEAR_ATTENTION,) if family == "Qwen3.5" else ()) + family_stages(*row)


STAGES = QWEN3_VL_STAGES + tuple(stage for row in FAMILY_SHAPES for stage in _family(row[0]))
BY_NAME = {s.name: s for s in STAGES}


# ----------------------------------------------------------------------------- the record


def machine_info(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "host": platform.node(), "cpus": os.cpu_count()}
    info["device_name"] = _gpu_name() if device == "cuda" else (platform.processor() or "CPU")
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def _gpu_name() -> str:
    """The GPU's name, without making a CUDA context in a process that has none (the parent of
    the stages' processes must not hold device memory while they run)."""
    import torch

    if torch.cuda.is_initialized():
        return torch.cuda.get_device_name()
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=10).stdout.split("\n")
        return names[0].strip() or "CUDA device"
    except (OSError, subprocess.SubprocessError):
        return "CUDA device"


def load_results(out: Path, *, device: str, quick: bool) -> dict[str, Any]:
    path = out / JSON_NAME
    if not path.exists():
        return {"settings": {"device": device, "quick": quick}, "stages": {}}
    data = json.loads(path.read_text())
    if data.get("settings") != {"device": device, "quick": quick}:
        raise ValueError(f"{path} holds results of {data.get('settings')}, not device {device!r} quick {quick}: "
                         "give another --out")
    return data


def save_results(out: Path, data: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (JSON_NAME + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, out / JSON_NAME)
    (out / MD_NAME).write_text(markdown(data))


def markdown(data: dict[str, Any]) -> str:
    """The table the README pastes: one row per stage, its figures or why there are none."""
    stages = data["stages"]
    devices = sorted({r["machine"]["device_name"] for r in stages.values() if r.get("machine")})
    first = next((r["machine"] for r in stages.values() if r.get("machine")), None)
    s = data["settings"]
    head = f"`saccade bench gpu{' --quick' if s['quick'] else ''}` on {', '.join(devices) or s['device']}"
    if first:
        head += (f" (torch {first['torch']}, transformers {first['transformers']}, Python {first['python']}"
                 + (f", saccade {first['commit']}" if first.get("commit") else "") + ")")
    dates = sorted(r["finished"][:10] for r in stages.values() if r.get("finished"))
    if dates:
        head += f", {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "")
    lines = [head + ":", "", "| stage | checks | result | s |", "|---|---|---|---|"]
    for stage in STAGES:
        r = stages.get(stage.name)
        if r is None:
            result, seconds = "not run yet", ""
        else:
            seconds = f"{r['seconds']:.0f}" + (f" ({r['machine']['device_name']})" if len(devices) > 1 else "")
            if r["status"] == "ok":
                try:
                    result = stage.summary(r["result"])
                except Exception as err:  # noqa: BLE001 - a summary must never lose the JSON
                    result = f"ok (no summary: {type(err).__name__}: {err})"
                if r.get("check") == "failed":
                    result = "**CHECK FAILED**: " + result
            else:
                result = f"**{r['status'].upper()}**: {_last_line(r.get('error'))[:200]}"
        lines.append(f"| {stage.name} | {stage.what} | {result.replace('|', '/')} | {seconds} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- running a stage


def run_stage_here(stage: Stage, plan: S.Plan) -> dict[str, Any]:
    """Run one stage in this process; its record."""
    start = time.perf_counter()
    record: dict[str, Any] = {"started": _now()}
    try:
        result = stage.run(plan)
        record.update(status="ok", result=result)
        if result.get("passed") is False:
            record["check"] = "failed"
    except S.NotAvailable as err:
        record.update(status="unavailable", error=str(err))
    except Exception:  # noqa: BLE001 - recorded with its traceback; the next stage runs
        record.update(status="failed", error=traceback.format_exc())
    record.update(seconds=time.perf_counter() - start, finished=_now(), machine=machine_info(plan.device))
    return record


class StageJob(BaseModel):
    """One stage in a fresh interpreter: the bench's config (its device resolved, the one stage
    named), and the file its record goes to."""

    bench: GpuBenchConfig
    record: str


def run_stage_child(stage: Stage, plan: S.Plan, timeout_s: float | None) -> dict[str, Any]:
    """Run one stage in a fresh interpreter (`python -m saccade.tools.bench.gpu JOB.json`), its output
    streamed here and into the log; a crash or a timeout becomes a failed record with the
    output's last lines."""
    record_file = plan.out / f".{stage.name}.record.json"
    record_file.unlink(missing_ok=True)
    bench = GpuBenchConfig(device=plan.device, quick=plan.quick, out=str(plan.out), stage=[stage.name])
    job = write_job(StageJob(bench=bench, record=str(record_file)), plan.out / f".{stage.name}.job.json")
    cmd = [sys.executable, "-m", "saccade.tools.bench.gpu", str(job)]
    tail: collections.deque[str] = collections.deque(maxlen=40)
    start = time.perf_counter()
    started = _now()
    # Its own process group: a timeout stops the stage's torchrun workers too.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def pump() -> None:
        with open(plan.out / LOG_NAME, "a") as log:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
                tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=10)
    job.unlink(missing_ok=True)
    if record_file.exists() and not timed_out:
        record = json.loads(record_file.read_text())
        record_file.unlink()
        return record
    why = f"timed out after {timeout_s:.0f} s (the budget)" if timed_out else f"the stage's process exited {proc.returncode}"
    return {"started": started, "status": "timeout" if timed_out else "failed",
            "error": f"{why}; its last output:\n{''.join(tail)}",
            "seconds": time.perf_counter() - start, "finished": _now(), "machine": machine_info(plan.device)}


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[-1] if lines else ""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def estimate_s(stage: Stage, plan: S.Plan) -> float:
    """The stage's estimated seconds on one H100, with the builds of the models it needs that
    are not built yet (a fresh machine, or the models stage not run)."""
    if plan.quick:
        return 0.0
    return stage.gpu_s + sum(S.BIG[n].build_s for n in stage.needs if not _is_built(S.BIG[n].preset))


def _is_built(preset: str) -> bool:
    from saccade.models.presets import is_built, preset_folder

    return is_built(preset_folder(preset))


# ----------------------------------------------------------------------------- the command


def select(names: list[str] | None) -> list[Stage]:
    if not names:
        return list(STAGES)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; the stages: {', '.join(BY_NAME)}")
    return [s for s in STAGES if s.name in names]


def should_run(stage: Stage, record: dict | None, *, named: bool, force: bool) -> tuple[bool, str]:
    """Whether to run a stage given its record (see the module docstring); why not, if not."""
    if force or record is None:
        return True, ""
    status = record["status"]
    if status == "ok":
        return False, "ok before (--force runs it again)"
    if status == "failed" and not named:
        return False, f"failed before (--stage {stage.name} runs it again)"
    return True, ""  # unavailable before, or stopped by the budget: again


def run_gpu_bench(cfg: GpuBenchConfig, *, log=print) -> int:
    """Run the selected stages (`cfg.stage`; all by default); the exit code (module docstring)."""
    from saccade.devices import resolve_device

    quick, force, budget_s, in_process = cfg.quick, cfg.force, cfg.budget, cfg.in_process
    stages = cfg.stage or None
    device = resolve_device(cfg.device, setting="bench gpu --device").type  # the stages are told "cuda" or "cpu"
    out = Path(cfg.out)
    data = load_results(out, device=device, quick=quick)
    out.mkdir(parents=True, exist_ok=True)
    plan = S.Plan(device=device, quick=quick, out=out, log=log)
    chosen = select(stages)
    started = time.perf_counter()
    pending: list[str] = []
    ran = 0  # stages run in this invocation
    for k, stage in enumerate(chosen, 1):
        tag = f"[{k}/{len(chosen)}] {stage.name}"
        run, why = should_run(stage, data["stages"].get(stage.name), named=bool(stages), force=force)
        if not run:
            log(f"{tag}: skipped, {why}")
            continue
        left = None if budget_s is None else budget_s - (time.perf_counter() - started)
        estimate = estimate_s(stage, plan)
        record = data["stages"].get(stage.name)
        # A stage the budget stopped before gets a whole budget: it runs first in an invocation.
        retry_first = record is not None and record["status"] == "timeout" and ran
        if left is not None and (estimate > left or retry_first):
            log(f"{tag}: left for the next run (estimated {estimate:.0f} s, {max(left, 0):.0f} s of the budget left"
                + (", and the budget stopped it before: it runs first next time" if retry_first else "") + ")")
            pending.append(stage.name)
            continue
        if record is not None and record["status"] == "timeout" and not ran and left is not None:
            log(f"{tag}: the budget stopped it before; it has the whole budget now")
        log(f"{tag}: {stage.what} ({device}{', quick' if quick else ''}"
            + (f", about {estimate:.0f} s on an H100" if estimate else "") + ")")
        previous = record
        record = run_stage_here(stage, plan) if in_process else run_stage_child(stage, plan, left)
        if record["status"] == "timeout" and previous is not None and previous["status"] == "timeout" and not ran:
            # Stopped twice, the second time with the whole budget: longer than one invocation.
            record["status"] = "failed"
            record["error"] = f"longer than the whole budget ({budget_s:.0f} s) twice: {record['error']}"
        ran += 1
        data["stages"][stage.name] = record
        save_results(out, data)
        summary = ""
        if record["status"] == "ok":
            try:
                summary = stage.summary(record["result"])
            except Exception as err:  # noqa: BLE001
                summary = f"(no summary: {err})"
        else:
            summary = _last_line(record.get("error"))[:300]
        log(f"{tag}: {record['status']} in {record['seconds']:.0f} s"
            + (" (CHECK FAILED)" if record.get("check") == "failed" else "") + f": {summary}")
    save_results(out, data)
    log(f"results: {out / JSON_NAME}, table: {out / MD_NAME}")
    records = [data["stages"].get(s.name) for s in chosen]
    pending += [s.name for s, r in zip(chosen, records) if r and r["status"] == "timeout" and s.name not in pending]
    if pending:
        log(f"{len(pending)} stage(s) left for the next run: {', '.join(pending)}; run the same command again")
        return EXIT_PENDING
    failed = [s.name for s, r in zip(chosen, records) if r and (r["status"] == "failed" or r.get("check") == "failed")]
    unavailable = [s.name for s, r in zip(chosen, records) if r and r["status"] == "unavailable"]
    if unavailable:
        log(f"not available in this checkout: {', '.join(unavailable)} (see the table)")
    if failed:
        log(f"failed: {', '.join(failed)} (errors in {out / JSON_NAME})")
        return EXIT_FAILED
    return EXIT_OK


def run_recorded_stage(job: StageJob) -> int:
    """The child's side of `run_stage_child`: the job's one stage here, its record to `job.record`."""
    plan = S.Plan(device=job.bench.device, quick=job.bench.quick, out=Path(job.bench.out))
    (name,) = job.bench.stage
    result = run_stage_here(BY_NAME[name], plan)
    Path(job.record).write_text(json.dumps(result, default=str))
    return 0


def listed_seconds() -> dict[str, int]:
    """Each stage's estimated seconds on one H100 when the stages run in order on a fresh machine:
    a stage's own, plus building the models it is the first to need (the models stage builds
    Qwen3-VL's; each other family's first stage builds its shape)."""
    seconds, built = {}, set()
    for stage in STAGES:
        new = [n for n in stage.needs if n not in built]
        built.update(new)
        seconds[stage.name] = stage.gpu_s + sum(S.BIG[n].build_s for n in new)
    return seconds


def list_stages() -> str:
    """The stages by family, with their estimated seconds on one H100 (builds included where they
    happen), each family's sum and the whole."""
    seconds = listed_seconds()
    width = max(len(s.name) for s in STAGES) + 2
    lines = [f"{'stage':<{width}}{'H100 s':>8}  checks"]
    for family in dict.fromkeys(s.family for s in STAGES):
        stages = [s for s in STAGES if s.family == family]
        lines.append(f"{family}: {sum(seconds[s.name] for s in stages)} s")
        lines += [f"  {s.name:<{width - 2}}{seconds[s.name]:>8}  {s.what}" for s in stages]
    lines.append(f"{'all':<{width}}{sum(seconds.values()):>8}  (estimates; one process start each included)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m saccade.tools.bench.gpu JOB.json`: one stage, in the fresh process `run_stage_child` started."""
    from saccade.logs import configure

    configure()  # what the library says goes to stderr, as under `saccade bench gpu` itself
    return run_recorded_stage(read_job(StageJob, argv))


if __name__ == "__main__":
    sys.exit(main())
