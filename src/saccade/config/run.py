"""`RunConfig`: everything an RL or SFT run reads, composed of the sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from saccade.config.evaluation import EvalConfig
from saccade.config.launch import LaunchConfig
from saccade.config.loss import DEFAULT_TIS_CAP, LossConfig, PpoClipLossConfig
from saccade.config.engine import EmbeddedEngineConfig, EngineConfig
from saccade.config.sections import (
    CheckpointConfig, EnvConfig, ImageCacheConfig, ImagesConfig, LogConfig, LoraConfig,
    ModelConfig, RolloutConfig, SamplingConfig, Section, SftConfig, StallConfig, StallWarnConfig, TrainerConfig,
    section_or_off,
)
from saccade.config.task import ShapesTaskConfig, TaskConfig


class RunConfig(Section):
    """Everything an RL or SFT run reads. The defaults are a CPU demo on the built-in tiny model."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy checkpoint")
    lora: LoraConfig | None = Field(
        default_factory=LoraConfig,
        description="LoRA adapters on the language model (a [lora] table; the default), or false: full fine-tuning "
        "of the language model (`lora = false` at the top of a file, --lora false; --lora true turns LoRA back on)",
    )
    images: ImagesConfig = Field(default_factory=ImagesConfig, description="image limits")
    image_cache: ImageCacheConfig = Field(default_factory=ImageCacheConfig, description="the image-embedding cache")
    engine: EngineConfig = Field(
        default_factory=EmbeddedEngineConfig,
        description="the inference engine: its kind (with that kind's own fields; vLLM's weight sync under it)",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="how completions are sampled")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollouts per step and advantages")
    stall: StallConfig = Field(
        default_factory=StallWarnConfig, description="the stall watch: when a run has stalled, and what it then does"
    )
    loss: LossConfig = Field(
        default_factory=PpoClipLossConfig,
        description="the policy loss: its kind (with that kind's own fields), normalisation, TIS, masked IS, KL, "
        "entropy",
    )
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the optimizer loop")
    sft: SftConfig = Field(default_factory=SftConfig, description="supervised fine-tuning")
    task: TaskConfig = Field(default_factory=ShapesTaskConfig, description="the task: its kind and its own fields")
    env: EnvConfig = Field(default_factory=EnvConfig, description="how episodes run, whatever the task")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="periodic evaluation")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving weights")
    log: LogConfig = Field(default_factory=LogConfig, description="metrics and the run folder")
    launch: LaunchConfig = Field(
        default_factory=LaunchConfig, description="where `saccade launch` runs the servers and the trainer"
    )

    @property
    def run_dir(self) -> Path:
        """The run folder: log.dir, else runs/<log.name>."""
        return Path(self.log.dir) if self.log.dir else Path("runs") / self.log.name

    @property
    def engine_weights_dir(self) -> Path:
        """Where the weights for vLLM servers are written (a folder transport's): the engine's
        weight_sync.weights_dir, else <run_dir>/engine-weights."""
        configured = getattr(getattr(self.engine, "weight_sync", None), "weights_dir", None)
        return Path(configured) if configured else self.run_dir / "engine-weights"

    @property
    def checkpoint_dir(self) -> Path:
        """<run_dir>/checkpoints: where `saccade rl` saves and `--resume` looks."""
        return self.run_dir / "checkpoints"

    @field_validator("lora", mode="before")
    @classmethod
    def _lora_or_full_finetuning(cls, value: Any) -> Any:
        value = section_or_off(value)
        if value is not None and not isinstance(value, dict | LoraConfig):
            raise ValueError(f"lora is a [lora] table (LoRA) or false (full fine-tuning), got {value!r}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _servers_from_the_layout(cls, data: Any) -> Any:
        # A layout's servers are the run's engine.urls: a config with [launch] leaves them out.
        if not (isinstance(data, dict) and isinstance(data.get("launch"), dict)):
            return data
        engine = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        if engine.get("kind") != "vllm" or "urls" in engine:
            return data
        try:
            urls = LaunchConfig.model_validate(data["launch"]).server_urls()
        except ValidationError:
            return data  # reported where [launch] itself is validated
        return {**data, "engine": {**engine, "urls": urls}} if urls else data

    @model_validator(mode="after")
    def _layout_matches_the_engine(self) -> RunConfig:
        if not self.launch.nodes:
            return self
        layout = self.launch.server_urls()
        if self.engine.kind == "embedded" and layout:
            raise ValueError(f"launch.nodes start {len(layout)} vLLM server(s) but engine.kind is 'embedded': set "
                             "engine.kind = 'vllm', or give the nodes no servers")
        if self.engine.kind == "vllm" and self.engine.urls != layout:
            raise ValueError(
                f"engine.urls {self.engine.urls} are not the servers launch.nodes start ({layout or 'none'}): leave "
                "engine.urls out of a config with a [launch] layout (they are the layout's), or change the layout")
        return self

    @model_validator(mode="after")
    def _async_needs_servers(self) -> RunConfig:
        if self.rollout.max_async_level > 0 and self.engine.kind != "vllm":
            raise ValueError(
                f"rollout.max_async_level = {self.rollout.max_async_level} needs vLLM servers (engine.kind = "
                "'vllm'): the embedded engine samples from the very weights being trained, so it cannot sample "
                "ahead of them; set rollout.max_async_level = 0"
            )
        return self


def effective_loss(cfg: RunConfig) -> LossConfig:
    """The loss a run trains with: `loss`, with tis_cap set when TIS is on (`loss.tis`) and
    is_mask 'on' or 'off' (`loss.is_mask`, 'auto' resolved).

    Without TIS the clipped ratio is pi / mu, against the engine's logprobs: the clip bounds how
    far an update moves the sampled tokens from the policy that sampled them, across any lag.
    With TIS it is pi / pi_old, the trainer's own logprobs before the update, and pi_old / mu is
    a capped weight; at num_iterations = 1 that ratio is 1 when the gradient is taken, so nothing
    bounds the update, and one step ahead collapsed that way (docs/async.md). So 'auto' turns TIS
    on for rollouts from older weights only when the trainer takes several optimizer steps per
    batch (the clip acts from the second on), or when tis_cap is set. Masked IS leaves the ratio
    as it is (without TIS it reads pi_old from the loss's own forward: saccade.trainer.loss);
    'auto' turns it on for every run on rollouts from older weights (the default is 'off')."""
    loss = cfg.loss
    off_policy = cfg.rollout.max_async_level > 0 or cfg.engine.sync_every_steps > 1
    decoupled = off_policy and cfg.trainer.num_iterations > 1
    tis = loss.tis == "on" or (loss.tis == "auto" and (decoupled or loss.tis_cap is not None))
    mask = loss.is_mask == "on" or (loss.is_mask == "auto" and off_policy)
    return loss.model_copy(update={"tis_cap": (loss.tis_cap or DEFAULT_TIS_CAP) if tis else None,
                                   "is_mask": "on" if mask else "off"})
