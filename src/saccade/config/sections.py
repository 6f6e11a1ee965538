"""The plain sections of a run's config: one pydantic model per concern.

`saccade.config.task` holds the `[task]` union, `saccade.config.run` the `RunConfig` that
composes them all. Every section is a `Section`: unknown keys refused, assignment validated,
no inf or nan, a description on every field and bounds wherever a bound means something.

This module imports no other part of saccade (but `saccade.installed`, which imports nothing).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A user error in a config file or a command-line override; the message says where."""


class Section(BaseModel):
    """Base of every config model: unknown keys refused, assignment validated, no inf/nan.

    A field that is a union of sections picked by a tag (`[task]` by `kind`) reads a table
    without its tag as the default's variant: `--task.num_choices 3` alone works."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _default_tags(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, tag, default in _tagged_unions(cls):
                table = data.get(name)
                if isinstance(table, dict) and tag not in table:
                    data = {**data, name: {tag: default, **table}}
        return data


def union_members(annotation: Any) -> list[Any]:
    """The members of a union annotation (or the annotation itself)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return list(typing.get_args(annotation))
    return [annotation]


def union_variants(info: FieldInfo) -> dict[str, type[BaseModel]] | None:
    """{tag: variant} of a field that is a union of sections picked by a tag; None for any other."""
    if not isinstance(info.discriminator, str):
        return None
    out = {}
    for member in union_members(info.annotation):
        for tag in typing.get_args(member.model_fields[info.discriminator].annotation):
            out[tag] = member
    return out


@functools.cache
def _tagged_unions(cls: type[BaseModel]) -> tuple[tuple[str, str, str], ...]:
    """(field, its tag's key, the default's tag) of each tagged union field of `cls`."""
    out = []
    for name, info in cls.model_fields.items():
        if union_variants(info) is not None:
            key = str(info.discriminator)
            out.append((name, key, getattr(info.get_default(call_default_factory=True), key)))
    return tuple(out)


# The built-in random models: `saccade.models.presets.PRESETS`' names, in its (FAMILIES') order
# (tests/models/test_families.py keeps the lists equal).
PRESET_NAMES = ("tiny", "small", "qwen3vl-2b", "qwen3vl-4b", "qwen3vl-8b", "qwen2.5vl-tiny", "qwen2.5vl-7b", "qwen2.5vl-3b",
                "moe-tiny", "qwen3vl-30b-a3b-l6", "qwen3.5-tiny", "qwen3.5-small", "qwen3.5-9b",
                "qwen3.5-moe-tiny", "qwen3.5-35b-a3b")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class ModelConfig(Section):
    """The policy: which checkpoint (of a family in saccade.models.families), in which dtype, with which attention kernel."""

    path: str = Field(
        "tiny",
        min_length=1,
        description="Hugging Face hub id or local folder of a checkpoint of a supported family (docs/families.md); 'tiny', 'small', "
        "'qwen3vl-2b', 'qwen3vl-4b' or 'qwen3vl-8b' (Qwen3-VL-2B's, 4B's or 8B's shapes), 'qwen2.5vl-tiny', 'qwen2.5vl-3b' or "
        "'qwen2.5vl-7b' (Qwen2.5-VL's), 'moe-tiny' or 'qwen3vl-30b-a3b-l6' (Qwen3-VL-30B-A3B's widths, 6 "
        "layers) for the built-in random presets "
        "(built offline, cached); "
        "'tiny-warm' or 'qwen2.5vl-tiny-warm' ('<tiny preset>-warm'): that tiny model after the demo's warm "
        "start (built on first use, cached)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="compute dtype (bfloat16 on GPU): frozen weights and image embeddings are stored in it; "
        "trainable weights, optimizer state, logprobs and the loss stay float32 (docs/precision.md)",
    )
    attn_implementation: Literal["auto", "packed_sdpa", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto",
        description="attention kernel of the language model. auto = packed_sdpa: each packed sample attends "
        "causally within itself and masked blocks are never computed (docs/packing.md); sdpa builds the "
        "block-diagonal mask; flash_attention_2 needs a GPU, bf16 and the flash-attn package",
    )

    @field_validator("attn_implementation")
    @classmethod
    def _kernel_importable(cls, name: str) -> str:
        # Checked when the config loads, so --dry-run refuses it before a model is built, not the
        # first trainer forward after a whole rollout.
        from saccade.installed import attention_kernel_problem

        problem = attention_kernel_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @property
    def is_preset(self) -> bool:
        """True for the built-in random presets, which have no hub id."""
        return self.path in PRESET_NAMES or self.path.removesuffix("-warm") in PRESET_NAMES


