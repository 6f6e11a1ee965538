"""The pieces every row format reads a row with: its images, its chat, its answer, its options;
and the prompt parts a task puts on a row's chat (`with_prompt_parts`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from PIL import Image

from saccade.config import ImagesConfig
from saccade.data.image_paths import check_image_location
from saccade.data.images import MissingImageError, load_image
from saccade.data.questions import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER
from saccade.data.rows import RowSkipped

__all__ = [
    "answer", "chat", "format_choices", "images", "is_letter", "parse_options", "scalars", "user_text",
    "videos", "with_base", "with_prompt_parts",
]


def images(values: Any, *, sample_id: str, column: str, limits: ImagesConfig,
           root: Path | None = None) -> list[Image.Image]:
    """The row's images; a file outside `root` (any file when None) is refused first
    (`check_image_location`)."""
    if values is None:
        return []
    if not isinstance(values, list):
        values = [values]
    out = []
    for i, value in enumerate(values):
        if value is None:
            raise MissingImageError(f"{column}[{i}] is None", sample=f"{sample_id} ({column}[{i}])")
        check_image_location(value, root, f"{column}[{i}]")
        # load_image's errors say what is wrong; this names the row and the column.
        out.append(load_image(value, limits=limits, sample=f"{sample_id} ({column}[{i}])"))
    return out


def videos(value: Any, *, sample_id: str, column: str, base: Path | None = None,
           root: Path | None = None) -> list[Any]:
    """The row's clip (one a row: a video file, or a list of frames), its files made relative to
    `base` and refused outside `root` (`check_image_location`), as `load_video` will read it; it is
    decoded, with the model's video sampling, when its prompt is tokenized."""
    if value is None:
        raise RowSkipped("missing_image", f"{column} (the row's clip) is None")
    if isinstance(value, list):
        if not value:
            raise RowSkipped("missing_image", f"{column} (the row's clip) is an empty list of frames")
        frames = [with_base(v, base) for v in value]
        for i, frame in enumerate(frames):
            check_image_location(frame, root, f"{column}[{i}]")
        return [frames]
    value = with_base(value, base)
    check_image_location(value, root, column)
    return [value]


def with_base(value: Any, base: Path | None) -> Any:
    """An image reference with a relative file path made relative to `base`; others as they are."""
    if base is None:
        return value
    if isinstance(value, dict) and value.get("bytes") is None and isinstance(value.get("path"), str):
        return {**value, "path": with_base(value["path"], base)}
    if isinstance(value, str) and "://" not in value and not value.startswith("data:") and not Path(value).is_absolute():
        return str(base / value)
    return value


def chat(prompt: Any, *, sample_id: str) -> list[dict[str, str]]:
    """A row's prompt as chat messages: a string is one user turn; a list must be
    {role, content} messages with string contents (`<image>` placeholders in them)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise ValueError(f"row {sample_id}: prompt must be a list of {{role, content}} messages, got {prompt!r:.200}")
    for m in prompt:
        if not isinstance(m.get("content"), str):
            raise ValueError(f"row {sample_id}: prompt message contents must be strings with {IMAGE_PLACEHOLDER} "
                             f"placeholders, got {type(m.get('content')).__name__}")
    return [{"role": str(m["role"]), "content": m["content"]} for m in prompt]


def user_text(messages: list[dict[str, str]]) -> str:
    """The user turns' text, placeholders blanked: the question as a sample states it."""
    text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    return text.replace(IMAGE_PLACEHOLDER, " ").replace(VIDEO_PLACEHOLDER, " ").strip()


# "A. text", "(A) text", "A) text", "A: text", one option per line.
_OPTION_LINE = re.compile(r"^\s*\(?([A-Z])[.):：]\s*(.+?)\s*$", re.MULTILINE)
# "(A) text (B) text" inline, as in "Choices: (A) 3 (B) 4".
_OPTION_INLINE = re.compile(r"\(([A-Z])\)\s*(.+?)(?=\s*\([A-Z]\)|\s*$|\n)")


def parse_options(text: str) -> list[str] | None:
    """The option texts of a multiple-choice prompt, in order from A; None when there are
    not at least two options lettered A, B, ... without a gap."""
    for pattern in (_OPTION_LINE, _OPTION_INLINE):
        found = pattern.findall(text)
        options: list[str] = []
        for letter, option in found:
            if ord(letter) - ord("A") == len(options):
                options.append(option.strip())
            elif letter == "A":  # a second list starts: keep the later one (the options follow the question)
                options = [option.strip()]
        if len(options) >= 2:
            return options
    return None


def format_choices(choices: list[str] | None) -> str:
    """Options as the prompt shows them: one a line, lettered ("A. red\nB. green"); "" for none."""
    if not choices:
        return ""
    return "\n".join(f"{chr(ord('A') + i)}. {choice}" for i, choice in enumerate(choices))


def answer(value: Any, *, column: str) -> str:
    """The ground truth as text; a row without one (None, blank) cannot be scored."""
    text = "" if value is None else str(value).strip()
    if not text:
        raise RowSkipped("no_answer", f"{column} is {'None' if value is None else 'blank'}")
    return text


def is_letter(text: str) -> bool:
    return len(text) == 1 and "A" <= text <= "Z"


def scalars(values: Any) -> dict[str, Any]:
    """The JSON-friendly scalar entries of a dict column (extra_info carries anything)."""
    if not isinstance(values, dict):
        return {}
    return {k: v for k, v in values.items() if isinstance(v, str | int | float | bool) and not isinstance(v, bytes)}


def with_prompt_parts(messages: list[dict[str, str]], template: str, system_prompt: str | None,
                      choices: list[str] | None = None) -> list[dict[str, str]]:
    """A row's chat with `template` applied to its last user turn (the turn's text trimmed, as
    {prompt}; `<image>` placeholders stay where they are) and `system_prompt` first when the chat
    has no system turn (OpenMMReasoner's rows mostly carry their own instructions in the user turn)."""
    messages = [dict(m) for m in messages]
    if template != "{prompt}":
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last]["content"] = template.format(prompt=messages[last]["content"].strip(),
                                                    choices=format_choices(choices)).strip()
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
