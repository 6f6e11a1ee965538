"""`saccade bench gpu --lease`: the stages in the order of their value, each written the moment it
ends (a command cut short keeps what finished), results carried from lease to lease
(`--record`, docs/gpu-results.json and docs/gpu-runs.md's table), the leases' arithmetic."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from saccade.cli import main
from saccade.config.bench import GpuBenchConfig
from saccade.tools.bench import gpu, gpu_results
from saccade.tools.bench import gpu_stages as S

ROOT = Path(__file__).resolve().parents[3]
QUICK = ["bench", "gpu", "--lease", "--device", "cpu", "--quick"]


def doc_with_markers(folder: Path) -> Path:
    doc = folder / "gpu-runs.md"
    doc.write_text(f"# GPU runs\n\nbefore\n\n{gpu_results.DOC_BEGIN}\nold table\n{gpu_results.DOC_END}\n\nafter\n")
    return doc


def record(status: str, finished: str, device: str = "NVIDIA H100 80GB HBM3", **extra) -> dict:
    return {"status": status, "finished": finished, "seconds": 12.0, "result": {"x": 1}, "error": "boom\nlast line",
            "machine": {"device_name": device, "commit": "abc1234"}, "command": "saccade bench gpu --lease", **extra}


# ----------------------------------------------------------------------------- the order


def test_a_lease_runs_what_is_not_carried_first_in_the_order_of_value_and_retries_failures_last():
    assert [s.name for s in gpu.lease_order()[:5]] == ["smoke", "parity-2b", "trainer-lora", "syncs", "rl"]
    assert "models" not in [s.name for s in gpu.lease_order()]  # each stage builds what it needs
    assert {s.name for s in gpu.lease_order()} == {s.name for s in gpu.STAGES} - {"models"}
    carried = {"settings": gpu_results.LEASE_SETTINGS, "stages": {
        "smoke": record("ok", "2026-11-28T10:00:00"),
        "parity-2b": record("failed", "2026-11-28T10:01:00"),
        "trainer-lora": record("ok", "2026-11-28T10:02:00", check="failed"),  # ran, its check did not hold
        "syncs": record("timeout", "2026-11-28T10:03:00")}}
    names = [s.name for s in gpu.lease_stages(carried)]
    assert "smoke" not in names  # carried ok: never again
    assert names[:2] == ["rl", "trainer-full"]  # what has never run comes first
    assert names[-3:] == ["parity-2b", "trainer-lora", "syncs"]  # then what failed, in the same order


class FreshMachine:
    """A fresh GPU machine on a fake clock, as `run_gpu_bench` sees it: each stage it starts takes
    `pace` x its real cost there (its own seconds and building the models it needs that this
    machine has not built yet), or only the timeout it was given, as `run_stage_child` kills it."""

    def __init__(self, pace: float) -> None:
        self.pace, self.now, self.built, self.started = pace, 0.0, set(), []

    def perf_counter(self) -> float:
        return self.now

    def is_built(self, preset: str) -> bool:
        return preset in self.built

    def run_stage_child(self, stage, plan, timeout_s):
        cost = stage.gpu_s + sum(S.BIG[n].build_s for n in stage.needs if S.BIG[n].preset not in self.built)
        took = self.pace * cost if timeout_s is None else min(self.pace * cost, max(timeout_s, 0.0))
        self.started.append(stage.name)
        self.now += took
        machine = {"device_name": "fake H100", "torch": "-", "transformers": "-", "python": "-", "commit": None}
        if took < self.pace * cost:
            return {"status": "timeout", "error": f"timed out after {timeout_s:.0f} s", "seconds": took,
                    "started": "-", "finished": "-", "machine": machine}
        self.built.update(S.BIG[n].preset for n in stage.needs)
        return {"status": "ok", "result": {}, "seconds": took, "started": "-", "finished": "-", "machine": machine}


def run_a_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pace: float) -> tuple[FreshMachine, int]:
    """`saccade bench gpu --lease` (not quick: the H100 estimates apply) on a `FreshMachine`."""
    machine = FreshMachine(pace)
    monkeypatch.setattr(gpu, "time", SimpleNamespace(perf_counter=machine.perf_counter))
    monkeypatch.setattr(gpu, "run_stage_child", machine.run_stage_child)
    monkeypatch.setattr(gpu, "_is_built", machine.is_built)
    code = gpu.run_gpu_bench(GpuBenchConfig(device="cpu", lease=True, out=str(tmp_path / "out"),
                                            results=str(tmp_path / "none.json")), log=lambda line: None)
    return machine, code


def test_the_lease_command_runs_the_planned_first_lease_within_its_budget(tmp_path, monkeypatch):
    """What `--lease` starts on a fresh machine, each stage taking what it is estimated to take, is
    the first lease `--list` shows (plan_leases), and it ends within the lease's budget: the
    command's own scheduling, not a sum of the estimates redone here."""
    machine, code = run_a_lease(tmp_path, monkeypatch, pace=1.0)
    first = gpu.plan_leases()[0]
    assert machine.started == list(first) and code == gpu.EXIT_PENDING  # the other leases' stages wait
    assert machine.now == sum(first.values()) <= gpu.LEASE_BUDGET_S
    assert list(first)[:4] == ["smoke", "parity-2b", "trainer-lora", "syncs"]  # the figures that matter most