class LoraConfig(Section):
    """LoRA adapters on the language model's linears, the default; `lora = false` (`--lora false`)
    is full fine-tuning instead.

    The vision tower is frozen either way (its embeddings are computed once and cached)."""

    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input, in [0, 1)")
    target_modules: list[str] | None = Field(
        None,
        min_length=1,
        description="names of the language model's linear layers that get adapters; unset: the model family's own "
        "(attention and MLP linears, and Qwen3.5's Gated DeltaNet projections: docs/families.md)",
    )


class VideoConfig(Section):
    """How clips are sampled and sized, the same wherever a clip is read (engine, trainer, eval):
    `[images.video]`, under the image limits every stage already takes (docs/video.md).

    Unset keys take the model's video processor's own settings (Qwen3-VL's: 2 frames a second,
    4 to 768 frames); a processor that samples nothing (Qwen2-VL's, which Qwen2.5-VL uses) takes
    every frame unless `fps` or `num_frames` is set. A clip is decoded and sampled once; its
    embedding's cache key is its sampled frames' content hash with these settings."""

    fps: float | None = Field(
        None, gt=0, le=240, description="frames sampled per second of video; setting it (or num_frames) turns sampling "
        "on. Unset: the video processor's own (Qwen3-VL: 2; Qwen2-VL's processor: every frame)",
    )
    num_frames: int | None = Field(
        None, ge=1, le=100_000, description="sample exactly this many frames, evenly, instead of by fps (the "
        "processor's num_frames); unset: by fps",
    )
    min_frames: int | None = Field(
        None, ge=1, le=100_000, description="fewest frames sampled by fps; unset: the video processor's (4)",
    )
    max_frames: int | None = Field(
        None, ge=1, le=100_000, description="most frames a clip may have after sampling: fewer are sampled by fps, "
        "and a clip taken whole (a list of frames, or a processor that samples nothing) with more is refused; unset: "
        "the video processor's (768)",
    )
    min_pixels: int | None = Field(
        None, gt=0, description="lower bound of the video processor's resize (its size.shortest_edge), in pixels: "
        "for Qwen3-VL's processor (Qwen3-VL, Qwen3.5 and their MoE) all sampled frames together, for Qwen2-VL's "
        "(Qwen2.5-VL) each frame; unset: the processor's",
    )
    max_pixels: int | None = Field(
        None, gt=0, description="upper bound of the video processor's resize (its size.longest_edge), in pixels, "
        "read as min_pixels is (the clip's frames together, or each frame); unset: the processor's",
    )
    cap_pixels_per_frame: bool = Field(
        False, description="transformers' cap_pixels_per_frame (qwen-vl-utils' per-frame budget, so a clip's tokens "
        "grow with its length); false: transformers 5.19's default behaviour, uncapped",
    )
    frame_list_fps: float = Field(
        2.0, gt=0, le=240, description="a clip given as a list of frames is already sampled: its frames are taken "
        "1/frame_list_fps seconds apart (its timestamps; Qwen2.5-VL's seconds per temporal patch) unless its part "
        "says 'fps' (qwen-vl-utils' default, 2)",
    )
    max_source_pixels: int = Field(
        1 << 30, gt=0, description="a clip whose sampled frames hold more decoded pixels than this (frames x height "
        "x width, before the resize) is refused; each frame is also held to images.max_source_pixels",
    )
    decoded_cache_bytes: int = Field(
        512 << 20, ge=0, description="host memory for decoded, sampled clips (keyed by the source's content and "
        "these settings), so a clip read again is not decoded again; 0: no cache",
    )

    @model_validator(mode="after")
    def _consistent(self) -> VideoConfig:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are two ways to sample; set one (the processor refuses both)")
        if None not in (self.min_frames, self.max_frames) and self.min_frames > self.max_frames:
            raise ValueError(f"min_frames ({self.min_frames}) must be <= max_frames ({self.max_frames})")
        if None not in (self.min_pixels, self.max_pixels) and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        return self


