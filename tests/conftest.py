"""Shared fixtures: one tiny Qwen3-VL per test session, built offline (cached across sessions)."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: let torch use both, but never more (oversubscription costs 10x here).
torch.set_num_threads(min(2, os.cpu_count() or 1))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_path():
    from saccade.models.tiny import tiny_model_path

    return tiny_model_path("tiny", seed=0)


@pytest.fixture(scope="session")
def limits():
    from saccade.config import ImagesConfig

    return ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)


@pytest.fixture(scope="session")
def processor(tiny_path):
    from saccade.models.loading import load_processor

    return load_processor(tiny_path)


@pytest.fixture(scope="session")
def full_model(tiny_path):
    from saccade.models.loading import load_full_model

    return load_full_model(tiny_path)


@pytest.fixture(scope="session")
def tower(tiny_path):
    from saccade.models.loading import load_vision_tower

    return load_vision_tower(tiny_path)


@pytest.fixture()
def encoder(tower, processor, limits):
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    return VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache())


@pytest.fixture(scope="session")
def policy(tiny_path):
    """The trainer's LM-only model. Tests must not modify it (load their own to train)."""
    from saccade.models.lm import load_policy_lm

    return load_policy_lm(tiny_path).eval()
