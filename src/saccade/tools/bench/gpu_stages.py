"""The stages of `saccade bench gpu` (saccade.tools.bench.gpu runs them): what each measures, at the
real shapes on a GPU and at the family's tiny preset under `--quick`.

Each stage is a function of a `Plan` returning a JSON-able dict of figures, and a summary
function giving the one cell of the markdown table that the README pastes. They call the
benchmarks that exist (`bench trainer`, `bench step`, `bench distributed`, `bench render`,
`saccade.tools.parity`) with the arguments the README's GPU commands give them, so a stage
measures exactly what those commands would.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

@dataclass(frozen=True)
class Shape:
    """A real shape the stages load: its preset (random weights at those shapes, built on the GPU
    machine), the same family's tiny preset that --quick runs instead, and the seconds building it
    takes on the GPU machine's 16-core host."""

    preset: str
    quick: str
    build_s: int


# The shapes measured on a GPU, by the key a stage names. Build seconds are estimates: on this 2-core
# CPU drawing the weights was most of a build (65 s for the 2B), and on the GPU machine the real-shape
# presets draw them on the GPU (presets.builder.init_device: seconds), so what is left is the
# tokenizer and processor (~5 s), the copy to the host and the bf16 safetensors write, taken at
# ~1 GB/s with a margin: 2B 15 s, 4B 20, 8B 35, 9B 35; the MoE writes its weights twice (transformers'
# layout, then the hub's): 30 s.
BIG = {
    "2b": Shape("qwen3vl-2b", "tiny", 15),
    "4b": Shape("qwen3vl-4b", "tiny", 20),
    "8b": Shape("qwen3vl-8b", "tiny", 35),  # 8.8B, 17.5 GB
    "qwen2.5vl-3b": Shape("qwen2.5vl-3b", "qwen2.5vl-tiny", 20),
    "qwen3vl-30b-a3b-l6": Shape("qwen3vl-30b-a3b-l6", "moe-tiny", 30),
    # 9.41B parameters, 18.8 GB in bf16 (docs/families.md: 8.95B text + 0.46B tower). No smaller preset
    # has Qwen3.5's real shapes.
    "qwen3.5-9b": Shape("qwen3.5-9b", "qwen3.5-tiny", 35),
    # Not a real shape: 65M parameters, the 9B's pattern and head counts scaled down, linear heads of 64
    # (the 9B's are 128); the linear-attention stage times on it. A 0.26 GB fp32 folder and an 8192-token
    # BPE trained for it: 20 s, a guess (not timed here: the 2B's 65 s is mostly initialising 2.1B weights).
    "qwen3.5-small": Shape("qwen3.5-small", "qwen3.5-tiny", 20),
}


class NotAvailable(Exception):
    """A stage cannot run on this checkout or machine (not a failure of what it measures)."""


@dataclass(frozen=True)
class Plan:
    device: str  # "cuda" or "cpu": resolved
    quick: bool
    out: Path
    log: Callable[[str], None] = print

    def preset(self, size: str) -> str:
        return BIG[size].quick if self.quick else BIG[size].preset

    @property
    def dtype(self) -> str:
        """The production precision of the device: bf16 on a GPU, fp32 on the CPU."""
        return "bfloat16" if self.device == "cuda" else "float32"


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


# ----------------------------------------------------------------------------- models


def models(plan: Plan) -> dict[str, Any]:
    """Build (or find cached) every model the later stages load: random weights at the real
    shapes, built on this machine (a 2B folder is too large to carry), and the demo's warm start."""
    from saccade.tools.demo import resolve_model_name
    from saccade.models.presets import is_built, preset_folder

    names = ["tiny", "tiny-warm"] if plan.quick else [BIG["2b"].preset, BIG["4b"].preset, "tiny", "tiny-warm"]
    out = {}
    for name in names:
        # The warm start's folder is keyed by the demo config: found, or built, in resolve_model_name.
        cached = None if name == "tiny-warm" else is_built(preset_folder(name))
        start = time.perf_counter()
        path = Path(resolve_model_name(name))
        seconds = time.perf_counter() - start
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out[name] = {"path": str(path), "seconds": seconds, "gb": size / 1e9, "was_cached": cached}
        how = {True: "cached", False: "built", None: "ready"}[cached]
        plan.log(f"  {name}: {size / 1e9:.2f} GB, {how} in {seconds:.0f} s")
    return out


