"""The trainer and the engine hold the same model: checked at the start and at the first step.

What the trainer computes must be what the engine sampled from. Two checks stop a run whose two
halves hold different models, before it trains on the difference:
- at the start, each vLLM server's model fingerprint (its /saccade/info, from
  `saccade.models.checkpoint_layout.fingerprint`) against the trainer's
  (`saccade.inference.vllm.VLLMEngine.for_servers` refuses another model);
- at the first step that trains on tokens sampled under the trainer's current weights, the mean
  |trainer - engine| logprob of those tokens (`mismatch_abs_lag0`) against a limit far above what a
  dtype or kernel difference gives (`ModelMatchGuard`). It catches what a fingerprint cannot: the
  same files read into two different models (a checkpoint layout or a tie flag read differently).

The limit, `engine.model_mismatch_limit`, from measured figures (docs/families.md, docs/vllm.md):
the same model gives a mean gap of about 1e-6 in fp32 and 1.5e-3 to 4.7e-3 with a bf16 vLLM server
(Qwen3.5 and Qwen3.5-MoE presets, LoRA synced included), and 3.7e-2 on a random Qwen3.5-MoE whose
router margins are small (every weight N(0, 0.05): bf16 flips its experts; transformers' own bf16
against its fp32 gives 1.9e-2 there; tests/serving/test_vllm_checkpoint_variants.py); a head read
wrongly on one side gave 0.72 on a tiny model, and a random or foreign head gives several nats on
a real vocabulary. 0.1 sits above all the first and 7x below the second; raise it for a model whose
bf16 gap is known to be larger.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_LIMIT = 0.1


class ModelMismatchError(RuntimeError):
    """The trainer and the engine hold different models."""


LIKELY_CAUSES = (
    "the checkpoint read into two different models (check it with `saccade bench parity --model PATH`, which "
    "compares saccade's load with transformers' own); a tie_word_embeddings flag that config.json's levels "
    "disagree on; a server started on another model, revision or dtype than model.path (its /saccade/info "
    "names what it serves)")


@dataclass
class ModelMatchGuard:
    """Checks once, at the first step whose metrics hold `mismatch_abs_lag0` (tokens sampled under
    exactly the weights being trained), that the mean gap is under `limit` (None: never checked)."""

    limit: float | None
    model: str
    engine: str
    checked: bool = False

    @classmethod
    def of(cls, cfg) -> ModelMatchGuard:
        """The guard of a run config: its limit, model and engine."""
        return cls(cfg.engine.model_mismatch_limit, cfg.model.path, cfg.engine.kind)

    def after_train(self, step: int, metrics: dict[str, float]) -> None:
        if self.checked or self.limit is None or "mismatch_abs_lag0" not in metrics:
            return
        self.checked = True
        gap = metrics["mismatch_abs_lag0"]
        if gap > self.limit:
            raise ModelMismatchError(
                f"step {step + 1}: the trainer's logprobs of the tokens the {self.engine} engine sampled differ from "
                f"the engine's own by {gap:.3g} on average, over {self.limit:g} (engine.model_mismatch_limit; the same "
                f"model gives about 1e-6 in fp32 and 2e-3 to 5e-3 in bf16): the trainer ({self.model}) and the engine "
                f"hold different models, and training on that gap would not be RL on what was sampled. Likely "
                f"causes: {LIKELY_CAUSES}. The run stopped before saving anything")


def fingerprint_mismatch(url: str, info: dict, model: str, ours: str) -> str | None:
    """Why a server's model is not the trainer's (its /saccade/info `fingerprint` differs), else None.
    A server that reports no fingerprint (an older saccade) is not judged here."""
    theirs = info.get("fingerprint")
    if theirs is None or theirs == ours:
        return None
    return (f"the server at {url} serves {info.get('model')!r} (fingerprint {theirs}), but the trainer's model is "
            f"{model!r} (fingerprint {ours}): they are different models (other weights, or another config.json). "
            "Start the server on the trainer's model (`saccade launch CONFIG` does), or set model.path to the "
            "one it serves")
