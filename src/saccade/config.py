"""Run configuration: pydantic models, TOML files, dotted command-line overrides, --dry-run.

A run is described by one `RunConfig`, composed of sections (`model`, `lora`, `images`,
`engine`, `rollout`, `loss`, `trainer`, `sft`, `data`, `eval`, `checkpoint`, `log`). Each
section is a pydantic model with a docstring, a description on every field and bounds
wherever a bound means something; unknown keys are refused everywhere (`extra="forbid"`), and
assignment is validated too (`cfg.trainer.lr = -1` raises).

Where the values come from, later wins:
  1. the defaults below (a CPU demo on the built-in tiny model),
  2. a TOML file (tables map to sections: ``[trainer]`` ``lr = 1e-5``),
  3. dotted overrides from the command line: ``--trainer.lr 1e-5``, ``--trainer.lr=1e-5``,
     ``--lora.target_modules '["q_proj","v_proj"]'``, ``--rollout.reward_weights.format 0.1``
     (one key of a dict field). A value is read as JSON when it parses (numbers, ``true``,
     ``false``, ``null``, lists, objects), else kept as a string; pydantic then validates
     and coerces it against the field's type. A string field keeps the raw text
     (``--log.name 123`` gives the string "123").

Every mistake is a `ConfigError` (a `ValueError`) whose message names where the bad value
came from (the file or the override) and the field path, e.g.
``--trainer.lr: input should be greater than 0 (got -1)``; an unknown key lists the valid
keys at that level with a "did you mean" suggestion.

This module imports neither torch nor anything that imports torch: entry points parse and
print the config (``--help``, ``--dry-run``, errors) before paying torch's import time. The
``to_*`` helpers on some sections import their targets lazily.

Entry-point pattern (argparse)::

    parser = argparse.ArgumentParser(prog="saccade rl")
    add_config_arguments(parser)                       # CONFIG (optional) and --dry-run
    known, overrides = split_overrides(sys.argv[1:])   # --a.b value tokens go to overrides
    args = parser.parse_args(known)
    cfg = load_config(RunConfig, args.config, overrides)   # ConfigError -> parser.error(...)
    if args.dry_run:
        print(describe(cfg))
        return 0
    import torch  # only now

Overrides are split off *before* argparse sees them: ``parse_known_args`` alone would hand
the value of ``--trainer.lr 1e-5`` to the optional CONFIG positional.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "ColumnsConfig",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "ImagesConfig",
    "LogConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SHAPES_QUESTION_KINDS",
    "Section",
    "SftConfig",
    "TrainerConfig",
    "add_config_arguments",
    "config_to_toml",
    "describe",
    "load_config",
    "parse_overrides",
    "split_overrides",
]

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A user error in a config file or a command-line override; the message says where."""


