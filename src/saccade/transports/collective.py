"""Weights to the servers over a process group, no files (`engine.weight_sync.kind =
"collective"`), through vLLM's trainer-side interface, whatever the backend.

Every backend (`saccade.transports.backends`: saccade's gloo, vLLM's nccl, ipc, sparse_nccl,
nccl_m2n) is driven the same way: vLLM's `WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)` builds the trainer's engine for a group of servers, and each sync its
`send_weights()` drives a round: `/start_weight_update` (the servers pause generation: running
requests finish on the old weights, new ones queue), one `/update_weights` per layer group while
the bytes travel, `/finish_weight_update` {"version": k}. What is saccade's is here and in the two
modules beside it, once for every backend:

- what is sent (`saccade.transports.source`, over `saccade.trainer.transfer_plan`): the language
  model only, in the engine's names, layout and dtypes, layer group by layer group, one group
  materialized at a time (LoRA merged, a sharded model's shards gathered);
- the control plane (`saccade.transports.control`): the API key, the session and the rendezvous
  token, each server's ranks, the version;
- who joins and what a failure does (`CollectiveTransport`): the live servers and those that
  answer again (a restarted one gets the whole model with the others, then is put back); a
  server whose /saccade/info names another session (restarted, or taken over by another trainer)
  is joined again before the sync; a server that fails any phase is taken out and the sync goes
  on with the others: with a group per server (gloo) the others never noticed; with one group for
  all (nccl and the rest) the group is broken, so the others are joined again in a new one and
  sent the whole model, once; with none left, NoServerError. A server half-way through an update
  keeps generation paused until a complete one (`saccade.serving.transfer_routes`), so nothing
  samples a mix of versions.

A sharded trainer: every rank builds the transport; rank 0 talks to the servers and tells the
other ranks each pass (a broadcast), so that each goes through every group's gathers exactly as
often (and, for nccl_m2n, joins the group and sends its own shards).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from torch import nn

from saccade.distributed import SINGLE, World, broadcast
from saccade.inference.server_client import ServerClient, ServerError
from saccade.inference.servers import NoServerError
from saccade.serving.rendezvous import new_token
from saccade.serving.wire import INFO
from saccade.trainer.transfer_plan import GroupMaterializer
from saccade.transports.backends import backend_named
from saccade.transports.backends.base import Party, free_port
from saccade.transports.control import ServersSyncClient

log = logging.getLogger(__name__)


def trainer_address(urls: list[str], configured: str | None, layout_host: str | None = None) -> str:
    """The address the servers reach the trainer's rendezvous at: `configured`; else 127.0.0.1 when
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


@dataclass
class _Group:
    """One group the trainer is in: its servers, their control client and the trainer's engine."""

    servers: list
    control: ServersSyncClient
    engine: object

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(s.url for s in self.servers)


class _NoControl:
    """The control client of a rank other than 0: vLLM's engines call it only on the sender."""

    def init_weight_transfer_engine(self, init_info):
        raise RuntimeError("only rank 0 talks to the servers")

    start_weight_update = update_weights = finish_weight_update = init_weight_transfer_engine


