"""Environments from the `verifiers` package (classic 0.1.x API) run as saccade environments.

A verifiers `MultiTurnEnv` runs its own loop: it asks an OpenAI client for each assistant turn,
then `env_response(messages, state)` for the environment's reply, until one of its `@vf.stop`
conditions (max_turns, errors, its own) holds, and its rubric scores the rollout. Here saccade's
engine takes the client's place and the loop is cut at the model call: `reset` starts verifiers'
state and gives its prompt; `step` records the sampled turn in that state and runs the rest of one
loop iteration (stop conditions, then `get_prompt_messages`, which calls `env_response`). When the
episode ends the rubric scores it the way verifiers' own `run_rollout` does, so the reward is the
rubric's total and the info holds each function's score.

Messages stay in OpenAI format. Images are `image_url` parts with data URLs, which saccade's
message code already loads (`saccade.data.images.load_image`, with the run's `ImagesConfig`), so
they are passed on as they are. verifiers is imported only when an adapter is made: it is a dev
dependency of saccade (the tests run it), never a runtime one.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from saccade.envs.base import Message, StepResult, message_text

# The release the adapter is written against and tested with (pyproject's dev group says why).
VERIFIERS_VERSION = "0.1.10"


def import_verifiers():
    """The verifiers module, or an ImportError that says how to install the tested release."""
    hint = f"pip install verifiers=={VERIFIERS_VERSION} (in a saccade checkout: uv sync --group dev)"
    try:
        import verifiers
    except ImportError as err:
        raise ImportError(f"saccade.envs.verifiers_env needs the `verifiers` package, which is not "
                          f"installed: {hint}") from err
    if not hasattr(verifiers, "MultiTurnEnv"):  # 0.4 and later: only the v1 harness/taskset stack
        raise ImportError(f"saccade.envs.verifiers_env needs verifiers' classic MultiTurnEnv API, which "
                          f"verifiers {getattr(verifiers, '__version__', '?')} does not have: {hint}")
    return verifiers


def verifiers_module_name(env_id: str) -> str:
    """The module verifiers' `load_environment(env_id)` imports (verifiers 0.1.10,
    utils/env_utils.py): the id with '-' as '_', after any "owner/" prefix."""
    return env_id.replace("-", "_").split("/")[-1]


def check_verifiers_env(env_id: str) -> None:
    """That `verifiers` and the env's module can be found, without importing either (verifiers
    takes seconds to import; the env's module imports it). ValueError saying what to install."""
    if importlib.util.find_spec("verifiers") is None:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r} needs the `verifiers` package: pip install "
                         f"verifiers=={VERIFIERS_VERSION} (in a saccade checkout: uv sync --group dev)")
    module = verifiers_module_name(env_id)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ValueError(f"task.env_id: verifiers environment {env_id!r}: no module {module!r} on sys.path. "
                         f"Install the environment's package (verifiers' `vf-install {env_id}`), or put the "
                         f"folder holding {module}.py on PYTHONPATH")


def load_verifiers_env(env_id: str, args: dict[str, Any] | None = None):
    """The environment verifiers' own `load_environment(env_id, **args)` builds (it imports the
    module named like the id, '-' as '_', and calls its `load_environment`). What `task.kind =
    "verifiers"` runs: `task.env_id`, with `task.env_args` as the keyword arguments.

    Building a verifiers Environment installs its own SIGINT and SIGTERM handlers (teardown,
    then KeyboardInterrupt or exit 143)."""
    vf = import_verifiers()
    env = vf.load_environment(env_id, **(args or {}))
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(f"task.env_id: verifiers environment {env_id!r} is a {type(env).__name__}; saccade runs "
                         "verifiers MultiTurnEnv environments (SingleTurnEnv, ToolEnv, ... are ones)")
    return env


@dataclass
class VerifiersSample:
    """One row of a verifiers dataset (prompt or question, answer, info, task, example_id)."""

    sample_id: str  # RL names episodes and training samples by it
    row: dict[str, Any]


