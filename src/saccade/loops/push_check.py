"""The push check: after a weight sync, every server answers a small fixed probe and the trainer
scores its answers under the weights it just pushed; a server whose answer is far from the
trainer's is taken out (or the run stops), named with the push and the likely causes
(`engine.probe`, docs/vllm.md "The push check"). A server that joins or rejoins mid-run passes the
same check before it is put back (`admit`, the servers' client's hook): at once when its answer has
the tokens the last probed push scored (a server holding those weights answers so: seeded), else
it is parked (out, but given every push) and judged after the next push
(`saccade.inference.server_client`: `checked_rejoins`, `unpark`, `refuse`).

Why: a push can fail silently. A server may acknowledge a push without loading it (a proxy, a
server that ignores /update_weights), a LoRA adapter may load and change nothing (vLLM #49354),
a server may come back on the base model, or place images otherwise than the trainer (positions
corrupted in rollout only). The run then goes on and learns from samples of another policy than
the one it trains. The first-step model match (`saccade.model_match`) sees none of it after step
1, and one step ahead almost no token is sampled under the weights being trained.

How (`saccade.inference.probe`): a few pictures with a question each and one text-only prompt; each
server answers them with a few tokens sampled from a fixed seed, with their logprobs (the rollouts'
own path); every rank's trainer scores every answer under the weights just pushed (one short
forward, all servers' answers packed together). A server's answer is judged (`judge`, pure) by:
- the mean |server - trainer| gap over its tokens, under `engine.model_mismatch_limit` (what a
  dtype gives: ~1e-6 in fp32, 2e-3 to 5e-3 in bf16);
- the tokens after a picture against the text-only ones: their gap may exceed the text-only
  tokens' by at most `engine.image_mismatch_limit`;
- its answer when it last passed (and the run's first answer): seeded, a server that holds the
  same weights answers the same tokens with the same logprobs (bit for bit on the CPU). Same tokens
  as then, logprobs that moved less than a tenth as far as the trainer's own scores of them moved
  since (`STALE_RATIO`; and those moved over `MOVE_FLOOR`): the push did not take. Server against
  server and trainer against trainer, so the dtype's gap between the two sides cancels: a push that
  changed nothing is caught even when it moved the logprobs far less than the limit. Not closer:
  in bf16 each side's rounding jitters with any change of the weights (the tiny Qwen2.5-VL's
  trainer moved 0.014 on a LoRA step at lr 1e-5, its server 0.007), and a server that took the push
  moved half as far as the trainer there; one that did not moved 0.

Under torchrun rank 0 asks the servers; every rank scores the answers (a sharded forward takes every
rank) and judges them alike; each takes the refused servers out of its own pool and puts back those
rank 0 let in. Probing is thinned by `engine.probe.every_syncs`; a rejoining server that cannot be
judged from the last probed push's scores waits, parked, for the next one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from saccade.distributed import World, broadcast
from saccade.inference.probe import ProbeAnswer, ProbePrompt, probe_prompts, server_answers
from saccade.inference.servers import NoServerError
from saccade.models.sampling import SampledDistribution
from saccade.trainer.forward import forward_logprobs
from saccade.trainer.packing import pack
from saccade.trainer.samples import make_sample

if TYPE_CHECKING:
    from saccade.config import RunConfig
    from saccade.run.setup import Setup

log = logging.getLogger(__name__)

# A push that moved the trainer's scores of an answer by less than this (mean |logprob|) is not judged
# stale: a server that missed it samples nearly alike.
MOVE_FLOOR = 1e-3
# Stale: the server's own answer moved less than this share of the trainer's move (module note).
STALE_RATIO = 0.1

CAUSES = {
    "stale": "the server acknowledged the push without loading it (a proxy, or a server that ignores "
             "/update_weights); a LoRA adapter that loaded but changes nothing (target modules whose names match "
             "none of the served model's: vLLM #49354); a server restarted on the base model that never got the "
             "weights",
    "far": "another model, revision or dtype on the server; weights that loaded wrongly (a checkpoint layout or a "
           "tie flag read otherwise: `saccade bench parity --model PATH`); a push only partly loaded",
    "images": "image positions (M-RoPE) computed otherwise on one side; another vision tower or image processor "
              "on the server; other image bounds (images.min_pixels / max_pixels)",
}


class PushMismatchError(NoServerError):
    """A server answered the push check far from the trainer, and `engine.probe.action` is 'stop'."""


@dataclass
class Earlier:
    """A server's answer when it passed at `version` (the same tokens as now): its logprobs, and the
    trainer's scores of them under that version."""

    version: int
    server_T: torch.Tensor
    trainer_T: torch.Tensor