class Section(BaseModel):
    """Base of every config model: unknown keys refused, assignment validated, no inf/nan."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# ---------------------------------------------------------------------------------------------
# The schema of an RL / SFT run
# ---------------------------------------------------------------------------------------------

# The built-in random models (saccade.models.tiny.PRESETS; a test keeps the two lists equal).
PRESET_NAMES = ("tiny", "small", "qwen3vl-2b", "qwen3vl-4b")
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHAPES_QUESTION_KINDS = ["color", "shape", "count"]
# data.task's built-in names; a user's task is "verifiers:ENV_ID" or "package.module:make_task".
BUILTIN_TASKS = ("shapes", "views", "scenes", "openmmreasoner", "mathvista", "geometry3k", "dataset")
# The same list as saccade.envs.scenes.SCENE_QUESTION_KINDS (a test keeps them equal).
SCENE_QUESTION_KINDS = ["color", "count", "on"]
_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class ModelConfig(Section):
    """The policy: which Qwen3-VL checkpoint, in which dtype, with which attention kernel."""

    path: str = Field(
        "tiny",
        min_length=1,
        description="Hugging Face hub id or local folder of a Qwen3-VL checkpoint; 'tiny', 'small', "
        "'qwen3vl-2b' or 'qwen3vl-4b' (Qwen3-VL-2B's or 4B's shapes) for the built-in random presets "
        "(built offline, cached); "
        "'tiny-warm': the tiny model after the demo's warm start (built on first use, cached)",
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
        return self.path in PRESET_NAMES or self.path == "tiny-warm"


class LoraConfig(Section):
    """LoRA adapters on the language model's linears; `enabled = false` is full fine-tuning.

    The vision tower is frozen either way (its embeddings are computed once and cached)."""

    enabled: bool = Field(True, description="train LoRA adapters; false: full fine-tuning of the language model")
    rank: int = Field(16, ge=1, le=4096, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input, in [0, 1)")
    target_modules: list[str] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        min_length=1,
        description="names of the language model's linear layers that get adapters",
    )

    @property
    def full_finetune(self) -> bool:
        return not self.enabled


class ImagesConfig(Section):
    """Image limits, applied identically wherever images are processed (engine, trainer, eval),
    and the cache of their embeddings (the frozen tower's output, computed once per image).

    This one type is also what the image code takes as its `limits`."""

    min_pixels: int = Field(32 * 32, gt=0, description="lower bound of the processor's resize, in pixels (h*w)")
    max_pixels: int = Field(256 * 256, gt=0, description="upper bound of the processor's resize, in pixels (h*w)")
    max_source_pixels: int = Field(
        8192 * 8192, gt=0, description="decoded images with more pixels than this are refused (decompression bombs)"
    )
    allow_remote: bool = Field(False, description="allow http(s) image URLs; false refuses them")
    remote_timeout_s: float = Field(10.0, gt=0, description="total time allowed for one remote image fetch, seconds")
    max_remote_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest remote image download, bytes")
    cache_bytes: int = Field(
        1 << 30, gt=0,
        description="host-memory budget of the image-embedding cache, bytes. The images a step uses stay pinned "
        "from its rollout until its train step ends (the cache may exceed the budget meanwhile); then the least "
        "recently used go first",
    )
    cache_dir: str | None = Field(
        None, min_length=1,
        description="folder for a disk layer under the cache (safetensors per image, kept across runs); unset: none",
    )

    @model_validator(mode="after")
    def _min_below_max(self) -> ImagesConfig:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        return self


class EngineConfig(Section):
    """The inference engine that samples rollouts: embedded in-process, or vLLM servers."""

    kind: Literal["embedded", "vllm"] = Field(
        "embedded", description="'embedded': sample in the trainer's process; 'vllm': vLLM server(s) at `urls`"
    )
    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature (> 0; the trainer uses the same)")
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
    urls: list[str] = Field(
        default_factory=list, description="base URLs of the vLLM servers (kind = 'vllm'), e.g. http://localhost:8000"
    )
    timeout_s: float = Field(600.0, gt=0, description="timeout of one request to a vLLM server, seconds")
    max_concurrency: int = Field(64, ge=1, description="most requests in flight to the vLLM servers at once")
    sync_every_steps: int = Field(
        1, ge=1,
        description="push the trainer's weights to the vLLM servers after every k-th step (1: on-policy); "
        "rollouts in between are sampled from the last pushed policy, and each records its version. "
        "The embedded engine shares the trainer's module and is always current",
    )
    sync_lora_adapter: bool = Field(
        False,
        description="with LoRA, push only the adapter (MBs) instead of merged full weights (GBs); the servers "
        "load it in place and sample with it (start them with --enable-lora --max-lora-rank >= lora.rank)",
    )
    health_interval_s: float = Field(
        2.0, ge=0,
        description="how often servers that were taken out (or failed to answer at the start) are probed; one "
        "that answers gets the current weights and is put back in (0: never)",
    )
    no_server_wait_s: float = Field(
        60.0, ge=0,
        description="with every server out, how long a request waits for one to come back before the run saves "
        "a checkpoint and stops (then restart the servers and --resume)",
    )
    weights_dir: str | None = Field(
        None,
        description="folder where weights for the vLLM servers are written (must be readable by every server: "
        "a shared filesystem for remote ones); default <run_dir>/engine-weights. Only the latest version is kept",
    )

    @model_validator(mode="after")
    def _urls_for_vllm(self) -> EngineConfig:
        if self.kind == "vllm" and not self.urls:
            raise ValueError("kind 'vllm' needs at least one server in urls, e.g. urls = [\"http://localhost:8000\"]")
        for url in self.urls:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"urls must be http(s)://host[:port] addresses, got {url!r}")
        return self


class RolloutConfig(Section):
    """How many rollouts each step samples, and how rewards become advantages (GRPO family)."""

    prompts_per_step: int = Field(8, ge=1, description="distinct prompts per optimizer batch")
    group_size: int = Field(8, ge=2, le=1024, description="completions sampled per prompt (G)")
    filter_zero_variance: bool = Field(
        True, description="drop groups whose rewards are all equal: no signal (DAPO dynamic sampling)"
    )
    scale_advantages_by_std: bool = Field(
        True, description="divide advantages by the group's std (GRPO); false: Dr. GRPO"
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
        "docs/rewards.md. Checked when the config loads (your module is imported then)",
    )
    reward_timeout_s: float = Field(
        60.0, gt=0, le=86400,
        description="the most seconds one reward function may take on one answer (async ones, and your sync "
        "ones, which run on worker threads); past it the answer scores 0 there, counted in reward_timeouts",
    )

    @field_validator("reward_weights")
    @classmethod
    def _known_reward_functions(cls, weights: dict[str, float]) -> dict[str, float]:
        # Resolving them imports a user's module now, so --dry-run catches a bad name before
        # any model is built. saccade.scoring imports no torch.
        from saccade.scoring import reward_functions

        reward_functions(weights)
        return weights


class LossConfig(Section):
    """The policy loss (`saccade.trainer.loss.policy_loss` takes this very type)."""

    kind: Literal["ppo_clip", "reinforce"] = Field("ppo_clip", description="clipped PPO surrogate, or plain REINFORCE")
    eps_low: float = Field(0.2, ge=0, lt=1, description="the ratio is clipped below at 1 - eps_low")
    eps_high: float = Field(
        0.28, ge=0, le=10, description="the ratio is clipped above at 1 + eps_high (DAPO clip-higher)"
    )
    normalization: Literal["sequence", "token", "constant"] = Field(
        "token",
        description="'sequence': mean per sequence, then over sequences (GRPO); 'token': over all tokens "
        "(DAPO); 'constant': sum / (sequences * max_completion_tokens) (Dr. GRPO)",
    )
    max_completion_tokens: int = Field(
        16, ge=1, description="the constant of 'constant' normalization; set it to engine.max_tokens"
    )
    tis: Literal["auto", "on", "off"] = Field(
        "auto",
        description="truncated importance sampling: 'auto' is on whenever rollouts can come from older weights "
        "than the trainer's (rollout.max_async_level > 0 or engine.sync_every_steps > 1) or tis_cap is set; "
        "'on' always; 'off' never",
    )
    tis_cap: float | None = Field(
        None, gt=0, description="truncated importance sampling cap on pi_old / mu; unset: 2.0 when TIS is on"
    )
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL(pi || reference) penalty (k3 estimator)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of the entropy bonus")


DEFAULT_TIS_CAP = 2.0


def effective_loss(cfg: RunConfig) -> LossConfig:
    """The loss a run trains with: `loss`, with tis_cap set when TIS is on (`loss.tis`). Rollouts
    from older weights than the trainer's (async, or weights pushed every k > 1 steps) are
    reweighted by min(pi_old / mu, cap), so 'auto' turns it on for them."""
    loss = cfg.loss
    off_policy = cfg.rollout.max_async_level > 0 or cfg.engine.sync_every_steps > 1
    on = loss.tis == "on" or (loss.tis == "auto" and (off_policy or loss.tis_cap is not None))
    return loss.model_copy(update={"tis_cap": (loss.tis_cap or DEFAULT_TIS_CAP) if on else None})


class TrainerConfig(Section):
    """The optimizer loop (AdamW): steps, learning-rate schedule, micro-batching, seed."""

    steps: int = Field(40, ge=1, description="optimizer batches (RL steps) to train for")
    lr: float = Field(1e-3, gt=0, le=1, description="peak learning rate (AdamW)")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 to lr over this many steps")
    lr_decay: Literal["constant", "linear", "cosine"] = Field("constant", description="schedule after warm-up")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final lr / peak lr for 'linear' and 'cosine' decay")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    max_tokens: int = Field(4096, ge=16, description="token budget of one packed micro-batch")
    num_iterations: int = Field(1, ge=1, le=64, description="optimizer steps per rollout batch (mu); > 1 is off-policy")
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


class SftConfig(Section):
    """Supervised fine-tuning (`saccade sft`) on the task's reference answers."""

    steps: int = Field(100, ge=1, description="optimizer steps")
    lr: float = Field(1e-3, gt=0, le=1, description="peak learning rate (AdamW)")
    batch_size: int = Field(16, ge=1, description="examples per optimizer step")


# The fields data.prompt_template may name, and the placeholder that places an image
# (saccade.data.shapes.IMAGE_PLACEHOLDER, repeated so this module imports no data code).
PROMPT_TEMPLATE_FIELDS = ("prompt", "choices")
DEFAULT_PROMPT_TEMPLATE = "{prompt}\n{choices}"
IMAGE_PLACEHOLDER = "<image>"


def check_prompt_template(template: str) -> None:
    """Refuse a template that names anything but {prompt} and {choices}, or not {prompt}."""
    import string

    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template) if name is not None]
    except ValueError as err:  # an unmatched brace
        raise ValueError(f"data.prompt_template {template!r}: {err}; write {{{{ and }}}} for literal braces") from None
    for name, spec, conv in fields:
        if name not in PROMPT_TEMPLATE_FIELDS or spec or conv:
            raise ValueError(f"data.prompt_template {template!r} names {{{name}{'!' + conv if conv else ''}"
                             f"{':' + spec if spec else ''}}}; it may name only {{prompt}} and {{choices}} (write "
                             "{{ and }} for literal braces)")
    if "prompt" not in [name for name, _, _ in fields]:
        raise ValueError(f"data.prompt_template {template!r} does not name {{prompt}}: the question would never "
                         "reach the model")


