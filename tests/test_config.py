"""Config: TOML files into nested models, dotted overrides, clear errors, TOML round trip."""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import typing
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from saccade.config import (
    ConfigError,
    ImagesConfig,
    LoraConfig,
    LossConfig,
    TASK_CONFIGS,
    LegacyConfigWarning,
    RunConfig,
    Section,
    add_config_arguments,
    config_to_toml,
    describe,
    load_config,
    split_overrides,
)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = [ROOT / "configs" / "demo.toml", ROOT / "configs" / "qwen3vl-2b-1gpu.toml"]

# The servers a vLLM engine needs: sync_every_steps is a field of kind "vllm" only.
VLLM = ("--engine.kind", "vllm", "--engine.urls", '["http://a:1"]')


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error(*args) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, *args)
    assert isinstance(info.value, ValueError)
    return str(info.value)


# --- loading ---------------------------------------------------------------------------------


def test_defaults_without_a_file():
    cfg = load_config(RunConfig, None, [])
    assert cfg == RunConfig()
    assert cfg.model.path == "tiny" and cfg.engine.kind == "embedded"
    assert cfg.rollout.reward_weights == {"correct": 1.0}
    assert cfg.run_dir == Path("runs/demo") and cfg.checkpoint_dir == Path("runs/demo/checkpoints")


