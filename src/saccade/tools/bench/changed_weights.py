"""`saccade bench changed-weights`: how many of the language model's weights change, in the bf16 an
engine holds, in one optimizer step of full fine-tuning: what vLLM's sparse_nccl backend would
send per sync (`saccade.transports.backends.sparse_nccl`).

Each run is `saccade rl` on the demo's task (configs/demo.toml, the embedded engine), full
fine-tuning (`--lora false`), at one learning rate with a constant schedule (the peak rate, every
step). Around every optimizer step (torch's global step hooks) the trained tensors are read as the
bf16 an engine holds, before and after, and the changed share counted bit for bit. The shipped GPU
configs train a bf16 model with AdamW on float32 masters, which start on bf16 values (the hub's
checkpoints are bf16); by default (`dtype = "float32"`) the model trains in float32 with its
weights first rounded to bf16 values, which is the same AdamW on the same starting values (on this
CPU bf16 steps ran about 40x slower); `dtype = "bfloat16"` runs the masters themselves. Steps are
RL steps on the shapes task: 'tiny' from the demo's warm start (rewards vary), 'small' from its
random weights, with every group trained (`filter_zero_variance` off: the entropy bonus and the
rare rewarded answer give the gradient).

Then what one sync of Qwen3-VL-8B's language model would send at those fractions, dense against
sparse (an estimate: the parameter count from the published config, the bytes by arithmetic).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from saccade.config.bench import ChangedWeightsBenchConfig

AT_SCALE = "Qwen/Qwen3-VL-8B-Instruct"


class ChangedCounter:
    """The share of an optimizer's parameters whose bf16 value each step changed."""

    def __init__(self):
        self.before: list[torch.Tensor] = []
        self.fractions: list[float] = []
        self.numel = 0

    def _bf16(self, optimizer) -> list[torch.Tensor]:
        return [p.detach().to(torch.bfloat16).view(torch.int16).clone()
                for group in optimizer.param_groups for p in group["params"]]

    def before_step(self, optimizer, args, kwargs) -> None:
        if not self.fractions and not self.before:  # the first step: float32 weights put on bf16 values
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.copy_(p.to(torch.bfloat16))
        self.before = self._bf16(optimizer)

    def after_step(self, optimizer, args, kwargs) -> None:
        after = self._bf16(optimizer)
        changed = sum(int((a != b).sum()) for a, b in zip(after, self.before, strict=True))
        self.numel = sum(a.numel() for a in after)
        self.fractions.append(changed / self.numel)


def measure(preset: str, lr: float, cfg: ChangedWeightsBenchConfig, work: Path) -> dict[str, Any]:
    """One run's per-step fractions (see the module note)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from saccade.config import RunConfig, load_config
    from saccade.loops.rl import train_rl
    from saccade.tools.demo import resolve_model_name

    path = resolve_model_name(f"{preset}-warm" if preset == "tiny" else preset)
    run = load_config(RunConfig, "configs/demo.toml", [
        "--model.path", str(path), "--model.dtype", cfg.dtype, "--lora", "false", "--trainer.lr", repr(lr),
        "--trainer.steps", str(cfg.steps), "--trainer.seed", str(cfg.seed), "--rollout.filter_zero_variance", "false",
        "--rollout.prompts_per_step", str(cfg.prompts_per_step), "--rollout.group_size", str(cfg.group_size),
        "--sampling.max_tokens", str(cfg.max_tokens), "--loss.max_completion_tokens", str(cfg.max_tokens),
        "--eval.every_steps", "0", "--checkpoint.every_steps", "0", "--log.dir", str(work / f"{preset}-{lr:g}"),
        *(["--trainer.torch_threads", str(cfg.torch_threads)] if cfg.torch_threads else []),
    ])
    counter = ChangedCounter()
    hooks = [register_optimizer_step_pre_hook(counter.before_step),
             register_optimizer_step_post_hook(counter.after_step)]
    try:
        train_rl(run, run_dir=run.run_dir, progress=False)
    finally:
        for hook in hooks:
            hook.remove()
    f = counter.fractions
    return {"preset": preset, "lr": lr, "params": counter.numel, "steps": len(f), "fractions": f,
            "first": f[0], "mean": statistics.fmean(f), "median": statistics.median(f), "max": max(f),
            "max_after_first": max(f[1:], default=f[0])}


def run_changed_weights_bench(cfg: ChangedWeightsBenchConfig) -> dict[str, Any]:
    from saccade.tools.bench.weight_sync import published_params

    work = Path(tempfile.mkdtemp(prefix="saccade-changed-weights-"))
    runs = [measure(preset, lr, cfg, work) for preset in cfg.presets for lr in cfg.lrs]
    lm, _ = published_params(AT_SCALE)
    return {"runs": runs, "at_scale": {"model": AT_SCALE, "lm_params": lm}, "config": cfg.model_dump()}


def sparse_estimate(lm_params: int, fraction: float, *, itemsize: int = 2, index_bytes: int = 4) -> list[str]:
    """One sync of `lm_params` weights, dense against sparse at `fraction` changed (the arithmetic shown)."""
    dense = lm_params * itemsize / 1e9
    sparse = lm_params * fraction * (index_bytes + itemsize) / 1e9
    return [f"    dense (nccl): {lm_params / 1e9:.2f}B x {itemsize} B = {dense:.2f} GB",
            f"    sparse (sparse_nccl): {lm_params / 1e9:.2f}B x {fraction:.4f} x ({index_bytes} + {itemsize}) B = "
            f"{sparse:.2f} GB ({sparse / dense:.2f} of dense)"]


def format_changed_weights(r: dict[str, Any]) -> str:
    lines = [f"bf16 weights changed per optimizer step (full fine-tuning, AdamW, constant lr, the model in "
             f"{r['config']['dtype']} from bf16 values), share of the language model:",
             f"  {'preset':<7}{'lr':>8}{'params':>12}{'steps':>7}{'step 1':>9}{'median':>9}{'mean':>9}{'max 2..':>9}"]
    for run in r["runs"]:
        lines.append(f"  {run['preset']:<7}{run['lr']:>8g}{run['params']:>12,}{run['steps']:>7}{run['first']:>9.2%}"
                     f"{run['median']:>9.2%}{run['mean']:>9.2%}{run['max_after_first']:>9.2%}")
    lm = r["at_scale"]["lm_params"]
    lines.append(f"one sync of {r['at_scale']['model'].split('/')[-1]}'s language model in bf16 (estimates: the "
                 "published config's parameters, the largest measured fraction at each lr after step 1):")
    for lr in sorted({run["lr"] for run in r["runs"]}):
        worst = max(run["max_after_first"] for run in r["runs"] if run["lr"] == lr)
        lines += [f"  lr {lr:g}: {worst:.2%} changed", *sparse_estimate(lm, worst)]
    return "\n".join(lines)