class ColumnsConfig(Section):
    """Task 'dataset': the data set's column names for each part of a question.

    ``images`` holds one image or a list of them (Image feature structs, paths relative to
    the data file, or bytes); ``<image>`` placeholders in the prompt place them, else they go
    first. ``choices`` is a list column of options. Unset optional columns are not read."""

    prompt: str = Field("question", min_length=1, description="the question text (may hold <image> placeholders)")
    answer: str = Field("answer", min_length=1, description="the ground truth: option text or letter, number, text")
    images: str = Field("image", min_length=1, description="the image, or list of images, of each row")
    choices: str | None = Field(
        None, min_length=1, description="a list column of answer options; unset: free-form answers"
    )
    id: str | None = Field(
        None, min_length=1, description="the rows' own ids, used in eval samples and skipped.jsonl; "
        "unset: dataset-<split>-<index>"
    )
    category: str | None = Field(
        None, min_length=1, description="a category per row (text, or a list of them): saccade eval reports "
        "accuracy per category"
    )


class DataConfig(Section):
    """The task: the synthetic shapes questions (built on the spot), or a real data set.

    Data sets (`saccade.data.datasets`) are read through Hugging Face `datasets` from a hub id
    or a local copy; every unset field below takes the task's default."""

    task: str = Field(
        "shapes",
        min_length=1,
        description="'shapes': synthetic shapes, answer by choice; 'views': multi-turn view selection "
        "(see [env]); 'openmmreasoner': OpenMMReasoner-RL-74K (training); 'mathvista': MathVista testmini "
        "(evaluation); 'geometry3k': Geometry3K; 'dataset': your own data set, data.dataset read through "
        "data.columns (docs/data.md); 'verifiers:ENV_ID': a verifiers environment (load_environment(ENV_ID, "
        "**task_args)); 'package.module:make_task': your own Task, make_task(cfg) (docs/rewards.md)",
    )
    task_args: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments for a 'verifiers:ENV_ID' task's load_environment; a "
        "'package.module:make_task' task may read them from cfg.data.task_args",
    )
    eval_size: int = Field(
        64, ge=0, description="held-out evaluation prompts; data sets: the first this many rows of the eval split"
    )
    question_kinds: list[str] = Field(
        default_factory=lambda: ["color"], min_length=1, description="kinds of question asked about each image (shapes)"
    )
    num_choices: int = Field(4, ge=3, le=6, description="answer options per question (shapes)")
    image_size: int = Field(64, ge=32, le=4096, description="side of the generated square images, pixels (shapes)")
    blank_images: bool = Field(
        False, description="replace every image by a blank one: the control run, which must not learn"
    )
    dataset: str | None = Field(
        None, min_length=1,
        description="hub id, local folder laid out like a hub repository, or parquet / JSONL file(s) (a path or "
        "glob) of the data set; unset: the task's hub id (OpenMMReasoner/OpenMMReasoner-RL-74K, AI4Math/MathVista, "
        "hiyouga/geometry3k); required by 'dataset'; ignored by 'shapes'",
    )
    columns: ColumnsConfig = Field(
        default_factory=ColumnsConfig,
        description="task 'dataset': which column holds what (the prompt, the answer, the images, ...)",
    )
    prompt_template: str = Field(
        DEFAULT_PROMPT_TEMPLATE, min_length=1,
        description="task 'dataset': the user turn's text, a str.format template over {prompt} (the prompt "
        "column, required) and {choices} (the options lettered A., B., ... one a line; empty without "
        "options); the text is stripped. Write {{ and }} for literal braces",
    )
    system_prompt: str | None = Field(
        None, min_length=1, description="task 'dataset': the system turn of every prompt; unset: none"
    )
    split: str = Field("train", min_length=1, description="dataset split to train on")
    subsets: list[str] | None = Field(
        None, min_length=1,
        description="dataset configs to train on, rows concatenated; unset: openmmreasoner's seven training "
        "configs (algopuzzle, mmk12, thinklite_vl_hard, tqa_train, virl39k, wemath_pro, wemath_standard), "
        "else the default config",
    )
    eval_dataset: str | None = Field(
        None, min_length=1, description="hub id or path of the held-out data set; unset: the same as dataset"
    )
    eval_split: str | None = Field(
        None, min_length=1,
        description="held-out split; unset: openmmreasoner 'val', mathvista 'testmini', geometry3k 'test'; "
        "'dataset': 'test' when the eval data set has it, else 'validation', else refused (a single file "
        "has no held-out split: set data.eval_dataset to another file)",
    )
    eval_subsets: list[str] | None = Field(
        None, min_length=1,
        description="held-out configs; unset: openmmreasoner ['validation'], else the default config",
    )
    max_skip_fraction: float = Field(
        0.05, ge=0, lt=1,
        description="data sets: stop the run when more than this share of the last 200 rows read were skipped "
        "as broken (each skipped row is listed in <run_dir>/skipped.jsonl; saccade.data.rows)",
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        # A user's make_task module is imported now and a verifiers env's module looked up
        # (not imported), so --dry-run catches a bad name before any model is built.
        from saccade.plugins import VERIFIERS_PREFIX, check_verifiers_env, is_import_path, load_callable

        if task.startswith(VERIFIERS_PREFIX):
            check_verifiers_env(task[len(VERIFIERS_PREFIX):])
        elif is_import_path(task):
            load_callable(task)
        elif task not in BUILTIN_TASKS:
            close = difflib.get_close_matches(task, BUILTIN_TASKS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown task {task!r}; {hint}built-in: {', '.join(BUILTIN_TASKS)}; or "
                             "'verifiers:ENV_ID', or your own as 'package.module:make_task'")
        return task

    @model_validator(mode="after")
    def _task_args_read(self) -> DataConfig:
        if self.task_args and self.task in BUILTIN_TASKS:
            raise ValueError(f"task_args are read only by 'verifiers:ENV_ID' and 'package.module:make_task' "
                             f"tasks, not by {self.task!r}: remove them")
        return self

    @model_validator(mode="after")
    def _shapes_kinds(self) -> DataConfig:
        # The same list as saccade.data.shapes.KINDS, repeated so that a typo is caught by
        # --dry-run without importing the task's code.
        if self.task == "shapes":
            unknown = [k for k in self.question_kinds if k not in SHAPES_QUESTION_KINDS]
            if unknown:
                choose = ", ".join(SHAPES_QUESTION_KINDS)
                raise ValueError(f"question_kinds {unknown} unknown to task 'shapes'; choose from {choose}")
            if len(set(self.question_kinds)) != len(self.question_kinds):
                raise ValueError(f"question_kinds {self.question_kinds} repeat an entry")
        if self.task == "scenes":
            unknown = [k for k in self.question_kinds if k not in SCENE_QUESTION_KINDS]
            if unknown:
                raise ValueError(f"question_kinds {unknown} unknown to task 'scenes'; choose from "
                                 f"{', '.join(SCENE_QUESTION_KINDS)}")
        for name in ("subsets", "eval_subsets"):
            names = getattr(self, name)
            if names is not None and len(set(names)) != len(names):
                raise ValueError(f"{name} {names} repeat an entry")
        return self

    @model_validator(mode="after")
    def _own_data_set(self) -> DataConfig:
        if self.task == "dataset" and self.dataset is None:
            raise ValueError("data.task = 'dataset' needs data.dataset: a hub id, a local folder laid out like a "
                             "hub repository, or a parquet / JSONL file or glob")
        check_prompt_template(self.prompt_template)
        if self.system_prompt is not None and IMAGE_PLACEHOLDER in self.system_prompt:
            raise ValueError(f"data.system_prompt holds {IMAGE_PLACEHOLDER}: images go in the user turn; put the "
                             "placeholder in the prompt column or data.prompt_template")
        # Fields only 'dataset' reads: changed for another task they would silently do nothing.
        # (Compared with the defaults, not looked up in model_fields_set: --dry-run writes every value.)
        if self.task != "dataset":
            defaults = DataConfig.model_fields
            unused = [name for name in ("columns", "prompt_template", "system_prompt")
                      if getattr(self, name) != defaults[name].get_default(call_default_factory=True)]
            if unused:
                raise ValueError(f"only data.task = 'dataset' reads data.{', data.'.join(unused)} (the task is "
                                 f"{self.task!r}): remove them or set data.task = 'dataset'")
        return self


class EvalConfig(Section):
    """Periodic evaluation on the held-out prompts."""

    every_steps: int = Field(10, ge=0, description="evaluate (greedy decoding) every this many steps; 0: never")
    samples_k: int = Field(
        1, ge=1, le=1024, description="saccade eval: samples per prompt at engine.temperature, for pass@k (n)"
    )


class CheckpointConfig(Section):
    """Saving the trained weights (the LoRA adapter, or the full model) to <run_dir>/checkpoints."""

    every_steps: int = Field(0, ge=0, description="save every this many steps, and at the end; 0: only at the end")
    keep_last: int = Field(2, ge=1, description="checkpoints kept on disk; older ones are deleted")


class LogConfig(Section):
    """Where metrics, samples of the completions and the resolved config go."""

    dir: str | None = Field(None, min_length=1, description="run folder; unset: runs/<name>")
    name: str = Field("demo", pattern=_NAME_PATTERN, description="run name (letters, digits, '.', '_', '-')")
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


VIEW_PLACES = ("left", "right", "ceiling", "floor", "far")
# The same list as saccade.data.shapes.COLORS, repeated so that --dry-run catches a typo
# without importing the renderer (tests/test_config.py checks the two agree).
VIEW_COLORS = ("red", "green", "blue", "yellow", "purple", "orange")
# Mesh scenes also name scanned objects' neutral colours (saccade.scenes.mesh.SCENE_COLORS).
SCENE_COLORS = (*VIEW_COLORS, "white", "gray", "black", "brown")


class EnvConfig(Section):
    """Multi-turn episodes (data.task = "views", a verifiers env): turns, rewards, and what the loss trains on."""

    max_turns: int = Field(
        3, ge=1, le=64,
        description="assistant turns per episode at most (a verifiers env: caps the env's own max_turns)",
    )
    turn_cost: float = Field(0.0, ge=0, le=1, description="reward subtracted per extra turn taken")
    places: list[str] = Field(
        default_factory=lambda: list(VIEW_PLACES), min_length=1,
        description="views: where the asked-about object may be (left, right, ceiling, floor, far)",
    )
    image_size: int = Field(64, ge=32, le=1024, description="views: side of the rendered square views, pixels")
    distractors: int = Field(2, ge=0, le=4, description="views: objects in the start view (never the answer's color)")
    require_seen: bool = Field(True, description="views: an answer counts only once the object has been in view")
    look_reward: float = Field(
        0.0, ge=0, le=1, description="views: per-turn reward for the action that first brings the object into view"
    )
    colors: list[str] = Field(
        default_factory=lambda: list(VIEW_COLORS), min_length=3,
        description="views: the objects' colors, and so the answers (red, green, blue, yellow, purple, orange)",
    )
    scene_dir: str | None = Field(
        None, min_length=1,
        description="scenes: a folder of scenes loaded with saccade.scenes.loaders.load_scene (ScanNet or "
        "ARKitScenes scene folders, .ply/.obj/.glb files); unset: generated rooms, training and held-out rooms "
        "from different seeds",
    )
    eval_scenes: int = Field(
        1, ge=0, le=100_000,
        description="scenes with env.scene_dir: the last this many scenes (by name) are held out for evaluation; "
        "0: evaluate on the training scenes (questions from another seed)",
    )
    render_size: int = Field(128, ge=32, le=1024, description="scenes: side of the rendered square views, pixels")
    fov_deg: float = Field(60.0, ge=20, le=120, description="scenes: the camera's horizontal field of view, degrees")
    start_poses: int = Field(
        4, ge=1, le=64,
        description="scenes: candidate start poses per question (valid, not showing the asked-about objects); "
        "each episode starts from one of them",
    )
    start_turn: float = Field(
        0.0, ge=0, le=180,
        description="scenes: 0: start poses anywhere in the room; > 0: each start pose is a good view of the "
        "objects turned away by this many degrees, so one 'turn <start_turn> left/right' shows them",
    )
    say_side: bool = Field(
        False, description="scenes with start_turn > 0: the question says which side the objects are on "
        "('What color is the chair to your left?')",
    )
    view_fill: float = Field(
        0.9, gt=0, le=4,
        description="scenes with start_turn > 0: the view a start turns away from frames the objects' box to "
        "this share of the view's width (above 1: closer, the objects overflow the view)",
    )
    start_clear: float = Field(
        1.0, ge=0, le=1,
        description="scenes: a start view may show other labelled objects on at most this fraction of its "
        "pixels (1: no limit; the views demo's 'no distractors' is about 0.01)",
    )
    view_reward: float = Field(
        0.0, ge=0, le=10,
        description="scenes: weight of the largest fraction of the image the asked-about objects covered in "
        "any view, added to the answering turn's reward",
    )
    seen_fraction: float = Field(
        0.01, ge=0, le=1,
        description="scenes: the objects count as seen (env.require_seen) once they cover this fraction of a view",
    )
    describe_actions: bool = Field(
        True, description="scenes: the prompt lists the action grammar (off for the tiny demo model, which "
        "copies from such lists)",
    )
    max_total_tokens: int = Field(4096, ge=64, description="an episode ends once its next turn would not fit this")
    loss_on: Literal["assistant", "markers"] = Field(
        "assistant", description="train on every sampled assistant token, or only on those inside loss_markers"
    )
    loss_markers: list[str] = Field(
        default_factory=lambda: ["[ACTION]", "[/ACTION]"], min_length=2, max_length=2,
        description="the open and close markers for loss_on = 'markers'",
    )
    correct_metric: str | None = Field(
        None, min_length=1,
        description="verifiers environments: the rubric function whose score counts as success (accuracy "
        "metrics); unset: accuracy stays 0 and the rubric's scores are logged as env_<function>",
    )
    check_consistency: Literal["first", "always", "never"] = Field(
        "first", description="compare the engine's inputs with the training samples on the first step, every step, or never"
    )

    @model_validator(mode="after")
    def _known_places(self) -> EnvConfig:
        unknown = [p for p in self.places if p not in VIEW_PLACES]
        if unknown:
            raise ValueError(f"places {unknown} unknown; choose from {', '.join(VIEW_PLACES)}")
        unknown = [c for c in self.colors if c not in SCENE_COLORS]
        if unknown:
            raise ValueError(f"colors {unknown} unknown; choose from {', '.join(VIEW_COLORS)} (and, for "
                             f"data.task = 'scenes', {', '.join(SCENE_COLORS[len(VIEW_COLORS):])})")
        if len(set(self.colors)) != len(self.colors):
            raise ValueError(f"colors {self.colors} repeat an entry")
        if len(self.colors) <= self.distractors:
            raise ValueError(f"{self.distractors} distractors need more than {len(self.colors)} colors: "
                             "lower env.distractors or add colors")
        return self


class RunConfig(Section):
    """Everything an RL or SFT run reads. The defaults are a CPU demo on the built-in tiny model."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy checkpoint")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters or full fine-tuning")
    images: ImagesConfig = Field(default_factory=ImagesConfig, description="image limits")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the inference engine")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="sampling and advantages")
    loss: LossConfig = Field(default_factory=LossConfig, description="the policy loss")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="the optimizer loop")
    sft: SftConfig = Field(default_factory=SftConfig, description="supervised fine-tuning")
    data: DataConfig = Field(default_factory=DataConfig, description="the task or dataset")
    env: EnvConfig = Field(default_factory=EnvConfig, description="multi-turn episodes")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="periodic evaluation")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="saving weights")
    log: LogConfig = Field(default_factory=LogConfig, description="metrics and the run folder")

    @property
    def run_dir(self) -> Path:
        """The run folder: log.dir, else runs/<log.name>."""
        return Path(self.log.dir) if self.log.dir else Path("runs") / self.log.name

    @property
    def checkpoint_dir(self) -> Path:
        """<run_dir>/checkpoints: where `saccade rl` saves and `--resume` looks."""
        return self.run_dir / "checkpoints"

    @model_validator(mode="after")
    def _async_needs_servers(self) -> RunConfig:
        if self.rollout.max_async_level > 0 and self.engine.kind != "vllm":
            raise ValueError(
                f"rollout.max_async_level = {self.rollout.max_async_level} needs vLLM servers (engine.kind = "
                "'vllm'): the embedded engine samples from the very weights being trained, so it cannot sample "
                "ahead of them; set rollout.max_async_level = 0"
            )
        return self

    @model_validator(mode="after")
    def _scenes_fields(self) -> RunConfig:
        if self.data.task == "views":
            neutral = [c for c in self.env.colors if c not in VIEW_COLORS]
            if neutral:
                raise ValueError(f"env.colors {neutral} are for data.task = 'scenes'; the views room draws "
                                 f"{', '.join(VIEW_COLORS)}")
        if self.data.task == "scenes":
            if self.env.say_side and self.env.start_turn == 0:
                raise ValueError("env.say_side needs env.start_turn > 0: only then is the asked-about object on "
                                 "one side of the start view")
            if "color" in self.data.question_kinds and self.data.num_choices > len(self.env.colors):
                raise ValueError(f"data.num_choices = {self.data.num_choices} color options need at least as many "
                                 f"env.colors, got {self.env.colors}: lower data.num_choices or add colors")
        return self

    @model_validator(mode="after")
    def _views_choices_fit_palette(self) -> RunConfig:
        if self.data.task == "views" and self.data.num_choices > len(self.env.colors):
            raise ValueError(f"data.num_choices = {self.data.num_choices} options need at least as many "
                             f"env.colors, got {self.env.colors}: lower data.num_choices or add colors")
        return self


# ---------------------------------------------------------------------------------------------
# Command line: splitting and parsing dotted overrides
# ---------------------------------------------------------------------------------------------

_OVERRIDE = re.compile(r"^--([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)+)(=.*)?$", re.DOTALL)


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split argv into (tokens for argparse, dotted override tokens).

    ``--a.b value`` and ``--a.b=value`` (any option whose name has a dot) are overrides; the
    token after ``--a.b`` is its value, even if it starts with '-' (``--trainer.lr -1``),
    unless it is itself an option (``--x``). Everything after a bare ``--`` goes to argparse.
    """
    known: list[str] = []
    overrides: list[str] = []
    i = 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        if token == "--":
            known.extend(argv[i:])
            break
        m = _OVERRIDE.match(token)
        if m is None:
            known.append(token)
        elif m.group(2) is not None:
            overrides.append(token)
        else:
            overrides.append(token)
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        i += 1
    return known, overrides


def parse_overrides(tokens: Sequence[str]) -> list[tuple[str, str, str]]:
    """argv-style override tokens -> [(source, dotted path, raw value)].

    Accepts ``--a.b value``, ``--a.b=value`` and, for top-level fields of a flat model,
    ``--a value``. `source` is how the override is named in errors (``--a.b``).
    """
    out: list[tuple[str, str, str]] = []
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ConfigError(f"{token!r}: expected an override such as --trainer.lr 1e-5 or --trainer.lr=1e-5")
        name, eq, value = token[2:].partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", name):
            raise ConfigError(f"{token!r}: not a valid override name (expected --section.field)")
        if not eq:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise ConfigError(f"--{name}: needs a value (--{name} VALUE or --{name}=VALUE)")
            value = tokens[i + 1]
            i += 1
        out.append((f"--{name}", name, value))
        i += 1
    return out


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the optional CONFIG positional (a TOML file) and --dry-run to `parser`.

    Dotted overrides are not argparse options: split them off with `split_overrides` before
    `parser.parse_args` (see the module docstring for the whole pattern).
    """
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        metavar="CONFIG",
        help="a TOML config file (default: the built-in defaults); then any number of dotted "
        "overrides such as --trainer.lr 1e-5 or --lora.target_modules '[\"q_proj\"]'",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print the resolved config as TOML and exit without running"
    )
    return parser


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _unwrap(annotation: Any) -> list[Any]:
    """The members of a union annotation (or the annotation itself)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return list(typing.get_args(annotation))
    return [annotation]


def _model_class(annotation: Any) -> type[BaseModel] | None:
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_dict(annotation: Any) -> bool:
    return any(typing.get_origin(m) in (dict, Mapping) or m is dict for m in _unwrap(annotation))


def _admits(annotation: Any, kind: type) -> bool:
    """Does the annotation accept a plain `kind` (str or NoneType), directly or in a union?"""
    for member in _unwrap(annotation):
        if member is kind or member is Any:
            return True
        if kind is str and typing.get_origin(member) is Literal:
            if any(isinstance(a, str) for a in typing.get_args(member)):
                return True
    return False


def _unknown_key(cls: type[BaseModel], prefix: str, key: str) -> str:
    """'unknown key 'trainer.lrr'; did you mean 'trainer.lr'? Valid keys in [trainer]: ...'."""
    valid = list(cls.model_fields)
    dotted = f"{prefix}." if prefix else ""
    msg = f"unknown key {dotted + key!r}"
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {dotted + close[0]!r}?"
    where = f"in [{prefix}]" if prefix else "at the top level"
    return msg + f" Valid keys {where}: {', '.join(valid)}"


def _field_at(cls: type[BaseModel], path: str, source: str) -> tuple[Any, Any]:
    """(annotation of the value at `path`, the dict field's FieldInfo if `path` is one key of a
    dict field, else None). ConfigError for an unknown key, with the valid keys at that level."""
    parts = path.split(".")
    current: type[BaseModel] = cls
    for i, part in enumerate(parts):
        if part not in current.model_fields:
            raise ConfigError(f"{source}: {_unknown_key(current, '.'.join(parts[:i]), part)}")
        info = current.model_fields[part]
        rest = parts[i + 1 :]
        if not rest:
            return info.annotation, None
        sub = _model_class(info.annotation)
        if sub is not None:
            current = sub
            continue
        if _is_dict(info.annotation) and len(rest) == 1:
            for member in _unwrap(info.annotation):
                args = typing.get_args(member)
                if len(args) == 2:
                    return args[1], info
            return Any, info
        raise ConfigError(f"{source}: {'.'.join(parts[: i + 1])} is a value, not a section; it has no key {rest[0]!r}")
    raise AssertionError("unreachable")


def _parse_value(raw: str, annotation: Any) -> Any:
    """JSON when it parses, else the raw string; a string field keeps the raw text."""
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str):
        return value
    if value is None:
        return None if _admits(annotation, type(None)) or not _admits(annotation, str) else raw
    if _admits(annotation, str) and not isinstance(value, list | dict):
        return raw  # "--log.name 123" is the string "123"
    return value


