"""Environments written for `verifiers` 0.4 (its v1 API: tasksets, tasks, envs) as saccade tasks.

A verifiers environment is a taskset (`vf.Taskset.load()` yields `vf.Task`s: a prompt with
images or none, a system prompt, data) and an env (`vf.Env.run(task, agents)`): a plain
taskset's `SingleAgentEnv` runs the agent once on the task's prompt; a multi-turn env talks
to it as the user, `interaction.turn(messages)` per turn, images in any of them. The task's
`@vf.stop` conditions and the seat's `max_turns` end a rollout; its `@vf.reward` (weighted)
and `@vf.metric` functions score the finished trace, and `Env.finalize` may add rewards.
verifiers runs each model call as: harness program -> the rollout's interception endpoint
(which records the turn in the trace and applies the stops and limits) -> the run's client.

saccade keeps all of that and takes the client's place. Every episode runs verifiers' own
`Env.run_episode` on one event loop on a thread of its own (saccade's rollout loop runs each
turn in a fresh `asyncio.run`, and a verifiers episode lives across turns); the seat plays
saccade's harness (`saccade.envs.verifiers_harness`: one chat call per segment, in process,
no tools) in a local subprocess runtime, and the run's client is an endpoint here that hands
each request to the episode's `VerifiersEnv` and answers with the engine's reply:

    saccade rollout loop         VerifiersEnv              verifiers (its own thread and loop)
    reset(sample)          ->    start run_episode   ->    Env.run -> harness -> interception
                           <-    the request's messages <- endpoint: request (the prompt)
    engine samples; step(reply) -> answer the request ->   turn committed; Env.run's next user
                           <-    the new messages    <-    turn, or the episode ends: scored

The engine's token ids stay saccade's (`saccade.envs.trajectory`): verifiers sees the reply's
text, and the adapter checks that each request only appends to the last one (the request
before it, the reply as sampled, then the environment's new messages). Images are OpenAI
`image_url` parts with data URLs, loaded by saccade's message code with the run's
`ImagesConfig`. The reward is the trace's (its weighted rewards summed, verifiers'
`Trace.reward`); the info holds each reward's score and each metric.

Only this release line: the distribution is one (`verifiers`), so one lock holds one release,
and 0.4 dropped the classic `MultiTurnEnv` API of 0.1 (and 0.1.11-0.3.1 do not resolve here:
pyproject's dev group says why). verifiers is imported only when an adapter is made: it is
a dev dependency of saccade (the tests run it), never a runtime one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from saccade.envs.base import Message, StepResult, message_text

# The release the adapter is written against and tested with (pyproject's dev group says why).
VERIFIERS_VERSION = "0.4.0"
INSTALL_HINT = f"pip install verifiers=={VERIFIERS_VERSION} (in a saccade checkout: uv sync --group dev)"


def import_verifiers():
    """`verifiers.v1`, or an ImportError that says how to install the tested release."""
    try:
        import verifiers
    except ImportError as err:
        raise ImportError(f"saccade.envs.verifiers_env needs the `verifiers` package, which is not "
                          f"installed: {INSTALL_HINT}") from err
    try:
        import verifiers.v1 as vf
    except ImportError as err:  # 0.1.x: only the classic MultiTurnEnv API
        raise ImportError(f"saccade.envs.verifiers_env runs environments written for verifiers' current API "
                          f"(verifiers.v1, release {VERIFIERS_VERSION}); verifiers "
                          f"{getattr(verifiers, '__version__', '?')} has only the classic MultiTurnEnv API, which "
                          f"saccade no longer runs: {INSTALL_HINT}") from err
    return vf


def verifiers_module_name(env_id: str) -> str:
    """The module verifiers imports for a taskset id (0.4, utils/loaders.py `_import_plugin`):
    the id without an "owner/" prefix or "@version" suffix, '-' as '_', lower case."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def check_verifiers_env(env_id: str) -> None:
    """That `verifiers` and the environment's module can be found, without importing either
    (verifiers takes seconds to import; the module imports it). ValueError saying what to install."""
    spec = importlib.util.find_spec("verifiers")
    if spec is None:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r} needs the `verifiers` package: "
                         f"{INSTALL_HINT}")
    module = verifiers_module_name(env_id)
    # verifiers' own tasksets (verifiers.v1.tasksets.<module>) come first, as in its loader.
    if any((Path(p) / "v1" / "tasksets" / module).is_dir() for p in spec.submodule_search_locations or []):
        return
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r}: no module {module!r} on sys.path. "
                         f"Install the environment's package (`prime env install {env_id}`, or pip), or put "
                         f"the folder holding {module}.py on PYTHONPATH")