class ImagesConfig(Section):
    """Image limits, applied identically wherever images are processed (engine, trainer, eval).

    This one type is also what the image code takes as its `limits`; the cache of the images'
    embeddings has its own section, `[image_cache]`. Clips' settings sit under it,
    `[images.video]`, so every stage that takes the image limits reads clips alike."""

    min_pixels: int = Field(32 * 32, gt=0, description="lower bound of the processor's resize, in pixels (h*w)")
    max_pixels: int = Field(256 * 256, gt=0, description="upper bound of the processor's resize, in pixels (h*w)")
    max_source_pixels: int = Field(
        8192 * 8192, gt=0, description="decoded images with more pixels than this are refused (decompression bombs)"
    )
    allow_remote: bool = Field(False, description="allow http(s) image URLs; false refuses them")
    remote_timeout_s: float = Field(10.0, gt=0, description="total time allowed for one remote image fetch, seconds")
    max_remote_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest remote image download, bytes")
    video: VideoConfig = Field(default_factory=VideoConfig, description="clips: frame sampling and sizes")

    @model_validator(mode="after")
    def _min_below_max(self) -> ImagesConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        return self


class ImageCacheConfig(Section):
    """The cache of image embeddings: the frozen vision tower's output, computed once per image."""

    budget_bytes: int = Field(
        1 << 30, gt=0,
        description="host-memory budget of the image-embedding cache, bytes. The images a step uses stay pinned "
        "from its rollout until its train step ends (the cache may exceed the budget meanwhile); then the least "
        "recently used go first",
    )
    dir: str | None = Field(
        None, min_length=1,
        description="folder for a disk layer under the cache (safetensors per image, kept across runs); unset: none",
    )


class SamplingConfig(Section):
    """How completions are sampled: the one place these are set. The engine's request
    (`saccade.inference.engine.SamplingParams.sampled`) and the distribution the trainer scores
    (`SamplingParams.distribution`) are both made from it."""

    temperature: float = Field(
        1.0, gt=0, le=10, description="sampling temperature (> 0; the trainer scores the same distribution)"
    )
    top_p: float = Field(
        1.0, gt=0, le=1,
        description="nucleus sampling: keep the most likely tokens whose probability reaches top_p, in (0, 1] "
        "(1: off). As top_k and min_p, it applies after the temperature, and the trainer scores the same "
        "truncated, renormalised distribution",
    )
    top_k: int = Field(
        0, ge=0, le=1_000_000, description="keep only the k most likely tokens when sampling (0: off; vLLM's "
        "convention); applied after min_p and before top_p",
    )
    min_p: float = Field(
        0.0, ge=0, lt=1, description="keep only tokens with probability >= min_p x the most likely one's, "
        "after the temperature, in [0, 1) (0: off); applied before top_k and top_p",
    )
    max_tokens: int = Field(16, ge=1, le=262144, description="most tokens sampled per completion")


