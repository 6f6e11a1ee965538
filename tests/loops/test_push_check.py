"""The push check (`saccade.loops.push_check`): the verdict by hand (`judge`), and the check after a
push on the tiny model with the servers' answers stood in for (their real answers:
tests/serving/test_vllm_push_check.py): a server whose answer did not change across a push that moved
the trainer's scores, or that scores the tokens after a picture otherwise, is taken out (or stops the
run), named with the push and the likely causes; the others are kept; a parked (rejoining) server is
put back only once it passes."""

from __future__ import annotations

import pytest
import torch

from saccade.inference.probe import ProbeAnswer
from saccade.loops.push_check import MOVE_FLOOR, Earlier, PushCheck, PushMismatchError, judge

IMAGE = torch.tensor([True, True, True, False, False])  # three tokens after a picture, two text-only


def t(values):
    return torch.tensor(values, dtype=torch.float32)


NOW = t([-1.2, -2.2, -3.2, -4.2, -5.2])  # the trainer's scores of the answer under the weights just pushed
THEN = Earlier(0, server_T=t([-1.001, -2.001, -3.001, -4.001, -5.001]), trainer_T=t([-1.0, -2.0, -3.0, -4.0, -5.0]))


def test_a_server_that_holds_the_pushed_weights_passes():
    found = judge(NOW + 1e-3, NOW, IMAGE, 1, limit=0.1, image_limit=0.05, earlier=[THEN])
    assert found.problem is None and found.gap == pytest.approx(1e-3, rel=1e-3)
    assert found.gap_image == pytest.approx(1e-3, rel=1e-3) and found.gap_text == pytest.approx(1e-3, rel=1e-3)


def test_a_server_whose_answer_did_not_change_across_the_push_is_stale_even_under_the_limit():
    # The same tokens with the same logprobs as at v0, while the trainer's scores moved 0.2 (under the
    # limit 0.5): the push did nothing there.
    found = judge(THEN.server_T, NOW, IMAGE, 1, limit=0.5, image_limit=None, earlier=[THEN])
    assert (found.problem, found.like) == ("stale", 0)
    assert found.unchanged == 0.0 and found.moved == pytest.approx(0.2, rel=1e-3)
    text = found.describe("http://a:1", 0.5, None)
    assert "the server at http://a:1" in text and "push of weights v1" in text and "under weights v0" in text
    assert "without loading it" in text and "vLLM #49354" in text  # the likely causes


def test_a_push_that_moved_the_trainers_scores_less_than_the_floor_is_not_judged_stale():
    then = Earlier(0, server_T=NOW, trainer_T=NOW + MOVE_FLOOR / 2)
    assert judge(NOW, NOW, IMAGE, 1, limit=0.1, image_limit=None, earlier=[then]).problem is None


def test_a_correct_bf16_servers_jitter_is_not_stale():
    """Seen on a correct bf16 run (the OpenMMReasoner recipe on the tiny Qwen2.5-VL, step 35): the same
    tokens as at v34, the server's logprobs 0.00668 from its answer then, the trainer's scores of them
    0.0138 from its own then (bf16 rounding that jitters with the weights on both sides)."""
    then = Earlier(34, server_T=NOW, trainer_T=NOW)
    found = judge(NOW + 0.00668, NOW + 0.0138, IMAGE, 35, limit=0.1, image_limit=None, earlier=[then])
    assert found.problem is None


def test_a_bf16_sized_gap_between_the_two_sides_does_not_make_a_small_push_stale():
    # The trainer moved 1e-3, the server (bf16) is 3e-3 from the trainer each time, its rounding
    # different at each version: its answer moved about as much as its own noise, not "unchanged".
    noise_then, noise_now = t([3e-3, -3e-3, 3e-3, -3e-3, 3e-3]), t([-3e-3, 3e-3, 3e-3, 3e-3, -3e-3])
    then = Earlier(0, server_T=NOW - 1e-3 + noise_then, trainer_T=NOW - 1e-3)
    found = judge(NOW + noise_now, NOW, IMAGE, 1, limit=0.1, image_limit=None, earlier=[then])
    assert found.problem is None


def test_tokens_after_a_picture_far_from_the_text_ones_are_an_image_fault():
    server = NOW + torch.where(IMAGE, 0.08, 0.001)  # after a picture 0.08, text-only 0.001
    found = judge(server, NOW, IMAGE, 1, limit=0.1, image_limit=0.05)
    assert found.problem == "images" and found.gap_image - found.gap_text == pytest.approx(0.079, rel=1e-3)
    text = found.describe("http://a:1", 0.1, 0.05)
    assert "after a picture" in text and "M-RoPE" in text and "engine.image_mismatch_limit 0.05" in text
    assert judge(server, NOW, IMAGE, 1, limit=0.1, image_limit=None).problem is None  # no budget, no check


def test_far_from_the_pushed_weights_is_another_model():
    found = judge(NOW + 0.7, NOW, IMAGE, 1, limit=0.1, image_limit=0.05, earlier=[THEN])
    assert found.problem == "far" and "another model" in found.describe("http://a:1", 0.1, 0.05)
    assert judge(NOW + 0.7, NOW, IMAGE, 1, limit=None, image_limit=None).problem is None


# ------------------------------------------------------------------ the check on the tiny model