class CollectiveTransport:
    """The trainer's end of the collective weight transfer to the servers of `client`, over
    `backend` (`engine.weight_sync.backend` resolved: saccade_gloo unless the servers offer another).

    `model`: the trainer's (PolicyLM or PeftModel; read, never changed). A sharded trainer makes
    one on every rank with its `world`: `sends` on rank 0 only."""

    adapter = False  # full weights: requests name the served model
    rejoins_at_sync = True  # a server that answers again gets the whole model from the next sync

    def __init__(self, client: ServerClient, model: nn.Module, base_model_path: str | Path, *,
                 address: str, timeout_s: float = 600.0, sends: bool = True, backend: str = "gloo",
                 world: World = SINGLE):
        self.client = client
        self.address = address
        self.timeout_s = timeout_s
        self.sends = sends  # False: a rank other than 0 of a sharded trainer (the gathers, and what rank 0 says)
        self.world = world
        self.backend = backend_named(backend)
        self.backend.register()
        self.weights = GroupMaterializer(model, base_model_path, computes=sends)
        self.source = self.backend.source(self.weights, model)
        self.groups: dict[tuple[str, ...], _Group] = {}  # the trainer's groups, by their servers' urls
        self.last: dict[str, float] = {}  # the last sync's figures (send's result)
        self._follower = None  # a rank other than 0: its engine
        # Our name for our groups: a server whose /saccade/info names another session was restarted, or
        # another trainer joined it since; it is joined again before the next sync.
        self.session = secrets.token_hex(8)
        # The rendezvous' key: sent to each server in its keyed /init_weight_transfer_engine request; gloo's
        # workers prove they hold it before any weight goes out (saccade.serving.rendezvous).
        self.token = new_token()

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes

    # --- joining ----------------------------------------------------------------------------
    def join(self, server) -> None:
        """Be in a group with `server` (`Server`) before the next sync: its own (gloo), or one with
        every live server (vLLM's backends). Raises what the join raised."""
        servers = [server] if self.backend.per_server else list(self.client.pool.alive)
        failed = self._join(servers, {s.url: self._info(s) for s in servers})
        if server.url in failed:
            raise ServerError(failed[server.url])

    def _info(self, server) -> dict:
        async def get():
            response = await self.client.http().get(server.url + INFO, headers=self.client.headers, timeout=30)
            response.raise_for_status()
            return response.json()
        return self.client.run(get())

    def _workers(self, server, info: dict) -> int:
        transfer = info.get("weight_transfer") or {}
        if transfer.get("backend") != self.backend.server_backend:
            raise ServerError(f"{server.url} offers the {transfer.get('backend')} weight transfer, not "
                              f"{self.backend.server_backend}: start it with --weight-transfer-config "
                              f"'{{\"backend\": \"{self.backend.server_backend}\"}}' (saccade launch does), or set "
                              'engine.weight_sync.kind = "files"')
        return int(transfer["workers"])

    def _join(self, servers: list, infos: dict[str, dict]) -> dict[str, str]:
        """Join groups for `servers` (those whose group is ours and current are kept); returns the
        servers that could not join, url -> why."""
        failed: dict[str, str] = {}
        workers: dict[str, int] = {}
        for server in servers:
            try:
                workers[server.url] = self._workers(server, infos[server.url])
            except Exception as err:  # noqa: BLE001 - that server is out, the others go on
                failed[server.url] = f"joining the weight transfer failed: {type(err).__name__}: {err}"[:300]
        ready = [s for s in servers if s.url in workers]
        current = {s.url for s in ready if (infos[s.url].get("weight_transfer") or {}).get("session") == self.session}
        wanted = [[s] for s in ready] if self.backend.per_server else ([ready] if ready else [])
        asked = {s.url for s in servers}
        for key in [k for k in self.groups if set(k) & asked and (list(k) not in [[s.url for s in w] for w in wanted]
                                                                 or not set(k) <= current)]:
            self._leave(self.groups.pop(key))  # a member gone, a new one, or a session not ours: joined anew
        for members in wanted:
            key = tuple(s.url for s in members)
            if key in self.groups:
                continue
            try:
                self.groups[key] = self._new_group(members, [workers[s.url] for s in members])
            except Exception as err:  # noqa: BLE001 - those servers are out, the others go on
                for s in members:
                    failed[s.url] = f"joining the weight transfer failed: {type(err).__name__}: {err}"[:300]
        return failed

    def _new_group(self, servers: list, workers: list[int]) -> _Group:
        """A group with `servers` through vLLM's trainer factory (the rendezvous is the backend's)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        control = ServersSyncClient(self.client, servers, workers, session=self.session, token=self.token)
        party = self._party(workers)
        if self.backend.all_ranks_join:
            self._tell({"join": party})  # every rank joins the group with rank 0
        try:
            engine = WeightTransferTrainerFactory.trainer_init(self.backend.init_info(party), client=control,
                                                               source=self._engine_source())
        except Exception as err:
            reasons = "; ".join(f"{u}: {why}" for u, why in control.failures.items())
            raise ServerError(f"{err}" + (f" ({reasons})" if reasons else "")) from err
        group = _Group(servers, control, engine)
        log.info("weight transfer: joined %s (%s, world %d, at %s)", ", ".join(group.urls), self.backend.name,
                 party.world_size, self.address)
        return group

    def _party(self, workers: list[int]) -> Party:
        """Rank 0's place in a new group with servers of `workers` workers each: the trainer's ranks
        are all in it only for a backend that every rank joins (nccl_m2n); else rank 0 alone."""
        ranks = self.world.size if self.backend.all_ranks_join else 1
        return Party(rank=0, trainer_ranks=ranks, address=self.address, workers=tuple(workers), token=self.token,
                     timeout_s=self.timeout_s, port=free_port(self.address) if self.backend.needs_port else 0)

    def _leave(self, group: _Group) -> None:
        try:
            group.engine.shutdown()
        except Exception:  # noqa: BLE001, S110 - a group that broke closes as it can
            pass

    def _tell(self, word) -> None:
        """Rank 0's word to the other ranks of a sharded trainer (`_follow` reads it)."""
        if self.world.size > 1:
            broadcast(word, self.world)

    # --- one sync ---------------------------------------------------------------------------
    def send(self, version: int) -> dict[str, float]:
        """One sync to every live server, and to every server that is out but answers again (it gets
        the whole model before it is put back). See the module note for failures; NoServerError when
        none took the weights. Returns seconds spent, in all and by phase (start: the servers paused
        and ready; finish: reload closed, caches reset, resumed; materialize: the groups made, within
        the stream), bytes sent per server and the servers that took them."""
        if not self.sends:
            return self._follow()
        start = time.perf_counter()
        materialized = self.source.materialize_s
        try:
            done = self._round(list(self.client.pool.alive) + self._answering_again(), version)
        finally:
            self._tell(None)  # the other ranks: no more passes
        if not done:
            raise NoServerError(f"{self.client.pool.describe_down()}; weights v{version} reached none. Start them "
                                "again (saccade serve MODEL ...) at the run's engine.urls")
        for server in done:
            server.versions_loaded.append(version)
            if server.alive:
                server.version = version
            elif self.client.put_back_after_sync(server, version):  # once the push check lets it in
                log.info("server %s is back in, with weights version %s (the whole model sent)", server.url, version)
        seconds = time.perf_counter() - start
        phases = [g.control.seconds for g in self.groups.values()]
        start_s = max((p["start_s"] for p in phases), default=0.0)
        finish_s = max((p["finish_s"] for p in phases), default=0.0)
        self.last = {"seconds": seconds, "start_s": start_s, "stream_s": seconds - start_s - finish_s,
                     "materialize_s": self.source.materialize_s - materialized, "finish_s": finish_s,
                     "bytes": float(self.nbytes), "servers": float(len(done))}
        return self.last

    def _round(self, servers: list, version: int) -> list:
        """The servers that took `version`: one pass, and for a broken group for all, one more with
        the servers that did not fail it, in a new group."""
        done: list = []
        for attempt in range(2):
            infos = {}
            for server in servers:
                try:
                    infos[server.url] = self._info(server)
                except Exception as err:  # noqa: BLE001 - that server is out, the others go on
                    self._take_out(server, f"joining the weight transfer failed: {type(err).__name__}: {err}"[:300])
            servers = [s for s in servers if s.url in infos]
            for url, why in self._join(servers, infos).items():
                self._take_out(self.client.pool.servers[url], why)
            groups = [g for g in self.groups.values() if all(s.url in infos for s in g.servers)]
            ok, again = self._pass(groups, version)
            done += ok
            if not again or attempt:
                for server in again:
                    self._take_out(server, "a second try in a new group failed too")
                break
            servers = again
            self.session = secrets.token_hex(8)  # a new group: the servers end the update the broken one left
        return done

    def _pass(self, groups: list[_Group], version: int) -> tuple[list, list]:
        """Every group's round (one inline; several at once, in threads, over one pass of the
        weights); returns the servers that took the weights and, from broken groups for all, the
        servers that did not fail (to try again)."""
        self._tell({"send": True})
        for group in groups:
            group.control.version = version
            group.control.failures.clear()
        errors = self._run_all(groups)
        ok, again = [], []
        for i, group in enumerate(groups):
            if i not in errors:
                ok += group.servers
                continue
            self._leave(self.groups.pop(group.urls, group))
            why = f"{type(errors[i]).__name__}: {errors[i]}"[:300]
            failed = group.control.failures
            for server in group.servers:
                if server.url in failed or self.backend.per_server or not failed:
                    self._take_out(server, f"the weight sync failed: {failed.get(server.url, why)}"[:300])
                else:
                    again.append(server)
        return ok, again

    def _run_all(self, groups: list[_Group]) -> dict[int, BaseException]:
        """Every group's round over one pass of the weights (one group in this thread, several in
        threads of their own); the errors by group. A sharded trainer's rank 0 then goes through the
        groups nobody asked for (a round that failed half way, or no group at all): the other ranks
        gather every group."""
        from saccade.transports.source import SharedGroups

        errors: dict[int, BaseException] = {}
        shared = SharedGroups(self.source, len(groups))

        def run(i: int) -> None:
            try:
                error = self._run(groups[i], shared.view(i))
                if error is not None:
                    errors[i] = error
            finally:
                shared.leave(i)
        if len(groups) == 1:
            run(0)
        else:
            threads = [threading.Thread(target=run, args=(i,), name=f"weight-sync-{i}") for i in range(len(groups))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        if self.world.size > 1:
            shared.drain()
        return errors

    def _run(self, group: _Group, source) -> BaseException | None:
        """One group's round; the error it raised, if any (a dead peer breaks only its own group)."""
        try:
            self.backend.send(group.engine, source)
        except Exception as err:  # noqa: BLE001 - that group's servers are handled by _pass
            return err
        return None

    def _follow(self) -> dict[str, float]:
        """A rank other than 0: do what rank 0 says until it says the sync is over."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        while (word := broadcast(None, self.world)) is not None:
            if "join" in word:
                if self._follower is not None:
                    self._follower.shutdown()
                party = replace(word["join"], rank=self.world.rank)
                self._follower = WeightTransferTrainerFactory.trainer_init(
                    self.backend.init_info(party), client=_NoControl(), source=self._engine_source())
                continue
            if self._follower is None:
                party = Party(rank=self.world.rank, trainer_ranks=self.world.size, address=self.address,
                              workers=(1,), token="", timeout_s=self.timeout_s)
                self._follower = WeightTransferTrainerFactory.trainer_init(
                    self.backend.init_info(party), client=_NoControl(), source=self._engine_source())
            self.backend.send(self._follower, self.source)
        return {}

    def _engine_source(self):
        return self.source if self.backend.takes_source else None

    # --- the pool ---------------------------------------------------------------------------
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
        """A server that failed: out of the pool and out of the transfer (its group is joined again,
        afresh, when it answers again)."""
        for key in [k for k in self.groups if server.url in k]:
            self._leave(self.groups.pop(key))
        if self.client.pool.take_out(server, why):
            log.warning("server %s taken out during a weight sync (%s); the others go on", server.url, why)
        else:
            server.last_error = why
