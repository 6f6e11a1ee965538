"""The `[engine]` section: a union picked by `kind`. The embedded engine samples in the trainer's
process from its very module; vLLM servers (`kind = "vllm"`) hold the servers' fields and
`weight_sync`, itself a union of the ways the trainer's weights reach them (`saccade.transports`,
one file a way), each with only its own fields.

This module imports only `saccade.config.sections` (the `Section` base).
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from saccade.config.sections import Section

ENGINE = "'embedded': sample in the trainer's process; 'vllm': vLLM server(s) at `urls`"
WEIGHT_SYNC = ("how the trainer's weights reach the vLLM servers: 'files' (a folder each server reads back), "
               "'adapter' (LoRA: only the adapter's folder), 'collective' (broadcast over a process group, no files), "
               "'auto' (the collective where it can be used, else files; the run says why). docs/vllm.md")


def model_mismatch_limit_field() -> Any:
    return Field(
        0.1, gt=0,
        description="at the first step, the mean |trainer - engine| logprob of the tokens sampled under the weights "
        "being trained above which the run stops: the two hold different models (a dtype or kernel difference "
        "gives about 1e-6 in fp32, 2e-3 to 5e-3 in bf16); the push check (engine.probe) holds each server's "
        "answer to it after every sync too; unset: never checked (saccade.model_match)",
    )


def image_mismatch_limit_field() -> Any:
    return Field(
        0.05, gt=0, le=10,
        description="the budget of the images' own trainer-engine gap: how far the mean |trainer - engine| logprob "
        "of tokens that follow an image may exceed the text-only tokens' (at lag 0; at a lag > 0 only where the "
        "step has text-only tokens at that lag too). Positions or a tower that differ between the two sides show "
        "there first. Past it: image_mismatch_action; the push check judges each server's probe by it too; "
        "unset: never checked (saccade.loops.guards.ImageMismatch)",
    )


def image_mismatch_action_field() -> Any:
    return Field(
        "warn",
        description="a training step whose images' gap is past image_mismatch_limit: 'warn' (logged, the run goes "
        "on) or 'stop' (the run stops once the step is logged, nothing saved)",
    )


def weights_dir_field(what: str) -> Any:
    return Field(
        None,
        description=f"folder where {what} for the vLLM servers are written (must be readable by every server: a "
        "shared filesystem for remote ones); default <run_dir>/engine-weights. Only the latest version is kept",
    )


# The collective's backends (saccade.transports.backends, one file each; a test holds the two lists equal).
BACKEND_NAMES = ("gloo", "nccl", "ipc", "sparse_nccl", "nccl_m2n")
Backend = Literal["auto", "gloo", "nccl", "ipc", "sparse_nccl", "nccl_m2n"]


def backend_field() -> Any:
    return Field(
        "auto",
        description="how the bytes travel: 'gloo' (saccade's: CPU tensors over TCP, anywhere; a group per server), "
        "'nccl' (vLLM's: the trainer and the servers on GPUs of their own, one group), 'ipc' (vLLM's: the trainer "
        "and its one server on one GPU), 'sparse_nccl' (vLLM's: only the weights that changed), 'nccl_m2n' "
        "(vLLM's: a sharded trainer's shards, nobody gathers); 'auto': the one the servers were started with "
        "(saccade launch picks it from the layout). vLLM's are untested here (no GPU). docs/vllm.md",
    )


def transfer_address_field() -> Any:
    return Field(
        None, min_length=1, max_length=255,
        description="the address of this machine the servers reach the trainer at (it opens a port there per "
        "server, bound to it); unset: 127.0.0.1 when every server is on this machine, else the host of the "
        "[launch] layout's node that runs rank 0",
    )


class FilesSyncConfig(Section):
    """Full weights (LoRA merged) written to a folder after each sync; every server reads it back."""

    kind: Literal["files"] = Field("files", description=WEIGHT_SYNC)
    weights_dir: str | None = weights_dir_field("the weights")


class AdapterSyncConfig(Section):
    """With LoRA, only the adapter (MBs, not the GBs of merged weights): written to a folder, each
    server loads it in place and samples with it (start them with --enable-lora --max-lora-rank >=
    lora.rank)."""

    kind: Literal["adapter"] = Field("adapter", description=WEIGHT_SYNC)
    weights_dir: str | None = weights_dir_field("the adapters")


class CollectiveSyncConfig(Section):
    """Full weights sent layer group by layer group over a process group the trainer forms with the
    servers' workers (vLLM's weight-transfer API, over `backend`); no files. Every server must reach
    this machine at `transfer_address`."""

    kind: Literal["collective"] = Field("collective", description=WEIGHT_SYNC)
    backend: Backend = backend_field()
    transfer_address: str | None = transfer_address_field()


class AutoSyncConfig(Section):
    """The collective where every server offers it and reaches this machine, else files; the run
    logs which it took and why."""

    kind: Literal["auto"] = Field("auto", description=WEIGHT_SYNC)
    backend: Backend = backend_field()
    transfer_address: str | None = transfer_address_field()
    weights_dir: str | None = weights_dir_field("the weights (when it falls back to files)")


WeightSyncConfig = Annotated[FilesSyncConfig | AdapterSyncConfig | CollectiveSyncConfig | AutoSyncConfig,
                             Field(discriminator="kind")]


class ProbeConfig(Section):
    """A check after every weight sync, on every server: each answers a small fixed probe (a few
    prompts with synthetic pictures and one text-only) with a few tokens sampled from a fixed
    seed and their logprobs, and the trainer scores the same tokens under the weights it just
    pushed. A server whose answer is far from the trainer's (a push that changed nothing, a stale
    or foreign model, an adapter with no effect, images placed otherwise) is taken out or stops
    the run, named with the push and the likely causes. A server that joins or rejoins mid-run is probed before it samples
    (saccade.loops.push_check, docs/vllm.md)."""

    every_syncs: int = Field(
        1, ge=0, le=100_000,
        description="probe every server after every k-th weight sync (the start's included; 1: every one); 0: "
        "never. A server that answers again waits, out, for a probed sync's weights before it is put back",
    )
    prompts: int = Field(2, ge=1, le=16, description="probe prompts with a picture, beside one text-only prompt")
    tokens: int = Field(
        8, ge=1, le=64,
        description="tokens each server samples after each probe prompt (temperature 1, a fixed seed); their "
        "logprobs, the server's and the trainer's, are what the check compares",
    )
    action: Literal["take_out", "stop"] = Field(
        "take_out",
        description="a server whose answer is far from the trainer's: 'take_out' (out of the pool; the run stops "
        "when none is left, saving its finished steps) or 'stop' (the run saves its finished steps and stops)",
    )


class EmbeddedEngineConfig(Section):
    """The embedded engine: samples in the trainer's process, from the trainer's very module (so
    always current: no weights to send)."""

    kind: Literal["embedded"] = Field("embedded", description=ENGINE)
    model_mismatch_limit: float | None = model_mismatch_limit_field()
    image_mismatch_limit: float | None = image_mismatch_limit_field()
    image_mismatch_action: Literal["warn", "stop"] = image_mismatch_action_field()
    # It shares the trainer's module: every step's weights are the engine's, as a sync every step.
    sync_every_steps: typing.ClassVar[int] = 1


class VLLMEngineConfig(Section):
    """vLLM servers (`saccade serve`) at `urls`: the trainer's weights go to them by `weight_sync`."""

    kind: Literal["vllm"] = Field("vllm", description=ENGINE)
    urls: list[str] = Field(
        default_factory=list, description="base URLs of the vLLM servers, e.g. http://localhost:8000"
    )
    timeout_s: float = Field(
        600.0, gt=0,
        description="timeout of one request to a vLLM server, seconds: a long generation may take this long (a "
        "server that stops answering /health is cut sooner: hang_after_s)",
    )
    max_concurrency: int = Field(64, ge=1, description="most requests in flight to the vLLM servers at once")
    sync_every_steps: int = Field(
        1, ge=1,
        description="push the trainer's weights to the vLLM servers after every k-th step (1: on-policy); "
        "rollouts in between are sampled from the last pushed policy, and each records its version",
    )
    health_interval_s: float = Field(
        2.0, ge=0,
        description="how often servers that were taken out (or failed to answer at the start) are probed; one "
        "that answers gets the current weights and is put back in. Servers with requests in flight are probed as "
        "often (hang_after_s). 0: never, neither",
    )
    no_server_wait_s: float = Field(
        60.0, ge=0,
        description="with every server out, how long a request waits for one to come back before the run saves "
        "a checkpoint and stops (then restart the servers and --resume)",
    )
    hang_after_s: float = Field(
        60.0, ge=1, le=3600,
        description="a server with requests in flight whose /health (asked every health_interval_s) has not "
        "answered for this long is taken out as hung and its requests go to the other servers; a slow server that "
        "answers keeps its long requests (timeout_s). The bound for a server started by hand, which nobody "
        "restarts; under `saccade launch`, launch.hang_after_s also restarts it. Seconds",
    )
    model_mismatch_limit: float | None = model_mismatch_limit_field()
    image_mismatch_limit: float | None = image_mismatch_limit_field()
    image_mismatch_action: Literal["warn", "stop"] = image_mismatch_action_field()
    weight_sync: WeightSyncConfig = Field(default_factory=FilesSyncConfig, description=WEIGHT_SYNC)
    probe: ProbeConfig = Field(
        default_factory=ProbeConfig,
        description="the check after every weight sync on every server, and before a server rejoins",
    )

    @model_validator(mode="after")
    def _urls(self) -> VLLMEngineConfig:
        if not self.urls:
            raise ValueError("kind 'vllm' needs at least one server in urls, e.g. urls = [\"http://localhost:8000\"], "
                             "or a [launch] layout whose servers they are (docs/launch.md)")
        for url in self.urls:
            if not re.match(r"^https?://[^/\s]+", url):
                raise ValueError(f"urls must be http(s)://host[:port] addresses, got {url!r}")
        return self


EngineConfig = Annotated[EmbeddedEngineConfig | VLLMEngineConfig, Field(discriminator="kind")]
