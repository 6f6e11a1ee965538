"""The one builder of random models: a preset (`table.py`) becomes a complete Hugging Face folder,
offline and deterministically from a seed.

What it writes: a byte-level BPE tokenizer trained on a small generated corpus plus Qwen's special
tokens, a Qwen-style chat template, the family's processor (Qwen2-VL's image processor, the
family's video processor and processor class), config.json, and random weights from transformers'
own class for the model type, saved as the hub's files hold them (`family.checkpoint.save`). The
Auto classes and vLLM load the folder like a real checkpoint, so every code path is the real one.

From the preset's config (`preset_config`: the published one with the preset's changes) the
builder keeps the architecture (`TEXT_FIELDS`, `VISION_FIELDS`); the rest is the builder's own and
the same for every preset: the tokenizer's token ids, 8192 positions, the rotary sections rescaled
to the new head size, the tower projecting into the language model's width. Built folders are
cached under `cache_dir()`, keyed by the preset, its published config, the seed and
`BUILD_VERSION`, so a second call is a directory lookup.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from saccade.models.presets.table import PRESETS, Preset, preset_config, text_fields

# Bump when anything below changes what gets written, so stale caches are not reused.
BUILD_VERSION = 1

# The language model's and the tower's fields a build keeps from its preset's config: shapes and
# structure. Everything else is the builder's (`build_config`) or the config class's default.
TEXT_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "initializer_range",
    # a hybrid's Gated DeltaNet layers (Qwen3.5)
    "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
    "linear_num_value_heads",
    # a mixture of experts
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
)
VISION_FIELDS = (
    "depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "spatial_merge_size",
    "temporal_patch_size", "num_position_embeddings", "deepstack_visual_indexes",
    # Qwen2.5-VL's windowed attention
    "window_size", "fullatt_block_indexes", "tokens_per_second",
)
MAX_POSITIONS = 8192

# Qwen2/3 special tokens, in Qwen's order. They are appended after the BPE vocabulary,
# as in the real tokenizer (where they start at id 151643).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Added but not "special" in Qwen3: they survive decoding with skip_special_tokens.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# A Qwen3-VL-style chat template. Content is a string or a list of parts; image parts
# (`image`, `image_url`) become <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to one pad per merged patch.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] in ['video', 'video_url'] -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# The published processors (each hub repo's preprocessor_config.json): (processor class, video
# processor class, mean, std); the image processor is Qwen2-VL's for all. Qwen2.5-VL normalises
# with OpenAI CLIP's mean and std (Qwen2VLImageProcessor's own defaults), the Qwen3 generations
# (Qwen3-VL, its MoE, Qwen3.5 and its MoE: transformers' auto mapping gives them Qwen3-VL's
# processor) with 0.5.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
QWEN3_VL_PROCESSOR = ("Qwen3VLProcessor", "transformers.models.qwen3_vl.video_processing_qwen3_vl.Qwen3VLVideoProcessor",
                      [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
PROCESSORS = {"qwen2_5_vl": ("Qwen2_5_VLProcessor",
                             "transformers.models.qwen2_vl.video_processing_qwen2_vl.Qwen2VLVideoProcessor",
                             CLIP_MEAN, CLIP_STD)}


# ----------------------------------------------------------------------------- the folder


def build(out_dir: str | os.PathLike, name: str, seed: int = 0) -> Path:
    """Write preset `name`'s complete random folder (tokenizer, processor, config, weights) into
    `out_dir`, the weights in the hub's layout; returns the folder."""
    import torch

    from saccade.models.families import family_of

    preset = PRESETS[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(preset.bpe_vocab_size, seed=seed)
    config = build_config(name, tokenizer)
    build_processor(tokenizer, config, preset).save_pretrained(out)
    family = family_of(config)
    model = seeded_model(family.full_model_class(), config, seed, device=init_device(name))
    family.checkpoint.save(model.to(getattr(torch, preset.dtype)).cpu(), out)
    return out


def init_device(name: str) -> str:
    """Where preset `name`'s random weights are drawn. The real-shape presets (bf16: 2B to 35B
    parameters) on a CUDA device when there is one: on a lent GPU machine, initialising a 2B model on
    the host's cores took most of a minute of a 15-minute lease (8B: four), on the GPU it takes
    seconds, and only the write remains. Their weights then follow from the seed and the device kind
    (`preset_folder` keys them by it); the tiny and small presets, which the tests compare byte for
    byte, are always drawn on the CPU."""
    import torch

    return "cuda" if PRESETS[name].dtype == "bfloat16" and torch.cuda.is_available() else "cpu"


def build_config(name: str, tokenizer):
    """Preset `name`'s transformers config: its architecture (`TEXT_FIELDS`, `VISION_FIELDS` of
    `preset_config`), the tokenizer's ids and vocabulary (the tiny presets) or the published
    vocabulary's rows, MAX_POSITIONS, the published rotary settings with M-RoPE's sections
    rescaled to the head size (`mrope_section`), the tower projecting into the text width, the
    head tied or not at both levels alike."""
    from transformers import AutoConfig

    preset, config = PRESETS[name], preset_config(name)
    published, published_vision = text_fields(config), config["vision_config"]
    text = {k: published[k] for k in TEXT_FIELDS if k in published}
    vision = {k: published_vision[k] for k in VISION_FIELDS if k in published_vision}
    if preset.tokenizer_vocab:
        text["vocab_size"] = len(tokenizer)
    assert text["vocab_size"] >= len(tokenizer), (name, text["vocab_size"], len(tokenizer))
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]  # Qwen2.5-VL has none
    tie = config["tie_word_embeddings"]
    ids = tokenizer.convert_tokens_to_ids
    text.update(max_position_embeddings=MAX_POSITIONS, rope_parameters=rope_parameters(published, head_dim),
                tie_word_embeddings=tie, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                eos_token_id=ids("<|im_end|>"))
    if "max_window_layers" in published:  # sliding windows are off; the field follows the depth
        text["max_window_layers"] = text["num_hidden_layers"]
    vision["out_hidden_size"] = text["hidden_size"]
    return AutoConfig.for_model(
        config["model_type"], text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=tie)