@pytest.mark.parametrize("pace", [1.5, 3.0])
def test_stages_slower_than_estimated_still_end_the_lease_within_its_budget(tmp_path, monkeypatch, pace):
    """Estimates are reasoned, not measured: a stage that runs long is stopped at the budget's end
    (it gets what is left as its timeout), and no stage starts that its estimate says will not fit."""
    machine, code = run_a_lease(tmp_path, monkeypatch, pace=pace)
    assert machine.now <= gpu.LEASE_BUDGET_S and code == gpu.EXIT_PENDING
    results = json.loads((tmp_path / "out" / gpu.JSON_NAME).read_text())["stages"]
    stopped = [name for name, r in results.items() if r["status"] == "timeout"]
    assert stopped == machine.started[-1:], "no stage ran into the budget's end: pick paces that make one"
    assert machine.started[:2] == ["smoke", "parity-2b"]


def test_the_lease_budget_fits_the_command_the_device_tool_runs():
    """The stages' budget and the wheels' install fit in the time limit docs/gpu-runs.md gives the
    device tool's command (`timeout_s`), and scripts/gpu-lease.sh gives the lease the code's LEASE_S."""
    script = (ROOT / "scripts" / "gpu-lease.sh").read_text()
    limits = {int(t) for t in re.findall(r"timeout_s (\d+)", (ROOT / "docs" / "gpu-runs.md").read_text() + script)}
    assert len(limits) == 1, limits  # the page and the script name one limit
    assert f"lease_s=${{LEASE_S:-{gpu.LEASE_S}}}" in script
    install_s = 20  # the wheels' install on the machine (docs/gpu-runs.md, "The first lease")
    assert gpu.LEASE_BUDGET_S + install_s <= gpu.LEASE_S < limits.pop()


def test_every_lease_stage_is_planned_once_and_one_too_large_is_refused():
    leases = gpu.plan_leases()
    assert sorted(n for lease in leases for n in lease) == sorted(s.name for s in gpu.lease_order())
    listing = gpu.list_stages()
    assert f"--lease: {len(leases)} leases of {gpu.LEASE_BUDGET_S} s" in listing and "lease 1: " in listing
    with pytest.raises(ValueError, match="more than a whole lease"):
        gpu.plan_leases(budget_s=100)


# ----------------------------------------------------------------------------- carried results


def test_a_merge_keeps_the_figures_of_a_stage_that_passed_and_notes_a_later_failure():
    carried = gpu_results.empty(gpu_results.LEASE_SETTINGS)
    first = {"settings": gpu_results.LEASE_SETTINGS, "stages": {"smoke": record("ok", "2026-11-28T10:00:00"),
                                                                "rl": record("failed", "2026-11-28T10:01:00")}}
    merged, changed = gpu_results.merge(carried, first)
    assert changed == ["smoke", "rl"] and merged["stages"]["rl"]["status"] == "failed"
    assert gpu_results.merge(merged, first)[1] == []  # the same lease twice: nothing new
    second = {"settings": gpu_results.LEASE_SETTINGS,
              "stages": {"smoke": record("failed", "2026-11-29T10:00:00", device="NVIDIA H200"),
                         "rl": record("ok", "2026-11-29T10:01:00", device="NVIDIA H200")}}
    merged, _ = gpu_results.merge(merged, second)
    assert merged["stages"]["smoke"]["status"] == "ok" and merged["stages"]["smoke"]["last_failure"]["status"] == "failed"
    assert merged["stages"]["rl"]["status"] == "ok" and merged["stages"]["rl"]["machine"]["device_name"] == "NVIDIA H200"
    table = gpu.results_markdown(merged)
    assert "| rl |" in table and "NVIDIA H200, 2026-11-29, abc1234" in table
    assert "later failed on NVIDIA H200: last line" in table and "| parity-2b |" in table and "not run yet" in table
    # A quick or CPU run is not a GPU figure.
    with pytest.raises(ValueError, match="only `saccade bench gpu --lease` on a GPU"):
        gpu_results.merge(merged, {"settings": {"device": "cpu", "quick": True}, "stages": {}})


