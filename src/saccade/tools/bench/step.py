"""One RL step, timed part by part, against HF transformers' own path on the same batch.

`saccade bench step` runs the demo config's GRPO step (8 prompts x G=8, at most 8 new tokens,
one shapes image per prompt) as `saccade rl` runs it, by construction: the loop's own
`saccade.loops.rl_step.RLStep`, built by the same call (rollouts scored by `sample_step` on the embedded
engine, `rank_micro_batches`, `train_step`), then the weight sync. Every part is timed where it
runs (`saccade.timing`), so the breakdown adds up to the step:

- rollout: env (prompt messages), templating (the chat template), image_prep (image checks,
  resizing and patchifying), encode (the frozen tower, once per new image), prefill, decode,
  rewards, samples (training samples, advantages, metrics);
- train: pack (micro-batches onto the device), forward (the language model), logprobs (the
  lm_head on the loss tokens), loss, backward, optimizer (clip and AdamW);
- weight_sync; "other" is the step's time no part covers.

The reference, in the same process and interleaved step by step (the order alternates), is
what TRL's GRPOTrainer runs inside on the same prompts with transformers alone: the processor
on the repeated prompts (prep), `generate` on all 64 rows (the vision tower and the prefill
per row), the processor again, then one padded forward of the full model from the pixels
(lm_head on the completion positions only, as TRL's `logits_to_keep`), backward, and an
AdamW step. Same LoRA (or full fine-tuning of the language model, the tower frozen), same
tokens. `ratio` is reference_s / saccade_s: how many times faster saccade's step is.

Simplified on purpose: the prompts (and their images) are read before the steps for both
sides, from the run's prompt stream, as a data loader would; new prompts every step, so the
tower runs every step. Nothing around the step is timed (metrics, evaluation, checkpoints). The
random model earns no reward, so advantages are 0 on both sides; the work does not depend
on them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from saccade.tools.bench.reference import GROUP, LORA_RANK, NEW_TOKENS
from saccade.config.bench import StepBenchConfig

# Speed-ups asked of saccade's step over the reference (issue 15), by shape.
GOALS = {("tiny", 64, False): 2.0, ("small", 64, False): 1.5, ("small", 448, True): 3.0}
ROLLOUT_PARTS = ("env", "templating", "image_prep", "encode", "prefill", "decode", "rewards", "samples")
TRAIN_PARTS = ("pack", "forward", "logprobs", "loss", "backward", "optimizer")
# What the issue counts as overhead: neither the model nor the tower.
OVERHEAD_PARTS = ("env", "templating", "image_prep", "rewards", "samples", "pack", "loss", "other")


def bench_config(bench: StepBenchConfig, run_dir: Path):
    """The demo config at the bench's shape (its preset, image size, LoRA or not, device, dtype,
    prompts; `max_tokens`: another micro-batch budget)."""
    from saccade.config import ImagesConfig, RunConfig, load_config
    from saccade.tools.demo import demo_config_path

    max_pixels = max(ImagesConfig().max_pixels, bench.image_size * bench.image_size)
    return load_config(RunConfig, demo_config_path(), [
        "--model.path", bench.preset, "--trainer.device", bench.device, "--model.dtype", bench.dtype,
        "--rollout.prompts_per_step", str(bench.prompts), "--rollout.group_size", str(GROUP),
        "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", str(NEW_TOKENS),
        "--loss.max_completion_tokens", str(NEW_TOKENS), "--task.image_size", str(bench.image_size),
        "--images.max_pixels", str(max_pixels), "--eval.every_steps", "0", "--checkpoint.every_steps", "0",
        "--lora", str(bench.lora).lower(),
        *(["--lora.rank", str(LORA_RANK), "--lora.alpha", str(2 * LORA_RANK)] if bench.lora else []),
        "--log.dir", str(run_dir),
        *(["--trainer.max_tokens", str(bench.max_tokens)] if bench.max_tokens else []),
    ])


class SaccadeStep:
    """`saccade rl`'s step: the loop's own `RLStep`, built as `train_rl` builds it (the effective
    loss, the run's optimizer, sampling and prompt seeds), and the weights pushed to the engine
    after, as the loop does every step. The prompts are read beforehand from the run's prompt
    stream (`rows`), as a data loader would, so the reference gets the same ones."""

    def __init__(self, cfg, run_dir: Path):
        from saccade.loops.rl_step import RLStep
        from saccade.run.setup import build_setup
        from saccade.run.tasks import task_from_config

        self.cfg = cfg
        self.setup = build_setup(cfg, run_dir)
        self.rl = RLStep.build(cfg, self.setup, task_from_config(cfg))
        self.stream = self.rl.prompt_stream(run_dir)
        self.steps = 0  # taken so far: the next step's index, and the version of the weights it samples from

    def rows(self, step: int):
        """The prompts of `step`, the stream's next ones (`saccade.data.rows.StepRows`)."""
        return self.stream.take(self.cfg.rollout.prompts_per_step, step=step + 1)

    def messages(self, prompts: list) -> list[list[dict]]:
        """The prompts' opening messages, as the task's environment gives them to the engine."""
        return [self.rl.task.make_env().reset(p) for p in prompts]

    def __call__(self, rows) -> dict[str, float]:
        """One step on these rows; returns tokens trained on and completion tokens sampled."""
        from saccade.timing import timed

        step, self.steps = self.steps, self.steps + 1
        rollouts = self.rl.sample(step, rows)
        metrics = self.rl.train(step, rollouts)
        with timed("weight_sync"):
            self.setup.engine.update_weights(version=step + 1)
        return {"train_tokens": metrics["train_tokens"], "forward_tokens": metrics["forward_tokens"],
                "completion_tokens": rollouts.batch.metrics["completion_tokens"],
                "micro_batches": metrics["micro_batches"]}


def _timed_step(step, inputs, device: torch.device) -> tuple[float, dict[str, float], dict[str, float]]:
    from saccade.timing import breakdown

    with breakdown(device) as parts:
        start = time.perf_counter()
        counts = step(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        total = time.perf_counter() - start
    parts = dict(parts)
    parts["other"] = max(0.0, total - sum(parts.values()))
    return total, parts, counts


def _median_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for r in runs for k in r})
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in names}