class RolloutConfig(Section):
    """How many rollouts each step samples, and how rewards become advantages (GRPO family)."""

    prompts_per_step: int = Field(8, ge=1, description="distinct prompts per optimizer batch")
    group_size: int = Field(8, ge=2, le=1024, description="completions sampled per prompt (G)")
    filter_zero_variance: bool = Field(
        True, description="drop groups whose rewards are all equal: no signal (DAPO dynamic sampling)"
    )
    advantage_baseline: Literal["group_mean", "rloo"] = Field(
        "group_mean",
        description="what a reward is measured against: 'group_mean' the mean of its group's G rewards (GRPO); "
        "'rloo' the mean of the other G - 1 (RLOO's leave-one-out baseline: the group mean's advantage times "
        "G / (G - 1))",
    )
    advantage_scaling: Literal["group", "batch", "none"] = Field(
        "group",
        description="what the advantage is divided by: 'group' its group's reward std (GRPO); 'batch' the std of "
        "the whole step's rewards, every group's (TRL's scale_rewards = 'batch'); 'none' nothing (Dr. GRPO)",
    )
    max_async_level: int = Field(
        0, ge=0, le=16,
        description="steps of rollouts sampled ahead of the trainer (vLLM engine): 0 samples each step's "
        "rollouts after the previous step's weights reached the servers (on-policy); 1 samples step n+1 while "
        "step n trains, from weights at most 1 version old. A batch staler than this is never trained on",
    )
    reward_weights: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0},
        min_length=1,
        description="weight of each reward function in the total reward: a built-in by name (correct, format, "
        "boxed_format) or your own as 'package.module:function', called as fn(completion, *, sample, messages) "
        "and returning a float or a dict of named parts (summed; each logged as reward_<name>_<part>); "
        "docs/rewards.md. Checked before the run builds anything, --dry-run included (your module is imported "
        "then)",
    )
    reward_timeout_s: float = Field(
        60.0, gt=0, le=86400,
        description="the most seconds one of your reward functions may take on one answer (they run in worker "
        "processes, killed when a call overruns); past it the answer scores 0 there, counted in reward_timeouts",
    )
    # Replies cut at sampling.max_tokens (DAPO's overlong filtering and shaping, docs/stalls.md).
    overlong_penalty: float = Field(
        0.0, ge=0, le=100,
        description="subtracted from an answer's reward when it was cut at sampling.max_tokens (an episode's: "
        "times the share of its replies cut). A group whose answers all score 0 then still has variance, and the "
        "answers that end beat those that run on: the way out of the collapse where replies stop ending. "
        "reward_mean stays the task's reward; reward_shaped_mean is what advantages came from. 0: off",
    )
    mask_overlong: bool = Field(
        False,
        description="leave answers whose final reply was cut at sampling.max_tokens out of the loss (DAPO's "
        "overlong filtering); they still count in their group's mean and std",
    )


# A stalled run (saccade.loops.stall, docs/stalls.md): what GRPO's most common collapse looks like.
STALL_ACTION = (
    "what a stalled run does: 'warn' says so once per stall and trains on; 'stop' ends the run, naming the last "
    "checkpoint from before the stall and the --resume command with a lower trainer.lr; 'rollback' reloads that "
    "checkpoint at a lower lr and trains on (docs/stalls.md)"
)


class StallWatchConfig(Section):
    """The stall watch, whatever it does (`[stall]`, the fields every action has): a run has stalled
    when, for `steps` steps in a row, no group had reward variance (nothing to learn from; a step
    whose replies are all correct does not count), or more than `truncated_frac` of the answers
    (episodes: their final replies) were cut at sampling.max_tokens."""

    action: str = Field("warn", description=STALL_ACTION)
    steps: int = Field(
        20, ge=1, le=100_000,
        description="steps in a row without reward variance, or with most replies cut, before the run counts as "
        "stalled",
    )
    truncated_frac: float = Field(
        0.5, gt=0, le=1,
        description="a step counts towards a stall when more than this share of its answers (episodes: their "
        "final replies) was cut at sampling.max_tokens (final_truncated_frac): past half, most answers are cut "
        "before they end. 1 turns this kind of stall off (for a run whose answers are meant to be cut)",
    )


class StallWarnConfig(StallWatchConfig):
    """A stalled run says so, once per stall, and trains on (where to look and what to change)."""

    action: Literal["warn"] = Field("warn", description=STALL_ACTION)


class StallStopConfig(StallWatchConfig):
    """A stalled run ends with StallError, naming the last checkpoint from before the stall and the
    --resume command with a lower trainer.lr; the stalled weights are not saved."""

    action: Literal["stop"] = Field("stop", description=STALL_ACTION)


class StallRollbackConfig(StallWatchConfig):
    """A stalled run reloads its last checkpoint from before the stall (it saves its start weights
    as step 0 for this), multiplies the lr by `lr_factor` and trains on, the step count going
    forward; after `max_rollbacks` rollbacks, a stall stops it as 'stop' does."""

    action: Literal["rollback"] = Field("rollback", description=STALL_ACTION)
    lr_factor: float = Field(
        0.5, gt=0, lt=1,
        description="each rollback multiplies the peak lr by this (kept in the checkpoints, so a --resume goes "
        "on at the lowered lr)",
    )
    max_rollbacks: int = Field(
        3, ge=1, le=100,
        description="rollbacks a run may make; a stall after the last one stops the run as action 'stop' does",
    )