def models_summary(r: dict) -> str:
    def one(name: str, m: dict) -> str:
        how = "(cached)" if m["was_cached"] else "{} in {:.0f} s".format(
            "built" if m["was_cached"] is False else "ready", m["seconds"])
        return f"{name} {m['gb']:.2f} GB {how}"

    return "; ".join(one(name, m) for name, m in r.items())


# ----------------------------------------------------------------------------- smoke


def smoke(plan: Plan) -> dict[str, Any]:
    """The lease's first seconds: versions, the GPU, the head's matmuls, fla, imports (gpu_smoke)."""
    from saccade.tools.bench.gpu_smoke import smoke as run_smoke

    result = run_smoke(plan.device)
    plan.log("  " + smoke_summary(result))
    return result


def smoke_summary(r: dict) -> str:
    from saccade.tools.bench.gpu_smoke import smoke_summary as summary

    return summary(r)


# ----------------------------------------------------------------------------- parity


def parity_lengths(plan: Plan) -> tuple[int, ...]:
    return (64, 256) if plan.quick else (1024, 8192)


def parity(plan: Plan, size: str) -> dict[str, Any]:
    """bf16 parity of the LM-only path against the full model at long positions, beside the
    full model's own bf16-vs-fp32 noise (`saccade.tools.parity.long_context_parity`); `passed` is its
    verdict (every position bucket's mean |Δ| within NOISE_FACTOR x the noise, rotary buffers
    in fp32), and a failed verdict fails the stage's check."""
    import torch

    import saccade.tools.parity
    from saccade.models.presets import resolve_model

    fn = getattr(saccade.tools.parity, "long_context_parity", None)
    if fn is None:
        raise NotAvailable("saccade.tools.parity.long_context_parity is not in this checkout yet (merge main)")
    lengths = parity_lengths(plan)
    if plan.device == "cuda":
        # The noise floor is the full model's bf16 against its fp32: that fp32 must be IEEE fp32, also in
        # flash-linear-attention's Triton kernels, which Qwen3.5's layers take where fla imports (its dots
        # by TRITON_F32_DEFAULT, its triangular solve set explicitly to TF32: models.linear_attention).
        # A TF32 reference would widen the floor and so loosen the bar. Before any kernel compiles.
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        try:
            from saccade.models.linear_attention import fla_solve_precision

            fla_solve_precision("ieee")
        except ImportError:
            pass  # no fla: transformers' torch kernels, fp32 as torch computes it
    result = fn(resolve_model(plan.preset(size)), lengths=lengths, dtype=torch.bfloat16, device=plan.device)
    for n, r in result.get("lengths", {}).items():
        for b in r.get("buckets", []):
            plan.log(f"  {n} tokens, positions {b['start']}-{b['end']}: LM-only vs full mean {b['lm_vs_full_mean']:.2e} "
                     f"max {b['lm_vs_full_max']:.2e}; full bf16 vs fp32 mean {b['noise_mean']:.2e}; ratio "
                     f"{b['ratio']:.2f}")
    return {"preset": plan.preset(size), **result}


def parity_summary(r: dict) -> str:
    """Per length: the last position bucket's mean and max |Δ| against the noise there, and the
    worst bucket's ratio to the noise (the bar is NOISE_FACTOR); then the verdict."""
    parts = []
    for n, d in r["lengths"].items():
        last = d["buckets"][-1]
        worst = max(b["ratio"] for b in d["buckets"])
        parts.append(f"{n} tokens: at {last['start']}-{last['end']} mean {last['lm_vs_full_mean']:.1e} (max "
                     f"{last['lm_vs_full_max']:.1e}) vs noise {last['noise_mean']:.1e}, worst ratio {worst:.2f}")
    rotary = f"; rotary buffers not fp32: {', '.join(r['rotary_not_fp32'])}" if r.get("rotary_not_fp32") else ""
    return (f"{r['preset']} {r['dtype']}: " + "; ".join(parts) + rotary
            + f"; bar ratio <= {r['noise_factor']:g}: {'pass' if r['passed'] else 'FAIL'}")


# ----------------------------------------------------------------------------- trainer


