"""A synthetic "shapes" VQA task, generated on the fly and deterministic from a seed.

Three kinds of question, each multiple choice with a fixed option list per task (so chance
accuracy is exactly ``1 / num_choices``):

* ``color``: one shape in one of ``num_choices`` palette colors on a light neutral
  background -- "What color is the shape?" -> ``"red"``.
* ``shape``: one large, roughly centred shape -- "What shape is it?" -> ``"circle"``.
* ``count``: 1..``num_choices`` identical, non-overlapping shapes -- "How many shapes are
  there?" -> ``"3"``.

``blank_images=True`` is the control: the same questions and answers over one uniform gray
image, so the answer cannot be read from the image and a model can only reach chance.

Sample ``index`` of the stream for ``seed`` is a pure function of ``(task, index, seed)``:
a sampler may ask for any index in any order, in any process. Answers are balanced:
within every block of ``num_choices`` consecutive samples of one kind each answer occurs
exactly once, in a seeded random order.

Images are drawn without anti-aliasing: every shape pixel is exactly its palette color,
which keeps colors clean for a random frozen vision tower and lets tests count shapes by
connected components. Each question is a `saccade.data.questions.VQASample`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from saccade.data.images import BLANK_GRAY
from saccade.data.questions import VQASample

__all__ = [
    "BACKGROUND_RANGE",
    "BLANK_GRAY",
    "COLORS",
    "KINDS",
    "SHAPES",
    "ShapesTask",
    "make_sample",
    "make_split",
    "task_choices",
]

# Highly distinct, saturated colors; their names are words of the tiny model's tokenizer.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 225),
    "yellow": (245, 215, 20),
    "purple": (140, 50, 185),
    "orange": (250, 130, 10),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "diamond")
KINDS: tuple[str, ...] = ("color", "shape", "count")
# Backgrounds are light neutral grays (never an answer color); blank images are mid gray
# (BLANK_GRAY, saccade.data.images).
BACKGROUND_RANGE: tuple[int, int] = (205, 255)

QUESTIONS: dict[str, str] = {
    "color": "What color is the shape?",
    "shape": "What shape is it?",
    "count": "How many shapes are there?",
}

# Shapes used in the count task: compact ones, whose small renderings stay one blob.
_COUNT_SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
_KIND_SALT = {"color": 11, "shape": 23, "count": 37}
_MIN_IMAGE_SIZE = 32


@dataclass(frozen=True)
class ShapesTask:
    """What to generate. Hashable and cheap: pass it to workers and build samples there."""

    kinds: tuple[str, ...] = ("color",)  # any of "color", "shape", "count"; samples cycle through them
    num_choices: int = 4  # 3..6 answer options shown in the prompt
    image_size: int = 64
    blank_images: bool = False  # the control: same questions, uniform gray images
    eval_seed: int = 10_000  # held-out questions come from this seed's stream

    def train_sample(self, position: int, *, seed: int) -> VQASample:
        """Question ``position`` of the training stream for ``seed``."""
        return make_sample(self, position, seed=seed)

    def eval_samples(self, n: int) -> list[VQASample]:
        """The first ``n`` questions of the held-out stream."""
        return make_split(self, n, seed=self.eval_seed)

    def __post_init__(self) -> None:
        kinds = self.kinds
        if isinstance(kinds, str):  # ShapesTask(kinds="color") is an easy slip; accept it
            object.__setattr__(self, "kinds", (kinds,))
            kinds = self.kinds
        if not isinstance(kinds, tuple):
            object.__setattr__(self, "kinds", tuple(kinds))
            kinds = self.kinds
        if not kinds:
            raise ValueError("ShapesTask: kinds must name at least one of " + ", ".join(KINDS))
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            raise ValueError(f"ShapesTask: unknown kinds {unknown}; choose from {list(KINDS)}")
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"ShapesTask: kinds {list(kinds)} repeat an entry")
        n = self.num_choices
        if isinstance(n, bool) or not isinstance(n, int) or not 3 <= n <= len(SHAPES):
            raise ValueError(f"ShapesTask: num_choices must be an integer in 3..{len(SHAPES)}, got {n!r}")
        size = self.image_size
        if isinstance(size, bool) or not isinstance(size, int) or size < _MIN_IMAGE_SIZE:
            raise ValueError(f"ShapesTask: image_size must be an integer >= {_MIN_IMAGE_SIZE}, got {size!r}")


def task_choices(task: ShapesTask, kind: str) -> list[str]:
    """The fixed option list of one kind of question for this task."""
    n = task.num_choices
    if kind == "color":
        return list(COLORS)[:n]
    if kind == "shape":
        return list(SHAPES[:n])
    if kind == "count":
        return [str(i) for i in range(1, n + 1)]
    raise ValueError(f"unknown kind {kind!r}; choose from {list(KINDS)}")


def make_sample(task: ShapesTask, index: int, *, seed: int) -> VQASample:
    """Sample ``index`` of the stream for ``seed``: a pure function of (task, index, seed)."""
    for name, value in (("index", index), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise ValueError(f"make_sample: {name} must be a non-negative integer, got {value!r}")
    index, seed = int(index), int(seed)
    n_kinds = len(task.kinds)
    kind = task.kinds[index % n_kinds]
    k = index // n_kinds  # position within this kind's own stream
    choices = task_choices(task, kind)
    n = task.num_choices
    # Balance: each block of n samples of a kind holds every answer once, in a seeded order.
    block, slot = divmod(k, n)
    order = np.random.default_rng([seed, _KIND_SALT[kind], n, block, 0]).permutation(n)
    answer_index = int(order[slot])
    # Everything else about the picture comes from a per-sample generator.
    rng = np.random.default_rng([seed, _KIND_SALT[kind], n, index, 1])
    size = task.image_size
    meta: dict[str, Any] = {
        "task": "shapes",
        "kind": kind,
        "seed": seed,
        "index": index,
        "answer_index": answer_index,
        "blank": task.blank_images,
    }
    if kind == "color":
        color = choices[answer_index]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        # Large: a random frozen tower keeps colour well only when the shape fills much of the
        # image (tiny model, 3 colours: 59% vs 100% held-out after the same SFT; docs/library-notes.md).
        r = _radius(rng, size, 0.32, 0.46)
        centres = [_random_centre(rng, size, r)]
    elif kind == "shape":
        shape = choices[answer_index]
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        r = _radius(rng, size, 0.28, 0.40)
        jitter = 0.10 * size
        lo, hi = r + 1, size - 1 - r
        centres = [
            (
                float(np.clip(size / 2 + rng.uniform(-jitter, jitter), lo, hi)),
                float(np.clip(size / 2 + rng.uniform(-jitter, jitter), lo, hi)),
            )
        ]
    else:  # count
        count = answer_index + 1
        shape = _COUNT_SHAPES[int(rng.integers(len(_COUNT_SHAPES)))]
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        r, centres = _place_apart(rng, size, count)
    background = int(rng.integers(BACKGROUND_RANGE[0], BACKGROUND_RANGE[1] + 1))
    boxes = [_box(cx, cy, r) for cx, cy in centres]
    meta.update(
        shape=shape,
        color=color,
        count=len(centres),
        radius=round(r, 3),
        boxes=boxes,
        background=(background,) * 3 if not task.blank_images else BLANK_GRAY,
    )
    if task.blank_images:
        image = Image.new("RGB", (size, size), BLANK_GRAY)
    else:
        image = Image.new("RGB", (size, size), (background,) * 3)
        draw = ImageDraw.Draw(image)
        for cx, cy in centres:
            _draw_shape(draw, shape, cx, cy, r, COLORS[color])
    tag = "blank-" if task.blank_images else ""
    return VQASample(
        sample_id=f"shapes-{tag}{kind}-n{n}-s{seed}-{index}",
        images=[image],
        question=QUESTIONS[kind],
        answer=choices[answer_index],
        choices=choices,
        answer_type="multi_choice",
        metadata=meta,
    )


def make_split(task: ShapesTask, n: int, *, seed: int) -> list[VQASample]:
    """The first ``n`` samples of the stream for ``seed`` (use different seeds for train/eval)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"make_split: n must be a non-negative integer, got {n!r}")
    return [make_sample(task, i, seed=seed) for i in range(n)]


