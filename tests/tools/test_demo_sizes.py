"""The data-set demo's picture sizes (`saccade.tools.demo_sizes`): which sizes the probe tries, given
the data set's size and the model's bound; the smallest that grounds is taken; the search stops at
the bound; what each size costs in tokens."""

from __future__ import annotations

import pytest

from saccade.config import ImagesConfig
from saccade.tools.demo_sizes import (MAX_SIZES, SizeTried, own_side, picture_tokens, search_sizes, size_limits,
                                      size_reason, sides_to_try)

TINY_BOUND = 256 * 256  # the tiny presets' processor max_pixels
FACTOR = 32  # the tiny tower: 16-px patches merged 2 x 2
DEMO = ImagesConfig(min_pixels=32 * 32, max_pixels=TINY_BOUND)  # demo.toml's [images]


def test_the_sides_double_from_the_data_sets_own_and_stop_at_the_models_bound():
    assert sides_to_try(64, TINY_BOUND, FACTOR) == [64, 128, 256]  # the 64-px pictures
    assert sides_to_try(96, TINY_BOUND, FACTOR) == [96, 192, 256]  # 384 would pass the bound: the bound's own side
    assert sides_to_try(224, TINY_BOUND, FACTOR) == [224, 256]
    assert sides_to_try(256, TINY_BOUND, FACTOR) == [256]  # already at the bound: nothing larger to try
    assert sides_to_try(300, TINY_BOUND, FACTOR) == [300]
    assert sides_to_try(32, TINY_BOUND, FACTOR) == [32, 64, 128, 256]
    # A real processor's bound is far away: a few sizes at most, each a probe.
    assert sides_to_try(64, 16384 * 28 * 28, 32) == [64, 128, 256, 512]
    assert sides_to_try(64, 16384 * 28 * 28, 32, most=2) == [64, 128] and MAX_SIZES == 4
    with pytest.raises(ValueError, match="positive"):
        sides_to_try(0, TINY_BOUND, FACTOR)


def test_a_sides_bounds_upscale_every_picture_to_it_and_the_own_side_keeps_the_configs():
    assert size_limits(DEMO, 64, own=64) is DEMO
    big = size_limits(DEMO, 128, own=64)
    assert (big.min_pixels, big.max_pixels) == (128 * 128, TINY_BOUND)
    low = ImagesConfig(min_pixels=1024, max_pixels=64 * 64)  # a config whose cap is below the side: raised to it
    assert (size_limits(low, 256, own=64).min_pixels, size_limits(low, 256, own=64).max_pixels) == (65536, 65536)
    assert size_limits(DEMO, 128, own=64).max_source_pixels == DEMO.max_source_pixels  # the rest as it was


def test_what_a_size_costs_in_image_tokens():
    pictures = [(64, 64)] * 3
    assert [picture_tokens(pictures, size_limits(DEMO, s, own=64), FACTOR) for s in (64, 128, 256)] == [4, 16, 64]
    assert picture_tokens([(64, 64), (128, 128)], DEMO, FACTOR) == 10  # the mean: 4 and 16
    assert picture_tokens([(50176 // 224, 224)], DEMO, FACTOR) == 49  # 224 x 224 as the processor rounds it
    assert own_side(pictures, DEMO, FACTOR) == 64 and own_side([(64, 64), (96, 96), (128, 128)], DEMO, FACTOR) == 96
    assert own_side([(20, 20)], DEMO, FACTOR) == 32  # the processor's floor (min_pixels 32 x 32) counts
    with pytest.raises(ValueError, match="no pictures"):
        own_side([], DEMO, FACTOR)


def search(sides, reads: dict[int, float]):
    """search_sizes with a probe that reads `reads[side]` (chance 0.125 elsewhere): grounded from
    0.225 on, enough from 0.9."""
    asked = []

    def probe_at(side: int) -> float:
        asked.append(side)
        return reads.get(side, 0.125)

    tried, chosen = search_sizes(sides, probe_at, lambda s: (s // FACTOR) ** 2, grounded=lambda a: a >= 0.225,
                                 enough=lambda a: a >= 0.9)
    return tried, chosen, asked


def test_the_smallest_size_that_reads_the_answers_is_taken_and_no_larger_one_is_probed():
    tried, chosen, asked = search([64, 128, 256], {128: 0.95, 256: 1.0})
    assert chosen == 128 and asked == [64, 128]
    assert tried == [SizeTried(64, 4, 0.125), SizeTried(128, 16, 0.95)]
    assert search([64, 128, 256], {64: 0.98})[1:] == (64, [64])  # its own size: nothing else tried


def test_a_size_that_grounds_in_part_does_not_stop_the_search():
    # 128 px keeps a quarter of the answers, 256 px all of them: 256 is taken.
    tried, chosen, asked = search([64, 128, 256], {128: 0.25, 256: 0.95})
    assert chosen == 256 and asked == [64, 128, 256]
    # None keeps them all: the one that keeps the most, the smallest of equals.
    assert search([64, 128, 256], {128: 0.5, 256: 0.4})[1] == 128
    assert search([64, 128, 256], {64: 0.5, 128: 0.5, 256: 0.5})[1] == 64


def test_pictures_that_ground_nowhere_are_probed_up_to_the_bound_and_none_is_taken():
    tried, chosen, asked = search(sides_to_try(64, TINY_BOUND, FACTOR), {})
    assert chosen is None and asked == [64, 128, 256] and [t.accuracy for t in tried] == [0.125] * 3


def test_the_reason_names_the_size_what_it_read_and_what_it_costs():
    tried = [SizeTried(64, 4, 0.109), SizeTried(128, 16, 0.12), SizeTried(256, 64, 0.953)]
    why = size_reason(tried, 256, blank=0.156, chance=0.125, enough=0.9)
    assert why.startswith("the smallest size at which the probe read 0.9 of the answers: 256 px (64 image tokens "
                          "a picture): 0.953")
    assert "64 px (4 image tokens a picture): 0.109" in why and "16 x the image tokens" in why and "blank 0.156" in why
    assert "own size" in size_reason(tried[:1], 64, blank=0.125, chance=0.125, enough=0.1)
    assert "read the most" in size_reason(tried, 256, blank=0.125, chance=0.125, enough=0.99)
    nowhere = size_reason(tried, None, blank=0.9, chance=0.125, enough=0.9)
    assert nowhere.startswith("not grounded at any size tried") and "256 px" in nowhere
