"""The control plane of a collective sync: vLLM's `VLLMWeightSyncClient` (the four phases a
trainer engine drives) over saccade's HTTP client, for the servers of one group.

Every trainer engine, saccade's gloo one and vLLM's (nccl, ipc, sparse_nccl, nccl_m2n), talks to
the servers only through this client, so what saccade adds is here once for all of them:
- the run's API key on every request (the `ServerClient`'s headers);
- on `/init_weight_transfer_engine`: the trainer's session (its name for its groups: a server
  whose /saccade/info names another is joined again) and the rendezvous token (the workers of
  saccade's gloo engine prove they hold it: `saccade.serving.rendezvous`), and, when the group holds
  several servers, each server's own first rank (`rank_offset` + the workers of the servers before
  it: a server's workers number themselves from its `rank_offset`);
- on `/finish_weight_update`: the policy version the weights are (`version`), which the server
  then names in the version header;
- each phase goes to every server of the group together; a server whose request fails is
  recorded in `failures` (url -> why) and the call raises `ServerError` naming it, so the engine
  stops and `saccade.transports.collective` takes out exactly the servers that failed.
"""

from __future__ import annotations

import time
from typing import Any

from saccade.inference.server_client import ServerClient, ServerError
from saccade.serving.wire import FINISH_UPDATE, INIT_TRANSFER, SHUTDOWN_TRANSFER, START_UPDATE, UPDATE_WEIGHTS


class ServersSyncClient:
    """`VLLMWeightSyncClient` for `servers` (`Server`s of the pool), whose workers number `workers`
    (one count per server), as the module note says."""

    def __init__(self, client: ServerClient, servers: list, workers: list[int], *, session: str, token: str):
        if len(servers) != len(workers):
            raise ValueError(f"{len(servers)} servers but {len(workers)} worker counts")
        self.client, self.servers, self.workers = client, list(servers), list(workers)
        self.session, self.token = session, token
        self.version: int | None = None  # what /finish_weight_update names, unless the engine passes one
        self.failures: dict[str, str] = {}  # url -> why, this group's failed requests
        self.seconds = {"start_s": 0.0, "finish_s": 0.0}  # the last sync's phases, as the servers answered

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _all(self, path: str, bodies: list[dict | None]) -> None:
        """POST `path` to every server (its own body), all together; ServerError naming those that failed."""
        asked = [(server, self.client.submit(self.client.post(path, json_body=body, server=server, once=True)))
                 for server, body in zip(self.servers, bodies, strict=True)]
        failed = []
        for server, future in asked:
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - recorded, and said in the error raised below
                why = f"{path}: {type(err).__name__}: {err}"[:300]
                self.failures.setdefault(server.url, why)
                failed.append(f"{server.url} {why}")
        if failed:
            raise ServerError("; ".join(failed))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        bodies, before = [], 0
        for workers in self.workers:
            info = {**init_info, "session": self.session, "token": self.token}
            if "rank_offset" in init_info:  # this server's workers come after the servers' before it
                info["rank_offset"] = int(init_info["rank_offset"]) + before
            before += workers
            bodies.append({"init_info": info})
        self._all(INIT_TRANSFER, bodies)

    def start_weight_update(self) -> None:
        t0 = time.perf_counter()
        self._all(START_UPDATE, [None] * len(self.servers))
        self.seconds["start_s"] = time.perf_counter() - t0

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.clients import _json_safe_update_payload

        body = {"update_info": _json_safe_update_payload(update_info)}  # IPC handles pickled, as vLLM's client does
        self._all(UPDATE_WEIGHTS, [body] * len(self.servers))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = int(weight_version) if weight_version is not None else self.version
        t0 = time.perf_counter()
        self._all(FINISH_UPDATE, [None if version is None else {"version": version}] * len(self.servers))
        self.seconds["finish_s"] = time.perf_counter() - t0

    def shutdown_weight_transfer_engine(self) -> None:
        """Leave the group, where the servers still answer (best effort: a server gone has left)."""
        try:
            self._all(SHUTDOWN_TRANSFER, [None] * len(self.servers))
        except ServerError:
            pass
