"""The stages of `saccade bench gpu` as a table: what each checks, its estimated seconds on one
H100 and the real-shape models it loads (run by saccade.tools.bench.gpu), and the lease's order
and arithmetic: which stages a 15-minute GPU lease runs first, and how the stages fall into leases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from saccade.tools.bench import gpu_stages as S


@dataclass(frozen=True)
class Stage:
    name: str
    what: str  # the table's first column: what the stage checks
    run: Callable[[S.Plan], dict]
    summary: Callable[[dict], str]
    gpu_s: int  # estimated seconds on one H100 (80 GB), its models already built
    needs: tuple[str, ...] = ()  # real-shape models it loads (keys of S.BIG): built first if missing
    family: str = "Qwen3-VL"  # whose code it checks: `--list` groups the stages by it


# Qwen3-VL, the family saccade started with: every check, at 2B, 4B and 8B shapes.
QWEN3_VL_STAGES = (
    # 20 s: a Python start and torch's CUDA context (~8 s), every saccade module imported (~8 s: transformers,
    # peft), three matmuls against float64 and ten bf16 8192^3 matmuls (~1 s).
    Stage("smoke", "versions, the GPU, bf16->fp32 `mm`/`addmm` against fp64, fla's precision, every module imports",
          S.smoke, S.smoke_summary, 20),
    Stage("models", "random models at 2B and 4B shapes built on this machine; the demo's warm start",
          S.models, S.models_summary, 30, needs=("2b", "4b")),
    Stage("parity-2b", "bf16 parity at 2B shapes, LM-only vs the full model, 1k and 8k positions",
          lambda p: S.parity(p, "2b"), S.parity_summary, 100, needs=("2b",)),
    Stage("parity-4b", "bf16 parity at 4B shapes, 1k and 8k positions",
          lambda p: S.parity(p, "4b"), S.parity_summary, 150, needs=("4b",)),
    Stage("syncs", "host syncs per decoded token (embedded engine) and per trainer micro-batch",
          S.syncs, S.syncs_summary, 40),
    # The trainer at the shipped configs' size (S.TRAINER_SIZE: 8,192-token micro-batches, ~33k tokens a step).
    # LoRA 200 s: a Python start 10, the policy and the full VLM loaded (2 x 4.3 GB) 10, the processor over
    # 96 conversations 10, four variants of a warm-up and 3 steps at ~2.5e14 FLOPs each (~1-1.5 s at a few
    # hundred TFLOP/s) 25, three memory processes (a start, a load, two steps each) 55: 110, 200 with a
    # margin. Full fine-tuning 240: the same plus AdamW's fp32 states (24 GB) and every weight's gradient.
    Stage("trainer-lora", "`bench trainer` at 2B shapes, LoRA, 8,192-token micro-batches: tokens/s, MFU, "
          "peak vs `saccade memory`, cached embeddings vs the full VLM",
          lambda p: S.trainer(p, "2b", full_finetune=False), S.trainer_summary, 200, needs=("2b",)),
    Stage("trainer-full", "`bench trainer` at 2B shapes, full fine-tuning, 8,192-token micro-batches",
          lambda p: S.trainer(p, "2b", full_finetune=True), S.trainer_summary, 240, needs=("2b",)),
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
    # 8.8B in bf16, 17.5 GB, loaded as the policy and as the full VLM (35 GB) beside an 8,192-token micro-batch's
    # activations: an H100's 80 GB hold it. Scaled from trainer-lora's 200 s by the loads (2 x 17.5 GB at
    # ~2 GB/s, three memory processes the same) and the steps (4x the 2B's FLOPs): 300 s.
    Stage("trainer-lora-8b", "`bench trainer` at 8B shapes, LoRA, 8,192-token micro-batches: tokens/s, MFU, "
          "peak vs `saccade memory` (the 8B configs' estimate checked)",
          lambda p: S.trainer(p, "8b", full_finetune=False), S.trainer_summary, 300, needs=("8b",)),
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

# ----------------------------------------------------------------------------- the lease

# A lease runs the stages in the order of what their figures are worth if the lease ends any minute
# (docs/gpu-runs.md, "The lease", argues it): whether the machine can run anything (smoke); whether the
# trainer computes what the model means in bf16 at real lengths (parity-2b); what a step costs at the
# shipped configs' size, and whether `saccade memory` tells the truth (trainer-lora); whether the decode
# and the trainer wait on the host (syncs); whether RL trains on CUDA at all (rl); then full fine-tuning,
# FSDP2 over NCCL, bf16 mixed precision, fla's kernels, the RL step part by part, 4B and 8B, the renderer
# and the other families. The models stage is not one: a stage builds what it needs when it first runs.
LEASE_ORDER = ("smoke", "parity-2b", "trainer-lora", "syncs", "rl", "trainer-full", "fsdp-2b", "fsdp-bf16",
               "linear-attention", "step", "parity-4b", "trainer-lora-8b", "render")
# A lease's command may run 8 minutes (a 15-minute lease less the machine's start, the copy back and a
# margin). scripts/gpu-lease.sh gives the stages what the wheels' install leaves of it; --lease alone
# assumes the install's ~20 s and a 10 s margin.
LEASE_S = 480
LEASE_BUDGET_S = LEASE_S - 30


def lease_order() -> list[Stage]:
    """Every lease stage: LEASE_ORDER, then the rest in STAGES' order (the models stage left out)."""
    rest = [s for s in STAGES if s.name not in LEASE_ORDER and s.name != "models"]
    return [BY_NAME[n] for n in LEASE_ORDER] + rest


def listed_seconds(stages: tuple[Stage, ...] | list[Stage] = STAGES) -> dict[str, int]:
    """Each stage's estimated seconds on one H100 when `stages` run in order on a fresh machine:
    a stage's own, plus building the models it is the first to need (in STAGES' order the models
    stage builds Qwen3-VL's; each other family's first stage builds its shape)."""
    seconds, built = {}, set()
    for stage in stages:
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
    leases = plan_leases()
    lines += ["", f"--lease: {len(leases)} leases of {LEASE_BUDGET_S} s on a fresh H100 each, the stages in the lease "
              "order, each lease taking the next that fit (H100 s with the builds that lease needs)"]
    for k, lease in enumerate(leases, 1):
        lines.append(f"lease {k}: {sum(lease.values())} s")
        lines += [f"  {name:<{width - 2}}{sec:>8}" for name, sec in lease.items()]
    return "\n".join(lines)


def plan_leases(stages: list[Stage] | None = None, budget_s: float = LEASE_BUDGET_S) -> list[dict[str, int]]:
    """The leases `stages` (default: every lease stage, none carried) take when each lease runs
    `--lease` on a fresh machine: as run_gpu_bench does, a lease takes, in order, each stage whose
    estimate (its builds on that machine included) fits in what is left, and leaves the others to
    the next. Each lease's stages with their seconds. A stage larger than a whole lease is an error:
    it would be left for the next lease forever."""
    todo = list(lease_order() if stages is None else stages)
    leases = []
    while todo:
        left, built, lease = budget_s, set(), {}
        for stage in list(todo):
            estimate = stage.gpu_s + sum(S.BIG[n].build_s for n in stage.needs if n not in built)
            if estimate <= left:
                lease[stage.name] = estimate
                left -= estimate
                built.update(stage.needs)
                todo.remove(stage)
        if not lease:
            raise ValueError(f"{todo[0].name} needs more than a whole lease ({budget_s:.0f} s)")
        leases.append(lease)
    return leases
