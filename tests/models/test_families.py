"""The model-family registry, and every family's parity on its own tiny model.

A new family joins the parametrised tests by being in `FAMILIES` with a tiny builder: the
`family_model_path` fixture builds (once, cached) the first of its `tiny_presets`.
"""

from __future__ import annotations

import json

import pytest
import torch

from saccade.config.sections import DEFAULT_LORA_TARGETS
from saccade.models.families import FAMILIES, LM_HEAD_KEY, LM_PREFIX, VISION_PREFIX, ModelFamily, family_of
from saccade.models.families import qwen3_vl
from saccade.parity import run_parity

TOLERANCE = 1e-5  # fp32, per-token logprob, max |Δ| (tests/models/test_lm.py's bar)
MISTAKE_FLOOR = 1e-2


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family_model_path(request):
    """(family, the folder of its first tiny preset), for every registered family."""
    family: ModelFamily = request.param
    return family, family.tiny_model_path(family.tiny_presets[0], 0)


def test_an_unknown_model_type_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"'llava'.*'qwen3_vl' \(Qwen3-VL\).*docs/families.md"):
        family_of({"model_type": "llava"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="'gemma3'"):
        family_of(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        family_of(tmp_path / "nowhere")


def test_loading_refuses_an_unknown_family(tmp_path, tiny_path):
    from saccade.models.loading import load_config

    config = json.loads((tiny_path / "config.json").read_text())
    config["model_type"] = "qwen2_vl"  # a real transformers type, but no saccade family
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no model family for model_type 'qwen2_vl'"):
        load_config(tmp_path)


def test_family_of_finds_qwen3_vl_from_the_tiny_folder_and_its_configs(tiny_path):
    from saccade.models.loading import load_config

    assert family_of(tiny_path) is qwen3_vl.FAMILY
    config = load_config(tiny_path)
    for part in (config, config.vision_config, config.text_config):
        assert family_of(part) is qwen3_vl.FAMILY
    assert family_of(json.loads((tiny_path / "config.json").read_text())) is qwen3_vl.FAMILY


def test_every_family_is_named_once():
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    presets = [p for f in FAMILIES for p in f.tiny_presets]
    assert len(presets) == len(set(presets)), "a preset name must say which family builds it"


def test_qwen3_vl_members_are_the_canonical_layout():
    f = qwen3_vl.FAMILY
    for key in (f"{LM_PREFIX}layers.0.self_attn.q_proj.weight", f"{VISION_PREFIX}blocks.0.attn.qkv.weight", LM_HEAD_KEY):
        assert f.checkpoint_key(key) == key
    t = torch.randn(3, 4)
    assert [(n, x) for n, x in f.engine_tensors("lm_head.weight", t)] == [("lm_head.weight", t)]
    assert list(f.lora_target_modules) == DEFAULT_LORA_TARGETS and f.lora_target_parameters == ()
    assert f.language_model_kwargs(None, None) == {}
    main, levels = f.split_served_features(torch.arange(24.0).view(2, 12), 2)
    assert main.shape == (2, 4) and [x.shape for x in levels] == [(2, 4), (2, 4)]
    assert torch.equal(levels[1], torch.arange(24.0).view(2, 12)[:, 8:])


def test_the_families_classes_build_their_configs(family_model_path):
    family, path = family_model_path
    from saccade.models.loading import load_config

    config = load_config(path)
    assert family_of(config) is family
    assert family.full_model_class().__name__ == family.full_model_name
    assert family.deepstack_levels(config) == family.deepstack_levels(config.vision_config) >= 0
    text, vision = family.memory_dims(json.loads((path / "config.json").read_text()))
    assert text["hidden_size"] == config.text_config.hidden_size


def test_the_lm_only_path_matches_the_full_model(family_model_path):
    """Invariant 2 for each family: cached tower outputs + the family's extras through the language
    model alone equal the full transformers model on pixels, packed or not; the mistakes show."""
    family, path = family_model_path
    figures = run_parity(path)
    assert figures["lm_only_vs_full_max_abs"] <= TOLERANCE
    assert figures["packed_vs_full_max_abs"] <= TOLERANCE
    assert figures["positions_1d_max_abs"] > MISTAKE_FLOOR
    from saccade.models.loading import load_config

    if family.deepstack_levels(load_config(path)):
        assert figures["deepstack_dropped_max_abs"] > MISTAKE_FLOOR
    else:  # nothing to drop: the same numbers
        assert figures["deepstack_dropped_max_abs"] == figures["lm_only_vs_full_max_abs"]
