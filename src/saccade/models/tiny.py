"""Build small random Qwen3-VL checkpoints offline, deterministically from a seed.

No machine here can download from a model hub, so tests, the demo and the benchmarks
run on a Qwen3-VL made on the spot: a byte-level BPE tokenizer trained on a small
generated corpus plus Qwen's special tokens, a Qwen-style chat template, the Qwen2-VL
image processor, the Qwen3-VL video processor and a random `Qwen3VLForConditionalGeneration`
with DeepStack on. The folder it writes is an ordinary Hugging Face folder: the Auto
classes and vLLM load it like a real checkpoint, so every code path is the real one.

Presets:
- "tiny": 1.55M parameters (language model 0.92M, vision 0.63M); what the tests and the
  demo use. Text head_dim is 32 because vLLM's CPU attention refuses 16.
- "small": 111.2M parameters (language model 50.3M, vision 61.0M) with Qwen3-VL's layer
  shapes scaled down; for benchmarks. Its BPE stops at ~1.7k tokens: the corpus has no more merges.
- "qwen3vl-2b": random weights at exactly Qwen3-VL-2B-Instruct's shapes (2.13B parameters,
  the 151,936-row vocabulary included, DeepStack from ViT blocks 5, 11, 17), saved in bf16
  (4.3 GB): what the GPU benchmarks measure speed, memory and bf16 parity on, offline.
  The tokenizer is the small BPE's; ids past it are rows nobody samples.
- "qwen3vl-4b": the same at Qwen3-VL-4B-Instruct's shapes (4.44B parameters, bf16, 8.9 GB):
  `saccade bench gpu`'s second parity shape.

Built folders are cached under `cache_dir()` keyed by preset, seed and a build version,
so a second call is a directory lookup.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# Bump when anything below changes what gets written, so stale caches are not reused.
BUILD_VERSION = 4

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


@dataclass(frozen=True)
class TinyPreset:
    """Shapes of a generated Qwen3-VL. Field names follow Qwen3VLTextConfig / VisionConfig."""

    bpe_vocab_size: int
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    deepstack_indexes: tuple[int, ...]
    vision_position_grid: int  # learned position grid side; Qwen3-VL uses 48
    patch_size: int = 16
    min_pixels: int = 32 * 32
    max_pixels: int = 256 * 256
    vocab_size: int | None = None  # model vocabulary rows; None: the tokenizer's size
    weights_dtype: str = "float32"  # what the weights are saved in


PRESETS: dict[str, TinyPreset] = {
    "tiny": TinyPreset(
        bpe_vocab_size=1024,
        text_hidden=128,
        text_layers=4,
        text_heads=4,
        text_kv_heads=2,
        text_head_dim=32,
        text_intermediate=384,
        vision_hidden=64,
        vision_depth=4,
        vision_heads=2,
        vision_intermediate=128,
        deepstack_indexes=(0, 1, 2),
        vision_position_grid=8,
    ),
    "small": TinyPreset(
        bpe_vocab_size=8192,
        text_hidden=640,
        text_layers=10,
        text_heads=10,
        text_kv_heads=2,
        text_head_dim=64,
        text_intermediate=2048,
        vision_hidden=512,
        vision_depth=12,
        vision_heads=8,
        vision_intermediate=2048,
        deepstack_indexes=(3, 6, 9),
        vision_position_grid=24,
        max_pixels=448 * 448,
    ),
    # Qwen/Qwen3-VL-2B-Instruct's config.json (saccade.memory.QWEN3_VL has the same numbers).
    "qwen3vl-2b": TinyPreset(
        bpe_vocab_size=8192,
        text_hidden=2048,
        text_layers=28,
        text_heads=16,
        text_kv_heads=8,
        text_head_dim=128,
        text_intermediate=6144,
        vision_hidden=1024,
        vision_depth=24,
        vision_heads=16,
        vision_intermediate=4096,
        deepstack_indexes=(5, 11, 17),
        vision_position_grid=48,
        max_pixels=448 * 448,
        vocab_size=151936,
        weights_dtype="bfloat16",
    ),
    # Qwen/Qwen3-VL-4B-Instruct's config.json (saccade.memory.QWEN3_VL has the same numbers).
    "qwen3vl-4b": TinyPreset(
        bpe_vocab_size=8192,
        text_hidden=2560,
        text_layers=36,
        text_heads=32,
        text_kv_heads=8,
        text_head_dim=128,
        text_intermediate=9728,
        vision_hidden=1024,
        vision_depth=24,
        vision_heads=16,
        vision_intermediate=4096,
        deepstack_indexes=(5, 11, 17),
        vision_position_grid=48,
        max_pixels=448 * 448,
        vocab_size=151936,
        weights_dtype="bfloat16",
    ),
}


def cache_dir() -> Path:
    """Where built models are kept: $SACCADE_CACHE, else ~/.cache/saccade."""
    root = os.environ.get("SACCADE_CACHE") or Path.home() / ".cache" / "saccade"
    return Path(root) / "models"


def preset_folder(preset: str = "tiny", seed: int = 0) -> Path:
    """Where `tiny_model_path` keeps a preset's build (built or not: see `is_built`)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return cached_folder(f"qwen3vl-{preset}", PRESETS[preset], BUILD_VERSION, seed)