def test_toml_tables_map_to_nested_models(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        path = "Qwen/Qwen3-VL-2B-Instruct"
        dtype = "bfloat16"

        [trainer]
        lr = 3e-5
        steps = 7

        [rollout]
        reward_weights = { correct = 1.0, format = 0.25 }

        [log]
        name = "x"
        dir = "/tmp/somewhere"
        """,
    )
    cfg = load_config(RunConfig, path, [])
    assert cfg.model.path == "Qwen/Qwen3-VL-2B-Instruct" and cfg.model.dtype == "bfloat16"
    assert cfg.trainer.lr == 3e-5 and cfg.trainer.steps == 7
    assert cfg.trainer.seed == 0  # untouched keys keep their defaults
    assert cfg.rollout.reward_weights == {"correct": 1.0, "format": 0.25}
    assert cfg.run_dir == Path("/tmp/somewhere")
    assert cfg.checkpoint_dir == Path("/tmp/somewhere/checkpoints")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(RunConfig, path, [])
    if "qwen3vl-2b" in path.name:
        assert cfg.model.path == "Qwen/Qwen3-VL-2B-Instruct"
        assert (cfg.model.dtype, cfg.model.attn_implementation) == ("bfloat16", "auto")
        assert cfg.lora is not None and cfg.engine.kind == "vllm" and len(cfg.engine.urls) == 1
        assert cfg.rollout.group_size == 8 and cfg.sampling.max_tokens == 2048
        assert cfg.images.max_pixels == 802816 and cfg.launch.shares_gpu()
    else:
        assert cfg.model.path == "tiny" and cfg.engine.kind == "embedded"
        assert cfg.model.dtype == "float32" and cfg.task.kind == "shapes"


# --- overrides -------------------------------------------------------------------------------


def test_overrides_of_each_type(tmp_path):
    path = write(tmp_path, "[trainer]\nlr = 1e-3\nsteps = 5\n")
    cfg = load_config(
        RunConfig,
        path,
        [
            "--trainer.lr", "1e-5",  # float, over the file's value
            "--trainer.steps=12",  # int, --a.b=c form
            "--lora.rank", "8",  # int
            "--task.blank_images=true",
            "--lora.target_modules", '["q_proj","v_proj"]',  # list as JSON
            "--model.path", "Qwen/Qwen3-VL-2B-Instruct",  # plain string
            "--log.name", "123",  # a string field keeps the text, not the number
            "--sampling.top_p", "0.9",
            "--loss.tis_cap", "2",  # int into float | None
            "--rollout.reward_weights.format", "0.5",  # one key of a dict field
            "--task.question_kinds=[\"color\", \"shape\"]",
        ],
    )  # fmt: skip
    assert cfg.trainer.lr == 1e-5 and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.steps == 12 and isinstance(cfg.trainer.steps, int)
    assert cfg.lora is not None and cfg.lora.rank == 8
    assert cfg.task.blank_images is True
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.path == "Qwen/Qwen3-VL-2B-Instruct"
    assert cfg.log.name == "123"
    assert cfg.sampling.top_p == 0.9
    assert cfg.loss.tis_cap == 2.0
    assert cfg.rollout.reward_weights == {"correct": 1.0, "format": 0.5}
    assert cfg.task.question_kinds == ["color", "shape"]


def test_override_null_and_whole_dict(tmp_path):
    path = write(tmp_path, '[loss]\ntis_cap = 2.0\n[task]\nkind = "mathvista"\ndataset = "some/dataset"\n')
    cfg = load_config(
        RunConfig, path, ["--loss.tis_cap", "null", "--task.dataset=null", "--rollout.reward_weights", '{"format": 2}']
    )
    assert cfg.loss.tis_cap is None and cfg.task.dataset is None
    assert cfg.rollout.reward_weights == {"format": 2.0}


def test_negative_number_is_a_value_not_an_option():
    known, overrides = split_overrides(["rl", "cfg.toml", "--trainer.seed", "-1", "--dry-run"])
    assert known == ["rl", "cfg.toml", "--dry-run"]
    assert overrides == ["--trainer.seed", "-1"]
    assert "greater than or equal to 0" in error(None, overrides)


def test_split_overrides_and_argparse_pattern():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    argv = ["configs/demo.toml", "--trainer.lr", "1e-5", "--dry-run", "--lora=true", "--lora.rank=4",
            "--sampling.top_p", "0.5"]
    known, overrides = split_overrides(argv)
    assert known == ["configs/demo.toml", "--dry-run"]
    assert overrides == ["--trainer.lr", "1e-5", "--lora=true", "--lora.rank=4", "--sampling.top_p", "0.5"]
    args = parser.parse_args(known)
    assert args.config == "configs/demo.toml" and args.dry_run
    cfg = load_config(RunConfig, ROOT / args.config, overrides)
    assert (cfg.trainer.lr, cfg.lora.rank, cfg.sampling.top_p) == (1e-5, 4, 0.5)
    args = parser.parse_args(split_overrides(["--trainer.lr", "1e-5"])[0])
    assert args.config is None and not args.dry_run


# --- errors ----------------------------------------------------------------------------------


def test_unknown_key_in_toml_suggests(tmp_path):
    path = write(tmp_path, "[trainer]\nlrr = 1e-5\n")
    msg = error(path, [])
    assert str(path) in msg
    assert "unknown key 'trainer.lrr'" in msg and "did you mean 'trainer.lr'" in msg
    assert "steps" in msg and "weight_decay" in msg  # the valid keys at that level

    path = write(tmp_path, "[trainr]\nlr = 1e-5\n")
    msg = error(path, [])
    assert "did you mean 'trainer'" in msg and "lora" in msg


def test_unknown_key_in_override_suggests():
    msg = error(None, ["--trainer.lrr", "1e-5"])
    assert msg.startswith("--trainer.lrr: ")
    assert "did you mean 'trainer.lr'" in msg and "num_iterations" in msg
    msg = error(None, ["--lroa.rank=4"])
    assert msg.startswith("--lroa.rank: ") and "did you mean 'lora'" in msg
    assert "has no key" in error(None, ["--trainer.lr.x", "1"])
    assert "needs a value" in error(None, ["--trainer.lr"])


def test_out_of_bounds_names_the_override_and_path(tmp_path):
    msg = error(None, ["--trainer.lr", "-1"])
    assert msg.startswith("--trainer.lr: input should be greater than 0")
    assert "--rollout.group_size" in error(None, ["--rollout.group_size", "1"])
    assert "lora.target_modules[0]" in error(None, ["--lora.target_modules", "[1]"])
    assert error(None, ["--lora", "maybe"]).startswith("--lora: lora is a [lora] table (LoRA) or false")
    assert "--trainer.steps" in error(None, ["--trainer.steps", "1.5"])
    assert "--model.dtype" in error(None, ["--model.dtype", "float16"])

    path = write(tmp_path, "[lora]\ndropout = 1.0\n")
    msg = error(path, [])
    assert str(path) in msg and "lora.dropout" in msg and "less than 1" in msg


def test_several_errors_are_all_reported(tmp_path):
    msg = error(None, ["--trainer.lr", "0", "--task.num_choices", "9"])
    assert "2 errors" in msg and "--trainer.lr" in msg and "--task.num_choices" in msg


def test_min_pixels_above_max_pixels_refused(tmp_path):
    msg = error(None, ["--images.min_pixels", "100000000"])
    assert "--images.min_pixels" in msg and "min_pixels" in msg and "max_pixels" in msg
    path = write(tmp_path, "[images]\nmin_pixels = 4096\nmax_pixels = 1024\n")
    assert str(path) in error(path, [])
    cfg = RunConfig()
    with pytest.raises(ValidationError):
        cfg.images.min_pixels = 10**9  # assignment is validated too


def test_vllm_needs_a_url():
    assert "urls" in error(None, ["--engine.kind", "vllm"])
    cfg = load_config(RunConfig, None, ["--engine.kind", "vllm", "--engine.urls", '["http://localhost:8000"]'])
    assert cfg.engine.urls == ["http://localhost:8000"]
    assert "http" in error(None, ["--engine.kind", "vllm", "--engine.urls", '["localhost:8000"]'])
    # the servers' fields are vllm's alone: on the embedded engine the error says which kind has them
    assert "engine.urls is a field of kind 'vllm'" in error(None, ["--engine.urls", '["http://localhost:8000"]'])


def test_shapes_question_kinds_checked():
    msg = error(None, ["--task.question_kinds", '["colour"]'])
    assert "--task.question_kinds" in msg and "colour" in msg and "count" in msg
    assert "repeat" in error(None, ["--task.question_kinds", '["color","color"]'])
    from saccade.config import SHAPES_QUESTION_KINDS
    from saccade.data.shapes import KINDS

    assert tuple(SHAPES_QUESTION_KINDS) == KINDS


def test_views_colors_checked():
    assert "purpel" in error(None, ["--task.kind", "views", "--task.colors", '["red","green","purpel"]'])
    assert "repeat" in error(None, ["--task.kind", "views", "--task.colors", '["red","green","red"]'])
    msg = error(None, ["--task.kind", "views", "--task.num_choices", "4", "--task.colors", '["red","green","blue"]'])
    assert "num_choices" in msg and "at least as many colors" in msg
    assert "distractors" in error(None, ["--task.kind", "views", "--task.distractors", "3", "--task.num_choices", "3",
                                         "--task.colors", '["red","green","blue"]'])
    from saccade.config import VIEW_COLORS
    from saccade.data.shapes import COLORS

    assert tuple(VIEW_COLORS) == tuple(COLORS)


def test_file_errors(tmp_path):
    assert "not found" in error(tmp_path / "missing.toml", [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\nlr = 1")
    assert "invalid TOML" in error(bad, [])


# --- writing ---------------------------------------------------------------------------------


def test_config_to_toml_round_trip(tmp_path):
    cfg = load_config(
        RunConfig,
        None,
        [
            "--trainer.lr=1.5e-5",
            "--loss.tis_cap=2.5",
            "--task.kind", "dataset", "--task.dataset", 'some/ds "quoted" \\ ü',
            "--rollout.reward_weights", '{"correct": 1, "saccade.rewards:format_reward": 0.1}',
            "--engine.kind=vllm", "--engine.urls", '["http://a:1", "http://b:2"]',
            "--trainer.torch_threads=2",
        ],
    )  # fmt: skip
    for text in (config_to_toml(cfg), describe(cfg)):
        path = tmp_path / "round.toml"
        path.write_text(text)
        assert load_config(RunConfig, path, []) == cfg
    for shipped in SHIPPED:
        cfg = load_config(RunConfig, shipped, [])
        path.write_text(config_to_toml(cfg))
        assert load_config(RunConfig, path, []) == cfg


def test_describe_is_commented_toml():
    text = describe(RunConfig())
    assert "[trainer]" in text and "lr = 0.001" in text
    assert "# peak learning rate" in text  # descriptions as comments
    assert "# tis_cap: unset" in text


def test_every_field_has_a_description_and_every_section_a_docstring():
    def walk(cls):
        assert cls.__doc__ and cls.__doc__.strip(), cls
        assert issubclass(cls, Section)
        assert cls.model_config.get("extra") == "forbid" and cls.model_config.get("validate_assignment")
        for name, info in cls.model_fields.items():
            assert info.description, f"{cls.__name__}.{name} has no description"
            for sub in typing.get_args(info.annotation) or (info.annotation,):
                if isinstance(sub, type) and issubclass(sub, Section):
                    walk(sub)

    walk(RunConfig)
    assert len(typing.get_args(RunConfig.model_fields["task"].annotation)) == len(TASK_CONFIGS)


def test_the_runtime_code_takes_the_sections_themselves():
    """One config type per concept: the loss, LoRA and image code take the pydantic sections,
    with no dataclass twin that re-checks them with other defaults."""
    import saccade.data.images as images
    import saccade.models.lm as lm
    import saccade.trainer.loss as loss

    assert loss.LossConfig is LossConfig and images.ImagesConfig is ImagesConfig and lm.LoraConfig is LoraConfig
    cfg = load_config(RunConfig, ROOT / "configs" / "qwen3vl-2b-1gpu.toml", [])
    assert cfg.loss.tis_cap is None and cfg.loss.max_completion_tokens == 2048
    for module in (images, lm, loss):
        twins = [name for name in vars(module) if name in ("ImageLimits", "LoraSettings", "LossSection")]
        assert not twins, f"{module.__name__} still defines {twins}"


def test_import_does_not_import_torch_nor_user_code():
    code = ("import saccade.config, sys; assert 'torch' not in sys.modules, 'torch imported'; "
            "above = sorted(m for m in sys.modules if m.startswith('saccade.') and m.split('.')[1] not in "
            "('config', 'plugins', 'installed', 'rewards')); assert not above, above")  # rewards: the layer below
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_tis_is_on_by_default_only_for_older_rollouts_trained_on_several_times():
    """At num_iterations 1 the ratio stays against the engine's logprobs (the clip's trust region
    around the policy that sampled); TIS's decoupled ratio would be 1 there (docs/async.md)."""
    from saccade.config import DEFAULT_TIS_CAP, effective_loss

    def cap(*overrides):
        return effective_loss(load_config(RunConfig, None, list(overrides))).tis_cap

    ahead = ("--engine.kind", "vllm", "--engine.urls", '["http://a:1"]', "--rollout.max_async_level", "1")
    assert cap() is None  # on-policy: off
    assert cap(*ahead) is None and cap(*VLLM, "--engine.sync_every_steps", "2") is None
    assert cap(*ahead, "--trainer.num_iterations", "2") == DEFAULT_TIS_CAP
    assert cap(*VLLM, "--engine.sync_every_steps", "2", "--trainer.num_iterations", "4") == DEFAULT_TIS_CAP
    assert cap("--trainer.num_iterations", "2") is None  # on-policy rollouts: nothing to correct
    assert cap("--loss.tis_cap", "3.0") == 3.0  # set: on, as before
    assert cap("--loss.tis", "on") == DEFAULT_TIS_CAP
    assert cap(*VLLM, "--engine.sync_every_steps", "2", "--loss.tis", "off") is None


