"""samples.jsonl from a real short RL run on the tiny model: one line per (step, prompt) with the
G completions, their rewards and advantages; thumbnails that exist, decode and are written
once; every image of a multi-turn episode; a resumed run drops the lines past its checkpoint
(and a torn last line) like metrics.jsonl; TensorBoard gets the text and the images."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil

import pytest
import torch
from PIL import Image
from stub_tasks import HashEpisodesTask, scored_task

from saccade.data.rows import StepRows
from saccade.inference.engine import SamplingParams
from saccade.metrics import SAMPLES_FILE, read_metrics
from saccade.orchestrator.rollout import sample_step
from saccade.loops.rl import train_rl
from saccade.loops.sample_log import SAMPLES_DIR, sample_line, step_samples


@pytest.mark.slow
def test_every_step_writes_its_first_prompts_with_their_completions(short_rl_run):
    cfg, _ = short_rl_run
    records = read_metrics(cfg.run_dir / SAMPLES_FILE)
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3, 4, 4]
    for rec in records:
        assert rec["answer"] in ("red", "green", "blue")
        assert "What color is the shape?" in rec["prompt"]["text"]
        assert len(rec["completions"]) == cfg.rollout.group_size
        rewards = [c["reward"] for c in rec["completions"]]
        advantages = [c["advantage"] for c in rec["completions"]]
        # GRPO's advantages: centred within the group, larger where the reward is larger.
        assert sum(advantages) == pytest.approx(0.0, abs=1e-5)
        assert all((a > b) == (ra > rb) for a, ra in zip(advantages, rewards) for b, rb in zip(advantages, rewards)
                   if ra != rb)
        for c in rec["completions"]:
            assert len(c["texts"]) == len(c["finish_reasons"]) == 1 and c["finish_reasons"][0] in ("stop", "length")
            assert c["info"]["correct"] in (0.0, 1.0) and c["replies"] == []
            assert c["policy_version"] == rec["step"] - 1  # sampled from the weights of the step before
            # The reply's logprob with and without its image (checked against a direct forward below).
            assert c["reply_logprob"] < 0 and c["reply_logprob_blank"] < 0
            assert c["image_logprob_gain"] == c["reply_logprob"] - c["reply_logprob_blank"]
    # The random tiny model's replies depend on its image a little: the blank one moves them.
    assert all(c["image_logprob_gain"] != 0 for rec in records for c in rec["completions"])
    # The two prompts of a step are the step's first two, in order: different questions.
    assert records[0]["prompt_id"] != records[1]["prompt_id"]


@pytest.mark.slow
def test_a_replys_logprob_with_and_without_its_image_matches_a_direct_forward(short_rl_run):
    """`reply_logprobs` packs each sample with its blank counterpart; each figure equals the
    sample's own forward (the trainer's path: collate, forward_logprobs, the loss tokens summed),
    the blank one with the prompt the engine itself makes of the blanked messages."""
    from saccade.data.messages import with_blank_images
    from saccade.inference.engine import ChatRequest
    from saccade.trainer.forward import forward_logprobs
    from saccade.trainer.packing import collate
    from saccade.orchestrator.visual import reply_logprobs

    cfg, result = short_rl_run
    setup = result["setup"]
    sampling = SamplingParams(max_tokens=cfg.sampling.max_tokens, n=2)
    task = scored_task(cfg)
    rows = StepRows([task.train_sample(50, seed=3)], positions=[50], end=51, skipped=[])
    rollouts = sample_step(0, rows, setup=setup, task=task, cfg=cfg, sampling=sampling)
    rollouts.pins.release()
    (group,) = rollouts.groups
    figures = reply_logprobs(setup, group, distribution=sampling.distribution,
                             banned_token_ids=setup.engine.banned_token_ids, max_tokens=cfg.trainer.max_tokens)

    @torch.no_grad()
    def direct(sample) -> float:
        mb = collate([sample], setup.cache.get, image_token_id=setup.image_token_id, spatial_merge_size=setup.merge)
        logprobs_N, _ = forward_logprobs(setup.model, mb, distribution=sampling.distribution, only_loss_tokens=True,
                                         banned_token_ids=setup.engine.banned_token_ids)
        return float(logprobs_N.sum())

    for r, f in zip(group, figures, strict=True):
        blank_prompt = setup.engine.prepare(ChatRequest("blank", with_blank_images(r.env_messages[0])))
        assert torch.equal(blank_prompt.inputs.input_ids, r.sample.input_ids[:blank_prompt.length])
        blank_sample = dataclasses.replace(r.sample, image_keys=blank_prompt.image_keys)
        assert blank_prompt.image_keys != r.sample.image_keys
        assert abs(f["reply_logprob"] - direct(r.sample)) <= 1e-5
        assert abs(f["reply_logprob_blank"] - direct(blank_sample)) <= 1e-5
        assert f["image_logprob_gain"] == f["reply_logprob"] - f["reply_logprob_blank"] != 0


@pytest.mark.slow
def test_images_are_thumbnails_written_once_under_samples(short_rl_run):
    cfg, _ = short_rl_run
    records = read_metrics(cfg.run_dir / SAMPLES_FILE)
    paths = [p for rec in records for p in rec["prompt"]["images"]]
    assert len(paths) == len(records)  # one image per shapes question
    for rel in paths:
        assert rel.startswith(SAMPLES_DIR + "/") and rel.endswith(".png")
        with Image.open(cfg.run_dir / rel) as im:
            im.load()
            assert im.size == (64, 64) and im.mode == "RGB"  # 64 px images: below the side, kept as they are
    files = sorted(p.name for p in (cfg.run_dir / SAMPLES_DIR).iterdir())
    assert files == sorted({rel.split("/")[1] for rel in paths})  # content-named: one file per distinct image
    assert not [f for f in files if f.endswith(".tmp")]


def test_the_console_line_shows_a_prompts_completions():
    rec = {"step": 20, "prompt_id": "shapes/17", "completions": [
        {"texts": ["red"], "reward": 1.0, "advantage": 0.93},
        {"texts": ["a very long answer that goes on and on"], "reward": 0.0, "advantage": -0.93},
        {"texts": ["x"], "reward": None, "advantage": None}]}
    assert sample_line([rec]) == ("step 20 · shapes/17: 'red' r=1.00 A=+0.93 | 'a very long answer that…' "
                                  "r=0.00 A=-0.93 | 'x' r=nan A=nan")
    assert sample_line([]) == ""


@pytest.mark.slow
def test_a_multi_turn_record_holds_every_image_of_each_episode(short_rl_run, tmp_path):
    cfg, result = short_rl_run
    setup, task = result["setup"], HashEpisodesTask()
    task.max_turns = 2  # the opening's image, then one or two new ones: enough to see them all kept
    prompts = [task.train_sample(0, seed=0)]
    rows = StepRows(prompts, positions=[0], end=1, skipped=[])
    rollouts = sample_step(0, rows, setup=setup, task=task, cfg=cfg,
                           sampling=SamplingParams(max_tokens=cfg.sampling.max_tokens, n=2))
    rollouts.pins.release()
    batch = rollouts.batch
    (rec,) = step_samples(7, prompts, rollouts.all_groups, rollouts.groups, count=2, folder=tmp_path / SAMPLES_DIR,
                          side=32)
    assert len(rec["completions"]) == 2
    for c, r in zip(rec["completions"], batch.groups[0], strict=True):
        shown = len(rec["prompt"]["images"]) + sum(len(reply["images"]) for reply in c["replies"])
        assert shown == r.sample.num_images > 1  # the opening's image and each turn's new ones
        assert len(c["texts"]) == r.turns and len(c["replies"]) >= r.turns - 1
    for rel in rec["prompt"]["images"] + [p for c in rec["completions"] for reply in c["replies"] for p in reply["images"]]:
        with Image.open(tmp_path / rel) as im:
            assert max(im.size) <= 32
    json.dumps(rec, allow_nan=False)  # a record is plain JSON
    # Each episode's reply (every turn's) scored with and without all its images.
    from saccade.orchestrator.visual import reply_logprobs

    figures = reply_logprobs(setup, batch.groups[0], distribution=SamplingParams().distribution,
                             banned_token_ids=setup.engine.banned_token_ids, max_tokens=cfg.trainer.max_tokens)
    assert all(f["reply_logprob"] < 0 and f["image_logprob_gain"] != 0 for f in figures)
    # Gathered to the other ranks (pickled), rollouts leave their images behind.
    (gathered,) = pickle.loads(pickle.dumps(batch.groups))
    assert [r.env_messages for r in gathered] == [[], []] and [r.texts for r in gathered] == [
        r.texts for r in batch.groups[0]]


@pytest.mark.slow
def test_a_resumed_run_drops_the_samples_past_its_checkpoint(short_rl_run, tmp_path):
    cfg, _ = short_rl_run
    run_dir = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")  # "killed" after step 4's samples, before its checkpoint
    with open(run_dir / SAMPLES_FILE, "ab") as f:
        f.write(b'{"step": 5, "prompt_id": "torn')  # and mid-write of a later line
    resumed = cfg.model_copy(update={"log": cfg.log.model_copy(update={"dir": str(run_dir)})})
    train_rl(resumed, run_dir=run_dir, task=scored_task(resumed), resume=True, progress=False, stop_after=1)
    records = read_metrics(run_dir / SAMPLES_FILE)
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3]  # steps 3-4 dropped, step 3 written again
    original = read_metrics(cfg.run_dir / SAMPLES_FILE)
    assert [c["texts"] for c in records[4]["completions"]] == [c["texts"] for c in original[4]["completions"]]


@pytest.mark.slow
def test_tensorboard_gets_the_samples_text_and_images(short_rl_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _ = short_rl_run
    events = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    assert {"samples/0/image0", "samples/1/image0"} <= set(tags["images"])
    assert [e.step for e in events.Images("samples/0/image0")] == [1, 2, 3, 4]
    text = events.Tensors("samples/0/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| completion | reward | advantage | finish |" in text
