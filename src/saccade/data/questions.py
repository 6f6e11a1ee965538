"""saccade's generic visual question (`VQASample`) and its chat messages (`to_messages`).

Every single-turn question task gives its prompts as `VQASample`s: the synthetic shapes
(`saccade.data.shapes`) and the data sets (`saccade.data.datasets`) alike, so the same rewards
(`saccade.rewards`, `saccade.rewards.weighted`), the same row checks (`saccade.data.rows`) and the same
`QuestionTask` (`saccade.run.tasks`) serve them all. `to_messages` turns one into OpenAI-format
messages: the clips and images first and then the question with its options, or, for a data
set's own chat, each image where its text says `IMAGE_PLACEHOLDER` and each clip where it says
`VIDEO_PLACEHOLDER` (a kind without placeholders goes first in the first user turn).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from PIL import Image

from saccade.data.images import image_to_data_url

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "VQASample", "prompt_text", "to_messages"]

# Where a data set's prompt puts an image: each one marks the next image of the sample.
IMAGE_PLACEHOLDER = "<image>"
# Where it puts a clip: each one marks the next clip of the sample.
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")


@dataclass
class VQASample:
    """saccade's generic visual question: real datasets map onto the same fields."""

    sample_id: str
    images: list[Image.Image]
    question: str  # the bare question; `prompt_text` adds the options
    answer: str  # the correct option text, e.g. "red" (datasets: a letter, a number, LaTeX, ...)
    choices: list[str] | None
    answer_type: str  # "multi_choice" here; datasets also use "integer", "float", "list", "free_form"
    metadata: dict[str, Any] = field(default_factory=dict)
    precision: int | None = None  # decimal places a float answer is compared at (MathVista)
    # Datasets: the chat as the data set wrote it, [{"role", "content"}] with string contents in
    # which each "<image>" marks where the next image of `images` goes. None: `question` +
    # options after the images (the synthetic tasks).
    prompt: list[dict[str, str]] | None = None
    # Datasets: where the row is, {"split", "config", "index" within the config}, for the
    # records of a refused row (saccade.data.rows). None: generated.
    origin: dict[str, Any] | None = None
    # How `correct` scores this sample (saccade.rewards.Scorer: a published protocol's
    # extractor and grader, from its task's `task.scoring`). None: saccade.rewards.score.
    scorer: Any = None
    # Clips, in order: what `load_video` reads (a file path, bytes, a list of frames, a VideoClip),
    # decoded with the model's video sampling when the prompt is tokenized (`messages_to_inputs`).
    videos: list[Any] = field(default_factory=list)


def prompt_text(sample: VQASample) -> str:
    """The user's text: the question, plus the options when the sample has them."""
    if sample.choices:
        return f"{sample.question} Answer with one word from: {', '.join(sample.choices)}."
    return sample.question


def to_messages(
    sample: VQASample,
    *,
    system_prompt: str | None = None,
    image_format: Literal["pil", "data_url"] = "pil",
) -> list[dict[str, Any]]:
    """OpenAI-format chat messages for one sample: images first, then the prompt text.

    ``image_format="pil"`` gives ``{"type": "image", "image": PIL}`` parts (for
    ``messages_to_inputs``); ``"data_url"`` gives ``{"type": "image_url", ...}`` parts
    with base64 PNG data URLs, ready to send to an OpenAI-compatible server.
    """
    if image_format == "pil":
        image_parts: list[dict[str, Any]] = [{"type": "image", "image": im} for im in sample.images]
    elif image_format == "data_url":
        image_parts = [{"type": "image_url", "image_url": {"url": image_to_data_url(im)}} for im in sample.images]
    else:
        raise ValueError(f"to_messages: image_format must be 'pil' or 'data_url', got {image_format!r}")
    video_parts: list[dict[str, Any]] = [{"type": "video", "video": clip} for clip in sample.videos]
    messages: list[dict[str, Any]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    if sample.prompt is not None:
        return messages + _placed_images(sample, image_parts, video_parts)
    parts = [*video_parts, *image_parts, {"type": "text", "text": prompt_text(sample)}]
    messages.append({"role": "user", "content": parts})
    return messages


def _placed_images(sample: VQASample, image_parts: list[dict[str, Any]],
                   video_parts: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The sample's own chat with an image part wherever its text says "<image>" and a clip part
    wherever it says "<video>".

    A kind without any placeholder (images, clips) goes at the start of the first user turn
    (where `prompt_text` samples have them), clips before images; any other count that differs
    from the number of images (or clips) is an error: guessing would show the model the wrong
    picture."""
    assert sample.prompt is not None
    remaining = {IMAGE_PLACEHOLDER: list(image_parts), VIDEO_PLACEHOLDER: list(video_parts)}
    front: list[dict[str, Any]] = []
    for mark, what in ((VIDEO_PLACEHOLDER, "clips"), (IMAGE_PLACEHOLDER, "images")):
        n_marks = sum(str(m.get("content", "")).count(mark) for m in sample.prompt)
        if n_marks not in (0, len(remaining[mark])):
            raise ValueError(
                f"sample {sample.sample_id!r}: its prompt has {n_marks} {mark} placeholders "
                f"but the sample has {len(remaining[mark])} {what}; they must match"
            )
        if n_marks == 0:
            front += remaining[mark]
            remaining[mark] = []
    messages: list[dict[str, Any]] = []
    for message in sample.prompt:
        role, text = message["role"], str(message.get("content", ""))
        parts: list[dict[str, Any]] = []
        if front and role == "user":
            parts.extend(front)
            front = []
        for piece in _PLACEHOLDERS.split(text):
            if piece in remaining:
                parts.append(remaining[piece].pop(0))
            elif piece.strip():
                parts.append({"type": "text", "text": piece})
        if role == "system" and all(p["type"] == "text" for p in parts):
            messages.append({"role": role, "content": "".join(p["text"] for p in parts)})
        else:
            messages.append({"role": role, "content": parts})
    if front:
        raise ValueError(f"sample {sample.sample_id!r}: its prompt has images but no user turn to put them in")
    return messages