def _trace(step, inputs, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        step(inputs)
    prof.export_chrome_trace(str(path))
    path.with_suffix(".txt").write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))


def run_step_bench(bench: StepBenchConfig, *, log=print) -> dict[str, Any]:
    """Median step times of saccade and of the reference, the ratio, and saccade's breakdown
    (`StepBenchConfig`: the shape, the steps, the device; `trace`: a profiler trace of each side)."""
    from saccade.tools.bench.reference import ReferenceStep
    from saccade.models.loading import load_processor

    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(bench, Path(tmp))
        preset, image_size, lora, trace_dir = bench.preset, bench.image_size, bench.lora, bench.trace
        log(f"building saccade's step and the reference on preset {preset!r}, {image_size}px images, "
            f"{'LoRA r%d' % LORA_RANK if lora else 'full fine-tuning'}")
        ours = SaccadeStep(cfg, Path(tmp))
        dev = ours.setup.device
        reference = ReferenceStep(ours.setup.model_path, load_processor(ours.setup.model_path), cfg.images,
                                  lora=lora, dtype=getattr(torch, cfg.model.dtype), device=dev, seed=cfg.trainer.seed)
        results: dict[str, list] = {"saccade": [], "reference": []}
        for k in range(bench.steps + 1):  # step 0 warms up both
            rows = ours.rows(k)
            order = [("saccade", ours), ("reference", reference)]
            inputs = {"saccade": rows, "reference": ours.messages(rows.prompts)}
            for name, step in order if k % 2 == 0 else order[::-1]:
                total, parts, counts = _timed_step(step, inputs[name], dev)
                if k:
                    results[name].append((total, parts, counts))
            if k:
                log(f"step {k}: saccade {results['saccade'][-1][0]:.2f} s, reference "
                    f"{results['reference'][-1][0]:.2f} s")
        if trace_dir:
            out = Path(trace_dir)
            out.mkdir(parents=True, exist_ok=True)
            rows = ours.rows(bench.steps + 1)
            _trace(ours, rows, out / "saccade_step.json")
            _trace(reference, ours.messages(rows.prompts), out / "reference_step.json")
            log(f"traces in {out}: saccade_step.json, reference_step.json (chrome://tracing, Perfetto)")
    return summarize(results, preset=preset, image_size=image_size, lora=lora, device=str(dev), prompts=bench.prompts,
                     max_tokens=cfg.trainer.max_tokens, micro_batches=results["saccade"][0][2]["micro_batches"],
                     dtype=cfg.model.dtype, image_tokens=_image_tokens(ours, rows.prompts), trace_dir=trace_dir)


