"""The rollout path on the tiny model with stub rewards: every completion gets its own reward
and its own group's advantage, zero-variance groups are dropped, episodes are scored by their
turns, and one GRPO step moves the logprobs the way the advantages say."""

from __future__ import annotations

import math

import pytest
import torch
from stub_tasks import HashEpisodesTask, hash_reward, scored_task

from saccade.models.sampling import SampledDistribution
from saccade.config import RunConfig, load_config
from saccade.inference.engine import SamplingParams
from saccade.data.rows import StepRows
from saccade.orchestrator.rollout import final_info_means, sample_step

ARGS = ["--rollout.group_size", "4", "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "6",
        "--trainer.seed", "11"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from saccade.run.setup import build_setup

    cfg = load_config(RunConfig, "configs/demo.toml", ARGS)
    return cfg, build_setup(cfg, tmp_path_factory.mktemp("rollout"))


def _rollouts(cfg, setup, task, prompts, **overrides):
    """The prompts as one RL step's rows, sampled and scored as `saccade rl` does (`sample_step`)."""
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=overrides)})
    rows = StepRows(prompts, positions=list(range(len(prompts))), end=len(prompts), skipped=[])
    rollouts = sample_step(0, rows, setup=setup, task=task, cfg=cfg,
                           sampling=SamplingParams(max_tokens=cfg.sampling.max_tokens, n=cfg.rollout.group_size))
    rollouts.pins.release()
    return rollouts.batch


def _by_hand(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO's advantage: (r - mean) / (sample std + eps); 0 for a group whose rewards are equal."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
    return [0.0 if std == 0 else (r - mean) / (std + eps) for r in rewards]


def _completion_text(setup, sample) -> str:
    return setup.processor.tokenizer.decode(sample.input_ids[sample.loss_mask], skip_special_tokens=True)


def test_each_completion_gets_its_own_reward_and_its_groups_advantage(built):
    cfg, setup = built

    def score(text, sample):  # depends on the answer and on the question it answers
        return hash_reward(sample.sample_id + "|" + text)

    task = scored_task(cfg, score)
    prompts = [task.train_sample(i, seed=5) for i in range(3)]
    batch = _rollouts(cfg, setup, task, prompts)
    assert len(batch.samples) == 12 and [len(g) for g in batch.groups] == [4, 4, 4]
    for prompt, group in zip(prompts, batch.groups, strict=True):
        rewards = [score(_completion_text(setup, r.sample), prompt) for r in group]
        assert len(set(rewards)) > 1, "stub rewards should vary within a group"
        assert [r.sample.reward for r in group] == rewards
        assert [r.sample.sample_id for r in group] == [f"{prompt.sample_id}/{i}" for i in range(4)]
        assert [r.sample.advantage for r in group] == pytest.approx(_by_hand(rewards), abs=1e-6)
    assert batch.metrics["reward_mean"] == pytest.approx(sum(s.reward for s in batch.samples) / 12)


def test_the_advantage_options_reach_the_samples(built):
    """rollout.advantage_baseline and advantage_scaling score the step: RLOO's leave-one-out
    baseline over the std of all the step's rewards, checked against the rewards by hand."""
    cfg, setup = built
    task = scored_task(cfg, lambda text, sample: hash_reward(sample.sample_id + "|" + text))
    prompts = [task.train_sample(i, seed=5) for i in range(3)]
    batch = _rollouts(cfg, setup, task, prompts, advantage_baseline="rloo", advantage_scaling="batch")
    rewards = [[r.sample.reward for r in group] for group in batch.groups]
    flat = [x for group in rewards for x in group]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    for group, scored in zip(rewards, batch.groups, strict=True):
        assert len(set(group)) > 1
        expected = [(r - (sum(group) - r) / 3) / (std + 1e-6) for r in group]
        assert [r.sample.advantage for r in scored] == pytest.approx(expected, abs=1e-6)


def test_groups_without_variance_are_dropped(built):
    cfg, setup = built
    prompts = scored_task(cfg).eval_samples(3)
    flat_id = prompts[1].sample_id  # this question's answers all score the same

    def score(text, sample):
        return 0.5 if sample.sample_id == flat_id else hash_reward(text)

    batch = _rollouts(cfg, setup, scored_task(cfg, score), prompts, filter_zero_variance=True)
    kept = {s.sample_id.rsplit("/", 1)[0] for s in batch.samples}
    assert kept == {prompts[0].sample_id, prompts[2].sample_id}
    assert batch.metrics["groups_kept_frac"] == pytest.approx(2 / 3)
    assert batch.metrics["groups_with_signal_frac"] == pytest.approx(2 / 3)
    assert all(r.sample.advantage == 0.0 for r in batch.groups[1])
    # What was dropped, for a normalisation that counts it (loss.denominator 'sampled').
    assert batch.filtered_samples == len(batch.groups[1])
    assert batch.filtered_loss_tokens == sum(int(r.sample.loss_mask.sum()) for r in batch.groups[1]) > 0
    # Kept or not, the flat group carries no signal (what the stall watch counts).
    unfiltered = _rollouts(cfg, setup, scored_task(cfg, score), prompts, filter_zero_variance=False)
    assert unfiltered.metrics["groups_kept_frac"] == 1.0
    assert unfiltered.metrics["groups_with_signal_frac"] == pytest.approx(2 / 3)
    assert (unfiltered.filtered_samples, unfiltered.filtered_loss_tokens) == (0, 0)


def test_replies_cut_at_max_tokens_are_counted(built):
    """truncated_frac: the share of replies that ran to sampling.max_tokens (finish reason
    "length"); the rest ended (stopped_frac)."""
    cfg, setup = built
    prompts = scored_task(cfg).eval_samples(3)
    cut_fracs = []
    for max_tokens in (2, 6):
        short = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"max_tokens": max_tokens})})
        batch = _rollouts(short, setup, scored_task(short), prompts)
        replies = [(r.finish_reasons[0], r.completion_tokens) for group in batch.groups for r in group]
        cut = [n for reason, n in replies if reason == "length"]
        assert batch.metrics["truncated_frac"] == len(cut) / len(replies)
        assert batch.metrics["truncated_frac"] + batch.metrics["stopped_frac"] == 1.0
        assert batch.metrics["final_truncated_frac"] == batch.metrics["truncated_frac"]  # one reply each
        assert all(n == max_tokens for n in cut)
        cut_fracs.append(batch.metrics["truncated_frac"])
    assert cut_fracs[0] > 0  # not vacuous: a random model's replies rarely end within 2 tokens
    assert cut_fracs[0] >= cut_fracs[1]