@dataclass
class VerifiersSample:
    """One task of a verifiers taskset."""

    sample_id: str  # RL names episodes and training samples by it
    task: Any  # a vf.Task


@dataclass
class _Episode:
    """One episode as the endpoint and VerifiersEnv share it (on the verifiers loop)."""

    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("request", messages) or ("done", result)
    traces: list[str] = field(default_factory=list)  # the trace ids its agent runs minted, in order
    reply: asyncio.Future | None = None  # the request saccade answers next
    runner: asyncio.Task | None = None
    misuse: ValueError | None = None


class VerifiersLoop:
    """verifiers' side of every episode of one env: an event loop on a daemon thread, the
    env's `serving()` resources entered on it, and the model endpoint its client calls."""

    def __init__(self, env):
        self.env = env
        self.routes: dict[str, _Episode] = {}  # trace id -> its episode
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verifiers", daemon=True)
        self.thread.start()
        self.stack = contextlib.AsyncExitStack()
        self.url = self.wait(self._open())

    def wait(self, coro):
        """Run `coro` on the verifiers loop from a thread with no running loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def call(self, coro):
        """Run `coro` on the verifiers loop from another loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _open(self) -> str:
        from aiohttp import web
        from verifiers.v1.clients.client import SESSION_ID_HEADER  # the rollout's trace id, every call

        self.session_header = SESSION_ID_HEADER
        await self.stack.enter_async_context(self.env.serving())
        app = web.Application(client_max_size=1024**3)  # images as data URLs make large bodies
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self.stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"

    async def _chat(self, request):
        """The run's model: the request goes to its episode, the engine's reply comes back."""
        from aiohttp import web

        trace_id = request.headers.get(self.session_header, "")
        episode = self.routes.get(trace_id)
        if episode is None:
            return web.json_response({"error": {"message": f"no saccade episode for session {trace_id!r}"}}, status=404)
        if trace_id != episode.traces[0]:
            episode.misuse = ValueError(
                f"{type(self.env).__name__} ran a second agent rollout in one episode; saccade trains one "
                "conversation per episode (one seat, run once: agent.run or one agent.interaction)")
            return web.json_response({"error": {"message": str(episode.misuse)}}, status=400)
        body = await request.json()
        reply = self.loop.create_future()
        episode.events.put_nowait(("request", body["messages"], reply))
        text = await reply
        return web.json_response({
            "id": f"saccade-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "saccade"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        })

    async def start(self, task, ctx) -> _Episode:
        """Start verifiers' own episode of `task`; its events arrive on the episode's queue."""
        episode = _Episode()

        def minted(trace):  # called when each agent run's trace exists, before its first request
            episode.traces.append(trace.id)
            self.routes[trace.id] = episode

        async def play():
            try:
                episode.events.put_nowait(("done", await self.env.run_episode(task, ctx, on_trace=minted)))
            except Exception as err:  # noqa: BLE001 - verifiers records an episode's failures; this is its own
                episode.events.put_nowait(("failed", err))
            finally:
                for trace_id in episode.traces:
                    self.routes.pop(trace_id, None)

        episode.runner = asyncio.create_task(play())
        return episode

    async def next_event(self, episode: _Episode, reply: str | None = None) -> tuple:
        """Answer the pending request with `reply` (if given), then the episode's next event."""
        if reply is not None:
            episode.reply.set_result(reply)
        event = await episode.events.get()
        if event[0] == "request":
            episode.reply = event[2]
        return event

    def cancel(self, episode: _Episode) -> None:
        """End an episode saccade stopped stepping (max_total_tokens): its rollout aborts, and
        the request it was waiting on is dropped."""
        def abandon():
            for waiting in (episode.runner, episode.reply):
                if waiting is not None:
                    waiting.cancel()

        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(abandon)

    def close(self) -> None:
        async def shut():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:  # episodes still waiting for a reply: their rollouts abort
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.stack.aclose()

        if self.thread.is_alive():
            self.wait(shut())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()


def load_verifiers_env(env_id: str, args: dict[str, Any] | None = None, *, max_turns: int | None = None):
    """verifiers' own `load_environment` for taskset `env_id` (its config: `args`, validated by
    the taskset's config class), with its one seat played by saccade's harness in a local
    subprocess runtime, at most `max_turns` model turns (the seat's own bound if lower; one of
    the two must be set). What `task.kind = "verifiers"` runs, with `task.env_args` as `args`.
    Returns (env, max_turns)."""
    vf = import_verifiers()
    from saccade.envs import verifiers_harness

    # verifiers imports a harness by its id's module name (see saccade.envs.verifiers_harness).
    sys.modules.setdefault(verifiers_harness.HARNESS_MODULE, verifiers_harness)
    try:
        config_type = vf.env_config_type(env_id)
    except ModuleNotFoundError as err:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r}: {err}") from None
    seats = [name for name, f in config_type.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
    if len(seats) != 1:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r} has seats {seats}; saccade trains one "
                         "agent per episode, so it runs environments with one seat")
    [seat] = seats
    own = config_type.model_fields[seat].default.max_turns
    bounds = [t for t in (own, max_turns) if t is not None]
    if not bounds:
        raise ValueError(f"verifiers environment {env_id!r}: its seat {seat!r} has no max_turns; pass max_turns, "
                         "saccade bounds every episode")
    no_retries = {"max_retries": 0, "rules": []}  # a retry would start the conversation again
    data = {
        "taskset": {**(args or {}), "id": env_id},
        seat: {"harness": {"id": verifiers_harness.HARNESS_ID}, "runtime": {"type": "subprocess"},
               "max_turns": min(bounds), "retries": no_retries},
        "interception": {"type": "server"},  # local: no tunnel
        "retries": no_retries,
    }
    try:
        config = vf.resolve_env_config(data)
    except ValueError as err:  # pydantic's ValidationError is one
        raise ValueError(f"task.env_args: verifiers environment {env_id!r} refused its config: {err}") from None
    env = vf.load_environment(config)
    taskset = env.taskset
    tools = [*type(taskset).toolsets(taskset.config), *taskset.task_type().toolsets(taskset.config.task)]
    if tools:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r} gives the model tools "
                         f"({', '.join(type(t).__name__ for t in tools)}); saccade samples text, not tool calls")
    return env, min(bounds)


