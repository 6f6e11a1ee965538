"""Environments written for verifiers 0.4 (its v1 API) run as saccade environments
(saccade.envs.verifiers_env).

The environment here is written in the test against that API and installed the way verifiers'
loader finds one by id, as a module on sys.path (`tiny_look_env` for "tiny-look-env"): a
taskset whose tasks show a picture (a data URL in an OpenAI image_url part) and ask for its
color, and an env that answers each turn with a new picture as the user
(`interaction.turn(messages)`), until the task's `@vf.stop` sees the color named or the seat's
turns run out; three weighted `@vf.reward` functions and a `@vf.metric` score the trace.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import sys
import time
import types

import pytest

vf = pytest.importorskip("verifiers.v1")

from saccade.data.images import image_hash, load_image  # noqa: E402
from saccade.envs.base import maybe_await  # noqa: E402
from saccade.envs.rollout import run_episodes  # noqa: E402
from saccade.envs.trajectory import ChatContinuation, check_consistency, to_training_sample  # noqa: E402
from saccade.envs.verifiers_env import (  # noqa: E402
    VERIFIERS_VERSION, VerifiersEnv, VerifiersTask, openai_messages,
)
from saccade.inference.engine import SamplingParams  # noqa: E402

ENV_MODULE = '''
import verifiers.v1 as vf

from saccade.data.images import image_to_data_url
from saccade.data.synthetic import synthetic_image

COLORS = ("red", "green", "blue")


def picture(seed, width=64):
    return {"type": "image_url", "image_url": {"url": image_to_data_url(synthetic_image(width, 64, seed))}}


class LookData(vf.TaskData):
    answer: str
    seed: int
    fail: bool = False


class LookTask(vf.Task[LookData]):
    async def setup(self, trace, runtime):
        if self.data.fail:
            raise RuntimeError("the camera is off")

    @vf.stop
    async def answered(self, trace: vf.Trace) -> bool:
        replies = trace.assistant_messages
        return bool(replies) and self.data.answer in (replies[-1].content or "")

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return float(bool(replies) and self.data.answer in (replies[-1].content or ""))

    @vf.reward(weight=0.5)
    async def few_turns(self, trace: vf.Trace) -> float:
        return 1.0 / max(1, trace.num_turns)

    @vf.reward(weight=0.001)
    async def chars(self, trace: vf.Trace) -> float:
        return float(sum(len(m.content or "") for m in trace.assistant_messages))

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class LookConfig(vf.TasksetConfig):
    rows: int = 3
    fail_setup: bool = False
    system_in_prompt: bool = False  # a system message in the prompt as well as the system prompt


class LookTaskset(vf.Taskset[LookTask, LookConfig]):
    def load(self):
        for i in range(self.config.rows):
            extra = [{"role": "system", "content": "Be brief."}] if self.config.system_in_prompt else []
            yield self.task_type()(LookData(
                prompt=[*extra, {"role": "user", "content": [picture(1000 + i),
                                                             {"type": "text", "text": f"Question {i}: which color?"}]}],
                system_prompt="Look, then name the color.", answer=COLORS[i % 3], seed=1000 + i,
                fail=self.config.fail_setup), self.config.task)


class LookAgainEnv(vf.SingleAgentEnv):
    """The user's side: each turn a new picture (a new size every other turn)."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as interaction:
            segment = await interaction.turn()
            k = 1
            while not segment.terminated:
                segment = await interaction.turn([{"role": "user", "content": [
                    picture(10 * task.data.seed + k, 64 + 32 * (k % 2)),
                    {"type": "text", "text": f"Look again ({k})."}]}])
                k += 1


__all__ = ["LookAgainEnv", "LookTaskset"]
'''

# Environments that misuse the adapter (and one endless taskset), each a module of its own.
OTHER_MODULES = {
    "twice_env": '''
import verifiers.v1 as vf
from tiny_look_env import LookTaskset


class TwiceEnv(vf.SingleAgentEnv):
    async def run(self, task, agents):
        await agents.agent.run(task)
        await agents.agent.run(task)


__all__ = ["TwiceEnv", "LookTaskset"]
''',
    "duo_env": '''