# ------------------------------------------------------------------------ drawing


def _radius(rng: np.random.Generator, size: int, lo: float, hi: float) -> float:
    return float(rng.uniform(lo, hi)) * size


def _random_centre(rng: np.random.Generator, size: int, r: float) -> tuple[float, float]:
    lo, hi = r + 1, size - 1 - r
    return float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))


def _box(cx: float, cy: float, r: float) -> list[int]:
    """Pixel bounding box [x0, y0, x1, y1] (inclusive) that contains the drawn shape."""
    return [math.floor(cx - r), math.floor(cy - r), math.ceil(cx + r), math.ceil(cy + r)]


def _place_apart(rng: np.random.Generator, size: int, count: int) -> tuple[float, list[tuple[float, float]]]:
    """Centres of ``count`` equal shapes whose boxes are at least ``gap`` pixels apart."""
    gap = max(3.0, size / 20)
    r = _radius(rng, size, 0.07, 0.11)
    for _ in range(8):
        centres: list[tuple[float, float]] = []
        for _ in range(400):
            if len(centres) == count:
                break
            cx, cy = _random_centre(rng, size, r)
            if all(max(abs(cx - x), abs(cy - y)) >= 2 * r + gap + 2 for x, y in centres):
                centres.append((cx, cy))
        if len(centres) == count:
            return r, centres
        r *= 0.85  # crowded: try again with smaller shapes
    # Fallback (rare): a shuffled grid of cells, one shape per cell.
    cells = math.ceil(math.sqrt(count))
    step = size / cells
    r = min(r, (step - gap - 2) / 2)
    slots = rng.permutation(cells * cells)[:count]
    return r, [((s % cells + 0.5) * step, (s // cells + 0.5) * step) for s in slots]


def _polygon(cx: float, cy: float, radii: list[float], start_deg: float) -> list[tuple[float, float]]:
    step = 360.0 / len(radii)
    return [
        (cx + rad * math.cos(math.radians(start_deg + i * step)), cy + rad * math.sin(math.radians(start_deg + i * step)))
        for i, rad in enumerate(radii)
    ]


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple[int, int, int]) -> None:
    """Draw one filled shape inside the box [cx - r, cx + r] x [cy - r, cy + r]."""
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        h = 0.85 * r
        draw.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif shape == "triangle":
        # Equilateral, pointing up, its box centred on (cx, cy).
        h = r * math.sqrt(3)  # height for side 2r
        draw.polygon([(cx, cy - h / 2), (cx + r, cy + h / 2), (cx - r, cy + h / 2)], fill=fill)
    elif shape == "star":
        draw.polygon(_polygon(cx, cy + 0.1 * r, [r, 0.45 * r] * 5, -90.0), fill=fill)
    elif shape == "cross":
        w = 0.33 * r
        draw.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        draw.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + 0.75 * r, cy), (cx, cy + r), (cx - 0.75 * r, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}; choose from {list(SHAPES)}")
