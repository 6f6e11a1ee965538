"""Supervised fine-tuning on the same packed, cached-image path as RL (`train_sft`).

A sample is the generation prompt exactly as the engine renders it (messages ->
inputs with the generation prompt) followed by the answer's tokens and the stop token,
so SFT trains the very token sequence the engine would sample. The loss is the mean
negative log-likelihood over the answer tokens of the whole batch.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from saccade.config import RunConfig, describe
from saccade.data.questions import to_messages
from saccade.inference.engine import ChatRequest
from saccade.metrics import MetricsLogger, format_step
from saccade.models.lm import unwrap_policy
from saccade.progress import ProgressBar
from saccade.run.setup import build_setup
from saccade.run.tasks import task_from_config
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import pack
from saccade.trainer.samples import make_sample
from saccade.trainer.step import build_optimizer, optimizer_step, staged


def sft_samples(setup, items: list[tuple[object, str, str]]) -> list:
    """TrainingSamples for (vqa_sample, answer, sample_id) items: the answer after the sample's
    prompt. The engine prepares the prompts, so their images' embeddings land in the cache."""
    # The engine's own prompt preparation: the very ids (and cached images) it samples after.
    prompts = setup.engine.prepare_all([ChatRequest(sample_id, to_messages(vqa)) for vqa, _, sample_id in items])
    tokenizer = setup.processor.tokenizer
    stop = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for prompt, (_, answer, sample_id) in zip(prompts, items, strict=True):
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [stop]
        P, C = prompt.length, len(answer_ids)
        out.append(make_sample(
            sample_id,
            torch.cat([prompt.inputs.input_ids, torch.tensor(answer_ids)]),
            torch.cat([prompt.inputs.mm_token_type_ids, torch.zeros(C, dtype=torch.long)]),
            prompt.inputs.image_grid_thw,
            prompt.image_keys,
            positions=setup.positions,
            loss_mask=torch.cat([torch.zeros(P, dtype=torch.bool), torch.ones(C, dtype=torch.bool)]),
            videos=prompt.inputs.videos,
        ))
    return out


def sft_step(model, optimizer, scheduler, micro_batches: list, *, grad_clip: float) -> dict[str, float]:
    """One optimizer step (`saccade.trainer.step.optimizer_step`) of token-level NLL over the
    packed micro-batches, in host memory: the mean over the step's answer tokens."""
    total = float(sum(int(mb.on_host.loss_mask.sum()) for mb in micro_batches))
    device = unwrap_policy(model).lm_head.weight.device

    def nll(k: int, mb) -> tuple[torch.Tensor, dict]:
        logprobs, _ = forward_logprobs(model, mb, only_loss_tokens=True)
        return -torch.where(mb.loss_mask, logprobs, 0.0).sum() / total, {}

    model.train()
    outcome = optimizer_step(optimizer, scheduler, micro_batches, nll, device=device, grad_clip=grad_clip)
    if not outcome.applied:
        return {"nll": outcome.sums["loss"], "skipped_steps": 1.0}
    return {"nll": outcome.sums["loss"], "grad_norm": outcome.grad_norm, "lr": scheduler.get_last_lr()[0],
            "skipped_steps": 0.0}


def sft_loop(cfg: RunConfig, setup, *, run_dir: Path, make_batch, progress: bool = True, phase: str = "sft") -> dict:
    """cfg.sft.steps optimizer steps on make_batch(step) -> TrainingSamples; a linear warm-up
    over the first tenth of the steps, then constant; the engine gets the weights after."""
    s = cfg.sft
    warmup = max(1, s.steps // 10)
    optimizer, scheduler = build_optimizer(setup.model, lr=s.lr, weight_decay=cfg.trainer.weight_decay,
                                           schedule=lambda k: min(1.0, (k + 1) / warmup))
    last: dict[str, float] = {}
    run_dir.mkdir(parents=True, exist_ok=True)
    with MetricsLogger(run_dir, config=cfg.model_dump()) as logger, ProgressBar(progress, s.steps, phase) as bar:
        for step in range(s.steps):
            start = time.perf_counter()
            pins = setup.cache.pins(f"{phase} step {step + 1}")
            with pins:  # the batch's image embeddings stay in memory until its step is done
                batch = make_batch(step)
            micro_batches = pack(batch, setup.cache.get, max_tokens=cfg.trainer.max_tokens,
                                 image_token_id=setup.image_token_id, spatial_merge_size=setup.merge,
                                 video_token_id=setup.video_token_id)
            metrics = sft_step(setup.model, optimizer, scheduler, staged(micro_batches, setup.device),
                               grad_clip=cfg.trainer.grad_clip)
            pins.release()
            metrics["step_s"] = time.perf_counter() - start
            logger.log(step + 1, metrics, phase=phase)
            bar(format_step(metrics))
            last = metrics
    # A vLLM engine still holds the weights from before SFT: give it the trained ones.
    setup.engine.update_weights()
    return last


def train_sft(cfg: RunConfig, *, run_dir: Path, setup=None, random_answers: bool = False,
              progress: bool = True, phase: str = "sft") -> dict:
    """SFT on the configured task's questions. random_answers: answers drawn uniformly from each
    question's choices, independent of the image (the demo's warm start: format without visual
    signal); a question without choices is refused."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(describe(cfg))  # what this run ran with, resolved
    setup = setup or build_setup(cfg, run_dir)
    task = task_from_config(cfg)
    rng = random.Random(cfg.trainer.seed + 1)

    def make_batch(step: int) -> list:
        items = []
        for i in range(cfg.sft.batch_size):
            index = step * cfg.sft.batch_size + i
            vqa = task.train_sample(index, seed=cfg.trainer.seed + 777)
            if random_answers and not vqa.choices:
                raise ValueError(f"sample {vqa.sample_id!r} has no options to draw a random answer from: the "
                                 "random-answer warm start needs multiple choice (task.columns.choices)")
            answer = rng.choice(vqa.choices) if random_answers else vqa.answer
            items.append((vqa, answer, f"sft-{index}"))
        return sft_samples(setup, items)

    last = sft_loop(cfg, setup, run_dir=run_dir, make_batch=make_batch, progress=progress, phase=phase)
    return {"setup": setup, "last": last}