def test_the_kl_term_loads_with_lora_and_with_full_finetuning():
    """loss.kl_coef > 0 is no longer refused for full fine-tuning (a frozen copy of the start
    weights is its reference, saccade.trainer.reference); the estimator is k1, k2 or k3 (k3 by
    default, as before), and another is refused with the choices."""
    for lora in ("true", "false"):
        cfg = load_config(RunConfig, None, ["--lora", lora, "--loss.kl_coef", "0.05",
                                            "--loss.kl_estimator", "k2"])
        assert cfg.loss.kl_coef == 0.05 and cfg.loss.kl_estimator == "k2"
    assert load_config(RunConfig, None, []).loss.kl_estimator == "k3"
    assert error(None, ["--loss.kl_estimator", "k4"]) == "--loss.kl_estimator: input should be 'k1', 'k2' or 'k3' (got 'k4')"


def test_sampling_ahead_needs_vllm_servers():
    with pytest.raises(ConfigError, match="max_async_level = 1 needs vLLM servers"):
        load_config(RunConfig, None, ["--rollout.max_async_level", "1"])


def test_a_kernel_that_cannot_be_imported_is_refused_when_the_config_loads(tmp_path):
    """flash-attn is not installed here: the config is refused at load (so --dry-run catches it), with the fix."""
    from saccade.installed import module_available

    if module_available("flash_attn"):
        pytest.skip("flash-attn is installed here")
    with pytest.raises(ValueError, match="flash-attn package.*Use 'auto'"):
        load_config(RunConfig, None, ["--model.attn_implementation", "flash_attention_2"])