import verifiers.v1 as vf
from tiny_look_env import LookTaskset


class DuoConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def run(self, task, agents):
        await agents.first.run(task)


__all__ = ["DuoEnv", "LookTaskset"]
''',
    "tools_env": '''
import verifiers.v1 as vf
from tiny_look_env import LookConfig, LookTask, LookTaskset


class Zoom(vf.Toolset[vf.ToolsetConfig]):
    @vf.tool
    def zoom(self) -> str:
        """Look closer."""
        return "closer"


class ToolsConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ZoomTask(LookTask, vf.Task[vf.TaskData, vf.State, ToolsConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Zoom(config.tools)]


class ZoomConfig(LookConfig):
    task: ToolsConfig = ToolsConfig()


class ZoomTaskset(LookTaskset, vf.Taskset[ZoomTask, ZoomConfig]):
    pass


__all__ = ["ZoomTaskset"]
''',
    "endless_look_env": '''
import itertools

import verifiers.v1 as vf
from tiny_look_env import LookData, LookTask, LookTaskset


class EndlessTaskset(LookTaskset):
    INFINITE = True

    def load(self):
        for i in itertools.count():
            yield LookTask(LookData(prompt=f"Question {i}", answer="red", seed=i), self.config.task)


__all__ = ["EndlessTaskset"]
''',
}


def urls_in(messages: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
            for p in m["content"] if p.get("type") == "image_url"]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    """The environments' modules, on sys.path as an installed package would be."""
    folder = tmp_path_factory.mktemp("vf_envs")
    (folder / "tiny_look_env.py").write_text(ENV_MODULE)
    for name, text in OTHER_MODULES.items():
        (folder / f"{name}.py").write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        yield folder


@pytest.fixture(scope="module")
def look(env_dir):
    task = VerifiersTask("tiny-look-env", {"rows": 6}, max_turns=3, correct_metric="correct")
    yield task
    task.close()


@pytest.fixture(scope="module")
def local_engine(tiny_path, processor, limits):
    from saccade.inference.local import LocalEngine
    from saccade.models.lm import load_policy_lm
    from saccade.models.loading import load_vision_tower
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    encoder = VisionEncoder(load_vision_tower(tiny_path), processor, limits=limits, cache=EmbeddingCache())
    return LocalEngine(load_policy_lm(tiny_path).eval(), processor, encoder, seed=3)


def verifiers_rollout(task: VerifiersTask, vtask, replies: list[str]):
    """verifiers' own episode (Env.run_episode: its loop, stops, limits, scoring) with a scripted
    model endpoint as the run's client: the episode and the requests the model was sent."""
    from aiohttp import web

    async def go():
        requests = []

        async def chat(request):
            body = await request.json()
            requests.append(body["messages"])
            return web.json_response({"id": "scripted", "object": "chat.completion", "created": 0, "model": "s",
                                      "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                          "role": "assistant", "content": replies[len(requests) - 1]}}]})

        app = web.Application(client_max_size=2**30)
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        ctx = vf.ModelContext(model="scripted", client=vf.EvalClientConfig(
            base_url=f"http://127.0.0.1:{port}/v1", api_key_var="NO_SUCH_KEY"))
        try:
            return await task.env.run_episode(vtask, ctx), requests
        finally:
            await runner.cleanup()

    episode, requests = task.verifiers.wait(go())
    [trace] = episode.traces
    return trace, requests


def adapter_episode(adapter: VerifiersEnv, sample, replies: list[str]):
    """The same episode through the adapter: the messages the model sees before each turn, the results."""
    async def go():
        conversation = await maybe_await(adapter.reset(sample))
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
    ["I see nothing yet", "maybe purple", "still unsure"],  # runs to the seat's max_turns
    ["purple?", "ANSWER"],  # the color in turn 2: the task's own @vf.stop ends it
    ["", "", ""],  # empty replies are turns like any other (verifiers 0.4 records them)
])
def test_scripted_episode_matches_verifiers_own_rollout(look, replies):
    sample = look.train_sample(1, seed=0)
    answer = sample.task.data.answer
    replies = [r.replace("ANSWER", f"it is {answer}") for r in replies]
    trace, requests = verifiers_rollout(look, sample.task, replies)
    seen, results = adapter_episode(look.make_env(), sample, replies)

    # The model is shown the same messages at every turn, images as the same data URLs, in
    # order: the task's picture, then one new one per environment turn.
    assert seen == [openai_messages(r) for r in requests] and len(seen) == len(replies)
    assert [len(urls_in(s)) for s in seen] == list(range(1, len(replies) + 1))
    assert urls_in(seen[-1]) == urls_in(requests[-1])
    assert results[-1].done and not any(r.done for r in results[:-1])
    assert all(r.reward == 0.0 and r.messages for r in results[:-1]) and results[-1].messages == []
    # The reward and the info are the trace's: each reward's score, each metric, why it stopped.
    info = results[-1].info
    assert results[-1].reward == pytest.approx(trace.reward) == info["reward"]
    assert {name: info[name] for name in trace.rewards} == pytest.approx({n: r.score for n, r in trace.rewards.items()})
    assert info["turns"] == trace.metrics["turns"] == len(replies)
    assert info["stop_condition"] == trace.stop_condition == ("answered" if answer in replies[-1] else "max_turns")
    assert info["correct"] == float(answer in replies[-1]) and "error" not in info
    # By hand: correct + 0.5 / turns + 0.001 * characters replied.
    assert trace.reward == pytest.approx(info["correct"] + 0.5 / len(replies) + 0.001 * len("".join(replies)))


def test_episodes_on_the_embedded_engine(look, local_engine, processor, limits):
    """Real episodes: the tiny model's turns, the environment's replies, token-in/token-out."""
    continuation = ChatContinuation(processor, limits=limits)
    samples = [look.train_sample(p, seed=0) for p in range(3)]
    assert len({s.sample_id for s in samples}) == 3
    local_engine.reseed(4)
    trajectories = run_episodes(local_engine, [look.make_env() for _ in samples], samples,
                                [s.sample_id for s in samples], SamplingParams(temperature=1.0, max_tokens=6),
                                continuation=continuation)
    for sample, t in zip(samples, trajectories, strict=True):
        assert t.done and 1 <= len(t.turns) <= 3
        # The images are the environment's data URLs, decoded, in order: the task's, then one per turn.
        trace, requests = verifiers_rollout(look, sample.task, t.texts)
        # The trajectory's conversation is the one verifiers sends the model before its last turn.
        conversation = list(t.env_messages[0])
        for text, new in zip(t.texts, t.env_messages[1:]):
            conversation += [{"role": "assistant", "content": text}, *new]
        assert conversation == openai_messages(requests[-1])
        urls = urls_in(requests[-1])
        assert len(urls) == len(t.turns) == len(t.image_keys)
        assert [image_hash(im) for im in t.images] == [image_hash(load_image(u, limits=limits)) for u in urls]
        # The reward is what verifiers gives the same replies; earlier turns give 0.
        assert t.rewards[:-1] == [0.0] * (len(t.turns) - 1)
        assert t.rewards[-1] == pytest.approx(trace.reward) and t.infos[-1]["reward"] == t.rewards[-1]
        assert t.infos[-1]["chars"] == trace.rewards["chars"].score == len("".join(t.texts)) > 0
        sample_ = to_training_sample(t, positions=local_engine.encoder.positions)
        check_consistency(sample_, t.turns, positions=local_engine.encoder.positions)


def test_rl_sample_step_runs_verifiers_episodes(look, tmp_path):
    """RL's episodic path takes the task as it is: G episodes per task, whole trajectories as
    samples, the consistency check on the first step."""
    from saccade.config import RunConfig, load_config
    from saccade.data.rows import StepRows
    from saccade.orchestrator.rollout import sample_step
    from saccade.run.setup import build_setup

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--log.dir", str(tmp_path), "--rollout.group_size", "2", "--rollout.filter_zero_variance", "false",
        "--sampling.max_tokens", "4"])
    setup = build_setup(cfg, tmp_path)
    assert look.max_turns > 1  # the episodic path
    rows = StepRows([look.train_sample(0, seed=0), look.train_sample(1, seed=0)], positions=[0, 1], end=2, skipped=[])
    assert cfg.env.check_consistency == "first"  # step 0: checked
    rollouts = sample_step(0, rows, setup=setup, task=look, cfg=cfg,
                           sampling=SamplingParams(max_tokens=cfg.sampling.max_tokens, n=cfg.rollout.group_size))
    samples, metrics = rollouts.batch.samples, rollouts.batch.metrics
    assert len(samples) == 4 and metrics["images_mean"] == metrics["turns_mean"] <= 3
    assert all(int(s.loss_mask.sum()) > 0 and len(s.image_keys) >= 1 for s in samples)


def test_task_streams_tasks(look, env_dir):
    epoch = [look.train_sample(p, seed=5).task.data.seed for p in range(6)]
    assert sorted(epoch) == [1000 + i for i in range(6)]  # every task once per epoch
    assert [s.task.data.seed for s in look.eval_samples(2)] == [1000, 1001]  # no eval split: the first tasks
    assert [s.sample_id for s in look.eval_samples(2)] == ["vf-eval0", "vf-eval1"]
    endless = VerifiersTask("endless-look-env", max_turns=1)
    try:  # read as far as asked, in its own order
        assert [endless.train_sample(p, seed=5).task.data.seed for p in (0, 1, 7)] == [0, 1, 7]
        assert [s.task.data.seed for s in endless.eval_samples(3)] == [0, 1, 2]
    finally:
        endless.close()


def test_max_turns_is_the_lower_bound_and_one_is_needed(env_dir):
    two = VerifiersTask("tiny-look-env", max_turns=2)
    try:
        assert two.max_turns == two.make_env().max_turns == 2
        seen, results = adapter_episode(two.make_env(), two.train_sample(0, seed=0), ["no", "still no", "never"])
        assert len(seen) == len(results) == 2 and results[-1].done  # verifiers' own max_turns stop
        assert results[-1].info["stop_condition"] == "max_turns"
        assert results[-1].reward == pytest.approx(0.0 + 0.5 / 2 + 0.001 * len("nostill no"))
    finally:
        two.close()
    with pytest.raises(ValueError, match="its seat 'agent' has no max_turns; pass max_turns"):
        VerifiersTask("tiny-look-env")


def test_a_failure_before_the_first_model_call_ends_after_one_turn(env_dir):
    broken = VerifiersTask("tiny-look-env", {"fail_setup": True}, max_turns=3, correct_metric="correct")
    try:
        seen, results = adapter_episode(broken.make_env(), broken.train_sample(0, seed=0), ["red", "never"])
        assert seen[0][0] == {"role": "system", "content": "Look, then name the color."}  # the task's own prompt
        assert len(urls_in(seen[0])) == 1 and len(results) == 1 and results[0].done
        info = results[0].info
        assert results[0].reward == 0.0 and info["correct"] == 0.0 and "the camera is off" in info["error"]
    finally:
        broken.close()


def test_an_episode_saccade_stops_stepping_is_cancelled(look):
    env = look.make_env()
    asyncio.run(env.reset(look.train_sample(0, seed=0)))
    runner = env.episode.runner
    assert look.verifiers.routes  # waiting for the model's reply
    del env
    gc.collect()  # as run_episodes drops an env it ended for max_total_tokens
    deadline = time.monotonic() + 30
    while not runner.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.done() and not look.verifiers.routes


@pytest.mark.parametrize(("env_id", "message"), [
    ("duo-env", r"verifiers environment 'duo-env' has seats \['first', 'second'\]; saccade trains one agent"),
    ("twice-env", r"TwiceEnv ran a second agent rollout in one episode"),
    ("tools-env", r"'tools-env' gives the model tools \(Zoom\); saccade samples text, not tool calls"),
    # verifiers' resume drops the prompt's own system messages when the task has a system prompt
    ("tiny-look-env", r"'tiny-look-env' rewrote earlier messages"),
])
def test_environments_saccade_cannot_train_are_refused(env_dir, env_id, message):
    with pytest.raises(ValueError, match=message):
        task = VerifiersTask(env_id, {"system_in_prompt": True} if env_id == "tiny-look-env" else {}, max_turns=2)
        try:
            adapter_episode(task.make_env(), task.train_sample(0, seed=0), ["no idea", "none"])
        finally:
            task.close()


def test_a_correct_metric_the_environment_does_not_score_is_refused(env_dir):
    task = VerifiersTask("tiny-look-env", max_turns=1, correct_metric="right")
    try:
        with pytest.raises(ValueError, match=r"task.correct_metric 'right': verifiers environment 'tiny-look-env' "
                                             r"has no such reward or metric; it scores \['chars', 'correct', "
                                             r"'few_turns', 'turns'\]"):
            adapter_episode(task.make_env(), task.train_sample(0, seed=0), ["no"])
    finally:
        task.close()


def test_unknown_env_args_are_refused(env_dir):
    with pytest.raises(ValueError, match="(?s)task.env_args: verifiers environment 'tiny-look-env' refused "
                                         "its config.*no_such_field.*Extra inputs are not permitted"):
        VerifiersTask("tiny-look-env", {"no_such_field": 1}, max_turns=2)


def test_missing_or_classic_verifiers_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)  # `import verifiers` now fails as if not installed
    monkeypatch.delitem(sys.modules, "saccade.envs.verifiers_env")
    module = importlib.import_module("saccade.envs.verifiers_env")  # the module itself imports without it
    with pytest.raises(ImportError, match=f"pip install verifiers=={VERIFIERS_VERSION}.*uv sync --group dev"):
        module.import_verifiers()
    classic = types.ModuleType("verifiers")
    classic.__version__ = "0.1.10"
    monkeypatch.setitem(sys.modules, "verifiers", classic)
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"verifiers 0.1.10 has only the classic MultiTurnEnv API.*"
                                          f"pip install verifiers=={VERIFIERS_VERSION}"):
        module.VerifiersTask("tiny-look-env", max_turns=2)


@pytest.mark.slow
def test_a_verifiers_env_named_in_the_config_trains(env_dir, tmp_path):
    """task.kind = "verifiers", env_id "tiny-look-env": verifiers' own loader finds the module
    ('-' as '_'), task.env_args is the taskset's config; a real `saccade rl` step trains on it."""
    from saccade.config import RunConfig, load_config
    from saccade.metrics import read_metrics
    from saccade.loops.rl import train_rl
    from saccade.run.tasks import check_user_code, task_from_config

    cfg = load_config(RunConfig, "configs/demo.toml", [
        "--log.dir", str(tmp_path / "run"), "--task.kind", "verifiers", "--task.env_id", "tiny-look-env",
        "--task.env_args", '{"rows": 5}', "--task.max_turns", "2", "--task.correct_metric", "correct",
        "--trainer.steps", "1", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--rollout.filter_zero_variance", "false", "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
        "--eval.every_steps", "0", "--checkpoint.every_steps", "0"])
    check_user_code(cfg)  # found without importing it
    task = task_from_config(cfg)
    try:
        assert isinstance(task, VerifiersTask) and task._count() == 5  # env_args reached the taskset
        assert task.max_turns == 2
    finally:
        task.close()
    train_rl(cfg, run_dir=cfg.run_dir, progress=False)  # builds its task from the config alone
    [row] = [r for r in read_metrics(cfg.run_dir) if r["phase"] == "train"]
    assert 1 <= row["turns_mean"] <= 2 and row["images_mean"] == row["turns_mean"]  # one image per turn
    assert "env_correct" in row and row["accuracy"] == row["env_correct"] and "loss" in row
    # It trained: the rewards (chars and few_turns vary with the replies) moved the weights.
    assert row["reward_std"] > 0 and row["grad_norm"] > 0, row


def test_a_verifiers_env_that_is_not_installed_is_refused_before_the_run():
    from saccade.config import RunConfig, load_config
    from saccade.run.tasks import check_user_code

    cfg = load_config(RunConfig, None, ["--task.kind", "verifiers", "--task.env_id", "owner/not-installed-env@1.0"])
    with pytest.raises(ValueError, match="verifiers environment 'owner/not-installed-env@1.0': no module "
                                         "'not_installed_env' on sys.path.*prime env install"):
        check_user_code(cfg)
