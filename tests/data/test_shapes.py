"""Tests for saccade.data.shapes: the synthetic shapes VQA task."""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
import pytest

from saccade.data.questions import VQASample, prompt_text, to_messages
from saccade.data.shapes import (
    BLANK_GRAY,
    COLORS,
    KINDS,
    SHAPES,
    ShapesTask,
    make_sample,
    make_split,
    task_choices,
)
from saccade.rewards import correct_reward, format_reward

ALL = ShapesTask(kinds=KINDS, num_choices=6)


def pixels(sample: VQASample) -> np.ndarray:
    return np.asarray(sample.images[0])


def components(mask: np.ndarray) -> list[int]:
    """Sizes of the 8-connected components of a boolean mask (plain BFS, no scipy)."""
    seen = np.zeros_like(mask, dtype=bool)
    h, w = mask.shape
    sizes = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        seen[y0, x0] = True
        queue, size = deque([(y0, x0)]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
        sizes.append(size)
    return sizes


# --------------------------------------------------------------------- determinism


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_and_index_give_identical_samples(kind):
    task = ShapesTask(kinds=(kind,), num_choices=5)
    a, b = make_sample(task, 17, seed=3), make_sample(task, 17, seed=3)
    assert a.images[0].tobytes() == b.images[0].tobytes()
    assert (a.question, a.answer, a.choices, a.sample_id) == (b.question, b.answer, b.choices, b.sample_id)
    assert a.metadata == b.metadata


def test_split_equals_individual_samples_in_any_order():
    split = make_split(ALL, 30, seed=9)
    for i in reversed(range(30)):  # random access: no hidden state between calls
        s = make_sample(ALL, i, seed=9)
        assert s.images[0].tobytes() == split[i].images[0].tobytes()
        assert s.answer == split[i].answer and s.sample_id == split[i].sample_id


@pytest.mark.parametrize("kind", KINDS)
def test_different_index_or_seed_gives_different_images(kind):
    task = ShapesTask(kinds=(kind,))
    images = {make_sample(task, i, seed=0).images[0].tobytes() for i in range(40)}
    assert len(images) == 40
    assert make_sample(task, 5, seed=0).images[0].tobytes() != make_sample(task, 5, seed=1).images[0].tobytes()
    ids = {make_sample(task, i, seed=s).sample_id for i in range(10) for s in range(3)}
    assert len(ids) == 30


# ------------------------------------------------------------------- answers/choices


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_choices", [3, 4, 6])
def test_answers_are_balanced(kind, num_choices):
    task = ShapesTask(kinds=(kind,), num_choices=num_choices)
    answers = Counter(s.answer for s in make_split(task, 600, seed=1))
    expected = 600 / num_choices
    assert set(answers) == set(task_choices(task, kind))
    for answer, count in answers.items():
        assert abs(count - expected) <= 0.25 * expected, (answer, count)


def test_answers_balanced_per_kind_when_kinds_are_mixed():
    split = make_split(ALL, 600, seed=2)
    by_kind = Counter(s.metadata["kind"] for s in split)
    assert by_kind == {k: 200 for k in KINDS}
    for kind in KINDS:
        answers = Counter(s.answer for s in split if s.metadata["kind"] == kind)
        assert len(answers) == 6 and max(answers.values()) - min(answers.values()) <= 1


def test_answer_order_is_not_a_fixed_cycle():
    task = ShapesTask()
    runs = [tuple(s.answer for s in make_split(task, 40, seed=0)[i : i + 4]) for i in range(0, 40, 4)]
    assert len(set(runs)) > 1  # each block is a fresh permutation
    other = [s.answer for s in make_split(task, 40, seed=1)]
    assert other != [s.answer for s in make_split(task, 40, seed=0)]


@pytest.mark.parametrize("num_choices", [3, 4, 5, 6])
def test_choices_are_fixed_and_contain_the_answer(num_choices):
    task = ShapesTask(kinds=KINDS, num_choices=num_choices)
    split = make_split(task, 60, seed=4)
    for s in split:
        kind = s.metadata["kind"]
        assert s.choices == task_choices(task, kind)
        assert len(s.choices) == num_choices == len(set(s.choices))
        assert s.answer in s.choices
        assert s.choices.index(s.answer) == s.metadata["answer_index"]
        assert s.answer_type == "multi_choice"
    assert task_choices(task, "color") == list(COLORS)[:num_choices]
    assert task_choices(task, "shape") == list(SHAPES)[:num_choices]
    assert task_choices(task, "count") == [str(i) for i in range(1, num_choices + 1)]


def test_prompt_is_short_and_lists_the_options():
    s = make_sample(ShapesTask(num_choices=4), 0, seed=0)
    assert prompt_text(s) == "What color is the shape? Answer with one word from: red, green, blue, yellow."
    for kind in KINDS:
        s = make_sample(ShapesTask(kinds=(kind,), num_choices=6), 0, seed=0)
        text = prompt_text(s)
        assert len(text.split()) <= 20
        assert all(c in text for c in s.choices)


# ------------------------------------------------------------------------- images


@pytest.mark.parametrize("size", [32, 64, 96])
def test_images_are_rgb_of_image_size(size):
    task = ShapesTask(kinds=KINDS, image_size=size)
    for s in make_split(task, 12, seed=0):
        assert len(s.images) == 1
        assert s.images[0].mode == "RGB" and s.images[0].size == (size, size)


def test_color_task_shape_is_drawn_in_the_answer_color_on_a_neutral_background():
    task = ShapesTask(num_choices=6)
    palette = set(COLORS.values())
    for s in make_split(task, 60, seed=5):
        px = pixels(s).reshape(-1, 3)
        colors = Counter(map(tuple, px))
        background = tuple(s.metadata["background"])
        assert set(colors) == {background, COLORS[s.answer]}
        assert background[0] == background[1] == background[2] and background not in palette
        assert colors[COLORS[s.answer]] >= 30  # a visible shape, not a speck


def test_shape_task_shapes_are_large():
    task = ShapesTask(kinds=("shape",), num_choices=6)
    for s in make_split(task, 36, seed=6):
        px = pixels(s)
        mask = np.any(px != px[0, 0], axis=-1)
        assert mask.mean() > 0.08, s.answer
        assert components(mask) == [int(mask.sum())]  # one connected shape
        assert s.metadata["shape"] == s.answer


def test_count_task_has_that_many_separate_shapes():
    task = ShapesTask(kinds=("count",), num_choices=6)
    for s in make_split(task, 90, seed=7):
        px = pixels(s)
        mask = np.all(px == COLORS[s.metadata["color"]], axis=-1)
        assert np.all(mask == np.any(px != px[0, 0], axis=-1))  # nothing else is drawn
        sizes = components(mask)
        assert len(sizes) == int(s.answer) == s.metadata["count"], s.sample_id
        assert max(sizes) <= 2 * min(sizes) + 4  # same kind and size of shape
        boxes = s.metadata["boxes"]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]  # boxes disjoint