# --- the [task] union ------------------------------------------------------------------------


def test_a_task_kind_holds_its_own_fields():
    cfg = load_config(RunConfig, None, ["--task.kind", "scenes", "--task.render_size", "64", "--task.max_turns", "4"])
    assert (cfg.task.kind, cfg.task.render_size, cfg.task.max_turns) == ("scenes", 64, 4)
    msg = error(None, ["--task.kind", "views", "--task.render_size", "64"])  # a scenes field
    assert "unknown key 'task.render_size'" in msg and "task kind 'views'" in msg and "places" in msg
    assert "did you mean 'mathvista'" in error(None, ["--task.kind", "mathvist"])
    # A table without a kind is the default task's; a dataset needs its path.
    assert load_config(RunConfig, None, ["--task.num_choices", "3"]).task.num_choices == 3
    assert error(None, ["--task.kind", "dataset"]) == "--task.kind: task.dataset: field required"


def test_another_kind_on_the_command_line_starts_a_fresh_task_table():
    cfg = load_config(RunConfig, ROOT / "configs" / "views.toml", ["--task.kind", "scenes", "--task.start_turn", "90"])
    assert cfg.task.kind == "scenes" and cfg.task.start_turn == 90
    assert cfg.task.num_choices == 4 and cfg.task.max_turns == 3  # the scenes defaults, not views.toml's 3 and 2
    same = load_config(RunConfig, ROOT / "configs" / "views.toml", ["--task.kind", "views"])
    assert same.task.max_turns == 2  # the same kind keeps the file's fields