class VerifiersTask:
    """A verifiers environment as an RL task (the interface `saccade.loops.rl` reads: train_sample,
    eval_samples, make_env, max_turns). Tasks come from the env's taskset, in its order; the
    held-out ones are its first tasks (verifiers has no eval split: its evals take the first
    tasks too). `correct_metric` names the reward or metric whose value saccade counts as
    success (`info["correct"]`, read by RL's accuracy metrics). `close()` ends the loop."""

    def __init__(self, env_id: str, env_args: dict[str, Any] | None = None, *, max_turns: int | None = None,
                 correct_metric: str | None = None):
        vf = import_verifiers()
        self.env, self.max_turns = load_verifiers_env(env_id, env_args, max_turns=max_turns)
        self.env_id = env_id
        self.correct_metric = correct_metric
        self.verifiers = VerifiersLoop(self.env)
        # The run's client: the endpoint above (no key: the variable stays unset).
        self.ctx = vf.ModelContext(model="saccade", client=vf.EvalClientConfig(
            base_url=self.verifiers.url, api_key_var="SACCADE_VERIFIERS_UNUSED_KEY"))
        self._tasks: list = []
        self._stream = iter(self.env.taskset)  # an endless taskset is read as far as asked

    def _task(self, index: int):
        self._tasks.extend(itertools.islice(self._stream, max(0, index + 1 - len(self._tasks))))
        return self._tasks[index]

    def _count(self) -> int:
        if self.env.taskset.bounded:
            self._tasks.extend(self._stream)
            return len(self._tasks)
        return 0  # endless

    def train_sample(self, position: int, *, seed: int) -> VerifiersSample:
        """Task `position` of the training stream: for a finite taskset every epoch a new seeded
        order, as for data sets; an endless one in its own order."""
        from saccade.data.datasets import shuffled_index

        count = self._count()
        if count == 0 and self.env.taskset.bounded:
            raise ValueError(f"verifiers environment {self.env_id!r}: its taskset has no tasks")
        index = shuffled_index(position, count, seed=seed) if count else position
        return VerifiersSample(f"vf{index}", self._task(index))

    def eval_samples(self, n: int) -> list[VerifiersSample]:
        count = self._count()
        return [VerifiersSample(f"vf-eval{i}", self._task(i)) for i in range(min(n, count) if count else n)]

    def make_env(self) -> VerifiersEnv:
        return VerifiersEnv(self)

    def close(self) -> None:
        self.verifiers.close()