class VerifiersEnv:
    """One episode of a verifiers MultiTurnEnv, as a saccade environment (async methods).

    Many of these may share one verifiers env: verifiers keeps everything about a rollout in its
    `state`, which lives here, one per episode. `max_turns` is the verifiers env's own (its
    `max_turns_reached` stop); an env without one (-1) needs `max_turns` given, since saccade
    bounds every episode. `correct_metric` names the rubric function whose score saccade counts
    as success (`info["correct"]`, read by RL's accuracy metrics)."""

    def __init__(self, env, *, max_turns: int | None = None, correct_metric: str | None = None):
        vf = import_verifiers()
        if not isinstance(env, vf.MultiTurnEnv):
            raise TypeError(f"expected a verifiers MultiTurnEnv (SingleTurnEnv is one), got {type(env).__name__}")
        if env.message_type != "chat":
            raise ValueError("verifiers completion-format envs give text prompts; saccade runs chat messages")
        own = env.max_turns if env.max_turns > 0 else None
        if own is None and max_turns is None:
            raise ValueError("this verifiers env has no max_turns (-1): pass max_turns, saccade bounds every episode")
        self.max_turns = min(t for t in (own, max_turns) if t is not None)
        self.env = env
        self.vf = vf
        self.correct_metric = correct_metric
        self.state = None
        self.prompt: list[Message] = []  # what the model sees this turn, as verifiers holds it

    async def reset(self, sample: VerifiersSample | dict[str, Any]) -> list[Message]:
        row = sample.row if isinstance(sample, VerifiersSample) else sample
        # No client: saccade's engine answers instead. init_state copies the row.
        state = await self.env.init_state(rollout_input(self.env, row), client=None, model="saccade")
        try:
            state = await self.env.setup_state(state)
        except self.vf.Error as err:
            # As in verifiers' loop: recorded, and the `has_error` stop ends the episode. Here that
            # happens after the first sampled turn (saccade samples at least one).
            state["error"] = err
        self.state = state
        self.prompt = list(state["prompt"])
        return openai_messages(self.prompt)

    async def step(self, assistant_message: Message) -> StepResult:
        env, state = self.env, self.state
        text = message_text(assistant_message)
        if not text:
            # verifiers refuses an empty model response (EmptyModelResponseError): the turn is not
            # recorded, the `has_error` stop ends the rollout, and the rubric scores the rest.
            state["error"] = self.vf.EmptyModelResponseError("Model returned no content and did not call any tools")
            await env.is_completed(state)
            return await self._finish()
        # The turn as verifiers records a model response (plain text: saccade samples no tool calls).
        completion = [{"role": "assistant", "content": text}]
        await env.add_trajectory_step(state, {
            "prompt": self.prompt, "completion": completion, "response": None, "tokens": None,
            "reward": None, "advantage": None, "is_truncated": False,
            "trajectory_id": state["trajectory_id"], "extras": {},
        })
        if await env.is_completed(state):  # every @vf.stop condition, max_turns_reached included
            return await self._finish()
        if len(state["trajectory"]) >= self.max_turns:
            # Only when saccade's max_turns is below the env's: saccade will not sample again, so
            # end the rollout here, as verifiers ends one cut short (cleanups run, then scoring).
            state.update(is_completed=True, is_truncated=True, stop_condition="saccade_max_turns")
            await env._cleanup(state)
            return await self._finish()
        try:
            prompt = await env.get_prompt_messages(state)  # calls env_response
        except self.vf.Error as err:
            state["error"] = err
            prompt = None
        if state.get("error") is not None or state.get("final_env_response") is not None:
            await env.is_completed(state)  # `has_error` or `has_final_env_response`: records why, cleans up
            return await self._finish()
        seen = len(self.prompt) + len(completion)
        if prompt[:seen] != self.prompt + completion:
            raise ValueError(f"{type(env).__name__}.get_prompt_messages rewrote earlier messages; saccade's "
                             "trajectories only append (the token ids already sampled are kept)")
        self.prompt = list(prompt)
        return StepResult(openai_messages(prompt[seen:]), 0.0, False, {})

    async def _finish(self) -> StepResult:
        """Score the finished rollout as verifiers' run_rollout does; the rubric's total is the reward."""
        env, state = self.env, self.state
        await env.render_completion(state)  # state["completion"], what the reward functions read
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        metrics = {name: float(value) for name, value in (state.get("metrics") or {}).items()}
        reward = float(state.get("reward") or 0.0)
        info: dict[str, Any] = {**metrics, "reward": reward, "stop_condition": state.get("stop_condition")}
        if state.get("error") is not None:
            info["error"] = repr(state["error"])
        if self.correct_metric is not None:
            info["correct"] = metrics[self.correct_metric]
        return StepResult([], reward, True, info)


def rollout_input(env, row: dict[str, Any]) -> dict[str, Any]:
    """A verifiers RolloutInput from a dataset row. Rows of `env.get_dataset()` already have their
    prompt; a raw row with a `question` gets the prompt verifiers would build for it (system
    prompt, few-shot messages, the question as the user turn)."""
    row = dict(row)
    if "prompt" not in row:
        prompt = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        row["prompt"] = [*prompt, *(env.few_shot or []), {"role": "user", "content": row["question"]}]
    elif env.system_prompt and (not row["prompt"] or row["prompt"][0].get("role") != "system"):
        row["prompt"] = [{"role": "system", "content": env.system_prompt}, *row["prompt"]]
    row.setdefault("example_id", 0)
    return row


def openai_messages(messages: list[Message]) -> list[Message]:
    """Copies with the None fields dropped from content parts: a Hugging Face dataset unifies the
    parts' schema, so a text part carries "image_url": None and an image part "text": None."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [{k: v for k, v in p.items() if v is not None} if isinstance(p, dict) else p for p in content]
        out.append({"role": message["role"], "content": content})
    return out


@dataclass
class VerifiersTask:
    """A verifiers env as an RL task (the interface `saccade.rl` reads: train_sample, eval_samples,
    make_env, max_turns). Rows come from the env's dataset; the held-out ones from its eval
    dataset (verifiers falls back to the training one when it has none)."""

    env: Any  # a verifiers MultiTurnEnv, shared by every episode's VerifiersEnv
    max_turns: int | None = None
    correct_metric: str | None = None

    def __post_init__(self):
        self.max_turns = self.make_env().max_turns  # the bound the episodes will have

    def train_sample(self, position: int, *, seed: int) -> VerifiersSample:
        """Row ``position`` of the training stream: every epoch a new seeded order, as for data sets."""
        from saccade.data.datasets import shuffled_index

        rows = self.env.get_dataset()  # without n/seed: get_dataset(seed=...) shuffles the env's copy in place
        index = shuffled_index(position, len(rows), seed=seed)
        return VerifiersSample(f"vf{index}", dict(rows[index]))

    def eval_samples(self, n: int) -> list[VerifiersSample]:
        rows = self.env.get_eval_dataset()
        return [VerifiersSample(f"vf-eval{i}", dict(rows[i])) for i in range(min(n, len(rows)))]

    def make_env(self) -> VerifiersEnv:
        return VerifiersEnv(self.env, max_turns=self.max_turns, correct_metric=self.correct_metric)
