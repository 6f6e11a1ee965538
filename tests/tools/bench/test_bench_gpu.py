"""`saccade bench gpu`: every stage runs under `--device cpu --quick`, results resume, failures
are recorded and the next stage still runs, the budget leaves stages for the next run."""

from __future__ import annotations

import json

import pytest

from saccade.tools.bench import gpu
from saccade.tools.bench import linear_attention as la_bench
from saccade.cli import main
from saccade.config.bench import GpuBenchConfig
from saccade.models.linear_attention import TORCH_VARLEN


@pytest.mark.long  # 230 s on two cores: the default suite's slowest test (2026-12-07, --durations)
def test_every_stage_runs_quick_on_the_cpu_and_a_second_run_resumes(tmp_path):
    args = ["bench", "gpu", "--device", "cpu", "--quick", "--in-process", "--out", str(tmp_path)]
    assert main(args) == gpu.EXIT_OK
    data = json.loads((tmp_path / gpu.JSON_NAME).read_text())
    assert data["settings"] == {"device": "cpu", "quick": True}
    assert list(data["stages"]) == [s.name for s in gpu.STAGES]
    for name, record in data["stages"].items():
        assert record["status"] == "ok" and record.get("check") != "failed", (name, record.get("error"))
        assert record["seconds"] >= 0 and record["machine"]["torch"]
    table = (tmp_path / gpu.MD_NAME).read_text()
    assert "not run yet" not in table and "FAILED" not in table
    assert all(f"| {s.name} |" in table for s in gpu.STAGES)
    smoke = data["stages"]["smoke"]["result"]  # the lease's first stage: every module imports, the matmuls hold
    assert smoke["passed"] and smoke["imports"]["modules"] > 100 and not smoke["imports"]["failed"]
    assert smoke["matmul"]["upcast_rel"] <= smoke["matmul"]["bar"] and smoke["versions"]["torch"]
    rl = data["stages"]["rl"]["result"]
    assert rl["steps_with_signal"] >= 1  # the warm start's groups carry reward variance
    syncs = data["stages"]["syncs"]["result"]
    assert syncs["per_token"]["syncs"] is None and syncs["per_token"]["would_sync"] >= 0
    for name, preset in (("parity-2b", "tiny"), ("parity-qwen2.5vl-3b", "qwen2.5vl-tiny"),
                         ("parity-qwen3vl-30b-a3b-l6", "moe-tiny"), ("parity-qwen3.5-9b", "qwen3.5-tiny")):
        parity = data["stages"][name]["result"]
        assert parity["passed"] and list(parity["lengths"]) == ["64", "256"] and parity["preset"] == preset
    # Each family's trainer stage ran its own tiny preset (--quick), the MoE's experts with LoRA.
    trainers = {n: data["stages"][n]["result"]["config"] for n in ("trainer-lora-qwen2.5vl-3b",
                                                                    "trainer-lora-qwen3vl-30b-a3b-l6",
                                                                    "trainer-lora-qwen3.5-9b")}
    assert [c["preset"] for c in trainers.values()] == ["qwen2.5vl-tiny", "moe-tiny", "qwen3.5-tiny"]
    assert not any(c["full_finetune"] for c in trainers.values())
    # Qwen3.5's packed rows on the CPU: the shared prompts take the torch varlen kernels (fla needs CUDA),
    # exact against each sample alone; the timing ran both paths.
    linear = data["stages"]["linear-attention"]["result"]
    check, timing = linear["check"], linear["timing"]
    assert check["kernels"] == TORCH_VARLEN.name and not check["fla_used"] and check["kernel_error"] is None
    assert check["shared_prompts"] >= 1 and check["images"] >= 1 and check["tokens"] < check["alone_tokens"]
    assert check["passed"] and check["logprob_max_abs"] <= 1e-5 and check["grad_max_rel"] <= 5e-5
    assert check["linear_attn_grad_max_rel"] is not None
    assert timing["varlen_kernels"] == TORCH_VARLEN.name and timing["shared_padded_over_varlen"] > 0

    # Run again: what finished is skipped, its record kept as it was.
    assert main(args) == gpu.EXIT_OK
    again = json.loads((tmp_path / gpu.JSON_NAME).read_text())
    for name in gpu.BY_NAME:
        assert again["stages"][name]["finished"] == data["stages"][name]["finished"]


@pytest.mark.slow
def test_a_stage_in_its_own_process_comes_back_as_a_record(tmp_path):
    """The default on a GPU: each stage in a fresh interpreter, its record handed back."""
    assert main(["bench", "gpu", "--device", "cpu", "--quick", "--out", str(tmp_path), "--stage", "render"]) == 0
    data = json.loads((tmp_path / gpu.JSON_NAME).read_text())
    assert list(data["stages"]) == ["render"] and data["stages"]["render"]["status"] == "ok"
    assert "renders/s" in (tmp_path / gpu.LOG_NAME).read_text()
    assert not list(tmp_path.glob(".*.record.json"))