def _image_tokens(ours: SaccadeStep, prompts: list) -> int:
    from saccade.data.messages import messages_to_inputs

    inputs = messages_to_inputs(ours.messages(prompts[:1])[0], ours.setup.processor, limits=ours.cfg.images)
    return int(inputs.mm_token_type_ids.sum())


def summarize(results: dict[str, list], **shape) -> dict[str, Any]:
    """Medians, the ratio, the breakdown and the tokens/s of each side's training."""
    ours, ref = results["saccade"], results["reference"]
    saccade_s = statistics.median(r[0] for r in ours)
    reference_s = statistics.median(r[0] for r in ref)
    parts = _median_parts([r[1] for r in ours])
    ref_parts = _median_parts([r[1] for r in ref])
    train_s = sum(parts.get(p, 0.0) for p in TRAIN_PARTS)
    ref_train_s = sum(ref_parts.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
    train_tokens = statistics.median(r[2]["train_tokens"] for r in ours)
    ref_tokens = statistics.median(r[2]["train_tokens"] for r in ref)
    overhead = sum(parts.get(p, 0.0) for p in OVERHEAD_PARTS)
    goal = GOALS.get((shape["preset"], shape["image_size"], shape["lora"]))
    ratio = reference_s / saccade_s
    return {
        **shape,
        "group_size": GROUP, "max_new_tokens": NEW_TOKENS, "steps": len(ours),
        "saccade_s": saccade_s, "reference_s": reference_s, "ratio": ratio,
        "goal_ratio": goal, "meets_goal": None if goal is None else ratio >= goal,
        "saccade_parts_s": parts,
        "saccade_rollout_s": sum(parts.get(p, 0.0) for p in ROLLOUT_PARTS),
        "saccade_train_s": train_s,
        "overhead_frac": overhead / saccade_s,
        "reference_parts_s": ref_parts,
        "train_tokens": train_tokens, "reference_train_tokens": ref_tokens,
        "forward_tokens": statistics.median(r[2]["forward_tokens"] for r in ours),
        "reference_padded_tokens": statistics.median(r[2]["padded_tokens"] for r in ref),
        "trainer_tokens_per_s": train_tokens / train_s,
        "reference_train_tokens_per_s": ref_tokens / ref_train_s,
        "trainer_speed_ratio": (train_tokens / train_s) / (ref_tokens / ref_train_s),
        "completion_tokens": statistics.median(r[2]["completion_tokens"] for r in ours),
        "reference_completion_tokens": statistics.median(r[2]["completion_tokens"] for r in ref),
    }


def format_step_report(r: dict[str, Any]) -> str:
    shape = f"{r['preset']}, {r['image_size']}px ({r['image_tokens']} image tokens/prompt), " \
            f"{'LoRA' if r['lora'] else 'full fine-tuning'}, {r['device']} {r['dtype']}"
    lines = [
        f"one RL step, {r['prompts']} prompts x G={r['group_size']}, <= {r['max_new_tokens']} new tokens: {shape}",
        f"  saccade   {r['saccade_s']:.3f} s/step  (rollout {r['saccade_rollout_s']:.3f}, train "
        f"{r['saccade_train_s']:.3f})",
        f"  reference {r['reference_s']:.3f} s/step  (HF generate + padded full-model forward/backward)",
        f"  ratio     {r['ratio']:.2f}x" + (f"  (goal {r['goal_ratio']:.1f}x: {'met' if r['meets_goal'] else 'MISSED'})"
                                           if r["goal_ratio"] else ""),
        f"  trained on {r['train_tokens']:.0f} tokens ({r['forward_tokens']:.0f} computed: each group's prompt once); "
        f"reference {r['reference_padded_tokens']:.0f} padded",
        f"  trainer tokens/s {r['trainer_tokens_per_s']:.0f} vs reference forward+backward "
        f"{r['reference_train_tokens_per_s']:.0f}: {r['trainer_speed_ratio']:.2f}x",
        f"  overhead (templating, image prep, env, rewards, samples, pack, loss, other): "
        f"{100 * r['overhead_frac']:.1f}% of the step",
        "  saccade breakdown (median s):",
    ]
    for part in (*ROLLOUT_PARTS, *TRAIN_PARTS, "weight_sync", "other"):
        value = r["saccade_parts_s"].get(part, 0.0)
        lines.append(f"    {part:<12} {value:8.4f}  {100 * value / r['saccade_s']:5.1f}%")
    lines.append("  reference breakdown (median s): " + ", ".join(
        f"{k} {v:.3f}" for k, v in r["reference_parts_s"].items()))
    return "\n".join(lines)
