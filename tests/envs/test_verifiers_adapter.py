"""Environments from the `verifiers` package run as saccade environments (saccade.envs.verifiers_env).

The verifiers env here is written in the test: "look again", a MultiTurnEnv that shows a picture
(a data URL in an OpenAI image_url part) and answers each turn with a new one, stops early once
the answer names the right color (a @vf.stop condition), and is scored by a Rubric of three
weighted functions.
"""

from __future__ import annotations

import asyncio
import importlib
import signal
import sys
import types

import pytest
import verifiers as vf
from datasets import Dataset
from openai.types.chat import ChatCompletion

from saccade.data.images import image_hash, image_to_data_url, load_image
from saccade.envs.base import maybe_await
from saccade.envs.rollout import run_episodes
from saccade.envs.trajectory import ChatContinuation, check_consistency, to_training_sample
from saccade.envs.verifiers_env import VERIFIERS_VERSION, VerifiersEnv, VerifiersSample, VerifiersTask
from saccade.inference.engine import SamplingParams
from saccade.data.synthetic import synthetic_image

COLORS = ("red", "green", "blue")


def data_url(seed: int, width: int = 64, height: int = 64) -> str:
    return image_to_data_url(synthetic_image(width, height, seed))


def image_url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def urls_in(messages: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == "image_url"]


def rows(n: int) -> list[dict]:
    """Dataset rows as a verifiers env holds them: a prompt with an image, an answer, an info."""
    return [{
        "prompt": [
            {"role": "system", "content": [{"type": "text", "text": "Look, then name the color."}]},
            {"role": "user", "content": [image_url_part(data_url(1000 + i)),
                                         {"type": "text", "text": f"Question {i}: which color is the ball?"}]},
        ],
        "answer": COLORS[i % 3],
        "info": {"seed": 1000 + i},
    } for i in range(n)]


class LookAgainEnv(vf.MultiTurnEnv):
    """Each environment turn shows a new picture (a data URL, a new size each turn)."""

    async def env_response(self, messages, state, **kwargs):
        k = len(state["trajectory"])
        url = data_url(10 * state["info"]["seed"] + k, 64 + 32 * (k % 2), 64)
        return [{"role": "user", "content": [image_url_part(url), {"type": "text", "text": f"Look again ({k})."}]}]

    @vf.stop
    async def answered(self, state) -> bool:
        turns = state["trajectory"]  # also checked before the first turn, when there is none
        return bool(turns) and state["answer"] in turns[-1]["completion"][-1]["content"]


def correct(completion, answer) -> float:
    return float(answer in completion[-1]["content"])


def few_turns(state) -> float:
    return 1.0 / len(state["trajectory"])


def chars(completion) -> float:
    return float(sum(len(m["content"]) for m in completion if m["role"] == "assistant"))


@pytest.fixture(autouse=True, scope="module")
def keep_signal_handlers():
    """verifiers' Environment installs SIGINT/SIGTERM handlers when built: give the rest of the
    test session its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def local_engine(tiny_path, processor, limits):
    from saccade.inference.local import LocalEngine
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    encoder = VisionEncoder(load_vision_tower(tiny_path), processor, limits=limits, cache=EmbeddingCache())
    return LocalEngine(load_policy_lm(tiny_path).eval(), processor, encoder, seed=3)


@pytest.fixture(scope="module")
def vf_env():
    rubric = vf.Rubric(funcs=[correct, few_turns, chars], weights=[1.0, 0.5, 0.001])
    return LookAgainEnv(dataset=Dataset.from_list(rows(6)), rubric=rubric, max_turns=3)


class ScriptedClient:
    """Stands in for AsyncOpenAI in verifiers' own loop: answers from a script, records each request."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.requests: list[list[dict]] = []
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self._create))

    async def _create(self, *, model, messages, **kwargs):
        self.requests.append(messages)
        return ChatCompletion.model_validate({
            "id": f"scripted-{len(self.requests)}", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": self.replies.pop(0)}}],
        })


