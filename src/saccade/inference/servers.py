"""The vLLM servers a run samples from, as the client sees them: which answer, how busy each is,
which weights each holds, and what failed.

Pure bookkeeping with no I/O, so the routing and failure rules are tested without a server;
`VLLMEngine` does the HTTP on its one event loop and tells the pool what happened.

- Routing: a request goes to the live server with the fewest requests in flight (ties:
  round-robin).
- Failure: a server that refuses a connection, drops one, or times out is taken out at once;
  its request is rerouted to another live server. A 5xx is retried (with backoff) without
  taking the server out: it answered, the request may be what is wrong.
- Rejoining: the engine's health check probes servers that are out; one that answers gets the
  current weights and is put back.
- Silence: a live server with requests in flight is probed too (`probed`); one that has not
  answered for the client's bound since its first unanswered probe is taken out by the client,
  which cuts its requests in flight. Only busy servers are watched, so a silence noted while
  busy is forgotten once nothing is in flight.
- Idle time: each server's seconds with nothing in flight, the engine-side half of the overlap
  that async rollouts buy.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field


class NoServerError(RuntimeError):
    """No vLLM server of the run answers any more."""


@dataclass
class Server:
    url: str
    alive: bool = True
    in_flight: int = 0
    version: int | None = None  # the weights version it confirmed loading; None: not known
    versions_loaded: list[int] = field(default_factory=list)  # every version it confirmed, in order
    requests: int = 0  # HTTP requests sent to it
    last_error: str = ""
    # When the first /health probe that went unanswered since its last answer was sent; None while
    # it answers (or while nothing is in flight: only a busy server is watched).
    silent_since: float | None = None
    idle_s: float = 0.0  # seconds with nothing in flight while alive, until idle_since
    idle_since: float | None = field(default_factory=time.perf_counter)  # None while busy or out


@dataclass
class PoolCounters:
    """Since the pool was made; a step's figures are differences of two snapshots."""

    requests: int = 0
    retried: int = 0  # attempts after a 5xx
    rerouted: int = 0  # requests sent again to another server after theirs failed
    taken_out: int = 0
    rejoined: int = 0


class ServerPool:
    def __init__(self, urls: list[str], *, clock=time.perf_counter):
        self.servers = {url: Server(url, idle_since=clock()) for url in urls}
        self.counters = PoolCounters()
        self._turn = itertools.count()
        self._clock = clock

    @property
    def alive(self) -> list[Server]:
        return [s for s in self.servers.values() if s.alive]

    @property
    def down(self) -> list[Server]:
        return [s for s in self.servers.values() if not s.alive]

    @property
    def busy(self) -> list[Server]:
        """The live servers with requests in flight: those whose silence costs a request."""
        return [s for s in self.alive if s.in_flight]

    def now(self) -> float:
        return self._clock()

    def pick(self, exclude: set[str] = frozenset()) -> Server:
        """The live server with the fewest requests in flight; NoServerError when none is live."""
        live = [s for s in self.alive if s.url not in exclude] or self.alive
        if not live:
            raise NoServerError(self.describe_down())
        least = min(s.in_flight for s in live)
        candidates = [s for s in live if s.in_flight == least]
        return candidates[next(self._turn) % len(candidates)]

    def begin(self, server: Server) -> None:
        if server.in_flight == 0 and server.idle_since is not None:
            server.idle_s += self._clock() - server.idle_since
            server.idle_since = None
        server.in_flight += 1
        server.requests += 1

    def end(self, server: Server) -> None:
        server.in_flight -= 1
        if server.in_flight == 0:
            server.silent_since = None  # nothing in flight: not watched, and a later request starts afresh
            if server.alive:
                server.idle_since = self._clock()

    def probed(self, server: Server, *, answered: bool, asked_at: float) -> float:
        """A /health probe of `server`, sent at `asked_at` (this pool's clock), answered or not:
        the seconds it has been silent since the first unanswered probe after its last answer
        (0.0 when this one answered)."""
        if answered:
            server.silent_since = None
            return 0.0
        if server.silent_since is None:
            server.silent_since = asked_at
        return self._clock() - server.silent_since

    def take_out(self, server: Server, reason: str) -> bool:
        """Mark a server out; True when it was live until now."""
        server.last_error = reason
        if not server.alive:
            return False
        server.alive = False
        if server.idle_since is not None:
            server.idle_s += self._clock() - server.idle_since
        server.idle_since = None
        self.counters.taken_out += 1
        return True

    def put_back(self, server: Server, version: int | None) -> None:
        server.alive = True
        server.version = version
        server.last_error = ""
        server.silent_since = None
        if server.in_flight == 0:
            server.idle_since = self._clock()
        self.counters.rejoined += 1

    def add(self, url: str) -> Server:
        """A server not known before: out until the health check has given it the weights."""
        if url not in self.servers:
            self.servers[url] = Server(url, alive=False, idle_since=None, last_error="new")
        return self.servers[url]

    def idle_seconds(self) -> float:
        """Each live-or-not server's idle seconds so far, summed."""
        now = self._clock()
        return sum(s.idle_s + (now - s.idle_since if s.idle_since is not None else 0.0) for s in self.servers.values())

    def describe_down(self) -> str:
        reasons = "; ".join(f"{s.url}: {s.last_error or 'down'}" for s in self.servers.values())
        return f"no vLLM server answers ({reasons})"
