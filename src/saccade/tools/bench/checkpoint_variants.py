"""Checkpoints saccade did not write: the layouts transformers and the hub use, built offline.

For each family, one random model (transformers' own class, from the family's tiny config with
other shapes: other MLP widths, other expert counts, experts that are not square) saved the
ways the outside world saves it:

- `save_pretrained`: transformers' default (`save_original_format=True`): Qwen2.5-VL under its
  pre-4.52 names, Qwen3.5-MoE's experts one tensor per expert, Qwen3-VL-MoE's experts in
  transformers' memory layout (E, 2I, H);
- `memory`: `save_original_format=False`, the names and layouts transformers holds in memory;
- `sharded-bf16`: `save_pretrained` with small shards and an index, in bf16;
- `hub`: what the published files hold, as read from the published loaders
  (shared/notes/platform-facts.md, "Hub checkpoint layouts"): Qwen3-VL-MoE's experts transposed
  (E, H, 2I) / (E, I, H) with a text config that omits `tie_word_embeddings` (whose class
  default is true) under a top level that says false; Qwen3.5's multi-token-prediction head
  `mtp.*` beside the model, for Qwen3.5-MoE with its experts split per expert while the main
  layers' stay fused; Qwen2.5-VL and Qwen3-VL as `save_pretrained` writes them.

`build_variants(out, family)` writes them; `saccade bench parity --model OUT/<family>/<variant>`
then compares saccade's load of each with transformers' own (docs/families.md, "Checkpoint
layouts"). The tests (tests/models/test_checkpoint_layout.py) build them the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from saccade.models.families import FAMILIES, ModelFamily, family_of
from saccade.models.presets import preset_path, tiny_preset

VARIANTS = ("save_pretrained", "memory", "sharded-bf16", "hub")

# The shapes each family's variants change from its tiny preset (text_config fields).
OTHER_SHAPES: dict[str, dict] = {
    "Qwen3-VL": {"intermediate_size": 160, "num_hidden_layers": 3},
    "Qwen2.5-VL": {"intermediate_size": 160},
    # Not square: 2I = 80 and I = 40 against hidden 128, so no expert tensor's orientation is ambiguous.
    "Qwen3-VL-MoE": {"moe_intermediate_size": 40, "num_experts": 6, "intermediate_size": 160},
    "Qwen3.5": {"intermediate_size": 160, "tie_word_embeddings": False},
    "Qwen3.5-MoE": {"moe_intermediate_size": 40, "num_experts": 6, "shared_expert_intermediate_size": 56,
                    "tie_word_embeddings": False},
}
# Tied or not as the published checkpoints are (platform-facts: Qwen3-VL-2B and Qwen2.5-VL-3B tied,
# Qwen3-VL-30B-A3B, Qwen3.5-9B and Qwen3.5-35B-A3B untied); the tiny presets of the Qwen3.5 families tie.
OTHER_TOP: dict[str, dict] = {"Qwen3.5": {"tie_word_embeddings": False}, "Qwen3.5-MoE": {"tie_word_embeddings": False}}


def family_named(name: str) -> ModelFamily:
    return next(f for f in FAMILIES if f.name == name)


def random_model(family: ModelFamily, *, seed: int = 0, text: dict | None = None, top: dict | None = None):
    """A random full model of `family` (transformers' class), from its tiny preset's config.json
    with `OTHER_SHAPES` (or `text`) in the text config and `top` at the top level; and the preset's
    folder (tokenizer, processor, chat template)."""
    from transformers import AutoConfig

    preset = preset_path(tiny_preset(family))
    config = json.loads((preset / "config.json").read_text())
    config["text_config"].update(OTHER_SHAPES[family.name] if text is None else text)
    config.update(OTHER_TOP.get(family.name, {}) if top is None else top)
    config.pop("transformers_version", None)
    hf_config = AutoConfig.for_model(**config)
    torch.manual_seed(seed)
    model = family.full_model_class()._from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():  # transformers' init leaves some tensors at 0 or 1: random everywhere
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    return model.eval(), preset


def copy_processing_files(preset: Path, out: Path) -> None:
    """The tokenizer, processor and chat template of the preset (not its config or weights)."""
    for p in preset.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",):
            shutil.copy2(p, out / p.name)


def save_variant(model, preset: Path, out: Path, variant: str) -> Path:
    """Write `model` as `variant` (see the module note) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    copy_processing_files(preset, out)
    family = family_of(model.config)
    if variant == "save_pretrained":
        model.save_pretrained(out)
    elif variant == "memory":
        model.save_pretrained(out, save_original_format=False)
    elif variant == "sharded-bf16":
        model.to(torch.bfloat16).save_pretrained(out, max_shard_size="300KB")
        model.to(torch.float32)
    elif variant == "hub":
        save_hub_layout(model, family, out)
    else:
        raise ValueError(f"unknown variant {variant!r}: one of {', '.join(VARIANTS)}")
    return out


def save_hub_layout(model, family: ModelFamily, out: Path) -> None:
    """The layout of the published files (the module note)."""
    from safetensors.torch import save_file

    if family.name in ("Qwen3-VL", "Qwen2.5-VL"):
        model.save_pretrained(out)
        return
    model.save_pretrained(out, save_original_format=False)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: family.checkpoint.to_hub(k, t) for k, t in state.items()}
    config = json.loads((out / "config.json").read_text())
    if family.name == "Qwen3-VL-MoE":
        # The published config: `num_experts` (transformers writes num_local_experts), no tie key
        # in the text config, the head untied at the top level.
        text = config["text_config"]
        text["num_experts"] = text.pop("num_local_experts", text.get("num_experts"))
        text.pop("tie_word_embeddings", None)
    if family.name.startswith("Qwen3.5"):
        state.update(mtp_head(model, split_experts=family.name == "Qwen3.5-MoE"))
    for f in out.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def mtp_head(model, *, split_experts: bool) -> dict[str, torch.Tensor]:
    """A random multi-token-prediction head as Qwen3.5's hub files hold it (vLLM's qwen3_5_mtp.py
    reads these names): `mtp.fc` (H, 2H), three norms, and one full-attention decoder layer shaped
    like the model's own, its experts split per expert when `split_experts`."""
    text = model.config.text_config
    H = text.hidden_size
    g = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.05  # noqa: E731
    out = {"mtp.fc.weight": rand(H, 2 * H), "mtp.norm.weight": rand(H),
           "mtp.pre_fc_norm_hidden.weight": rand(H), "mtp.pre_fc_norm_embedding.weight": rand(H)}
    full = text.layer_types.index("full_attention")
    prefix = f"model.language_model.layers.{full}."
    for key, t in model.state_dict().items():
        if not key.startswith(prefix):
            continue
        name = "mtp.layers.0." + key[len(prefix):]
        if split_experts and name.endswith("mlp.experts.gate_up_proj"):
            E, two_I, _ = t.shape
            for e in range(E):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = rand(two_I // 2, H)
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = rand(two_I // 2, H)
        elif split_experts and name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = rand(H, t.shape[2])
        else:
            out[name] = rand(*t.shape)
    return out


def build_variants(out: Path, family: ModelFamily, variants=VARIANTS, *, seed: int = 0) -> dict[str, Path]:
    """Every variant of one random model of `family`, under out/<variant>."""
    model, preset = random_model(family, seed=seed)
    return {v: save_variant(model, preset, out / v, v) for v in variants}


def main(argv: list[str] | None = None) -> None:
    """`python -m saccade.tools.bench.checkpoint_variants OUT`: every family's variants under OUT."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    for family in FAMILIES:
        for variant, path in build_variants(args.out / tiny_preset(family), family).items():
            print(f"{family.name:14s} {variant:16s} {path}")


if __name__ == "__main__":
    main()