def verifiers_rollout(env, row: dict, replies: list[str]):
    """verifiers' own single rollout (run_rollout: the loop, then the rubric) on scripted replies."""
    client = ScriptedClient(replies)
    output = asyncio.run(env.run_rollout(row, client, "scripted", {}))
    return output, client.requests


def adapter_episode(adapter: VerifiersEnv, row, replies: list[str]):
    """The same episode through the adapter: the messages the model sees before each turn, the results."""
    async def go():
        conversation = await maybe_await(adapter.reset(row))
        seen, results = [], []
        for reply in replies:
            seen.append(list(conversation))
            result = await maybe_await(adapter.step({"role": "assistant", "content": reply}))
            results.append(result)
            if result.done:
                break
            conversation += [{"role": "assistant", "content": reply}, *result.messages]
        return seen, results
    return asyncio.run(go())


@pytest.mark.parametrize("replies", [
    ["I see nothing yet", "maybe purple", "still unsure"],  # runs to the env's max_turns
    ["purple?", "ANSWER"],  # the answer in turn 2: the env's own @vf.stop ends it
    ["purple?", ""],  # an empty reply: verifiers' EmptyModelResponseError ends it (has_error)
])
def test_scripted_episode_matches_verifiers_own_rollout(vf_env, replies):
    row = dict(vf_env.get_dataset()[1])
    replies = [r.replace("ANSWER", f"it is {row['answer']}") for r in replies]
    output, requests = verifiers_rollout(vf_env, row, replies)
    seen, results = adapter_episode(VerifiersEnv(vf_env, correct_metric="correct"), row, replies)

    # The model is shown the same messages at every turn (verifiers strips the dataset's None
    # fields before sending; so does the adapter), images as the same data URLs, in order.
    assert seen == requests and len(seen) == len(replies)
    assert len(urls_in(seen[-1])) == len(seen)
    assert results[-1].done and not any(r.done for r in results[:-1])
    assert all(r.reward == 0.0 and r.messages for r in results[:-1]) and results[-1].messages == []
    assert results[-1].reward == pytest.approx(output["reward"])
    info = results[-1].info
    assert {k: info[k] for k in output["metrics"]} == pytest.approx(output["metrics"])
    assert info["stop_condition"] == output["stop_condition"]
    assert ("error" in info) == (replies[-1] == "")
    assert info["correct"] == output["metrics"]["correct"] == float(row["answer"] in replies[-1])
    recorded = len(replies) - (replies[-1] == "")  # an empty reply is not a turn verifiers scores
    assert output["reward"] == pytest.approx(info["correct"] + 0.5 / recorded + 0.001 * len("".join(replies)))


def test_episodes_on_the_embedded_engine(vf_env, local_engine, processor, limits):
    """Real episodes: the tiny model's turns, the verifiers env's replies, token-in/token-out."""
    continuation = ChatContinuation(processor, limits=limits)
    task = VerifiersTask(vf_env, correct_metric="correct")
    assert task.max_turns == 3
    samples = [task.train_sample(p, seed=0) for p in range(3)]
    assert len({s.sample_id for s in samples}) == 3
    local_engine.reseed(4)
    trajectories = run_episodes(local_engine, [task.make_env() for _ in samples], samples,
                                [s.sample_id for s in samples], SamplingParams(temperature=1.0, max_tokens=6),
                                continuation=continuation)
    for sample, t in zip(samples, trajectories, strict=True):
        assert t.done and 1 <= len(t.turns) <= 3
        # The images are the env's data URLs, decoded, in order: the prompt's, then one per reply.
        output, requests = verifiers_rollout(vf_env, sample.row, t.texts)
        urls = urls_in(requests[-1])
        assert len(urls) == len(t.turns) == len(t.image_keys)
        assert [image_hash(im) for im in t.images] == [image_hash(load_image(u, limits=limits)) for u in urls]
        # The reward is what verifiers gives the same replies; earlier turns give 0.
        assert t.rewards[:-1] == [0.0] * (len(t.turns) - 1)
        assert t.rewards[-1] == pytest.approx(output["reward"]) and t.infos[-1]["reward"] == t.rewards[-1]
        assert {k: t.infos[-1][k] for k in output["metrics"]} == pytest.approx(output["metrics"])
        assert output["metrics"]["chars"] == len("".join(t.texts)) > 0  # the engine's texts, scored
        sample_ = to_training_sample(t, spatial_merge_size=local_engine.encoder.merge)
        check_consistency(sample_, t.turns, spatial_merge_size=local_engine.encoder.merge)