@dataclass
class Finding:
    """One server's answer to the probe after the push of `version`, judged (`judge`)."""

    version: int
    gap: float  # mean |server - trainer| logprob over its answer's tokens, under `version`
    gap_image: float | None  # the same over the tokens after a picture (None: none)
    gap_text: float | None  # ... over the text-only prompt's
    like: int | None = None  # an earlier version it answers as (stale), else None
    unchanged: float | None = None  # stale: mean |server now - server then| over the same tokens
    moved: float | None = None  # stale: mean |trainer now - trainer then| over them
    problem: str | None = None  # "stale", "images" or "far"; None: the server holds the weights

    def describe(self, url: str, limit: float | None, image_limit: float | None) -> str:
        """Why the server is refused, naming it, the push and the likely causes."""
        images = f"after a picture {self.gap_image:.3g}, text-only {self.gap_text:.3g}"
        if self.problem == "stale":
            what = (f"answers as it did under weights v{self.like}: the same tokens, their logprobs "
                    f"{self.unchanged:.3g} apart, while the trainer's scores of them moved {self.moved:.3g} from "
                    f"v{self.like} to v{self.version} (mean |server - trainer| logprob {self.gap:.3g}): the push took "
                    "no effect there")
        elif self.problem == "images":
            what = (f"scores the tokens after a picture {self.gap_image - self.gap_text:.3g} further from the trainer "
                    f"than the text-only ones ({images}; engine.image_mismatch_limit {image_limit:g})")
        else:
            what = (f"differs from the weights just pushed by {self.gap:.3g} on average ({images}; "
                    f"engine.model_mismatch_limit {limit:g})")
        return (f"push check after the push of weights v{self.version}: the server at {url} {what}. Likely causes: "
                f"{CAUSES[self.problem]}")


def mean_abs(a_T: torch.Tensor, b_T: torch.Tensor, mask_T: torch.Tensor | None = None) -> float | None:
    """Mean |a - b| over `mask` (every token when None); None over no token."""
    diff_T = (a_T.double() - b_T.double()).abs()
    if mask_T is not None:
        diff_T = diff_T[mask_T]
    return float(diff_T.mean()) if diff_T.numel() else None


def judge(server_T: torch.Tensor, trainer_T: torch.Tensor, image_T: torch.Tensor, version: int, *,
          limit: float | None, image_limit: float | None, earlier: list[Earlier] = ()) -> Finding:
    """A server's logprobs of its answer's tokens (`server_T`) against the trainer's scores of them
    under the weights of `version` (`trainer_T`); `image_T`: which follow a picture; `earlier`: the
    server's earlier passing answers with the same tokens. The module note's rules, the first that
    fails naming the problem: stale, then images, then far."""
    gap = mean_abs(server_T, trainer_T)
    out = Finding(version, gap, mean_abs(server_T, trainer_T, image_T), mean_abs(server_T, trainer_T, ~image_T))
    for then in earlier:
        if then.version == version:
            continue
        moved, unchanged = mean_abs(trainer_T, then.trainer_T), mean_abs(server_T, then.server_T)
        if moved > MOVE_FLOOR and unchanged < STALE_RATIO * moved:
            if out.unchanged is None or unchanged < out.unchanged:
                out.like, out.unchanged, out.moved, out.problem = then.version, unchanged, moved, "stale"
    if out.problem is None and image_limit is not None and out.gap_image is not None:
        if out.gap_image - (out.gap_text or 0.0) > image_limit:
            out.problem = "images"
    if out.problem is None and limit is not None and gap > limit:
        out.problem = "far"
    return out


@dataclass
class Passed:
    """A server's answers when it last passed the check, at `version`, and the trainer's scores of them."""

    version: int
    answers: list[ProbeAnswer]
    trainer_T: torch.Tensor


def logprobs_of(answers: list[ProbeAnswer]) -> torch.Tensor:
    return torch.tensor([lp for a in answers for lp in a.logprobs], dtype=torch.float32)


def tokens_of(answers: list[ProbeAnswer]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(a.ids) for a in answers)


FIRST = "\0first"  # the run's first passing answers, scored beside the servers' at every probed push