def rope_parameters(text: dict, head_dim: int) -> dict:
    """transformers 5's `rope_parameters` from a published text config (its own, or 4.x's
    `rope_theta` + `rope_scaling`), with `mrope_section` rescaled to this head size."""
    rope = dict(text.get("rope_parameters") or {**text["rope_scaling"], "rope_theta": text["rope_theta"]})
    rope.pop("type", None)  # 4.x's "mrope": the sections say it
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    assert rotary % 2 == 0 and head_dim % 8 == 0, (rotary, head_dim)
    return {**rope, "rope_type": "default", "rope_theta": float(rope["rope_theta"]),
            "mrope_section": mrope_section(rope["mrope_section"], rotary // 2)}


def mrope_section(published: list[int], half: int) -> list[int]:
    """M-RoPE's (t, h, w) sections over `half` rotary frequencies, in the published sections'
    proportions: t and h rounded, w the rest (Qwen3-VL's [24, 20, 20] -> [6, 5, 5] at half 16;
    Qwen2.5-VL's [16, 24, 24] -> [4, 6, 6]; Qwen3.5's [11, 11, 10] -> [3, 3, 2] at half 8)."""
    scale = half / sum(published)
    t, h = round(published[0] * scale), round(published[1] * scale)
    section = [t, h, half - t - h]
    assert min(section) > 0 and sum(section) == half, (published, half, section)
    return section


def build_processor(tokenizer, config, preset: Preset):
    """The family's processor: Qwen2-VL's image processor and the family's video processor at the
    tower's patch, merge 2, the published mean and std, sized in pixels (shortest_edge /
    longest_edge: transformers 5's spelling of min_pixels / max_pixels)."""
    import importlib

    import transformers
    from transformers import Qwen2VLImageProcessor

    processor_name, video_name, mean, std = PROCESSORS.get(config.model_type, QWEN3_VL_PROCESSOR)
    module, _, cls = video_name.rpartition(".")
    video_class = getattr(importlib.import_module(module), cls)
    common = dict(patch_size=config.vision_config.patch_size, temporal_patch_size=2, merge_size=2, image_mean=mean,
                  image_std=std)
    size = {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels}
    return getattr(transformers, processor_name)(
        image_processor=Qwen2VLImageProcessor(size=size, **common),
        tokenizer=tokenizer,
        video_processor=video_class(size={**size, "longest_edge": preset.max_pixels * 4}, **common),
        chat_template=CHAT_TEMPLATE,
    )


def seeded_model(model_class, config, seed: int, device: str = "cpu"):
    """`model_class(config)` with random weights that depend on the seed (and the device kind)
    alone: initialised on `device` on a private generator state, the caller's left as it was."""
    import torch

    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.cuda.current_device()]):
        torch.manual_seed(seed)  # seeds every device's generator
        with torch.device(device):
            return model_class(config)