def test_the_cache_budget_and_sampling_have_their_own_sections():
    cfg = load_config(RunConfig, None, ["--image_cache.budget_bytes", "1000", "--sampling.temperature", "0.7"])
    assert cfg.image_cache.budget_bytes == 1000 and cfg.sampling.temperature == 0.7
    assert "cache" not in "".join(type(cfg.images).model_fields)
    assert not {"temperature", "top_p", "top_k", "min_p", "max_tokens"} & set(type(cfg.engine).model_fields)
    assert "greater than 0" in error(None, ["--image_cache.budget_bytes", "0"])


@pytest.mark.parametrize(("old", "new"), [
    ("--data.task", "task.kind"), ("--data.num_choices", "task.num_choices"), ("--env.max_turns", "task.max_turns"),
    ("--engine.temperature", "sampling.temperature"), ("--images.cache_bytes", "image_cache.budget_bytes"),
    ("--data.eval_size", "eval.prompts"), ("--data.columns.images", "task.columns.images"),
])
def test_an_old_key_on_the_command_line_is_refused_with_its_new_name(old, new):
    assert error(None, [old, "1"]).startswith(f"{old}: {old[2:]} is now {new}")


OLD_VIEWS = """
[engine]
kind = "embedded"
temperature = 0.9
max_tokens = 8

[images]
max_pixels = 65536
cache_bytes = 2000000

[data]
task = "views"
num_choices = 3

[env]
max_turns = 2
loss_on = "assistant"
"""


def test_a_file_from_before_the_task_section_is_refused_naming_each_new_key(tmp_path):
    """The format before the [task] union (2026-11-24) is no longer read (config/legacy.py is
    retired): the message names every old key with its new one, and the date."""
    msg = error(write(tmp_path, OLD_VIEWS), [])
    assert "before the [task] section (2026-11-24)" in msg
    for old, new in [("engine.temperature", "sampling.temperature"), ("engine.max_tokens", "sampling.max_tokens"),
                     ("images.cache_bytes", "image_cache.budget_bytes"), ("data.task", "task.kind"),
                     ("data.num_choices", "task.num_choices"), ("env.max_turns", "task.max_turns")]:
        assert f"{old} is now {new}" in msg, old
    assert "env.loss_on" not in msg and "images.max_pixels" not in msg  # today's keys
    assert "[data] is now [task]" in error(write(tmp_path, "[data]\nwhatever = 1\n"), [])


def test_shipped_configs_use_todays_keys():
    for path in sorted((ROOT / "configs").glob("*.toml")):
        with warnings.catch_warnings():
            warnings.simplefilter("error", LegacyConfigWarning)
            load_config(RunConfig, path)


def test_the_data_set_kinds_agree_with_the_row_code():
    from saccade.config import DATASET_CONFIGS
    from saccade.data.rows import DATASET_TASKS

    kinds = [k for cls in DATASET_CONFIGS for k in typing.get_args(cls.model_fields["kind"].annotation)]
    assert sorted(kinds) == sorted(DATASET_TASKS)



# --- modes as unions (issue 45) --------------------------------------------------------------


