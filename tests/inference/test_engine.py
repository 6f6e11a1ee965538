"""The Engine protocol: both engines have every member the loops call, so no loop asks
`getattr(engine, ...)` (the embedded engine's answers where it has nothing to say)."""

from __future__ import annotations

import inspect

import pytest

from saccade.inference.engine import Engine
from saccade.inference.local import LocalEngine
from saccade.inference.vllm import VLLMEngine


def protocol_methods() -> list[str]:
    return sorted(name for name, member in vars(Engine).items()
                  if inspect.isfunction(member) and not name.startswith("_"))


def test_the_protocol_lists_what_the_loop_calls():
    assert {"generate", "generate_tokens", "prepare_all", "encode_images", "key_for_hash", "update_weights",
            "reseed", "rng_state", "set_rng_state", "stats"} <= set(protocol_methods())


@pytest.mark.parametrize("engine", [LocalEngine, VLLMEngine], ids=lambda e: e.__name__)
def test_both_engines_have_every_method_with_the_protocols_parameters(engine):
    for name in protocol_methods():
        assert callable(getattr(engine, name, None)), f"{engine.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Engine, name)).parameters)
        have = list(inspect.signature(getattr(engine, name)).parameters)
        assert have == want, f"{engine.__name__}.{name}{have} is not the protocol's {want}"


def test_the_embedded_engine_has_no_counters(policy, processor, encoder):
    """No servers: nothing retried, rerouted, taken out or waited for; the loop logs none of them."""
    assert LocalEngine(policy, processor, encoder).stats() == {}