class PushCheck:
    """The push check of a run on vLLM servers (module note): `after_push` on every rank after each
    sync; it parks rejoining servers (`ServerClient.checked_rejoins`) and decides on them at the next."""

    def __init__(self, cfg: RunConfig, setup: Setup, world: World):
        probe, engine = cfg.engine.probe, setup.engine
        self.every, self.action, self.tokens = probe.every_syncs, probe.action, probe.tokens
        self.limit, self.image_limit = cfg.engine.model_mismatch_limit, cfg.engine.image_mismatch_limit
        self.setup, self.engine, self.world = setup, engine, world
        self.prompts: list[ProbePrompt] = probe_prompts(setup.processor, setup.images, engine.key_for_hash,
                                                        prompts=probe.prompts)
        self.embeddings = {}  # the probe's pictures' embeddings, fetched once and kept
        for prompt in self.prompts:
            if prompt.images:
                engine.encode_images(prompt.images, prompt.image_keys)
                self.embeddings.update({k: setup.cache.get(k) for k in prompt.image_keys})
        self.passed: dict[str, Passed] = {}  # url -> its answers when it last passed
        self.first: Passed | None = None  # the run's first passing answers: what its start weights answer
        self.syncs = 0  # weight syncs so far (the start's included)
        # The last probed push's version and the trainer's scores under it, by the answers' tokens: what
        # `admit` judges a rejoining server by, on the client's thread (the lock keeps the two apart).
        self.scored: tuple[int, dict[tuple, torch.Tensor]] | None = None
        self.lock = threading.Lock()
        engine.client.checked_rejoins = True
        engine.client.admit = self.admit

    @classmethod
    def of(cls, cfg: RunConfig, setup: Setup, world: World) -> PushCheck | None:
        """The run's push check: on vLLM servers with engine.probe.every_syncs > 0, else None."""
        if cfg.engine.kind != "vllm" or not cfg.engine.probe.every_syncs:
            return None
        return cls(cfg, setup, world)

    def after_push(self, version: int) -> tuple[dict[str, float], NoServerError | None]:
        """Every rank, after the push of `version` returned on every rank (every `every`-th sync): rank 0
        asks every live server and every parked one; every rank scores the answers and takes the
        refused servers out (or, with engine.probe.action 'stop', stops the run) and the parked ones
        that passed back in. Returns the step's figures and the error that stops the run, or None."""
        self.syncs += 1
        if (self.syncs - 1) % self.every:
            return {}, None
        start = time.perf_counter()
        client = self.engine.client
        asked = client.run(self._ask(version)) if self.world.is_main else None
        # url -> its answers or why it gave none; and the servers rank 0 holds live (some let in meanwhile)
        asked, live = broadcast((asked, [s.url for s in client.pool.alive]), self.world)
        answered = {url: answers for url, answers in asked.items() if not isinstance(answers, str)}
        first = {FIRST: self.first.answers} if self.first is not None else {}
        scores = self.trainer_logprobs({**answered, **first})
        verdicts: dict[str, tuple[Finding | None, str | None]] = {}
        for url, answers in asked.items():
            if isinstance(answers, str):
                verdicts[url] = (None, answers)
                continue
            finding = self._judge(url, version, answers, scores[url])
            verdicts[url] = (finding, finding.describe(url, self.limit, self.image_limit) if finding.problem else None)
        with self.lock:
            by_tokens = {tokens_of(answers): scores[url] for url, answers in {**answered, **first}.items()}
            self.scored = (version, by_tokens)
        for url in live:
            client.unpark(url, version)  # another rank's `admit` let it in
        figures = self._figures(verdicts, time.perf_counter() - start)
        return figures, self._act(version, verdicts)

    async def _ask(self, version: int) -> dict[str, list[ProbeAnswer] | str]:
        client = self.engine.client
        servers = [s for s in client.pool.servers.values() if s.alive or client.parked.get(s.url) == version]
        answers = await asyncio.gather(*(server_answers(self.engine, s, self.prompts, tokens=self.tokens)
                                         for s in servers), return_exceptions=True)
        return {s.url: (f"push check after the push of weights v{version}: the server at {s.url} did not answer "
                        f"the probe: {type(a).__name__}: {a}"[:500] if isinstance(a, BaseException) else a)
                for s, a in zip(servers, answers, strict=True)}

    def trainer_logprobs(self, answered: dict[str, list[ProbeAnswer]]) -> dict[str, torch.Tensor]:
        """url -> the trainer's logprobs of its answers' tokens, under its current weights, in order, as
        the servers sampled them (temperature 1, vision tokens banned). One forward, every answer packed."""
        s = self.setup
        if not answered:
            return {}
        samples = []
        for url, answers in answered.items():
            for prompt, answer in zip(self.prompts, answers, strict=True):
                reply = torch.tensor(answer.ids, dtype=torch.long)
                loss_mask = torch.cat([torch.zeros(prompt.input_ids.numel(), dtype=torch.bool),
                                       torch.ones(reply.numel(), dtype=torch.bool)])
                samples.append(make_sample(
                    f"{url} {prompt.name}", torch.cat([prompt.input_ids, reply]),
                    torch.cat([prompt.mm_token_type_ids, torch.zeros(reply.numel(), dtype=torch.long)]),
                    prompt.image_grid_thw, prompt.image_keys, positions=s.positions, loss_mask=loss_mask))
        [mb] = pack(samples, self.embeddings.get, max_tokens=sum(x.num_tokens for x in samples),
                    image_token_id=s.image_token_id, spatial_merge_size=s.merge)
        was_training = s.model.training
        s.model.eval()
        try:
            with torch.no_grad():
                logprobs_N, _ = forward_logprobs(s.model, mb, distribution=SampledDistribution(temperature=1.0),
                                                 only_loss_tokens=True, banned_token_ids=self.engine.banned_token_ids)
        finally:
            s.model.train(was_training)
        by_name = {name: logprobs_N[sl][mb.loss_mask[sl]].float().cpu()
                   for name, sl in zip(mb.sample_ids, mb.sample_slices(), strict=True)}
        return {url: torch.cat([by_name[f"{url} {p.name}"] for p in self.prompts]) for url in answered}

    def _judge(self, url: str, version: int, answers: list[ProbeAnswer], trainer_T: torch.Tensor) -> Finding:
        """`judge` one server's answers, against its own last passing ones and the run's first where their
        tokens are the same; a pass is remembered."""
        image_T = torch.tensor([p.after_image for p, a in zip(self.prompts, answers, strict=True) for _ in a.ids])
        earlier = [Earlier(then.version, logprobs_of(then.answers), then.trainer_T)
                   for then in (self.passed.get(url), self.first)
                   if then is not None and [a.ids for a in then.answers] == [a.ids for a in answers]]
        finding = judge(logprobs_of(answers), trainer_T, image_T, version, limit=self.limit,
                        image_limit=self.image_limit, earlier=earlier)
        if finding.problem is None:
            with self.lock:
                self.passed[url] = Passed(version, answers, trainer_T)
                self.first = self.first or self.passed[url]
        return finding

    async def admit(self, server, version: int) -> bool | str | None:
        """The servers' client's hook (`ServerClient.admit`) for a rejoining server that now holds
        `version`: True lets it in, a str says why not; None parks it for the check after the next push
        (its answer has tokens the last probed push did not score, or that push was not `version`'s)."""
        with self.lock:
            scored = self.scored[1] if self.scored is not None and self.scored[0] == version else None
        if scored is None:
            return None
        try:
            answers = await server_answers(self.engine, server, self.prompts, tokens=self.tokens)
        except Exception as err:  # noqa: BLE001 - a server that cannot answer the probe stays out, saying why
            return (f"push check of a rejoining server at weights v{version}: the server at {server.url} did not "
                    f"answer the probe: {type(err).__name__}: {err}"[:500])
        trainer_T = scored.get(tokens_of(answers))
        if trainer_T is None:
            return None
        finding = self._judge(server.url, version, answers, trainer_T)
        return True if finding.problem is None else finding.describe(server.url, self.limit, self.image_limit)

    def _act(self, version: int, verdicts: dict[str, tuple[Finding | None, str | None]]) -> NoServerError | None:
        """Parked servers that passed back in; the refused out (or the run stopped); the error, if any."""
        client = self.engine.client
        refused = {url: why for url, (_, why) in verdicts.items() if why is not None}
        for url in verdicts.keys() - refused.keys():
            client.unpark(url, version)
        if refused and self.action == "stop":
            return PushMismatchError("; ".join(refused.values()) + ". The run stops (engine.probe.action = 'stop')")
        for url, why in refused.items():
            taken = client.refuse(url, version, why)
            if self.world.is_main:
                log.warning("%s: %s", why, "taken out" if taken else "kept out")
        if refused and not client.pool.alive:
            return NoServerError(f"{client.pool.describe_down()}: no server left that holds the trainer's weights")
        return None

    @staticmethod
    def _figures(verdicts: dict, probe_s: float) -> dict[str, float]:
        """The step's figures: the probe's seconds (the servers' answers and the trainer's forward), the
        largest gaps over the servers that answered, how many were probed and refused."""
        findings = [f for f, _ in verdicts.values() if f is not None]
        out = {"probe_s": probe_s, "probe_servers": float(len(verdicts)),
               "probe_refused": float(sum(why is not None for _, why in verdicts.values()))}
        for name in ("gap", "gap_image", "gap_text"):
            values = [getattr(f, name) for f in findings if getattr(f, name) is not None]
            if values:
                out[f"probe_{name}"] = max(values)
        return out