def test_blank_images_are_uniform_gray_and_identical():
    task = ShapesTask(kinds=KINDS, blank_images=True)
    split = make_split(task, 30, seed=0)
    first = split[0].images[0].tobytes()
    for s in split:
        assert s.images[0].tobytes() == first
        assert s.images[0].getcolors() == [(64 * 64, BLANK_GRAY)]
        assert s.metadata["blank"] is True
    # Same questions and answers as the real task: only the image differs.
    real = make_split(ShapesTask(kinds=KINDS), 30, seed=0)
    assert [s.answer for s in split] == [s.answer for s in real]
    assert [s.question for s in split] == [s.question for s in real]
    assert split[0].sample_id != real[0].sample_id


def test_task_validation():
    with pytest.raises(ValueError, match="num_choices"):
        ShapesTask(num_choices=2)
    with pytest.raises(ValueError, match="num_choices"):
        ShapesTask(num_choices=7)
    with pytest.raises(ValueError, match="unknown kinds"):
        ShapesTask(kinds=("size",))
    with pytest.raises(ValueError, match="at least one"):
        ShapesTask(kinds=())
    with pytest.raises(ValueError, match="image_size"):
        ShapesTask(image_size=16)
    assert ShapesTask(kinds="shape").kinds == ("shape",)
    assert ShapesTask(kinds=["color", "count"]).kinds == ("color", "count")
    with pytest.raises(ValueError, match="index"):
        make_sample(ShapesTask(), -1, seed=0)
    with pytest.raises(ValueError, match="seed"):
        make_sample(ShapesTask(), 0, seed=-3)
    assert make_split(ShapesTask(), 0, seed=0) == []


def test_rewards_accept_shape_samples():
    for s in make_split(ALL, 12, seed=0):
        assert correct_reward(s.answer, s) == 1.0
        assert correct_reward(f"Answer: {s.answer}.", s) == 1.0
        wrong = next(c for c in s.choices if c != s.answer)
        assert correct_reward(wrong, s) == 0.0
        assert format_reward(wrong, s.choices) == 1.0 == format_reward(wrong, s)
        assert format_reward("no idea", s.choices) == 0.0
    count = make_sample(ShapesTask(kinds=("count",)), 2, seed=0)
    word = ["zero", "one", "two", "three", "four"][int(count.answer)]
    assert correct_reward(word, count) == 1.0


def test_blanking_a_sample_messages_gives_the_blank_tasks_images():
    """The generic blanking (saccade.data.messages.with_blank_images, what eval.visual_gain
    scores) shows the policy exactly the pixels of the shapes control task (blank_images)."""
    from saccade.data.messages import with_blank_images

    real, blank = (ShapesTask(kinds=KINDS, image_size=48, blank_images=b).eval_samples(3) for b in (False, True))
    for r, b in zip(real, blank, strict=True):
        (part,) = [p for p in with_blank_images(to_messages(r))[0]["content"] if p["type"] == "image"]
        assert part["image"].tobytes() == b.images[0].tobytes() and part["image"].size == b.images[0].size