def test_overlong_penalty_gives_all_zero_groups_a_signal_and_mask_drops_cut_answers(built):
    """DAPO's overlong tools on the collapse they are for: every answer scores 0, some are cut.
    Without shaping no group has variance; with overlong_penalty the answers that ended get the
    positive advantages; with mask_overlong the cut ones leave the loss."""
    cfg, setup = built
    short = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"max_tokens": 3})})
    task = scored_task(short, lambda text, sample: 0.0)
    prompts = task.eval_samples(3)
    plain = _rollouts(short, setup, task, prompts)
    assert plain.metrics["groups_with_signal_frac"] == 0.0 and "reward_shaped_mean" not in plain.metrics
    shaped = _rollouts(short, setup, task, prompts, overlong_penalty=0.5, filter_zero_variance=True)
    mixed = [g for g in shaped.groups if len({r.finish_reasons[0] for r in g}) == 2]
    assert mixed, "not vacuous: some group must have both cut and ended answers"
    for group in mixed:
        shaped_rewards = [-0.5 * (r.finish_reasons[0] == "length") for r in group]
        assert [r.sample.advantage for r in group] == pytest.approx(_by_hand(shaped_rewards), abs=1e-6)
        assert all((r.sample.advantage > 0) == (r.finish_reasons[0] == "stop") for r in group)
    assert shaped.metrics["groups_with_signal_frac"] == pytest.approx(len(mixed) / 3)
    assert shaped.metrics["reward_mean"] == 0.0  # the task's reward, unshaped
    assert shaped.metrics["reward_shaped_mean"] == pytest.approx(-0.5 * shaped.metrics["truncated_frac"])
    masked = _rollouts(short, setup, task, prompts, overlong_penalty=0.5, mask_overlong=True)
    kept = {s.sample_id for s in masked.samples}
    ended = {r.sample.sample_id for g in masked.groups for r in g if r.finish_reasons[0] == "stop"}
    assert kept == ended and kept


