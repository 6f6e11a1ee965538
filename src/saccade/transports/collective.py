"""Weights to the servers over a process group, no files (`engine.weight_sync.kind =
"collective"`): the trainer's side of vLLM's weight-transfer protocol, on torch.distributed's gloo.
What is sent (names, dtypes, order, layer groups) is the trainer's: `saccade.trainer.transfer_plan`.

Per server, once (`CollectiveTransport.join`): the trainer opens a TCPStore on a free port of the
address the servers reach and asks the server (`/init_weight_transfer_engine`, with the run's
token) to join; the group is the trainer (rank 0) and the server's workers (ranks 1..N,
`/saccade/info`'s `weight_transfer.workers`), each of which proves it holds the token before any
weight is sent (`saccade.serving.rendezvous`). One group per server:
a server that dies breaks only its own. The trainer names its groups (a session id); a server
whose /saccade/info names another (restarted, or joined by another trainer since) is joined
again before the next sync, so no broadcast goes to a group nobody listens on.

Per sync (`CollectiveTransport.send`), on every live server together:
1. `/start_weight_update`: the server pauses generation (running requests finish on the old
   weights, new ones queue) and begins vLLM's layerwise reload.
2. For each layer group (`saccade.trainer.transfer_plan`: the tensors outside the decoder
   layers, then layer 0, 1, ...): the group's names, dtypes and shapes go in a `/update_weights`
   request, and while the servers wait in it the trainer broadcasts the group's bytes, one buffer
   per group, materialized one group at a time (LoRA merged in).
3. `/finish_weight_update` {"version": k}: the server ends the reload, reports version k in the
   policy-version header from then on, and resumes generation.
The server side is `saccade.serving.transfer` (the engine) and `saccade.serving.transfer_routes` (routes).

Failures: a server that fails any phase (refuses, drops its connection, dies mid-stream: its
broadcast raises, in its own group only) is taken out and the sync goes on with the others. A
server mid-update keeps generation paused (`saccade.serving.transfer_routes`): nothing samples a mix of
versions. A server that answers again (restarted by the launcher, or a new one) is not put back
by the health check: the next sync joins it under a fresh rendezvous, sends it the whole model
with the others, and puts it back at that version.

Simplified here, for now: gloo carries the bytes also between GPU machines (vLLM's nccl backend
is the fast path there, not wired yet); rank 0 alone sends (its gathered groups go out from
one process, as the folder export writes from one).
"""

from __future__ import annotations

import datetime
import logging
import secrets
import time
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn

from saccade.inference.server_client import ServerClient, ServerError
from saccade.inference.servers import NoServerError
from saccade.serving.rendezvous import challenge_peers, listening_store, new_token
from saccade.serving.wire import (
    FINISH_UPDATE, GLOO_BACKEND, INFO, INIT_TRANSFER, START_UPDATE, TRANSFER_STORE_PREFIX, UPDATE_WEIGHTS,
)
from saccade.trainer.transfer_plan import GroupMaterializer, Outgoing

log = logging.getLogger(__name__)


def trainer_address(urls: list[str], configured: str | None, layout_host: str | None = None) -> str:
    """The address the servers reach the trainer's TCPStore at: `configured`; else 127.0.0.1 when
    every server is on this machine; else `layout_host`, the host of rank 0's node in the
    `[launch]` layout (`saccade.run.setup`); ValueError otherwise (the run then syncs through
    files)."""
    from urllib.parse import urlparse

    from saccade.config import is_loopback

    if configured:
        return configured
    hosts = [urlparse(u).hostname or "" for u in urls]
    if all(is_loopback(h) for h in hosts):
        return "127.0.0.1"
    if layout_host and not is_loopback(layout_host):
        return layout_host
    raise ValueError(f"the servers ({', '.join(sorted(set(hosts)))}) are not all on this machine: set "
                     "engine.weight_sync.transfer_address to an address of this machine they can reach")