# The trainer stages at the shipped configs' size, not a toy's: their micro-batches of 8,192 tokens
# (trainer.max_tokens), and a step of 96 conversations of 1-3 images of sides up to 896 px, their area
# capped at the preset's 448^2 (~33k tokens, four or five micro-batches), so that an H100 is
# compute-bound (an MFU that says something of the trainer) and the peak holds a full micro-batch's
# activations, not only the weights.
TRAINER_SIZE = dict(batch=96, max_tokens=8192, max_side=896, steps=3)


def trainer(plan: Plan, size: str, *, full_finetune: bool) -> dict[str, Any]:
    """`bench trainer` at a real shape (`BIG[size]`): tokens/s, MFU, peak memory against saccade
    memory's estimate."""
    from saccade.tools.bench.trainer import format_report, run_trainer_bench
    from saccade.config.bench import TrainerBenchConfig

    # --quick: the memory processes (three fresh interpreters) are left out: seconds here, not figures.
    sizes = dict(steps=1, batch=2, max_side=64, measure_memory=False) if plan.quick else TRAINER_SIZE
    result = run_trainer_bench(TrainerBenchConfig(preset=plan.preset(size), device=plan.device,
                                                  full_finetune=full_finetune, **sizes))
    plan.log(format_report(result))
    return result


def trainer_summary(r: dict) -> str:
    c = r["config"]
    mfu = f", MFU {r['cached_mfu']:.1%}" if r.get("cached_mfu") else ""
    peak = (f"; peak {r['cached_peak_mb'] / 1024:.1f} GiB, saccade memory {r['estimated_cached_peak_mb'] / 1024:.1f} "
            f"GiB (x{r['estimate_over_measured']['cached']:.2f}, {r['estimate_flag']})"
            if "cached_peak_mb" in r else
            f"; estimate {r['estimated_cached_peak_mb'] / 1024:.2f} GiB (peak not measured)")
    return (f"{c['preset']} {'full FT' if c['full_finetune'] else 'LoRA'} {c['dtype']}: {r['cached_tokens_per_s']:,.0f} "
            f"tokens/s{mfu}, {r['cached_tflops']:.1f} TFLOP/s; full VLM {r['full_over_cached_step_time']:.2f}x the "
            f"step{peak}")


# ----------------------------------------------------------------------------- step


def step(plan: Plan) -> dict[str, Any]:
    """`bench step` on the device: one RL step part by part against HF's own path."""
    from saccade.tools.bench.step import format_step_report, run_step_bench
    from saccade.config.bench import StepBenchConfig

    if plan.quick:
        cfg = StepBenchConfig(preset="tiny", steps=1, device=plan.device, dtype=plan.dtype, prompts=2)
    else:
        cfg = StepBenchConfig(preset=BIG["2b"].preset, image_size=448, lora=True, steps=3, device=plan.device,
                              dtype=plan.dtype)
    result = run_step_bench(cfg, log=plan.log)
    plan.log(format_step_report(result))
    return result


def step_summary(r: dict) -> str:
    return (f"{r['preset']} {r['image_size']} px {'LoRA' if r['lora'] else 'full FT'} {r['dtype']}: saccade "
            f"{r['saccade_s']:.2f} s/step (rollout {r['saccade_rollout_s']:.2f}, train {r['saccade_train_s']:.2f}), "
            f"HF reference {r['reference_s']:.2f} s: {r['ratio']:.2f}x; trainer {r['trainer_tokens_per_s']:,.0f} tokens/s")


# ----------------------------------------------------------------------------- RL steps