def test_rl_sample_step_runs_verifiers_episodes(vf_env, tmp_path):
    """RL's episodic path takes the task as it is: G episodes per row, whole trajectories as
    samples, the consistency check on the first step."""
    from saccade.config import RunConfig, load_config
    from saccade.inference.engine import SamplingParams
    from saccade.data.rows import StepRows
    from saccade.orchestrator.rollout import sample_step
    from saccade.setup import build_setup

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--log.dir", str(tmp_path), "--rollout.group_size", "2", "--rollout.filter_zero_variance", "false",
        "--sampling.max_tokens", "4", "--lora.rank", "4"])
    setup = build_setup(cfg, tmp_path)
    task = VerifiersTask(vf_env, correct_metric="correct")
    assert task.max_turns > 1  # the episodic path
    rows = StepRows([task.train_sample(0, seed=0), task.train_sample(1, seed=0)], positions=[0, 1], end=2, skipped=[])
    assert cfg.env.check_consistency == "first"  # step 0: checked
    rollouts = sample_step(0, rows, setup=setup, task=task, cfg=cfg,
                           sampling=SamplingParams(max_tokens=cfg.sampling.max_tokens, n=cfg.rollout.group_size))
    samples, metrics = rollouts.batch.samples, rollouts.batch.metrics
    assert len(samples) == 4 and metrics["images_mean"] == metrics["turns_mean"] <= 3
    assert all(int(s.loss_mask.sum()) > 0 and len(s.image_keys) >= 1 for s in samples)


def test_task_streams_rows(vf_env):
    task = VerifiersTask(vf_env, max_turns=2)
    assert task.max_turns == 2 and task.make_env().max_turns == 2  # below the env's own 3
    epoch = [task.train_sample(p, seed=5).row["info"]["seed"] for p in range(6)]
    assert sorted(epoch) == [1000 + i for i in range(6)]  # every row once per epoch
    assert [s.sample_id for s in task.eval_samples(2)] == ["vf-eval0", "vf-eval1"]  # no eval split: the train rows


def test_saccade_max_turns_below_the_envs_own_ends_and_scores(vf_env):
    row = dict(vf_env.get_dataset()[0])
    seen, results = adapter_episode(VerifiersEnv(vf_env, max_turns=2), row, ["no", "still no", "never sampled"])
    assert len(seen) == len(results) == 2 and results[-1].done
    assert results[-1].info["stop_condition"] == "saccade_max_turns"
    assert results[-1].reward == pytest.approx(0.0 + 0.5 / 2 + 0.001 * len("nostill no"))