class Engine:
    """The parts of VLLMEngine the check uses: the real client and pool over `urls`, the local
    engine's tower for the probe's pictures."""

    def __init__(self, local, urls):
        from saccade.config import ImagesConfig
        from saccade.inference.server_client import ServerClient

        self.client = ServerClient(urls, limits=ImagesConfig(), lora=False, health_interval_s=0)
        self.key_for_hash, self.encode_images = local.key_for_hash, local.encode_images
        self.banned_token_ids = local.banned_token_ids


URLS = ["http://good", "http://stale", "http://images"]


@pytest.fixture
def check(tmp_path, monkeypatch):
    """A PushCheck over three stand-in servers on the tiny model. Each answers the same ids; by default
    with the trainer's own scores of them (it holds what was pushed); `check.answers[url]` replaces that."""
    from saccade.config import RunConfig, VLLMEngineConfig, load_config
    from saccade.distributed import SINGLE
    from saccade.loops import push_check
    from saccade.run.setup import build_setup

    cfg = load_config(RunConfig, "configs/demo.toml", ["--log.dir", str(tmp_path)])
    setup = build_setup(cfg, tmp_path)  # the embedded engine's tower encodes the probe's pictures
    setup.engine = Engine(setup.engine, URLS)
    made = PushCheck(cfg.model_copy(update={"engine": VLLMEngineConfig(urls=URLS)}), setup, SINGLE)
    made.answers = {}

    def held(extra_on_images: float = 0.0):
        ids = [[100 + i, 101 + i, 102 + i] for i in range(len(made.prompts))]
        scored = made.trainer_logprobs({"x": [ProbeAnswer(i, [0.0] * 3) for i in ids]})["x"]
        return [ProbeAnswer(i, (scored[3 * k:3 * k + 3] + (extra_on_images if p.after_image else 0.0)).tolist())
                for k, (i, p) in enumerate(zip(ids, made.prompts))]

    made.held = held

    async def answer(engine, server, prompts, tokens):
        return made.answers[server.url]() if server.url in made.answers else made.held()

    monkeypatch.setattr(push_check, "server_answers", answer)
    yield made
    setup.engine.client.close()


def move_weights(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)


def test_after_a_push_the_stale_and_the_image_servers_are_taken_out_and_named(check):
    figures, gone = check.after_push(0)
    assert gone is None and figures["probe_refused"] == 0 and figures["probe_servers"] == 3
    assert figures["probe_gap"] < 1e-6 and figures["probe_s"] > 0
    start = check.held()
    move_weights(check.setup.model)
    check.answers = {"http://stale": lambda: start, "http://images": lambda: check.held(extra_on_images=0.2)}
    figures, gone = check.after_push(1)
    pool = check.engine.client.pool
    assert gone is None and [s.url for s in pool.alive] == ["http://good"]
    assert "push of weights v1" in pool.servers["http://stale"].last_error
    assert "under weights v0" in pool.servers["http://stale"].last_error
    assert "after a picture" in pool.servers["http://images"].last_error
    assert figures["probe_refused"] == 2 and figures["probe_gap_image"] >= 0.2  # the largest over the servers
    # A parked (rejoining) server is asked at the next push, and put back once it passes.
    client = check.engine.client
    client.parked["http://stale"] = 2
    check.answers = {"http://images": lambda: check.held(extra_on_images=0.2)}
    move_weights(check.setup.model)
    figures, gone = check.after_push(2)
    assert gone is None and sorted(s.url for s in pool.alive) == ["http://good", "http://stale"]
    assert figures["probe_servers"] == 2 and "http://stale" not in client.parked  # images: out, not parked


def test_with_action_stop_a_refused_server_stops_the_run_and_none_left_stops_it_too(check):
    check.after_push(0)
    start = check.held()
    move_weights(check.setup.model)
    check.action = "stop"
    check.answers = {"http://stale": lambda: start}
    _, gone = check.after_push(1)
    assert isinstance(gone, PushMismatchError) and "http://stale" in str(gone) and "'stop'" in str(gone)
    check.action = "take_out"
    check.answers = {url: (lambda: start) for url in URLS}
    move_weights(check.setup.model)
    _, gone = check.after_push(2)
    assert gone is not None and "no server left that holds the trainer's weights" in str(gone)


def test_thinned_the_check_probes_every_kth_sync_only(check):
    check.every = 3
    assert [bool(check.after_push(v)[0]) for v in range(7)] == [True, False, False, True, False, False, True]


def test_a_rejoining_server_is_judged_from_the_last_pushs_scores_or_parked(check):
    """`admit` (the client's hook, on its own thread, no forward): a server answering the tokens the
    last probed push scored is let in when it holds those weights and refused when it answers as the
    start's; one with other tokens, or asked at a version not probed, is parked (None)."""
    check.after_push(0)
    start = check.held()
    move_weights(check.setup.model)
    check.after_push(1)
    client = check.engine.client
    server = client.pool.servers["http://stale"]
    check.answers = {"http://stale": lambda: start}  # restarted on the start weights
    why = client.run(check.admit(server, 1))
    assert isinstance(why, str) and "under weights v0" in why and "push of weights v1" in why
    check.answers = {}  # holds v1: the tokens the push scored, with the trainer's scores
    assert client.run(check.admit(server, 1)) is True
    check.answers = {"http://stale": lambda: [ProbeAnswer([7, 8, 9], [-1.0] * 3) for _ in check.prompts]}
    assert client.run(check.admit(server, 1)) is None  # tokens never scored: parked for the next push
    assert client.run(check.admit(server, 2)) is None  # a version the check has no scores of
