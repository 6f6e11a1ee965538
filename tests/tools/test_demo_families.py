"""The demo on every family: each family's tiny preset has a warm start, "<preset>-warm",
resolved where a run starts and cached under a key that names the preset."""

from __future__ import annotations

import json

import pytest

import saccade.tools.demo as demo
from saccade.models.families import FAMILIES

WARM = "qwen2.5vl-tiny-warm"


def test_a_familys_warm_start_is_resolved_where_a_run_starts(monkeypatch, tmp_path):
    """Qwen2.5-VL's warm start becomes its own folder in `saccade rl` and `saccade serve`; Qwen3-VL's
    "tiny-warm" stays where it was."""
    from saccade import cli

    monkeypatch.setattr(demo, "warm_model_path", lambda preset="tiny": tmp_path / preset)  # the real one trains
    warm = demo.resolve_warm_start(demo.load_demo_config(["--model.path", WARM]))
    assert warm.model.path == str(tmp_path / "qwen2.5vl-tiny")
    assert demo.resolve_model_name(WARM) == str(tmp_path / "qwen2.5vl-tiny")
    assert demo.resolve_model_name("tiny-warm") == str(tmp_path / "tiny")
    base = demo.load_demo_config(["--model.path", "qwen2.5vl-tiny"])
    assert demo.resolve_warm_start(base) is base

    served = []
    monkeypatch.setattr("saccade.serving.server.main", lambda argv: served.append(argv) or 0)
    assert cli.cmd_serve([WARM, "--port", "8000"]) == 0
    assert served == [[str(tmp_path / "qwen2.5vl-tiny"), "--port", "8000"]]


def test_every_familys_warm_start_is_cached_under_its_preset(monkeypatch):
    """The cache folder is "<preset>-warm-<key>", the key a hash of the demo config and the preset's
    folder; Qwen3-VL's keeps the key it had before the families had warm starts (its cached folder is
    reused)."""
    import hashlib

    import saccade.models.presets as presets
    import saccade.models.presets.builder as builder

    for module in (presets, builder):  # name the folders, build nothing
        monkeypatch.setattr(module, "build_once", lambda target, build: target)
    config = demo.demo_config_path().read_text()
    folders = {}
    for family in FAMILIES:
        preset = presets.tiny_preset(family)
        folders[preset] = demo.warm_model_path(preset)
        key = hashlib.sha256((config + str(presets.preset_path(preset))).encode()).hexdigest()[:10]
        assert folders[preset] == presets.cache_dir() / f"{preset}-warm-{key}", preset
    assert demo.warm_model_path() == folders["tiny"]
    assert len(set(folders.values())) == len(FAMILIES)


def test_the_demo_of_a_warm_start_is_the_demo_of_its_preset(capsys):
    """`saccade demo` trains the warm start itself (step 1), so "qwen2.5vl-tiny-warm" runs the demo from
    "qwen2.5vl-tiny" and says so; the dry run shows the model it would start from."""
    from saccade.cli import main

    assert main(["demo", "--dry-run", "--model.path", WARM]) == 0
    out = capsys.readouterr().out
    assert "warm start of 'qwen2.5vl-tiny'" in out and 'path = "qwen2.5vl-tiny"' in out
    cfg = demo.load_demo_config(["--model.path", "qwen2.5vl-tiny"])
    assert demo.demo_start(cfg) is cfg


@pytest.mark.slow
def test_the_demo_runs_every_stage_on_qwen2_5_vl(tmp_path):
    """The whole demo on another family, on a budget too small to learn (tests/tools/test_demo.py's)."""
    from test_demo import FAST

    from saccade.cli import main

    out = tmp_path / "demo.json"
    rc = main(["demo", "--json", str(out), "--log.dir", str(tmp_path / "run"), "--model.path", "qwen2.5vl-tiny", *FAST])
    assert rc == 1  # two GRPO steps cannot reach 0.9
    result = json.loads(out.read_text())
    assert result["chance"] == pytest.approx(1 / 3)
    for part in ("sft", "grpo", "control"):
        assert (tmp_path / "run" / part / "metrics.jsonl").is_file(), part
    assert 'path = "qwen2.5vl-tiny"' in (tmp_path / "run" / "grpo" / "config.toml").read_text()
