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
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from saccade.tools.bench import gpu_results
from saccade.tools.bench import gpu_stages as S
from saccade.tools.bench.gpu_table import (  # noqa: F401 - the table, read here and by the tests as gpu.*
    BY_NAME, FAMILY_SHAPES, LEASE_BUDGET_S, LEASE_ORDER, LEASE_S, STAGES, Stage, lease_order, list_stages,
    listed_seconds, plan_leases)
from saccade.tools.bench import read_job, write_job
from saccade.config.bench import GpuBenchConfig
from saccade.parent_death import start_child

JSON_NAME, MD_NAME, LOG_NAME = "bench-gpu.json", "bench-gpu.md", "bench-gpu.log"
EXIT_OK, EXIT_FAILED, EXIT_PENDING = 0, 1, 3


def lease_stages(carried: dict[str, Any]) -> list[Stage]:
    """What a lease runs, in order: the stages the carried results lack, then those that failed or
    were stopped there (retried last: a fix may have landed, but new figures come first); a stage
    carried `ok` never runs again."""
    order = lease_order()
    new = [s for s in order if s.name not in carried["stages"]]
    again = [s for s in order if s.name in carried["stages"] and not gpu_results.is_done(carried["stages"][s.name])]
    return new + again


def load_carried(path: str, *, device: str, quick: bool, log=print) -> dict[str, Any]:
    """The results carried from earlier leases, if they are of this run's settings; else none (a
    `--device cpu --quick` lease, the tests', does not count the GPU's figures as its own)."""
    settings = {"device": device, "quick": quick}
    carried = gpu_results.load(path, settings=settings)
    if carried["settings"] != settings:
        log(f"{path} holds results of {carried['settings']}, not of this run ({settings}): starting from none")
        return gpu_results.empty(settings)
    return carried


def record_lease(cfg: GpuBenchConfig, *, log=print) -> int:
    """`--record DIR`: merge a lease's results (DIR/bench-gpu.json, or that file) into the carried
    file and rewrite the table of docs/gpu-runs.md beside it."""
    source = Path(cfg.record)
    source = source / JSON_NAME if source.is_dir() else source
    lease = json.loads(source.read_text())
    carried = gpu_results.load(cfg.results, settings=lease["settings"])
    merged, changed = gpu_results.merge(carried, lease)
    gpu_results.save(cfg.results, merged)
    doc = Path(cfg.results).with_name("gpu-runs.md")
    rewrote = gpu_results.rewrite_doc(doc, results_markdown(merged)) if doc.exists() else False
    log(f"{cfg.results}: {len(changed)} stage(s) recorded ({', '.join(changed) or 'none new'})"
        + (f"; {doc}'s table rewritten" if rewrote else ""))
    todo = lease_stages(merged)
    log(f"the next lease starts with: {', '.join(s.name for s in todo[:5]) or 'nothing: every stage is ok'}")
    return EXIT_OK


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
    """The table of one results folder: one row per stage, its figures or why there are none."""
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
            result = stage_result(stage, r)
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
    # Its own process group: a timeout stops the stage's torchrun workers too. It ends with the bench.
    proc = start_child(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
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


def stage_result(stage: Stage, r: dict[str, Any]) -> str:
    """A record's table cell: the stage's summary, or its status and the error's last line."""
    if r["status"] != "ok":
        return f"**{r['status'].upper()}**: {_last_line(r.get('error'))[:200]}"
    try:
        result = stage.summary(r["result"])
    except Exception as err:  # noqa: BLE001 - a summary must never lose the JSON
        result = f"ok (no summary: {type(err).__name__}: {err})"
    return ("**CHECK FAILED**: " if r.get("check") == "failed" else "") + result


def results_markdown(data: dict[str, Any]) -> str:
    """docs/gpu-runs.md's table of the carried results (gpu_results): every stage in the lease's
    order, each figure with the device, date, commit and command that made it."""
    lines = ["| stage | checks | result | device, date, commit | s |", "|---|---|---|---|---|"]
    for stage in lease_order():
        r = data["stages"].get(stage.name)
        if r is None:
            lines.append(f"| {stage.name} | {stage.what} | not run yet | | |")
            continue
        m = r.get("machine") or {}
        made = f"{m.get('device_name', '?')}, {(r.get('finished') or '')[:10]}, {m.get('commit') or '?'}"
        result = stage_result(stage, r)
        if r.get("last_failure"):
            f = r["last_failure"]
            result += f" (later {f['status']} on {(f.get('machine') or {}).get('device_name', '?')}: " \
                      f"{_last_line(f.get('error'))[:120]})"
        lines.append(f"| {stage.name} | {stage.what} | {result.replace('|', '/')} | {made} | {r['seconds']:.0f} |")
    commands = sorted({r["command"] for r in data["stages"].values() if r.get("command")})
    if commands:
        lines += ["", "Made by: " + "; ".join(f"`{c}`" for c in commands)]
    return "\n".join(lines) + "\n"


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


def command_line(cfg: GpuBenchConfig) -> str:
    """The `saccade bench gpu` command line that gives `cfg` (its options that are not the
    defaults), recorded with each stage's figures."""
    words = ["saccade", "bench", "gpu"]
    for name, field in GpuBenchConfig.model_fields.items():
        value = getattr(cfg, name)
        if value == field.get_default(call_default_factory=True):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag)
        else:
            for v in value if isinstance(value, list) else [value]:
                words += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return shlex.join(words)


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
    """Run the selected stages (`cfg.stage`; all by default; a lease's with `cfg.lease`); the exit
    code (module docstring). `--record` merges a lease's results instead."""
    from saccade.devices import resolve_device

    if cfg.record:
        return record_lease(cfg, log=log)
    quick, force, budget_s, in_process = cfg.quick, cfg.force, cfg.budget, cfg.in_process
    stages = cfg.stage or None
    device = resolve_device(cfg.device, setting="bench gpu --device").type  # the stages are told "cuda" or "cpu"
    out = Path(cfg.out)
    data = load_results(out, device=device, quick=quick)
    out.mkdir(parents=True, exist_ok=True)
    plan = S.Plan(device=device, quick=quick, out=out, log=log)
    if cfg.lease:
        carried = load_carried(cfg.results, device=device, quick=quick, log=log)
        wanted = {s.name for s in select(stages)}
        chosen = [s for s in lease_stages(carried) if s.name in wanted]
        budget_s = LEASE_BUDGET_S if budget_s is None else budget_s
        stages = [s.name for s in chosen]  # named: a stage carried as failed is retried
        log(f"lease: {len(carried['stages'])} stage(s) carried in {cfg.results}; this lease, in order: "
            f"{', '.join(stages) or 'nothing left'} (budget {budget_s:.0f} s)")
    else:
        chosen = select(stages)
    command = command_line(cfg)
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
        record["command"] = command
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


def main(argv: list[str] | None = None) -> int:
    """`python -m saccade.tools.bench.gpu JOB.json`: one stage, in the fresh process `run_stage_child` started."""
    from saccade.logs import configure

    configure()  # what the library says goes to stderr, as under `saccade bench gpu` itself
    return run_recorded_stage(read_job(StageJob, argv))


if __name__ == "__main__":
    sys.exit(main())