def test_the_stall_action_is_a_union_whose_rollback_alone_has_its_own_fields(tmp_path):
    from saccade.config import StallRollbackConfig, StallStopConfig, StallWarnConfig

    assert RunConfig().stall == StallWarnConfig(steps=20, truncated_frac=0.5)
    path = write(tmp_path, '[stall]\naction = "rollback"\nsteps = 5\nlr_factor = 0.3\n')
    cfg = load_config(RunConfig, path)
    assert cfg.stall == StallRollbackConfig(steps=5, lr_factor=0.3, max_rollbacks=3)
    cfg = load_config(RunConfig, None, ["--stall.action", "rollback", "--stall.max_rollbacks", "1"])
    assert isinstance(cfg.stall, StallRollbackConfig) and cfg.stall.max_rollbacks == 1
    # The tag switched on the command line keeps the fields every action has, not the others.
    cfg = load_config(RunConfig, path, ["--stall.action", "stop"])
    assert cfg.stall == StallStopConfig(steps=5)
    assert load_config(RunConfig, None, ["--stall.steps", "7"]).stall == StallWarnConfig(steps=7)
    # A wrong mix, in a file and on the command line, names the action that has the field.
    msg = error(write(tmp_path, '[stall]\naction = "warn"\nlr_factor = 0.3\n'), [])
    assert "unknown key 'stall.lr_factor'" in msg and "is a field of action 'rollback'" in msg
    assert "set stall.action = 'rollback'" in msg
    msg = error(None, ["--stall.action", "stop", "--stall.max_rollbacks", "2"])
    assert msg.startswith("--stall.max_rollbacks: unknown key") and "action 'rollback'" in msg
    assert "did you mean 'rollback'" in error(None, ["--stall.action", "rolback"])


def test_full_finetuning_is_lora_false_in_a_file_and_on_the_command_line(tmp_path):
    """LoRA or not is a mode: a [lora] table (the default, also when a config says nothing) or
    `lora = false`, full fine-tuning. --lora true turns it back on; a LoRA field while it is
    off is refused rather than turning it on unasked."""
    from saccade.config import LoraConfig

    assert RunConfig().lora == LoraConfig(rank=16, alpha=32.0, dropout=0.0, target_modules=None)
    off = write(tmp_path, 'lora = false\n[trainer]\nsteps = 3\n')
    assert load_config(RunConfig, off).lora is None
    assert load_config(RunConfig, None, ["--lora", "false"]).lora is None
    known, overrides = split_overrides(["rl", "x.toml", "--lora", "false", "--dry-run"])
    assert known == ["rl", "x.toml", "--dry-run"] and overrides == ["--lora", "false"]
    assert split_overrides(["bench", "step", "--lora", "--steps", "3"])[1] == []  # the bench's own flag
    cfg = load_config(RunConfig, off, ["--lora", "true", "--lora.rank", "4"])
    assert cfg.lora == LoraConfig(rank=4)
    on = tmp_path / "lora.toml"
    on.write_text("[lora]\nrank = 8\n")
    assert load_config(RunConfig, on, ["--lora=true"]).lora == LoraConfig(rank=8)  # true keeps the table
    assert load_config(RunConfig, on, ["--lora", "false"]).lora is None
    msg = error(off, ["--lora.rank", "4"])
    assert msg.startswith("--lora.rank: lora is false here (off)") and "--lora true" in msg
    # --dry-run writes it back as it reads it: `lora = false`, before the first table.
    text = describe(load_config(RunConfig, off))
    assert "\nlora = false\n" in text and text.index("lora = false") < text.index("[model]")
    path = tmp_path / "again.toml"
    path.write_text(text)
    assert load_config(RunConfig, path) == load_config(RunConfig, off)


def test_the_lr_decay_is_a_union_and_only_a_decay_has_an_lr_to_end_at(tmp_path):
    from saccade.config import ConstantDecayConfig, CosineDecayConfig, LinearDecayConfig

    assert RunConfig().trainer.lr_decay == ConstantDecayConfig()
    inline = write(tmp_path, '[trainer]\nlr_decay = { kind = "cosine", min_lr_ratio = 0.05 }\n')
    assert load_config(RunConfig, inline).trainer.lr_decay == CosineDecayConfig(min_lr_ratio=0.05)
    table = tmp_path / "table.toml"
    table.write_text('[trainer.lr_decay]\nkind = "linear"\n')
    assert load_config(RunConfig, table).trainer.lr_decay == LinearDecayConfig(min_lr_ratio=0.1)
    cfg = load_config(RunConfig, None, ["--trainer.lr_decay.kind", "linear", "--trainer.lr_decay.min_lr_ratio", "0.2"])
    assert cfg.trainer.lr_decay == LinearDecayConfig(min_lr_ratio=0.2)
    # Switching the kind drops the file's min_lr_ratio (none of the kinds' fields is common to all).
    assert load_config(RunConfig, inline, ["--trainer.lr_decay.kind", "linear"]).trainer.lr_decay == LinearDecayConfig()
    msg = error(None, ["--trainer.lr_decay.min_lr_ratio", "0.2"])
    assert msg.startswith("--trainer.lr_decay.min_lr_ratio: unknown key") and "kind 'linear' or 'cosine'" in msg
    msg = error(write(tmp_path, '[trainer]\nlr_decay = { kind = "constant", min_lr_ratio = 0.2 }\n'), [])
    assert "unknown key 'trainer.lr_decay.min_lr_ratio'" in msg and "set trainer.lr_decay.kind = 'linear'" in msg