StallConfig = Annotated[StallWarnConfig | StallStopConfig | StallRollbackConfig, Field(discriminator="action")]


DECAY = "the lr after warm-up: 'constant', or 'linear' or 'cosine' decay to min_lr_ratio x the peak"


def min_lr_ratio_field() -> Any:
    return Field(0.1, ge=0, le=1, description="the lr at the last optimizer step / the peak lr")


class ConstantDecayConfig(Section):
    """No decay: the peak lr from the end of warm-up to the last step."""

    kind: Literal["constant"] = Field("constant", description=DECAY)


class LinearDecayConfig(Section):
    """Linear decay from the peak lr at the end of warm-up to min_lr_ratio x the peak at the last
    optimizer step (trainer.steps x num_iterations)."""

    kind: Literal["linear"] = Field("linear", description=DECAY)
    min_lr_ratio: float = min_lr_ratio_field()


class CosineDecayConfig(Section):
    """Cosine decay (half a period) from the peak lr at the end of warm-up to min_lr_ratio x the
    peak at the last optimizer step (trainer.steps x num_iterations)."""

    kind: Literal["cosine"] = Field("cosine", description=DECAY)
    min_lr_ratio: float = min_lr_ratio_field()


LrDecayConfig = Annotated[ConstantDecayConfig | LinearDecayConfig | CosineDecayConfig, Field(discriminator="kind")]


def section_or_off(value: Any) -> Any:
    """A section that may be off, as TOML and the command line write it: TOML has no null, so off is
    `false`, and `true` is on with the section's defaults; a table is the section itself."""
    if value is False:
        return None
    if value is True:
        return {}
    return value


class GradSpikeConfig(Section):
    """Skip an optimizer step whose gradient norm spikes (`saccade.trainer.spike`): after `warmup`
    steps, one whose pre-clip norm is over `factor` x the median of the last `window` norms leaves
    the weights and the optimizer state as they were, and is counted (grad_spike_skipped)."""

    factor: float = Field(10.0, gt=1, le=1e6, description="a step whose gradient norm is over this many times the "
                          "recent median is skipped")
    window: int = Field(20, ge=3, le=10_000, description="the recent steps whose norms the median is taken over "
                        "(skipped ones included: a lasting change of scale is accepted once it fills half of it)")
    warmup: int = Field(5, ge=1, le=10_000, description="steps seen before the guard judges any")


class TrainerConfig(Section):
    """The optimizer loop (AdamW): steps, learning-rate schedule, micro-batching, seed."""

    steps: int = Field(40, ge=1, description="optimizer batches (RL steps) to train for")
    lr: float = Field(1e-3, gt=0, le=1, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over this many steps")
    lr_decay: LrDecayConfig = Field(
        default_factory=ConstantDecayConfig,
        description="the lr schedule after warm-up: kind 'constant', 'linear' or 'cosine', the last two down to "
        "min_lr_ratio x lr at the last optimizer step",
    )
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    grad_spike: GradSpikeConfig | None = Field(
        None,
        description="skip a step whose gradient norm spikes far above the recent ones (a [trainer.grad_spike] "
        "table, --trainer.grad_spike true), or false, the default: never skip one. Off by default because RL's "
        "learning steps spike too: the visual demo's first steps that find the image have norms 20-150x the "
        "median before them, and skipping them kept it at chance (docs/async.md)",
    )
    max_tokens: int = Field(4096, ge=16, description="token budget of one packed micro-batch")
    num_iterations: int = Field(1, ge=1, le=64, description="optimizer steps per rollout batch (mu); > 1 is off-policy")
    max_nonfinite_steps: int = Field(
        10, ge=0,
        description="stop the run, with a checkpoint (the weights are those before the first of them) and exit "
        "status 3, after this many steps in a row whose every optimizer step was skipped for a non-finite loss or "
        "gradient; 0: never stop for it",
    )
    seed: int = Field(0, ge=0, description="seed of torch, data order and sampling")
    torch_threads: int | None = Field(None, ge=1, description="torch.set_num_threads; unset: torch's default")
    device: str = Field(
        "auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="where the trainer's model (and the embedded engine) runs: 'auto' is the local rank's CUDA "
        "device when there is one (LOCAL_RANK, else cuda:0), else the CPU; or 'cpu', 'cuda', 'cuda:N'",
    )
    dist_timeout_s: float = Field(
        3600.0, ge=60, le=7 * 24 * 3600,
        description="under torchrun: how long a rank waits in any collective (barriers included) before the "
        "run fails. Ranks wait for rank 0 while it resolves (downloads) the model and while it runs the held-out "
        "evaluation: a cold download of an 8B checkpoint (about 17 GB) at 20 MB/s takes about 15 min, past "
        "NCCL's default 10. A dead rank ends the job at once anyway (torchrun stops the others), so the timeout "
        "only limits how long a hung rank goes unnoticed: 1 hour",
    )
    activation_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer's activations in backward instead of keeping them: activation "
        "memory drops to about one layer's plus each layer's input, for one extra forward per micro-batch",
    )
    share_prompts: bool = Field(
        True,
        description="pack each group's common prompt once: its G completions attend to one copy, so the forward "
        "and backward run the prompt (images included) once per group, not G times. Same logprobs; needs "
        "model.attn_implementation auto/packed_sdpa (other kernels pack every sample whole)",
    )


    @field_validator("grad_spike", mode="before")
    @classmethod
    def _grad_spike_or_off(cls, value: Any) -> Any:
        return section_or_off(value)