class CollectiveTransport:
    """The trainer's end of the collective weight transfer to the servers of `client`.

    `model`: the trainer's (PolicyLM or PeftModel; read, never changed). A sharded trainer makes
    one on every rank: `sends` on rank 0 only, which talks to the servers; every rank gathers each
    layer group's shards together (one all-gather per tensor), so no rank holds more than one
    group whole. Rank 0 goes through every group's gathers whatever the servers do (a failing
    server is taken out, never raised mid-stream), so the other ranks are never left in a gather."""

    adapter = False  # full weights: requests name the served model
    rejoins_at_sync = True  # a server that answers again gets the whole model from the next sync

    def __init__(self, client: ServerClient, model: nn.Module, base_model_path: str | Path, *,
                 address: str, timeout_s: float = 600.0, sends: bool = True):
        self.client = client
        self.address = address
        self.timeout_s = timeout_s
        self.sends = sends  # False: a rank other than 0 of a sharded trainer (the gathers only)
        self.weights = GroupMaterializer(model, base_model_path, computes=sends)
        self.groups_by_server: dict[str, object] = {}  # url -> its ProcessGroupGloo
        self.stores: dict[str, object] = {}  # url -> the TCPStore its group met at
        self.last: dict[str, float] = {}  # the last sync's seconds by phase (send's result)
        # Our name for our groups: a server whose /saccade/info names another session was restarted,
        # or another trainer joined it since; it is joined again before the next sync.
        self.session = secrets.token_hex(8)
        # The rendezvous' key: sent to each server in its keyed /init_weight_transfer_engine request; a
        # peer in the group that cannot prove it holds it is refused before any weight goes out.
        self.token = new_token()

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    def _post(self, path: str, body: dict | None, server) -> Future:
        return self.client.submit(self.client.post(path, json_body=body, server=server, once=True))

    def join(self, server) -> None:
        """Rendezvous with one server's workers (`Server`), unless its group is ours already."""
        import torch.distributed as dist

        info = self.client.run(self._info(server))
        transfer = info.get("weight_transfer")
        if server.url in self.groups_by_server and (transfer or {}).get("session") == self.session:
            return
        self.groups_by_server.pop(server.url, None)
        self.stores.pop(server.url, None)
        if not transfer or transfer.get("backend") != GLOO_BACKEND:
            raise ServerError(f"{server.url} offers no {GLOO_BACKEND} weight transfer ({transfer}): restart it with "
                              "this saccade's `saccade serve`, or set engine.weight_sync.kind = \"files\"")
        world = 1 + int(transfer["workers"])
        timeout = datetime.timedelta(seconds=self.timeout_s)
        # Bound to the address the servers reach, on a port the OS picks (saccade.serving.rendezvous).
        store = listening_store(self.address, world, timeout)
        port = store.port
        asked = self._post(INIT_TRANSFER, {"init_info": {
            "master_address": self.address, "master_port": port, "world_size": world, "timeout_s": self.timeout_s,
            "session": self.session, "token": self.token,
        }}, server)
        try:  # blocks until the server's workers have joined; then each proves it holds the token
            group = dist.ProcessGroupGloo(dist.PrefixStore(TRANSFER_STORE_PREFIX, store), 0, world, timeout)
            challenge_peers(group, self.token, world)
        except Exception:
            if asked.done():
                asked.result()  # the server's reason, if it gave one
            raise
        asked.result()
        self.groups_by_server[server.url] = group
        self.stores[server.url] = store  # kept as long as the group
        log.info("weight transfer: joined %s (gloo, world %d, store %s:%d)", server.url, world, self.address, port)

    async def _info(self, server) -> dict:
        response = await self.client.http().get(server.url + INFO, headers=self.client.headers, timeout=30)
        response.raise_for_status()
        return response.json()

    def send(self, version: int) -> dict[str, float]:
        """One sync to every live server, and to every server that is out but answers again (a
        restarted one: it gets the whole model before it is put back). A server that fails in any
        phase (refuses, drops its connection, dies mid-stream) is taken out and the others go on;
        NoServerError when none took the weights. See the module note. Returns seconds spent, in
        all and by phase (start: the servers paused and ready; stream: the groups materialized and
        broadcast; finish: reload closed, caches reset, resumed), and bytes sent per server."""
        if not self.sends:
            self.weights.gather_only()  # this rank's part of the gathers; rank 0 sends
            return {}
        start = time.perf_counter()
        servers = self._joined(list(self.client.pool.alive) + self._answering_again())
        servers = self._phase(START_UPDATE, None, servers)
        started = time.perf_counter()
        materialize_s = 0.0
        for group in self.weights.groups:  # every group, with servers left or not: the other ranks gather too
            t0 = time.perf_counter()
            buffer = self.weights.materialize(group)
            materialize_s += time.perf_counter() - t0
            if servers:
                servers = self._stream(group, buffer, servers)
        streamed = time.perf_counter()
        servers = self._phase(FINISH_UPDATE, {"version": version}, servers)
        if not servers:
            raise NoServerError(f"{self.client.pool.describe_down()}; weights v{version} reached none. Start them "
                                "again (saccade serve MODEL ...) at the run's engine.urls")
        for server in servers:
            server.versions_loaded.append(version)
            if server.alive:
                server.version = version
            elif self.client.put_back_after_sync(server, version):  # once the push check lets it in
                log.info("server %s is back in, with weights version %s (the whole model sent)", server.url, version)
        end = time.perf_counter()
        self.last = {"seconds": end - start, "start_s": started - start, "stream_s": streamed - started,
                     "materialize_s": materialize_s, "finish_s": end - streamed, "bytes": float(self.nbytes),
                     "servers": float(len(servers))}
        return self.last

    def _answering_again(self) -> list:
        """The servers that are out but answer and may come back (`ServerClient.fit_to_rejoin`)."""
        back = []
        for server in self.client.pool.down:
            try:
                self.client.run(self.client.fit_to_rejoin(server))
            except Exception as err:  # noqa: BLE001 - still out: the health check keeps asking
                server.last_error = f"{type(err).__name__}: {err}"[:300]
                continue
            back.append(server)
        return back

    def _take_out(self, server, why: str) -> None:
        """A server that failed a phase: out of the pool and out of the transfer (its group is joined
        again, under a fresh rendezvous, when it answers again)."""
        self.groups_by_server.pop(server.url, None)
        self.stores.pop(server.url, None)
        if self.client.pool.take_out(server, why):
            log.warning("server %s taken out during a weight sync (%s); the others go on", server.url, why)
        else:
            server.last_error = why

    def _joined(self, servers: list) -> list:
        """The servers in a process group with this trainer (joined now where needed)."""
        ok = []
        for server in servers:
            try:
                self.join(server)
            except Exception as err:  # noqa: BLE001 - that server is out, the others take the weights
                self._take_out(server, f"joining the weight transfer failed: {type(err).__name__}: {err}"[:300])
                continue
            ok.append(server)
        return ok

    def _phase(self, path: str, body: dict | None, servers: list) -> list:
        """One phase on every server together; those that fail it are taken out."""
        return self._answered([(s, self._post(path, body, s)) for s in servers], f"{path} failed")

    def _stream(self, group: list[Outgoing], buffer: torch.Tensor, servers: list) -> list:
        """One layer group to every server: each waits in its /update_weights while the trainer
        broadcasts the bytes in its process group."""
        import torch.distributed as dist

        meta = {"names": [i.name for i in group], "dtype_names": [str(i.dtype).removeprefix("torch.") for i in group],
                "shapes": [list(i.shape) for i in group]}
        asked = [(s, self._post(UPDATE_WEIGHTS, {"update_info": meta}, s)) for s in servers]
        sent = []
        for server, future in asked:
            try:
                if future.done():
                    future.result()  # refused before the broadcast: say why instead of waiting for a peer
                self.groups_by_server[server.url].broadcast([buffer], dist.BroadcastOptions()).wait()
            except Exception as err:  # noqa: BLE001 - a dead peer breaks only its own group
                self._take_out(server, f"streaming the weights failed: {type(err).__name__}: {err}"[:300])
                continue
            sent.append((server, future))
        # The servers whose /update_weights for the group returned: the group loaded there.
        return self._answered(sent, "loading the weights failed")

    def _answered(self, asked: list[tuple[object, Future]], failed: str) -> list:
        """The servers whose request returned; each of the others is taken out, `failed` and its error said."""
        ok = []
        for server, future in asked:
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - that server is out, the others go on
                self._take_out(server, f"{failed}: {type(err).__name__}: {err}"[:300])
                continue
            ok.append(server)
        return ok