def test_a_failed_stage_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    def boom(plan):
        raise RuntimeError("out of memory, say")

    stages = (gpu.Stage("boom", "fails", boom, lambda r: "", 1),
              gpu.Stage("fine", "works", lambda plan: {"x": 1}, lambda r: f"x = {r['x']}", 1))
    monkeypatch.setattr(gpu, "STAGES", stages)
    monkeypatch.setattr(gpu, "BY_NAME", {s.name: s for s in stages})
    args = ["bench", "gpu", "--device", "cpu", "--quick", "--in-process", "--out", str(tmp_path)]
    assert main(args) == gpu.EXIT_FAILED
    data = json.loads((tmp_path / gpu.JSON_NAME).read_text())
    assert data["stages"]["boom"]["status"] == "failed" and "out of memory, say" in data["stages"]["boom"]["error"]
    assert data["stages"]["fine"]["status"] == "ok"
    table = (tmp_path / gpu.MD_NAME).read_text()
    assert "| boom | fails | **FAILED**: RuntimeError: out of memory, say |" in table and "x = 1" in table
    # Not retried unless named: GPU time is short and a failure needs a fix first.
    finished = data["stages"]["boom"]["finished"]
    assert main(args) == gpu.EXIT_FAILED
    assert json.loads((tmp_path / gpu.JSON_NAME).read_text())["stages"]["boom"]["finished"] == finished
    assert main(args + ["--stage", "boom"]) == gpu.EXIT_FAILED
    assert json.loads((tmp_path / gpu.JSON_NAME).read_text())["stages"]["boom"]["finished"] >= finished


def test_the_budget_leaves_stages_for_the_next_run(tmp_path, capsys):
    # Not quick: the H100 estimates apply, and none of them fits in 1 s.
    assert main(["bench", "gpu", "--device", "cpu", "--out", str(tmp_path), "--budget", "1"]) == gpu.EXIT_PENDING
    assert "run the same command again" in capsys.readouterr().out
    assert json.loads((tmp_path / gpu.JSON_NAME).read_text())["stages"] == {}
    # A folder holds one kind of run: quick results never mix with real ones.
    with pytest.raises(ValueError, match="give another --out"):
        gpu.run_gpu_bench(GpuBenchConfig(device="cpu", quick=True, out=str(tmp_path)))


def test_the_stage_list_adds_up_to_the_gpu_budget():
    listing = gpu.list_stages()
    total = int(next(line for line in listing.splitlines() if line.startswith("all ")).split()[1])
    assert all(s.name in listing for s in gpu.STAGES)
    seconds = gpu.listed_seconds()
    assert total == sum(seconds.values())
    by_family = {f: sum(seconds[s.name] for s in gpu.STAGES if s.family == f) for f in {s.family for s in gpu.STAGES}}
    assert set(by_family) == {"Qwen3-VL", "Qwen2.5-VL", "Qwen3-VL-MoE", "Qwen3.5"}
    # Every stage, with the builds of all it loads (a fresh machine), fits one lease's budget: a stage
    # whose estimate never fits would be left for the next run forever (tests/tools/bench/test_gpu_lease.py
    # has the leases' arithmetic).
    for stage in gpu.STAGES:
        assert stage.gpu_s + sum(gpu.S.BIG[n].build_s for n in stage.needs) <= gpu.LEASE_BUDGET_S, stage.name


def test_each_family_stage_runs_its_familys_code_at_real_shapes_and_its_tiny_preset_quick():
    from saccade.models.presets import preset_family

    plan = lambda quick: gpu.S.Plan(device="cpu", quick=quick, out=None)  # noqa: E731
    for stage in gpu.STAGES:
        for size in stage.needs:
            real, quick = plan(False).preset(size), plan(True).preset(size)
            assert preset_family(real) is preset_family(quick), (stage.name, real, quick)
            if stage.family != "Qwen3-VL":
                assert preset_family(real).name == stage.family, (stage.name, real)
            if stage.name.startswith(("parity-", "trainer-lora-")) and stage.family != "Qwen3-VL":
                assert real in stage.name


def test_a_stage_the_budget_stops_runs_first_next_time_then_fails(tmp_path):
    """Stopped at the budget's end: `timeout`, run again first next time; stopped again with
    the whole budget, it has failed (longer than one invocation can take)."""
    args = ["bench", "gpu", "--device", "cpu", "--quick", "--out", str(tmp_path), "--stage", "render",
            "--budget", "1"]
    assert main(args) == gpu.EXIT_PENDING
    record = json.loads((tmp_path / gpu.JSON_NAME).read_text())["stages"]["render"]
    assert record["status"] == "timeout" and "timed out after 1 s" in record["error"]
    assert main(args) == gpu.EXIT_FAILED
    record = json.loads((tmp_path / gpu.JSON_NAME).read_text())["stages"]["render"]
    assert record["status"] == "failed" and "longer than the whole budget (1 s) twice" in record["error"]


def test_the_linear_attention_check_fails_off_its_bars_or_off_fla_on_cuda():
    """The linear-attention stage's verdict: both CPU bars, and on CUDA the packed row on
    flash-linear-attention (not installed, or installed and not importing, fails it, saying which)."""
    assert la_bench.verdict(1e-5, 5e-5, None) and not la_bench.verdict(1.1e-5, 0.0, None)
    assert not la_bench.verdict(0.0, 5.1e-5, None) and not la_bench.verdict(0.0, 0.0, "no fla")
    absent = {"installed": False, "imports": False, "error": None}
    broken = {"installed": True, "imports": False, "error": "ImportError: triton"}
    working = {"installed": True, "imports": True, "error": None}
    assert la_bench.missed_fla("cpu", False, absent) is None and la_bench.missed_fla("cuda", True, working) is None
    assert "gpu-wheels.sh" in la_bench.missed_fla("cuda", False, absent)
    assert "ImportError: triton" in la_bench.missed_fla("cuda", False, broken)
    assert "did not pick it" in la_bench.missed_fla("cuda", False, working)
    # On the CPU fla is never expected; where it is not installed, nothing tries to import it.
    status = la_bench.fla_status("cpu")
    assert status["expected"] is False
    if not status["installed"]:
        assert status == {"installed": False, "imports": False, "error": None, "expected": False}