class SftConfig(Section):
    """Supervised fine-tuning (`saccade sft`) on the task's reference answers."""

    steps: int = Field(100, ge=1, description="optimizer steps")
    lr: float = Field(1e-3, gt=0, le=1, description="peak learning rate (AdamW)")
    batch_size: int = Field(16, ge=1, description="examples per optimizer step")


# The fields data.prompt_template may name, and the placeholder that places an image
# (saccade.data.shapes.IMAGE_PLACEHOLDER, repeated so this module imports no data code).
class CheckpointConfig(Section):
    """Saving the trained weights (the LoRA adapter, or the full model) to <run_dir>/checkpoints."""

    every_steps: int = Field(0, ge=0, description="save every this many steps, and at the end; 0: only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept on disk; older ones are deleted")


class LogConfig(Section):
    """Where metrics, samples of the completions and the resolved config go."""

    dir: str | None = Field(None, min_length=1, description="run folder; unset: runs/<name>")
    name: str = Field("demo", pattern=NAME_PATTERN, description="run name (letters, digits, '.', '_', '-')")
    wandb: bool = Field(False, description="log to Weights & Biases")
    wandb_project: str = Field("saccade", min_length=1, description="W&B project")
    tensorboard: bool = Field(False, description="write TensorBoard event files to the run folder")
    samples_every: int = Field(
        10, ge=0, description="every this many RL steps, write a few prompts with their completions, rewards and "
        "advantages to <run_dir>/samples.jsonl (images under samples/; `saccade report` shows them); 0: never",
    )
    samples_prompts: int = Field(2, ge=1, le=64, description="prompts per samples.jsonl step, the step's first ones")
    samples_image_side: int = Field(
        256, ge=16, le=4096, description="longest side, pixels, of the PNG thumbnails written under samples/"
    )


class EnvConfig(Section):
    """How every episode runs in the rollout loop, whatever the task: its token budget, what the
    loss trains on, and the check of the engine's inputs against the training samples. (What a
    task's environment does is in `[task]`.)"""

    max_total_tokens: int = Field(4096, ge=64, description="an episode ends once its next turn would not fit this")
    loss_on: Literal["assistant", "markers"] = Field(
        "assistant", description="train on every sampled assistant token, or only on those inside loss_markers"
    )
    loss_markers: list[str] = Field(
        default_factory=lambda: ["[ACTION]", "[/ACTION]"], min_length=2, max_length=2,
        description="the open and close markers for loss_on = 'markers'",
    )
    check_consistency: Literal["first", "always", "never"] = Field(
        "first", description="compare the engine's inputs with the training samples on the first step, every step, or never"
    )