def test_the_loss_kind_is_a_union_and_only_the_clipped_surrogate_has_a_clip(tmp_path):
    from saccade.config import PpoClipLossConfig, ReinforceLossConfig

    assert RunConfig().loss == PpoClipLossConfig(eps_low=0.2, eps_high=0.28, normalization="token")
    path = write(tmp_path, '[loss]\nkind = "reinforce"\nnormalization = "sequence"\nkl_coef = 0.05\n')
    assert load_config(RunConfig, path).loss == ReinforceLossConfig(normalization="sequence", kl_coef=0.05)
    cfg = load_config(RunConfig, None, ["--loss.eps_high", "0.3"])  # a [loss] without kind: the clipped one
    assert cfg.loss == PpoClipLossConfig(eps_high=0.3)
    # Switching the kind keeps what every kind has (normalisation, KL, ...), and only that.
    cfg = load_config(RunConfig, ROOT / "configs" / "demo.toml", ["--loss.kind", "reinforce"])
    assert cfg.loss == ReinforceLossConfig(max_completion_tokens=16, entropy_coef=0.01)
    cfg = load_config(RunConfig, path, ["--loss.kind", "ppo_clip", "--loss.eps_low", "0.1"])
    assert cfg.loss == PpoClipLossConfig(normalization="sequence", kl_coef=0.05, eps_low=0.1)
    msg = error(write(tmp_path, '[loss]\nkind = "reinforce"\neps_low = 0.2\n'), [])
    assert "unknown key 'loss.eps_low'" in msg and "is a field of kind 'ppo_clip'" in msg
    msg = error(None, ["--loss.kind", "reinforce", "--loss.eps_high", "0.3"])
    assert msg.startswith("--loss.eps_high: unknown key") and "set loss.kind = 'ppo_clip'" in msg
    assert "did you mean 'reinforce'" in error(None, ["--loss.kind", "reinfroce"])


# --- the upgrade step: a run folder's config.toml from before the mode unions ------------------

OLD = Path(__file__).parent / "old_configs"  # --dry-run's output at a404b19, as run folders hold it
OLD_DEMO_MOVES = ["lora.enabled = false -> lora = false", "rollout.on_stall -> stall.action",
                  "rollout.stall_lr_factor -> stall.lr_factor", "trainer.lr_decay -> trainer.lr_decay.kind"]


def upgraded(path: Path, *overrides: str) -> tuple[RunConfig, str]:
    with pytest.warns(LegacyConfigWarning) as caught:
        cfg = load_config(RunConfig, path, list(overrides))
    return cfg, " ".join(str(w.message) for w in caught)


def test_the_defaults_resolve_as_before():
    """Every value the old defaults wrote out maps to today's default: the default run (LoRA,
    the stall watch warning after 20 steps, a constant lr, the clipped surrogate) is unchanged."""
    from saccade.config import (
        ConstantDecayConfig, LoraConfig, PpoClipLossConfig, StallRollbackConfig, StallWarnConfig,
    )

    cfg, said = upgraded(OLD / "defaults-a404b19.toml")
    assert cfg == RunConfig()
    assert "dropped" not in said  # nothing the old defaults set is lost
    assert cfg.lora == LoraConfig(rank=16, alpha=32.0, dropout=0.0, target_modules=None)
    assert cfg.stall == StallWarnConfig(steps=20, truncated_frac=0.5)
    assert (StallRollbackConfig().lr_factor, StallRollbackConfig().max_rollbacks) == (0.5, 3)
    assert cfg.trainer.lr_decay == ConstantDecayConfig()
    assert cfg.loss == PpoClipLossConfig(eps_low=0.2, eps_high=0.28, normalization="token", tis="auto", kl_coef=0.0)