# ----------------------------------------------------------------------------- the tokenizer


def build_tokenizer(bpe_vocab_size: int, *, seed: int = 0):
    """Train a byte-level BPE on a generated corpus and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(ADDED_TOKENS)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


_WORDS = (
    "system user assistant red green blue yellow purple orange black white gray pink brown cyan "
    "circle square triangle star cross diamond shape shapes color colors object objects "
    "how many what which is the a an of in on at to there are image picture view left right "
    "up down forward back turn look move answer question choose one option count number "
    "zero one two three four five six seven eight nine ten yes no true false "
    "think reasoning step therefore so final boxed room wall floor table chair camera "
    "largest smallest bigger smaller above below near far between inside outside"
).split()


def _corpus(seed: int, n_lines: int = 4000):
    """Deterministic lines mixing the demo vocabulary, digits, math and punctuation."""
    rng = random.Random(seed)
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if i % 3 == 0:
            words.insert(0, f"Q{rng.randint(0, 99)}:")
        if i % 4 == 0:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            words.append(f"{a} + {b} = {a + b}. Answer: {rng.choice('ABCDEF')}")
        if i % 5 == 0:
            words.append(f"\\boxed{{{rng.randint(0, 100) / 4}}} (x^2 - {rng.randint(1, 9)})")
        # Half the lines break words with newlines, as chat turns do ("assistant\nred"),
        # so words get merges both with and without a leading space.
        line = ("\n" if i % 2 else " ").join(words)
        yield line.capitalize() + rng.choice([".", "?", "!", ":", "\n"])


# ----------------------------------------------------------------------------- the cache


def cache_dir() -> Path:
    """Where built models are kept: $SACCADE_CACHE, else ~/.cache/saccade."""
    root = os.environ.get("SACCADE_CACHE") or Path.home() / ".cache" / "saccade"
    return Path(root) / "models"


def preset_folder(name: str, seed: int = 0) -> Path:
    """`cache_dir()/NAME-seedS-KEY`, where `preset_path` keeps preset `name`'s build (built or not:
    `is_built`). KEY hashes the build version, the preset, the config it starts from and the seed,
    so a changed builder, preset or published config never reuses a stale build."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    what = [BUILD_VERSION, asdict(PRESETS[name]), preset_config(name), seed]
    if init_device(name) != "cpu":  # other random values than the CPU's draw: another folder
        what.append(init_device(name))
    key = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]
    return cache_dir() / f"{name}-seed{seed}-{key}"


def preset_path(name: str, seed: int = 0) -> Path:
    """Preset `name`'s folder, built on first use and cached."""
    return build_once(preset_folder(name, seed), lambda tmp: build(tmp, name, seed))


def is_built(folder: Path) -> bool:
    return (folder / ".complete").exists()


def build_once(target: Path, build_into) -> Path:
    """`target`, built by `build_into(folder)` on first use. Built in a temp folder and renamed: a
    killed build never leaves a half-written model, and two processes racing both end up with
    a complete one."""
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build_into(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_built(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
