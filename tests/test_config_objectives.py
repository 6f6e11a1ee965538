"""The objectives' config (`saccade.config.loss`, `[rollout]`'s advantage options): every loss kind
and option from a file and from the command line, bad values refused with what to write, masked
IS resolved per run, and the old `rollout.scale_advantages_by_std` read as its new key."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest

from saccade.config import (
    CispoLossConfig, ConfigError, GspoLossConfig, LegacyConfigWarning, PpoClipLossConfig, ReinforceLossConfig,
    RunConfig, effective_loss, load_config,
)

ROOT = Path(__file__).resolve().parents[1]
OLD = Path(__file__).parent / "old_configs"

# The servers a vLLM engine needs: sync_every_steps is a field of kind "vllm" only.
VLLM = ("--engine.kind", "vllm", "--engine.urls", '["http://a:1"]')


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return path


def error(*args) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(RunConfig, *args)
    return str(info.value)


KINDS = [
    ("ppo_clip", PpoClipLossConfig, {"eps_low": 0.1, "eps_high": 0.3}),
    ("reinforce", ReinforceLossConfig, {}),
    ("cispo", CispoLossConfig, {"eps_low": 0.5, "eps_high": 0.2}),
    ("gspo", GspoLossConfig, {"eps_low": 1e-3, "eps_high": 2e-3, "normalization": "token"}),
]
MASK = {"is_mask": "on", "is_mask_low": 0.25, "is_mask_high": 4.0}


def toml_value(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


@pytest.mark.parametrize("kind, cls, own", KINDS, ids=[k[0] for k in KINDS])
def test_each_loss_kind_and_masked_is_load_from_a_file_and_the_command_line(tmp_path, kind, cls, own):
    fields = {**own, **MASK}
    lines = "\n".join(f"{key} = {toml_value(value)}" for key, value in fields.items())
    from_file = load_config(RunConfig, write(tmp_path, f'[loss]\nkind = "{kind}"\n{lines}\n')).loss
    overrides = [token for key, value in fields.items() for token in (f"--loss.{key}", str(value))]
    from_cli = load_config(RunConfig, None, ["--loss.kind", kind, *overrides]).loss
    assert from_file == from_cli == cls(**fields)
    assert type(from_cli) is cls and from_cli.kind == kind


def test_another_kind_on_the_command_line_keeps_the_common_fields_and_takes_its_own_defaults():
    # demo.toml: ppo_clip with eps 0.2 / 0.28, token normalisation, an entropy bonus
    cfg = load_config(RunConfig, ROOT / "configs" / "demo.toml", ["--loss.kind", "gspo"])
    assert cfg.loss == GspoLossConfig(normalization="token", max_completion_tokens=16, entropy_coef=0.01)
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)  # GSPO's, not the file's clip
    cfg = load_config(RunConfig, ROOT / "configs" / "demo.toml", ["--loss.kind", "cispo", "--loss.is_mask", "on"])
    assert cfg.loss == CispoLossConfig(normalization="token", max_completion_tokens=16, entropy_coef=0.01,
                                       is_mask="on")
    assert load_config(RunConfig, None, ["--loss.kind", "gspo"]).loss.normalization == "sequence"  # the paper's


@pytest.mark.parametrize("overrides, message", [
    (["--loss.kind", "gpso"], "--loss.kind: loss: unknown kind 'gpso'; did you mean 'gspo'? Choose from "
                              "ppo_clip, reinforce, cispo, gspo"),
    (["--loss.is_mask", "maybe"], "--loss.is_mask: input should be 'auto', 'on' or 'off' (got 'maybe')"),
    (["--loss.is_mask_low", "1.5"], "--loss.is_mask_low: input should be less than 1 (got 1.5)"),
    (["--loss.is_mask_high", "0.9"], "--loss.is_mask_high: input should be greater than 1 (got 0.9)"),
    (["--loss.kind", "cispo", "--loss.eps_low", "2"], "--loss.eps_low: input should be less than or equal to 1"),
    (["--loss.kind", "gspo", "--loss.eps_high", "-1e-4"], "--loss.eps_high: input should be greater than or equal"),
    (["--rollout.advantage_baseline", "loo"], "--rollout.advantage_baseline: input should be 'group_mean' or "
                                              "'rloo' (got 'loo')"),
    (["--rollout.advantage_scaling", "global"], "--rollout.advantage_scaling: input should be 'group', 'batch' "
                                                "or 'none' (got 'global')"),
])
def test_bad_values_are_refused_saying_what_to_write(overrides, message):
    assert error(None, overrides).startswith(message)


def test_a_field_of_the_clipped_kinds_under_reinforce_names_the_kinds_that_have_it(tmp_path):
    msg = error(write(tmp_path, '[loss]\nkind = "reinforce"\neps_high = 0.3\n'), [])
    assert "is a field of kind 'ppo_clip' or 'cispo' or 'gspo'" in msg


def test_masked_is_is_off_by_default_and_auto_turns_it_on_for_rollouts_older_than_the_trainer():
    """Off by default (one step ahead, masking held back the recovery from a bad update:
    docs/async.md); 'auto' on whenever rollouts can be older than the trainer's weights."""
    def mask(*overrides):
        return effective_loss(load_config(RunConfig, None, list(overrides))).is_mask

    vllm_ahead = ["--engine.kind", "vllm", "--engine.urls", '["http://a:1"]', "--rollout.max_async_level", "1"]
    assert mask() == mask(*vllm_ahead) == mask(*VLLM, "--engine.sync_every_steps", "2") == "off"
    assert mask("--loss.is_mask", "auto") == "off"  # on-policy
    assert mask(*VLLM, "--engine.sync_every_steps", "2", "--loss.is_mask", "auto") == "on"
    assert mask(*vllm_ahead, "--loss.is_mask", "auto") == "on"
    assert mask("--loss.is_mask", "on") == "on"
    assert mask("--loss.tis_cap", "3.0", "--loss.is_mask", "auto") == "off"  # TIS on by its cap; the mask is not
    # At one optimizer step per batch TIS stays off (its ratio would be 1: no trust region); at
    # several, on.
    one = effective_loss(load_config(RunConfig, None, [*VLLM, "--engine.sync_every_steps", "4", "--loss.kind", "gspo",
                                                       "--loss.is_mask", "auto"]))
    assert (one.kind, one.is_mask, one.tis_cap) == ("gspo", "on", None)
    several = effective_loss(load_config(RunConfig, None, [*VLLM, "--engine.sync_every_steps", "4",
                                                           "--trainer.num_iterations", "2"]))
    assert (several.is_mask, several.tis_cap) == ("off", 2.0)


