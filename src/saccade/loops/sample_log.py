"""A few of a step's prompts with their G completions, for a person to read: samples.jsonl.

Every `log.samples_every` steps the RL loop (rank 0) turns the step's first `log.samples_prompts`
prompts into one record each and hands them to `MetricsLogger.log_samples`, which appends them
to `<run_dir>/samples.jsonl` the way metrics.jsonl is written (fsync'd lines, a torn last line
repaired and the steps past a resumed checkpoint dropped on --resume) and mirrors them to W&B
and TensorBoard. `saccade report` shows them as a gallery. One record (docs/report.md)::

    {"step": 20, "prompt_id": "shapes-train-17", "answer": "red",
     "prompt": {"text": "What color is the shape? ...", "images": ["samples/3f9c0a1e5b7d2c44.png"]},
     "completions": [{"texts": ["red"], "finish_reasons": ["stop"], "reward": 1.0,
                      "advantage": 0.93, "info": {"correct": 1.0}, "policy_version": 19,
                      "replies": [], "reply_logprob": -0.41, "reply_logprob_blank": -1.37,
                      "image_logprob_gain": 0.96}, ...]}

`texts` and `finish_reasons` have one entry per assistant turn; `replies` holds what a
multi-turn environment answered after each turn (its text and images), so every image of an
episode is there. `info` is what the environment reported at the last step (the reward's parts
among it). `reply_logprob`, `reply_logprob_blank` and `image_logprob_gain` are the reply's
logprob with and without its images (`saccade.orchestrator.visual.reply_logprobs`; the RL loop adds them, in
one process). A value JSON cannot hold (NaN, infinity) is written as null.

Images are written once as small PNG thumbnails named by their content's hash under
`<run_dir>/samples/` and referenced by a path relative to the run folder: the same image met at
many steps is one file. Reading the opening's images and writing thumbnails costs a few
milliseconds per prompt, every `samples_every` steps; an image that cannot be read is left out
rather than stopping the run.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

SAMPLES_DIR = "samples"

__all__ = ["SAMPLES_DIR", "message_parts", "sample_line", "sample_record", "save_thumbnail", "step_samples"]


def finite(value: float) -> float | None:
    """A float JSON can hold: NaN and infinities become None."""
    value = float(value)
    return value if math.isfinite(value) else None


def plain_info(info: dict[str, Any]) -> dict[str, Any]:
    """The environment's info with the values JSON holds as they are: numbers, booleans, strings."""
    out: dict[str, Any] = {}
    for key, value in info.items():
        if isinstance(value, bool) or isinstance(value, str) or value is None:
            out[str(key)] = value
        elif isinstance(value, (int, float)):
            out[str(key)] = finite(value)
    return out


def message_parts(messages: list[dict[str, Any]]) -> tuple[str, list[Image.Image]]:
    """The text (one line per message, parts joined by spaces; a clip as "[clip]") and the images of
    messages as an environment sent them, in order. An image that cannot be loaded is left out."""
    from saccade.data.images import ImageError, load_image
    from saccade.data.messages import IMAGE_PART_TYPES, VIDEO_PART_TYPES, image_source

    lines, images = [], []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            lines.append(content)
            continue
        texts = []
        for part in content or []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
            elif kind in IMAGE_PART_TYPES:
                try:
                    images.append(load_image(image_source(part, kind)))
                except ImageError:  # a remote or broken image: the record goes on without it
                    pass
            elif kind in VIDEO_PART_TYPES:  # a clip's frames are not written: a mark where it was
                texts.append("[clip]")
        lines.append(" ".join(texts))
    return "\n".join(line for line in lines if line), images


def save_thumbnail(image: Image.Image, folder: Path, *, side: int) -> str:
    """Write `image`, shrunk to at most `side` pixels on its longest side, as `<hash>.png` in
    `folder` unless that file is already there; return its path relative to folder's parent
    (the run folder). The hash is of the thumbnail's pixels, so equal images share one file."""
    thumb = image.convert("RGB")
    thumb.thumbnail((side, side))  # in place, keeps the aspect ratio, never enlarges
    digest = hashlib.sha256(f"{thumb.width}x{thumb.height}:".encode() + thumb.tobytes()).hexdigest()[:16]
    path = folder / f"{digest}.png"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{digest}.png.tmp"
        thumb.save(tmp, format="PNG")
        os.replace(tmp, path)  # a kill mid-write leaves a .tmp file, never a torn image under the name
    return f"{folder.name}/{path.name}"


def sample_record(step: int, prompt: Any, group: list, env_messages: list[list[list[dict]]], *,
                  save: Callable[[Image.Image], str]) -> dict[str, Any]:
    """One prompt's record: its text and images (the first episode's opening), its answer when it
    has one, and each completion's turns, scores and the environment's replies. `group`: the
    prompt's Rollouts, advantages set; `env_messages`: each rollout's `env_messages` (passed apart:
    under torchrun only the rank that sampled them holds them); `save`: writes an image, returns
    its relative path."""
    def shown(messages: list[dict]) -> dict[str, Any]:
        text, images = message_parts(messages)
        return {"text": text, "images": [save(im) for im in images]}

    answer = getattr(prompt, "answer", None)
    record: dict[str, Any] = {"step": int(step), "prompt_id": str(getattr(prompt, "sample_id", "?"))}
    if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
        record["answer"] = str(answer)
    record["prompt"] = shown(env_messages[0][0]) if env_messages and env_messages[0] else {"text": "", "images": []}
    record["completions"] = [
        {"texts": list(r.texts), "finish_reasons": list(r.finish_reasons), "reward": finite(r.reward),
         "advantage": finite(r.sample.advantage), "info": plain_info(r.info), "policy_version": int(r.policy_version),
         "replies": [shown(m) for m in messages[1:]]}
        for r, messages in zip(group, env_messages, strict=True)
    ]
    return record


def step_samples(step: int, prompts: list, groups: list[list], own_groups: list[list], *, count: int,
                 folder: Path, side: int) -> list[dict[str, Any]]:
    """The records of the step's first `count` prompts. `groups`: the whole step's, in prompt
    order, advantages set; `own_groups`: this rank's (rank 0 samples the step's first prompts),
    the ones still holding the environment's messages and images."""
    n = min(count, len(own_groups))
    return [sample_record(step, prompts[g], groups[g], [r.env_messages for r in own_groups[g]],
                          save=lambda im: save_thumbnail(im, folder, side=side))
            for g in range(n)]


def sample_line(records: list[dict[str, Any]], *, chars: int = 24) -> str:
    """The first record as one line for the console, each completion's last turn cut to `chars`:
    `step 20 · shapes-train-17: 'red' r=1.00 A=+0.93 | 'blue' r=0.00 A=-0.93 | ...`."""
    if not records:
        return ""
    rec = records[0]

    def number(v: float | None, fmt: str) -> str:
        return "nan" if v is None else format(v, fmt)

    parts = []
    for c in rec["completions"]:
        text = " ".join((c["texts"][-1] if c["texts"] else "").split())
        text = text if len(text) <= chars else text[: chars - 1] + "…"
        parts.append(f"{text!r} r={number(c['reward'], '.2f')} A={number(c['advantage'], '+.2f')}")
    return f"step {rec['step']} · {rec['prompt_id']}: " + " | ".join(parts)