class VerifiersEnv:
    """One episode of a verifiers environment, as a saccade environment (async methods).

    `reset` starts verifiers' episode and returns the first request's messages; `step` answers
    the pending request with the sampled reply and returns what the environment says next, or
    the scored end of the episode."""

    def __init__(self, task: VerifiersTask):
        self.task = task
        self.max_turns = task.max_turns
        self.episode: _Episode | None = None
        self.seen: list[Message] = []  # the last request's messages, as verifiers sent them
        self.ended: tuple | None = None  # the episode ended before the model's first turn

    async def reset(self, sample: VerifiersSample | Any) -> list[Message]:
        vtask = sample.task if isinstance(sample, VerifiersSample) else sample
        loop = self.task.verifiers
        self.episode = await loop.call(loop.start(vtask, self.task.ctx))
        # An episode saccade stops stepping (max_total_tokens) is cancelled when this env goes.
        weakref.finalize(self, loop.cancel, self.episode)
        event = await loop.call(loop.next_event(self.episode))
        if event[0] == "request":
            self.seen = event[1]
            return openai_messages(self.seen)
        # Failed before the model was asked (task setup, Env.run): as verifiers scores it, after
        # one sampled turn on the task's own prompt (saccade samples at least one).
        self.ended = event
        opening = task_prompt(vtask.data)
        if not opening:
            raise RuntimeError(f"verifiers environment {self.task.env_id!r}: the episode of task {vtask.data.idx} "
                               f"ended before its first model call, and the task has no prompt: {self._why(event)}")
        return opening

    async def step(self, assistant_message: Message) -> StepResult:
        if self.ended is not None:
            return self._finish(self.ended)
        text = message_text(assistant_message)
        loop = self.task.verifiers
        event = await loop.call(loop.next_event(self.episode, text))
        if event[0] != "request":
            return self._finish(event)
        messages, seen = event[1], len(self.seen) + 1
        if messages[:seen] != [*self.seen, {"role": "assistant", "content": text}]:
            raise ValueError(f"verifiers environment {self.task.env_id!r} rewrote earlier messages between two "
                             "model calls (e.g. a task whose prompt holds a system message as well as a "
                             "system_prompt: verifiers' resume drops the prompt's); saccade's trajectories only "
                             "append: the token ids already sampled are kept")
        self.seen = messages
        return StepResult(openai_messages(messages[seen:]), 0.0, False, {})

    def _why(self, event: tuple) -> str:
        if event[0] == "failed":
            return repr(event[1])
        errors = [*event[1].errors, *(e for t in event[1].traces for e in t.errors)]
        return f"{errors[-1].type}: {errors[-1].message}" if errors else "no error recorded"

    def _finish(self, event: tuple) -> StepResult:
        """The scored end: the trace's reward (verifiers' Trace.reward), each reward and metric."""
        if event[0] == "failed":
            raise RuntimeError(f"verifiers failed running an episode of {self.task.env_id!r}") from event[1]
        if self.episode.misuse is not None:
            raise self.episode.misuse
        result = event[1]
        traces = [t for t in result.traces if self.episode.traces and t.id == self.episode.traces[0]]
        info: dict[str, Any] = {}
        reward = 0.0
        if traces:
            [trace] = traces
            info.update({name: r.score for name, r in trace.rewards.items() if r is not None})
            info.update({name: v for name, v in trace.metrics.items() if v is not None})
            reward = float(trace.reward)
            info["stop_condition"] = trace.stop_condition
        info["reward"] = reward
        if not result.ok:
            info["error"] = self._why(event)
        if self.task.correct_metric is not None:
            if self.task.correct_metric not in info and result.ok:
                scored = sorted(k for k in info if k not in ("reward", "stop_condition"))
                raise ValueError(f"task.correct_metric {self.task.correct_metric!r}: verifiers environment "
                                 f"{self.task.env_id!r} has no such reward or metric; it scores {scored}")
            info["correct"] = float(info.get(self.task.correct_metric, 0.0))
        return StepResult([], reward, True, info)


def task_prompt(data) -> list[Message]:
    """A task's opening as saccade's messages: its system prompt, then its prompt."""
    from verifiers.v1.dialects.chat import message_to_wire

    messages: list[Message] = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [message_to_wire(m) for m in data.prompt]
    return messages


def openai_messages(messages: list[Message]) -> list[Message]:
    """Copies holding role and content only (what the chat template reads)."""
    return [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