def test_the_advantage_options_load_from_a_file_and_the_command_line(tmp_path):
    assert (RunConfig().rollout.advantage_baseline, RunConfig().rollout.advantage_scaling) == ("group_mean", "group")
    path = write(tmp_path, '[rollout]\nadvantage_baseline = "rloo"\nadvantage_scaling = "batch"\n')
    from_file = load_config(RunConfig, path).rollout
    from_cli = load_config(RunConfig, None, ["--rollout.advantage_baseline", "rloo",
                                             "--rollout.advantage_scaling", "batch"]).rollout
    assert from_file == from_cli and (from_cli.advantage_baseline, from_cli.advantage_scaling) == ("rloo", "batch")


@pytest.mark.parametrize("old, new", [("true", "group"), ("false", "none")])
def test_the_old_scale_advantages_by_std_still_reads(tmp_path, old, new):
    with pytest.warns(LegacyConfigWarning) as caught:
        cfg = load_config(RunConfig, write(tmp_path, f"[rollout]\nscale_advantages_by_std = {old}\n"))
    assert cfg.rollout.advantage_scaling == new
    said = " ".join(str(w.message) for w in caught)
    assert f"rollout.scale_advantages_by_std = {old} -> rollout.advantage_scaling = '{new}'" in said
    with pytest.warns(LegacyConfigWarning, match="--rollout.scale_advantages_by_std is now --rollout.advantage_scaling"):
        cli = load_config(RunConfig, None, ["--rollout.scale_advantages_by_std", old])
    assert cli == cfg
    # beside its new key: which one was meant is not for the upgrade to guess
    both = f'[rollout]\nscale_advantages_by_std = {old}\nadvantage_scaling = "batch"\n'
    assert "has both rollout.scale_advantages_by_std (before 2026-11-28) and rollout.advantage_scaling" in error(
        write(tmp_path, both), [])


def test_a_run_folders_config_from_before_reads_its_std_scaling_as_group():
    with pytest.warns(LegacyConfigWarning) as caught:
        cfg = load_config(RunConfig, OLD / "demo-a404b19.toml")
    assert cfg.rollout.advantage_scaling == "group" and cfg.rollout.advantage_baseline == "group_mean"
    assert "rollout.scale_advantages_by_std = true -> rollout.advantage_scaling = 'group'" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(RunConfig, ROOT / "configs" / "demo.toml") == cfg  # today's keys: no warning