def _set_path(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _get_path(data: dict, parts: list[str]) -> Any:
    node: Any = data
    for part in parts:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _deep_merge(base: Any, update: dict) -> dict:
    merged = dict(base) if isinstance(base, dict) else {}
    for key, value in update.items():
        merged[key] = _deep_merge(merged.get(key), value) if isinstance(value, dict) else value
    return merged


def _loc_to_path(loc: tuple) -> str:
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        else:
            out += f".{item}" if out else str(item)
    return out


def _touches(override_path: str, error_path: str) -> bool:
    """Could the override at `override_path` be the cause of an error at `error_path`?"""
    o, e = override_path, error_path
    return not e or e == o or e.startswith((o + ".", o + "[")) or o.startswith(e + ".")


def _format_error(cls: type[BaseModel], err: dict, file_label: str | None, overrides: list[tuple[str, str]]) -> str:
    loc = tuple(err["loc"])
    path = _loc_to_path(loc)
    if err["type"] == "extra_forbidden" and loc:
        # The model class that refused the key: walk the schema down to loc[:-1].
        current: type[BaseModel] | None = cls
        for part in loc[:-1]:
            if current is None or not isinstance(part, str) or part not in current.model_fields:
                current = None
                break
            current = _model_class(current.model_fields[part].annotation)
        key = str(loc[-1])
        prefix = _loc_to_path(loc[:-1])
        what = _unknown_key(current, prefix, key) if current is not None else f"unknown key {path!r}"
    else:
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        msg = msg[:1].lower() + msg[1:]
        if err["type"] not in ("value_error", "assertion_error", "missing") and "input" in err:
            shown = err["input"]
            if not isinstance(shown, dict | BaseModel):
                msg += f" (got {json.dumps(shown) if not isinstance(shown, str) else repr(shown)})"
        what = msg
    # Name the source: the last override touching this path, else the file, else the defaults.
    source = None
    for label, opath in reversed(overrides):
        if _touches(opath, path):
            source = label
            break
    if source is None:
        source = file_label or "config"
    if source.startswith("--") and source[2:] == path:
        return f"{source}: {what}"
    if err["type"] == "extra_forbidden":
        return f"{source}: {what}"
    return f"{source}: {path or '(top level)'}: {what}"


def load_config(cls: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()) -> M:
    """Defaults of `cls`, then the TOML file at `path` (if any), then the override tokens.

    `overrides` are argv-style tokens (``["--trainer.lr", "1e-5", "--lora.rank=8"]``), e.g.
    the second value of `split_overrides`. Raises ConfigError for any mistake.
    """
    data: dict[str, Any] = {}
    file_label = None
    if path is not None:
        file_label = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{file_label}: config file not found")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{file_label}: invalid TOML: {e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{file_label}: not UTF-8 text: {e}") from None

    applied: list[tuple[str, str]] = []
    for source, dotted, raw in parse_overrides(overrides):
        annotation, dict_field = _field_at(cls, dotted, source)
        value = _parse_value(raw, annotation)
        parts = dotted.split(".")
        if dict_field is not None and not isinstance(_get_path(data, parts[:-1]), dict):
            # One key of a dict field: the other keys keep their default values.
            default = dict_field.get_default(call_default_factory=True)
            _set_path(data, parts[:-1], dict(default) if isinstance(default, dict) else {})
        if _model_class(annotation) is not None and isinstance(value, dict):
            value = _deep_merge(_get_path(data, parts), value)  # a section as JSON merges into the file's
        _set_path(data, parts, value)
        applied.append((source, dotted))

    try:
        return cls.model_validate(data)
    except ValidationError as e:
        lines = [_format_error(cls, err, file_label, applied) for err in e.errors()]
        if len(lines) == 1:
            raise ConfigError(lines[0]) from None
        raise ConfigError(f"{len(lines)} errors in the config:\n  " + "\n  ".join(lines)) from None