def test_question_rows_get_the_system_prompt(vf_env):
    env = LookAgainEnv(dataset=Dataset.from_list([{"question": "Which color?", "answer": "red", "info": {"seed": 3}}]),
                       system_prompt="Be brief.", rubric=vf.Rubric(funcs=[correct]), max_turns=2)
    row = dict(env.get_dataset()[0])
    adapter = VerifiersEnv(env)
    assert asyncio.run(adapter.reset(row)) == [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Which color?"}]
    # A raw row (not from the env's dataset) gets the same prompt verifiers would build.
    assert asyncio.run(VerifiersEnv(env).reset({"question": "Which color?", "answer": "red", "info": {"seed": 3}})) \
        == asyncio.run(adapter.reset(VerifiersSample("s", row)))


def test_unbounded_env_needs_max_turns():
    env = LookAgainEnv(dataset=Dataset.from_list(rows(1)), rubric=vf.Rubric(funcs=[correct]))
    with pytest.raises(ValueError, match="max_turns"):
        VerifiersEnv(env)
    assert VerifiersEnv(env, max_turns=4).max_turns == 4


def test_missing_verifiers_gives_an_install_hint(monkeypatch, vf_env):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` now fails as if not installed
    monkeypatch.delitem(sys.modules, "saccade.envs.verifiers_env")
    module = importlib.import_module("saccade.envs.verifiers_env")  # the module itself imports without it
    with pytest.raises(ImportError, match=f"pip install verifiers=={VERIFIERS_VERSION}.*uv sync --group dev"):
        module.VerifiersEnv(vf_env)
    v1_only = types.ModuleType("verifiers")
    v1_only.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", v1_only)
    with pytest.raises(ImportError, match="classic MultiTurnEnv API.*0.4.0"):
        module.VerifiersEnv(vf_env)


VERIFIERS_ENV_MODULE = """
import verifiers as vf
import zlib

from datasets import Dataset

from saccade.data.images import image_to_data_url
from saccade.data.synthetic import synthetic_image

COLORS = ("red", "green", "blue")


def picture(seed):
    return {"type": "image_url", "image_url": {"url": image_to_data_url(synthetic_image(64, 64, seed))}}


class LookTwice(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": [picture(100 + len(state["trajectory"])),
                                             {"type": "text", "text": "Look again."}]}]


def correct(completion, answer) -> float:
    return float(answer in completion[-1]["content"])


def text_hash(completion) -> float:
    # A random model never names the color: without a reward that varies with the reply, every
    # group would score 0 and the step would train on nothing.
    return zlib.crc32(str(completion[-1]["content"]).encode()) % 1000 / 1000


def load_environment(rows: int = 3, max_turns: int = 2):
    data = [{"prompt": [{"role": "user", "content": [picture(i), {"type": "text", "text": "Which color?"}]}],
             "answer": COLORS[i % 3]} for i in range(rows)]
    return LookTwice(dataset=Dataset.from_list(data), rubric=vf.Rubric(funcs=[correct, text_hash]),
                     max_turns=max_turns)
"""


@pytest.mark.slow
def test_a_verifiers_env_named_in_the_config_trains(tmp_path, monkeypatch):
    """task.kind = "verifiers", env_id "tiny-look-env": verifiers' own load_environment finds the
    module (a real file on sys.path, '-' as '_'), with task.env_args as its arguments; RL runs it."""
    from saccade.config import RunConfig, load_config
    from saccade.metrics import read_metrics
    from saccade.rl import train_rl
    from saccade.tasks import task_from_config

    (tmp_path / "tiny_look_env.py").write_text(VERIFIERS_ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--log.dir", str(tmp_path / "run"), "--task.kind", "verifiers", "--task.env_id", "tiny-look-env",
        "--task.env_args", '{"rows": 5}', "--task.correct_metric", "correct", "--trainer.steps", "1", "--rollout.prompts_per_step", "2",
        "--rollout.group_size", "2", "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "4",
        "--loss.max_completion_tokens", "4", "--eval.every_steps", "0", "--checkpoint.every_steps", "0"])
    task = task_from_config(cfg)
    assert isinstance(task, VerifiersTask) and len(task.env.get_dataset()) == 5  # env_args reached it
    assert task.max_turns == 2  # the env's own, below task.max_turns (3)
    train_rl(cfg, run_dir=cfg.run_dir, progress=False)  # builds its task from the config alone
    [row] = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert 1 <= row["turns_mean"] <= 2 and row["images_mean"] == row["turns_mean"]  # one image per turn
    assert "env_correct" in row and row["accuracy"] == row["env_correct"] and "loss" in row
    # It trained: the rubric's rewards reached the groups and moved the weights.
    assert row["reward_std"] > 0 and row["grad_norm"] > 0, row


def test_a_verifiers_env_that_is_not_installed_is_refused_before_the_run():
    from saccade.config import RunConfig, load_config
    from saccade.tasks import check_user_code

    cfg = load_config(RunConfig, None, ["--task.kind", "verifiers", "--task.env_id", "not-installed-env"])
    with pytest.raises(ValueError, match="verifiers environment 'not-installed-env': no module "
                                         "'not_installed_env' on sys.path.*vf-install not-installed-env"):
        check_user_code(cfg)