def test_an_episode_is_scored_by_all_its_turns(built):
    cfg, setup = built
    task = HashEpisodesTask()
    batch = _rollouts(cfg, setup, task, [task.train_sample(i, seed=0) for i in range(2)])
    for group in batch.groups:
        returns = [sum(hash_reward(text) for text in r.texts) for r in group]
        assert all(r.turns == 3 for r in group)
        assert [r.sample.reward for r in group] == pytest.approx(returns, abs=1e-12)
        assert [r.sample.advantage for r in group] == pytest.approx(_by_hand(returns), abs=1e-6)
    assert batch.metrics["turns_mean"] == 3.0 and batch.metrics["images_mean"] > 3
    # Every turn's reply counts in truncated_frac, each episode's last in final_truncated_frac.
    episodes = [r for group in batch.groups for r in group]
    turns = [reason for r in episodes for reason in r.finish_reasons]
    assert batch.metrics["truncated_frac"] == turns.count("length") / len(turns)
    final_cut = [r.finish_reasons[-1] == "length" for r in episodes]
    assert batch.metrics["final_truncated_frac"] == sum(final_cut) / len(episodes)


@pytest.mark.slow
def test_one_grpo_step_raises_what_the_advantages_favour(tmp_path):
    """After one step, completions with a positive advantage are more likely and those with a
    negative one less likely, sample by sample (sum of their tokens' logprobs)."""
    from saccade.run.setup import build_setup
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import pack
    from saccade.trainer.step import build_optimizer, lr_schedule, train_step

    cfg = load_config(RunConfig, "configs/demo.toml", [*ARGS, "--trainer.lr", "1e-4"])
    setup = build_setup(cfg, tmp_path)
    task = scored_task(cfg)
    batch = _rollouts(cfg, setup, task, [task.train_sample(i, seed=1) for i in range(4)])
    samples = [s for s in batch.samples if s.advantage != 0.0]
    assert sum(s.advantage > 0 for s in samples) >= 3 and sum(s.advantage < 0 for s in samples) >= 3
    banned = setup.engine.banned_token_ids

    def sequence_logprobs() -> list[float]:
        out = []
        with torch.no_grad():
            for s in samples:  # one micro-batch each
                (mb,) = pack([s], setup.cache.get, max_tokens=4096, image_token_id=setup.image_token_id,
                             spatial_merge_size=setup.merge)
                logprobs, _ = forward_logprobs(setup.model, mb, distribution=SampledDistribution(temperature=cfg.sampling.temperature),
                                               only_loss_tokens=True, banned_token_ids=banned)
                out.append(float(logprobs[mb.loss_mask].sum()))
        return out

    before = sequence_logprobs()
    optimizer, scheduler = build_optimizer(setup.model, lr=cfg.trainer.lr, weight_decay=0.0,
                                           schedule=lr_schedule(cfg.trainer))
    micro_batches = pack(samples, setup.cache.get, max_tokens=cfg.trainer.max_tokens,
                         image_token_id=setup.image_token_id, spatial_merge_size=setup.merge)
    metrics = train_step(setup.model, optimizer, scheduler, micro_batches, loss=cfg.loss, num_iterations=1,
                         grad_clip=cfg.trainer.grad_clip, distribution=SampledDistribution(temperature=cfg.sampling.temperature),
                         banned_token_ids=banned)
    assert metrics["skipped_steps"] == 0.0
    after = sequence_logprobs()
    for s, b, a in zip(samples, before, after, strict=True):
        assert (a - b) * s.advantage > 0, f"{s.sample_id}: advantage {s.advantage:+.3f}, logprob {b:.4f} -> {a:.4f}"


def test_final_info_means_turns_what_envs_report_into_metrics():
    infos = [
        {"correct": 1.0, "seen": True, "action": None, "place": "left"},
        {"correct": 0.0, "seen": False, "answered": True},
        {},  # ended before any step: nothing to report
    ]
    assert final_info_means(infos) == {"env_answered": 1.0, "env_correct": 0.5, "env_seen": 0.5}