def rl(plan: Plan) -> dict[str, Any]:
    """RL steps on the device that train: the demo config from its warm start (tiny-warm, whose
    answers are spread over the choices, so groups carry reward variance), in the device's
    precision, with held-out greedy accuracy before and after."""
    import tempfile

    from saccade.config import RunConfig, load_config
    from saccade.tools.demo import demo_config_path, resolve_model_name
    from saccade.orchestrator.evaluation import evaluate
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl
    from saccade.run.setup import build_setup
    from saccade.run.tasks import task_from_config

    steps, prompts, eval_size, every = (2, 4, 4, 0) if plan.quick else (60, 32, 64, 20)
    with tempfile.TemporaryDirectory(prefix="saccade-bench-rl-") as tmp:
        cfg = load_config(RunConfig, demo_config_path(), [
            "--model.path", resolve_model_name("tiny-warm"), "--model.dtype", plan.dtype, "--trainer.device", plan.device,
            "--trainer.steps", str(steps), "--rollout.prompts_per_step", str(prompts),
            "--eval.prompts", str(eval_size), "--eval.every_steps", str(every), "--checkpoint.every_steps", "0",
            "--log.dir", tmp])
        setup = build_setup(cfg, cfg.run_dir)
        task = task_from_config(cfg)
        held_out = task.eval_samples(eval_size)
        before = evaluate(setup, task, held_out, max_tokens=cfg.sampling.max_tokens)["accuracy"]
        plan.log(f"  held-out accuracy before: {before:.3f} ({eval_size} questions); {steps} RL steps")
        start = time.perf_counter()
        train_rl(cfg, run_dir=cfg.run_dir, setup=setup, task=task, progress=False)
        train_s = time.perf_counter() - start
        after = evaluate(setup, task, held_out, max_tokens=cfg.sampling.max_tokens)["accuracy"]
        rows = read_metrics(cfg.run_dir, phase="train")
        evals = [(r["step"], r["accuracy"]) for r in read_metrics(cfg.run_dir, phase="eval")]
    window = max(1, min(5, len(rows) // 2))
    mean = lambda key, part: statistics.fmean(r[key] for r in part) if part else None  # noqa: E731
    step_s = [r["step_s"] for r in rows]
    return {
        "model": "tiny-warm", "dtype": plan.dtype, "device": plan.device, "steps": len(rows), "prompts": prompts,
        "group_size": cfg.rollout.group_size, "eval_size": eval_size,
        "steps_with_signal": sum(1 for r in rows if r.get("groups_kept_frac", 0) > 0),
        "reward_first": mean("reward_mean", rows[:window]), "reward_last": mean("reward_mean", rows[-window:]),
        "reward_window": window,
        "accuracy_before": before, "accuracy_after": after, "eval_curve": evals,
        "s_per_step": statistics.median(step_s[1:] or step_s), "first_step_s": step_s[0], "train_s": train_s,
        "mismatch_abs": mean("mismatch_abs", [r for r in rows if r.get("mismatch_abs") is not None]),
        "cuda_peak_mb": max((r.get("cuda_peak_mb") or 0.0) for r in rows) or None,
        "per_step": [{k: r.get(k) for k in ("step", "reward_mean", "groups_kept_frac", "accuracy", "step_s",
                                            "mismatch_abs")} for r in rows],
    }


def rl_summary(r: dict) -> str:
    return (f"{r['model']} {r['dtype']}, {r['steps']} steps x {r['prompts']} prompts x G={r['group_size']}: "
            f"{r['steps_with_signal']}/{r['steps']} steps with signal, reward {_fmt(r['reward_first'], '.2f')} -> "
            f"{_fmt(r['reward_last'], '.2f')} (first/last {r['reward_window']}), held-out "
            f"{r['accuracy_before']:.2f} -> {r['accuracy_after']:.2f}, {r['s_per_step']:.2f} s/step, mismatch "
            f"{_fmt(r['mismatch_abs'], '.1e')}")


# ----------------------------------------------------------------------------- FSDP2


def fsdp(plan: Plan) -> dict[str, Any]:
    """`bench distributed --nproc 1` (torchrun, NCCL on CUDA, gloo on the CPU) at 2B shapes, LoRA
    and full fine-tuning: per-rank state, step time, export, peak against saccade memory."""
    from saccade.tools.bench.distributed import LOSS_TOKENS, SAMPLES, format_distributed_report, run_distributed_bench
    from saccade.config.bench import DistributedBenchConfig
    from saccade.tools.memory import trainer_memory
    from saccade.tools.memory_dims import model_dims
    from saccade.models.presets import resolve_model

    preset = plan.preset("2b")
    seq_len, max_tokens = (64, 256) if plan.quick else (256, 1024)
    out: dict[str, Any] = {"preset": preset, "backend": "nccl" if plan.device == "cuda" else "gloo"}
    # --quick: LoRA only (each is a torchrun launch, most of the stage's time on a CPU).
    for name, lora in (("lora", True),) if plan.quick else (("lora", True), ("full", False)):
        r = run_distributed_bench(DistributedBenchConfig(nproc=1, preset=preset, lora=lora, steps=1 if plan.quick else 3,
                                                         seq_len=seq_len, max_tokens=max_tokens, device=plan.device))
        plan.log(format_distributed_report(r))
        w = r["world1"]
        # What `saccade memory --world-size 1` says of this shape: the bench trains in float32.
        est = trainer_memory(model_dims(resolve_model(preset)), dtype="float32", lora_rank=16 if lora else None,
                             max_tokens=max_tokens, loss_fraction=LOSS_TOKENS / seq_len, world_size=1, fsdp=True)
        r.update(tokens_per_s=SAMPLES * seq_len / w["step_s"],
                 estimated_peak_mb=(est.total - est.get("CUDA context")) * 1024)
        if w.get("cuda_peak_mb"):
            r["estimate_over_measured"] = r["estimated_peak_mb"] / w["cuda_peak_mb"]
        out[name] = r
    return out


def fsdp_summary(r: dict) -> str:
    def one(name: str) -> str:
        d = r[name]
        w = d["world1"]
        peak = (f", peak {w['cuda_peak_mb'] / 1024:.1f} GiB vs estimate {d['estimated_peak_mb'] / 1024:.1f}"
                if w.get("cuda_peak_mb") else "")
        return f"{name}: {w['step_s']:.2f} s/step, {d['tokens_per_s']:,.0f} tokens/s, export {w['export_s']:.1f} s{peak}"

    return f"{r['preset']} fp32, world 1 ({r['backend']}): " + "; ".join(one(n) for n in ("lora", "full") if n in r)


def fsdp_bf16(plan: Plan) -> dict[str, Any]:
    """FSDP2 mixed precision (bf16 compute, fp32 shards and reduction) against fp32: RL steps
    from the warm start under torchrun at world 1."""
    from saccade.tools.bench.fsdp_precision import format_precision_report, run_precision_bench
    from saccade.config.bench import PrecisionBenchConfig

    result = run_precision_bench(PrecisionBenchConfig(device=plan.device, nproc=1, steps=2 if plan.quick else 5,
                                                      prompts=4 if plan.quick else 32))
    plan.log(format_precision_report(result))
    return result


def fsdp_bf16_summary(r: dict) -> str:
    def one(d: str) -> str:
        return (f"{d} {r[f'{d}_steps_with_signal']}/{r['steps']} with signal, reward "
                f"{_fmt(r[f'{d}_reward_first_half'], '.2f')} -> {_fmt(r[f'{d}_reward_second_half'], '.2f')}, "
                f"mismatch {_fmt(r[f'{d}_mismatch_abs'], '.1e')}, {_fmt(r[f'{d}_step_s'], '.2f')} s/step")

    return f"{r['model']}, {r['steps']} steps each: " + "; ".join(one(d) for d in ("bfloat16", "float32"))


# ----------------------------------------------------------------------------- render, syncs


def render(plan: Plan) -> dict[str, Any]:
    """`bench render` on the device (and on this machine's CPU beside it, on a GPU)."""
    from saccade.tools.bench.render import format_render_report, run_render_bench
    from saccade.config.bench import RenderBenchConfig

    kwargs = dict(size=32, renders=4, rooms=2) if plan.quick else dict(size=256, renders=64, rooms=8)
    out = {"device": run_render_bench(RenderBenchConfig(device=plan.device, **kwargs))}
    if plan.device == "cuda":
        out["cpu"] = run_render_bench(RenderBenchConfig(device="cpu", **kwargs))
    for r in out.values():
        plan.log(format_render_report(r))
    return out


def render_summary(r: dict) -> str:
    d = r["device"]
    text = (f"{d['size']} px on {d['device']}: {d['cold_renders_per_s']:.0f} renders/s cold, "
            f"{d['cached_renders_per_s']:.0f} cached")
    if "cpu" in r:
        text += f"; CPU ({r['cpu']['threads']} threads) {r['cpu']['cold_renders_per_s']:.0f} cold"
    return text


def syncs(plan: Plan) -> dict[str, Any]:
    """Host syncs per decoded token (embedded engine) and per trainer micro-batch."""
    from saccade.tools.bench.syncs import format_sync_report, run_sync_bench

    result = run_sync_bench(device=plan.device, short=2 if plan.quick else 16, long=6 if plan.quick else 48,
                            prompts=2 if plan.quick else 4, micro_batches=1 if plan.quick else 2, log=plan.log)
    plan.log(format_sync_report(result))
    return result


def syncs_summary(r: dict) -> str:
    def one(d: dict) -> str:
        return (f"{d['syncs']:.2f} syncs" if d["syncs"] is not None else "") + \
            f"{', ' if d['syncs'] is not None else ''}{d['would_sync']:.2f} would-sync ops"

    return (f"{r['device']} {r['dtype']}: per decoded token {one(r['per_token'])} (the engine checks for stops "
            f"every {r['stop_check_every']} token(s)); per trainer micro-batch "
            f"{one(r['per_micro_batch'])} (+ {one(r['per_micro_batch_to_device'])} moving it to the device)")


# ----------------------------------------------------------------------------- linear attention


def linear_attention(plan: Plan) -> dict[str, Any]:
    """Qwen3.5's packed rows through its Gated DeltaNet layers on the device
    (saccade.tools.bench.linear_attention): on qwen3.5-tiny in fp32, a packed micro-batch with images and
    shared prompts on the kernels `choose_kernels` picks (fla's varlen kernels on CUDA) against each
    sample alone on the torch kernels, logprobs and every parameter's gradient at the CPU tests' bars,
    failed if fla was expected and not used; then forward + backward of a GRPO group, varlen against
    padded, at qwen3.5-small's shapes in the device's precision (--quick: qwen3.5-tiny, a short group)."""
    import torch

    from saccade.tools.bench.linear_attention import grpo_timing, packing_check
    from saccade.models.presets import resolve_model

    check = packing_check(resolve_model("qwen3.5-tiny"), device=plan.device)
    plan.log(f"  kernels: {check['kernels']}" + "".join(f"\n  log: {line}" for line in check["kernel_log"]))
    solve = check.get("fla_solve_precision") or {}
    plan.log(f"  fla: {check['fla']}; Triton's fp32 dots: {check['triton_f32_default'] or 'its default'}; fla's "
             f"triangular solve: {solve.get('used') or '-'} (fla's own: {solve.get('fla_default') or '-'})")
    plan.log(f"  {check['segments']} segments ({check['tokens']} tokens, {check['alone_tokens']} alone; "
             f"{check['images']} images, {check['shared_prompts']} shared prompts) vs each sample alone on the torch kernels: logprobs max "
             f"|Δ| {check['logprob_max_abs']:.2e} (bar {check['logprob_bar']:g}), gradients max "
             f"{check['grad_max_rel']:.2e} of max(1, |g|) ({check['grad_worst']}; bar {check['grad_bar']:g})")
    if check["kernel_error"]:
        plan.log(f"  CHECK FAILED: {check['kernel_error']}")
    shape = dict(prompt=100, group=4, completions=(20, 40), repeats=1) if plan.quick else \
        dict(prompt=1024, group=16, completions=(128, 512), repeats=5)
    dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    timing = grpo_timing(resolve_model(plan.preset("qwen3.5-small")), device=plan.device, dtype=dtype, **shape)
    for name, ms in timing["ms"].items():
        plan.log(f"  {name}: {ms:.1f} ms")
    return {"check": check, "timing": timing, "passed": check["passed"]}


def linear_attention_summary(r: dict) -> str:
    c, t = r["check"], r["timing"]
    preset = Path(t["model"]).name.split("-seed")[0]
    fla = "" if not c.get("kernel_error") else f" ({c['kernel_error']})"
    solve = c.get("fla_solve_precision") or {}
    if solve.get("used"):
        fla += f" (solve in {solve['used']}, fla's own {solve['fla_default']})"
    return (f"{c['kernels']}{fla}; qwen3.5-tiny fp32, {c['segments']} segments with images and "
            f"{c['shared_prompts']} shared prompts vs alone on torch: logprobs {c['logprob_max_abs']:.1e} (bar "
            f"{c['logprob_bar']:g}), gradients {c['grad_max_rel']:.1e} (bar {c['grad_bar']:g}): "
            f"{'pass' if c['passed'] else 'FAIL'}; {preset} {t['dtype']}, GRPO group of {t['group']} "
            f"(prompt {t['prompt']}): padded (torch) / varlen {t['whole_padded_over_varlen']:.2f}x whole, "
            f"{t['shared_padded_over_varlen']:.2f}x shared ({t['ms']['shared, varlen']:.0f} ms varlen)")