def cached_folder(name: str, spec, build_version: int, seed: int) -> Path:
    """`cache_dir()/NAME-seedS-KEY`: KEY hashes the build version, the preset's fields (a
    dataclass) and the seed, so a changed builder or preset never reuses a stale build.
    Every family's tiny builder caches its folders so."""
    key = hashlib.sha256(json.dumps([build_version, asdict(spec), seed]).encode()).hexdigest()[:10]
    return cache_dir() / f"{name}-seed{seed}-{key}"


def cached_builds(family: str, presets: dict, build_version: int, build, folder_name=lambda preset: preset):
    """A family's `(preset_folder, tiny_model_path)` over its `presets` (name -> a dataclass of
    shapes): where each preset's build is cached (`cached_folder`, under `folder_name(preset)`)
    and that folder, built by `build(out_dir, preset, seed)` on first use (`build_once`)."""
    def preset_folder(preset: str, seed: int = 0) -> Path:
        if preset not in presets:
            raise ValueError(f"unknown {family} preset {preset!r}; choose one of {sorted(presets)}")
        return cached_folder(folder_name(preset), presets[preset], build_version, seed)

    def tiny_model_path(preset: str, seed: int = 0) -> Path:
        return build_once(preset_folder(preset, seed), lambda tmp: build(tmp, preset, seed))

    tiny_model_path.__doc__ = f"The folder of a generated {family}, built on first use and cached."
    return preset_folder, tiny_model_path


def seeded_model(model_class, config, seed: int):
    """`model_class(config)` with random weights that depend on the seed alone: initialised on a
    private generator state, the caller's left as it was."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config)


def is_built(folder: Path) -> bool:
    return (folder / ".complete").exists()


def tiny_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """Return the folder of a generated Qwen3-VL, building it on first use."""
    return build_once(preset_folder(preset, seed), lambda tmp: build_tiny_qwen3vl(tmp, preset=preset, seed=seed))


def build_once(target: Path, build) -> Path:
    """`target`, built by `build(folder)` on first use. Built in a temp folder and renamed: a
    killed build never leaves a half-written model, and two processes racing both end up with
    a complete one."""
    if is_built(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_built(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny_qwen3vl(out_dir: str | os.PathLike, *, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a complete random Qwen3-VL folder (tokenizer, processors, config, weights)."""
    import torch
    from transformers import Qwen3VLForConditionalGeneration

    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(spec.bpe_vocab_size, seed=seed)
    processor = build_processor(tokenizer, spec)
    processor.save_pretrained(out)

    config = build_config(tokenizer, spec)
    model = seeded_model(Qwen3VLForConditionalGeneration, config, seed)
    model.to(getattr(torch, spec.weights_dtype)).save_pretrained(out, safe_serialization=True)
    return out


def build_config(tokenizer, spec: TinyPreset):
    from transformers import Qwen3VLConfig

    assert spec.text_head_dim % 2 == 0
    half = spec.text_head_dim // 2
    # M-RoPE sections (t, h, w) over head_dim/2 frequencies, in Qwen3-VL's 24:20:20 ratio.
    h_w = (half * 20) // 64
    mrope_section = [half - 2 * h_w, h_w, h_w]
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=max(len(tokenizer), spec.vocab_size or 0),
            hidden_size=spec.text_hidden,
            intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_kv_heads,
            head_dim=spec.text_head_dim,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": mrope_section,
                "mrope_interleaved": True,
            },
            tie_word_embeddings=True,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        ),
        vision_config=dict(
            depth=spec.vision_depth,
            hidden_size=spec.vision_hidden,
            intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads,
            patch_size=spec.patch_size,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=spec.text_hidden,
            num_position_embeddings=spec.vision_position_grid**2,
            deepstack_visual_indexes=list(spec.deepstack_indexes),
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )


def build_processor(tokenizer, spec: TinyPreset):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    # Qwen3-VL's own preprocessing: patch 16, merge 2, mean = std = 0.5.
    common = dict(
        patch_size=spec.patch_size,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    image_processor = Qwen2VLImageProcessor(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}, **common
    )
    video_processor = Qwen3VLVideoProcessor(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels * 4}, **common
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


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
