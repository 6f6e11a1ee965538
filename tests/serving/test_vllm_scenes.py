"""A 3-turn episode in a generated 3D room on the real vLLM CPU server: what the server
sampled, turn by turn (rendered views, refusals sent back as text), is what the trainer
trains on (check_consistency), and the trainer's logprobs match the server's."""

from __future__ import annotations

import pytest

from saccade.tools.bench.engine import sample_logprob_diffs
from saccade.envs.rollout import run_episodes
from saccade.envs.scenes import ScenesTask
from saccade.envs.trajectory import ChatContinuation, check_consistency, to_training_sample
from saccade.inference.engine import SamplingParams
from saccade.models.sampling import SampledDistribution

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MISMATCH_MEAN = 1e-4  # as test_vllm_multiturn: fp32, every sampled token
MISMATCH_MAX = 1e-3


def test_a_three_turn_scenes_episode_on_vllm_passes_the_consistency_check(server, engine, policy, processor,
                                                                          limits):
    task = ScenesTask(kinds=("color",), colors=("red", "green", "blue"), render_size=64, start_turn=90.0,
                      say_side=True, max_turns=3, describe_actions=False)
    samples = [task.sample(i, seed=0) for i in range(3)]
    envs = [task.make_env() for _ in samples]
    trajectories = run_episodes(engine, envs, samples, [s.sample_id for s in samples],
                                SamplingParams(temperature=1.0, max_tokens=6),
                                continuation=ChatContinuation(processor, limits=limits))
    training = []
    for t in trajectories:
        # The random model answers nothing readable: every turn is refused or acts, so each
        # episode runs its three turns; the start view is always there.
        assert len(t.turns) == 3 and len(t.image_keys) >= 1
        assert sum(info.get("refusals", 0) > 0 for info in t.infos) >= 1 or len(t.image_keys) > 1
        sample = to_training_sample(t, positions=policy.positions)
        check_consistency(sample, t.turns, positions=policy.positions)  # the server's own prompt ids and types
        training.append(sample)
    diff = sample_logprob_diffs(policy, training, cache_get=engine.cache.get, image_token_id=engine.image_pad_id,
                                banned_token_ids=engine.banned_token_ids, distribution=SampledDistribution())
    assert float(diff.mean()) <= MISMATCH_MEAN and float(diff.max()) <= MISMATCH_MAX, (float(diff.mean()),
                                                                                      float(diff.max()))