# ---------------------------------------------------------------------------------------------
# Writing TOML
# ---------------------------------------------------------------------------------------------

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _toml_string(key)


def _toml_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(value: Any) -> str:
    if value is None:
        raise ValueError("TOML has no null; a None value can only be written by leaving its key out")
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise ValueError(f"cannot write {type(value).__name__} {value!r} as TOML")


def _comment(text: str | None) -> list[str]:
    if not text:
        return []
    return [f"# {line}".rstrip() for line in text.strip().splitlines()]


def _write_model(model: BaseModel, prefix: str, comments: bool, out: list[str]) -> None:
    fields = type(model).model_fields
    dumped = model.model_dump(mode="json")
    tables: list[tuple[str, BaseModel]] = []
    for name, info in fields.items():
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            tables.append((name, value))
            continue
        if value is None:
            if info.default is not None:
                raise ValueError(
                    f"{prefix + '.' if prefix else ''}{name} is None but its default is not: TOML cannot say so"
                )
            if comments:
                out.extend(_comment(info.description))
                out.append(f"# {_toml_key(name)}: unset")
            continue
        if comments:
            out.extend(_comment(info.description))
        out.append(f"{_toml_key(name)} = {_toml_value(dumped[name])}")
    for name, sub in tables:
        table = f"{prefix}.{_toml_key(name)}" if prefix else _toml_key(name)
        if out:
            out.append("")
        if comments:
            doc = type(sub).__doc__ or ""
            out.extend(_comment(doc.strip().split("\n\n")[0]))
        out.append(f"[{table}]")
        _write_model(sub, table, comments, out)


def config_to_toml(model: BaseModel, *, comments: bool = False) -> str:
    """The model as TOML text that `load_config(type(model), ...)` reads back to an equal model.

    Nested models become tables; None values are left out (they must be the defaults). With
    `comments`, each table and key is preceded by its docstring / description.
    """
    out: list[str] = []
    _write_model(model, "", comments, out)
    return "\n".join(out) + "\n"


def describe(model: BaseModel) -> str:
    """The resolved config as commented TOML, for --dry-run (it loads back like any config file)."""
    header = f"# resolved {type(model).__name__} (saccade --dry-run); every value below is in effect\n\n"
    return header + config_to_toml(model, comments=True)
