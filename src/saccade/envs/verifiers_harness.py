"""The harness saccade plays verifiers environments with: one chat call per segment, in process.

verifiers (0.4, its v1 API) runs an agent as a harness program whose model calls go to the
rollout's interception endpoint, which records each turn in the trace, applies the task's
`@vf.stop` conditions and turn limits, and forwards the call to the run's model client. Its
tool-less harness, `null`, is a PEP 723 script that uv installs (from the network, at first
use) and starts as a subprocess for every segment. saccade samples text, never tool calls, so
its harness is one step of that loop, in process: the conversation so far (the task's prompt;
on resume, the trace's branch and the user's new messages, as verifiers' `Harness.resume`
builds it) goes to the endpoint as one chat completion, and the reply ends the segment.

verifiers finds a harness by its id, as an importable top-level module that exports one
`Harness` subclass in `__all__` (verifiers/v1/utils/loaders.py), so the adapter enters this
module in `sys.modules` as `saccade_chat` (`HARNESS_ID = "saccade-chat"`). Importing it imports
verifiers: only `saccade.envs.verifiers_env` does, when an adapter is made.
"""

from __future__ import annotations

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire  # what verifiers' own chat harnesses send

__all__ = ["SaccadeChatHarness"]

HARNESS_ID = "saccade-chat"
HARNESS_MODULE = "saccade_chat"  # what verifiers imports for HARNESS_ID ('-' as '_')


class SaccadeChatHarness(vf.Harness[vf.HarnessConfig]):
    """One segment = one chat completion through the interception endpoint; no tools."""

    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt is its own message
    SUPPORTS_RESUME = True  # verifiers' default resume: relaunch on the accreted conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [vf.SystemMessage(content=system)] if system else []
        messages += [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
        body = {"model": ctx.model, "messages": [message_to_wire(m) for m in messages]}
        async with httpx.AsyncClient(timeout=None) as client:
            response = await client.post(f"{endpoint.rstrip('/')}/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {secret}"})
        # A refused turn (a limit, a @vf.stop) answers 400 with the trace already stopped:
        # verifiers then reads the exit as the end of the exchange, not as a harness failure.
        if response.status_code >= 400:
            return vf.ProgramResult(1, "", response.text)
        return vf.ProgramResult(0, response.text, "")