def test_the_committed_table_is_the_one_the_committed_results_make():
    """docs/gpu-runs.md's table is written from docs/gpu-results.json, never by hand."""
    data = gpu_results.load(ROOT / "docs" / "gpu-results.json")
    assert data["settings"] == gpu_results.LEASE_SETTINGS
    text = (ROOT / "docs" / "gpu-runs.md").read_text()
    table = text.split(gpu_results.DOC_BEGIN)[1].split(gpu_results.DOC_END)[0]
    assert table.strip() == gpu.results_markdown(data).strip()


# ----------------------------------------------------------------------------- a lease on the CPU


@pytest.mark.slow
def test_a_quick_lease_writes_each_stage_as_it_ends_and_the_next_lease_starts_after_them(tmp_path, capsys):
    results = tmp_path / "gpu-results.json"
    doc = doc_with_markers(tmp_path)
    lease = QUICK + ["--in-process", "--results", str(results), "--stage", "render", "--stage", "syncs"]
    # The first lease: in the lease's order, not the order named.
    assert main(lease + ["--out", str(tmp_path / "lease1")]) == gpu.EXIT_OK
    assert "this lease, in order: syncs, render" in capsys.readouterr().out
    one = json.loads((tmp_path / "lease1" / gpu.JSON_NAME).read_text())
    assert list(one["stages"]) == ["syncs", "render"]
    command = one["stages"]["syncs"]["command"]
    assert command.startswith("saccade bench gpu ") and " --lease" in command and "--stage render" in command

    # Recorded, the carried file and the page's table follow; the rest of the page is kept.
    assert main(["bench", "gpu", "--record", str(tmp_path / "lease1"), "--results", str(results)]) == 0
    carried = json.loads(results.read_text())
    assert carried["settings"] == {"device": "cpu", "quick": True} and list(carried["stages"]) == list(one["stages"])
    page = doc.read_text()
    assert page.startswith("# GPU runs\n\nbefore\n") and page.endswith("\nafter\n") and "old table" not in page
    assert "| syncs |" in page and "| render |" in page

    # The next lease starts after what is carried: with nothing left of these, nothing runs.
    assert main(lease + ["--out", str(tmp_path / "lease2")]) == gpu.EXIT_OK
    assert "this lease, in order: nothing left" in capsys.readouterr().out
    assert json.loads((tmp_path / "lease2" / gpu.JSON_NAME).read_text())["stages"] == {}


@pytest.mark.slow
def test_a_lease_command_killed_mid_stage_keeps_every_stage_that_ended(tmp_path):
    """The device tool kills a command at its time limit and returns what is under $OUT: the
    stages that ended are there, whole, and the carried file takes them."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SITE": str(tmp_path / "site"), "LEASE_S": "400",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu-lease.sh"), "--device", "cpu", "--quick",
                             "--results", str(tmp_path / "none.json"), "--stage", "rl", "--stage", "syncs"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    results = out / "bench-gpu" / gpu.JSON_NAME
    try:
        deadline = time.monotonic() + 300
        while not (results.exists() and "syncs" in json.loads(results.read_text())["stages"]):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "syncs never ended"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # mid-rl (or just after it): the lease is over
        proc.wait()
    data = json.loads(results.read_text())
    assert data["stages"]["syncs"]["status"] == "ok" and data["stages"].get("rl") is None
    assert "| syncs |" in (out / "bench-gpu" / gpu.MD_NAME).read_text()
    assert "[1/2] syncs: ok" in (out / "bench-gpu" / "lease-console.log").read_text()
    # Recorded, the next lease starts with rl.
    assert main(["bench", "gpu", "--record", str(out / "bench-gpu"), "--results", str(tmp_path / "carried.json")]) == 0
    names = [s.name for s in gpu.lease_stages(gpu_results.load(tmp_path / "carried.json"))]
    assert names[:4] == ["smoke", "parity-2b", "trainer-lora", "rl"] and "syncs" not in names