def test_a_config_toml_from_before_the_mode_unions_loads_as_the_same_run(tmp_path):
    """The demo's config.toml as a run folder holds it (every field, the old keys) is today's
    demo.toml: full fine-tuning, a constant lr. The warning names every move and the unread
    LoRA settings it dropped; --dry-run then writes today's keys, which load without a warning."""
    cfg, said = upgraded(OLD / "demo-a404b19.toml")
    assert cfg == load_config(RunConfig, ROOT / "configs" / "demo.toml")
    assert cfg.lora is None
    for move in OLD_DEMO_MOVES:
        assert move in said, move
    assert "dropped, as nothing in use reads them: lora.target_modules = [" in said  # full FT never read it
    assert "docs/config.md#older-config-files" in said
    path = tmp_path / "today.toml"
    path.write_text(describe(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(RunConfig, path) == cfg


def test_every_mode_of_an_old_config_toml_upgrades_to_its_union(tmp_path):
    """A run with every old flag set another way: rollback with its factor and limit, a cosine
    decay to 0.05, REINFORCE (whose file still carried the clip's eps: dropped, at their defaults
    quietly), LoRA on. The same run as today's keys give it, in a file or on the command line."""
    from saccade.config import CosineDecayConfig, ReinforceLossConfig, StallRollbackConfig

    cfg, said = upgraded(OLD / "mix-a404b19.toml")
    today = ["--stall.action", "rollback", "--stall.lr_factor", "0.25", "--stall.max_rollbacks", "2",
             "--trainer.lr_decay.kind", "cosine", "--trainer.lr_decay.min_lr_ratio", "0.05",
             "--loss.kind", "reinforce", "--log.name", "old-run",
             "--loss.tis_cap", "2.0"]  # the 2-B config's cap then (no longer: docs/async.md)
    assert cfg == load_config(RunConfig, ROOT / "configs" / "qwen3vl-2b-1gpu.toml", today)
    assert cfg.stall == StallRollbackConfig(lr_factor=0.25, max_rollbacks=2)
    assert cfg.trainer.lr_decay == CosineDecayConfig(min_lr_ratio=0.05)
    assert isinstance(cfg.loss, ReinforceLossConfig) and cfg.lora is not None and cfg.lora.rank == 32
    assert "lora.enabled = true -> [lora]" in said and "dropped" not in said
    # The old keys on the command line: read as the new ones, each named with its new key.
    old = ["--rollout.on_stall", "rollback", "--rollout.stall_lr_factor", "0.25", "--rollout.max_rollbacks", "2",
           "--trainer.lr_decay", "cosine", "--trainer.min_lr_ratio", "0.05", "--loss.kind", "reinforce",
           "--log.name", "old-run", "--lora.enabled", "true", "--loss.tis_cap", "2.0"]
    again, said = upgraded(ROOT / "configs" / "qwen3vl-2b-1gpu.toml", *old)
    assert again == cfg
    assert "--rollout.on_stall is now --stall.action (since 2026-11-28" in said
    assert "--trainer.min_lr_ratio is now --trainer.lr_decay.min_lr_ratio" in said


def test_an_old_key_the_upgrade_cannot_read_quietly_is_refused_or_named(tmp_path):
    # A value set on a field its variant does not read was never used: dropped, and named.
    cfg, said = upgraded(write(tmp_path, '[rollout]\non_stall = "stop"\nstall_lr_factor = 0.1\n'))
    assert cfg.stall.action == "stop" and "dropped, as nothing in use reads them: stall.lr_factor = 0.1" in said
    old = '[loss]\nkind = "reinforce"\neps_high = 0.3\n[trainer]\nlr_decay = "constant"\n'
    _, said = upgraded(write(tmp_path, old))
    assert "loss.eps_high = 0.3" in said
    # The old key beside its new one: which one meant it is not for the upgrade to guess.
    msg = error(write(tmp_path, '[rollout]\non_stall = "stop"\n[stall]\naction = "warn"\n'), [])
    assert "has both rollout.on_stall (before 2026-11-28) and stall.action" in msg
    # Today's wrong mix (no old key) is no upgrade: refused, naming the variant that has the field.
    assert "is a field of kind 'ppo_clip'" in error(write(tmp_path, '[loss]\nkind = "reinforce"\neps_high = 0.3\n'), [])


def test_config_changes_name_each_key_that_differs():
    from saccade.config import config_changes

    before = describe(load_config(RunConfig, "configs/demo.toml", []))
    after = describe(load_config(RunConfig, "configs/demo.toml", ["--trainer.lr", "1e-3", "--trainer.steps", "7"]))
    assert config_changes(before, before) == []
    changes = config_changes(before, after)
    assert len(changes) == 2 and changes[0].startswith("trainer.lr: ") and changes[0].endswith(" -> 0.001")
    assert changes[1].endswith(" -> 7") and changes[1].startswith("trainer.steps: ")
