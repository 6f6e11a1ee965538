"""`ServerClient`: the HTTP side of a run's `saccade serve` (vLLM) servers, under `VLLMEngine`.

It owns the transport and nothing about prompts or completions: one event loop in a thread of
its own with one persistent client (the synchronous engine methods hand it coroutines and wait,
from whichever thread calls them, so an async rollout thread and the trainer share it), the
choice of server, retries, the health check and the weights every server must hold.

Servers (`saccade.inference.servers.ServerPool`): each request goes to the live server with
the fewest requests in flight. A server that refuses or drops a connection, or times out, is
taken out and the request is sent again to another; a 5xx is retried with backoff. A reply
that the caller's `parse` finds malformed (`MalformedReply`: not JSON, token ids outside the
vocabulary, logprobs not finite or above 0, a garbled version header) is a server fault: asked
once more of the same server, then that server is taken out as a dead one is and the request
goes to another. A health
check probes servers that are out every `health_interval_s`: one that answers gets the
current weights before it is put back (`add_server` brings in a new one the same way). With
no server left, a request waits `no_server_wait_s` for one, then raises `NoServerError`.

A hung server (one that holds its connections and answers nothing: frozen, deadlocked, its
machine gone without a reset) would hold each of its requests for `timeout_s`, which must stay
long: a long generation legitimately takes minutes. So the servers with requests in flight are
probed too, every `health_interval_s`, with probes of their own client (requests filling the
pool must not hold a probe back). A busy server whose /health has not answered for
`hang_after_s` since its first unanswered probe is taken out and its requests in flight are cut,
so that each goes to another server as a dead server's would: a hung server costs its requests
`hang_after_s` plus a probe interval, and a slow server that answers its probes keeps its long
requests. Under `saccade launch` the launcher also restarts it (`launch.hang_after_s`); a server
started by hand has only this.

Weights: `push` POSTs a folder to every live server's /update_weights (full weights, or with
`lora` the adapter, which a server that loaded other full weights since it started first
restores its base for) and remembers it, so a server that rejoins loads it first.

A server that rejoins (or a new one) must serve the trainer's model (its fingerprint, when the
engine knows it: `model`). With the push check on (`checked_rejoins`, `saccade.loops.push_check`)
a server that holds the run's weights again, loaded by the health check or given by a transport at
a sync (`put_back_after_sync`), is put back only once the check lets it in (`admit`): at once where
the check can judge its answer from the last push's scores, else it is parked (`parked`: out, but
given every push like a live server) and the check after the next push puts it back (`unpark`) or
keeps it out with why (`refuse`). A refused server is not loaded again at that version.

Every rank samples, one rank pushes: the other ranks' clients cannot tell which servers took a
push. Once every rank has seen a push return, `confirm(version)` says so, and from then on a
request answered under an older version (its `x-saccade-policy-version` header) came from a
server that missed the push (taken out on the pushing rank, still live here): it is taken out
and the request goes to another, and the health check puts it back only once it holds the
confirmed version. A request sent before the confirmation may be answered under the version
before (it ran before the servers paused for the update).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from saccade.config import ImagesConfig
from saccade.inference.servers import NoServerError, Server, ServerPool
from saccade.loop_thread import LoopThread
from saccade.model_match import fingerprint_mismatch
from saccade.serving.wire import INFO, UPDATE_WEIGHTS, VERSION_HEADER

log = logging.getLogger(__name__)  # the person running the job hears of servers leaving and coming back

KEEPALIVE_EXPIRY_S = 2.0  # below the servers' 5 s keep-alive timeout (see ServerClient.http)


class ServerError(RuntimeError):
    """A server answered with an error that retrying will not fix (a 4xx), or kept failing."""


class MalformedReply(ServerError):
    """A server's reply that cannot be what vLLM sends: the server is at fault, not the run."""


class Unreachable(ConnectionError):
    """One named server did not answer (a push or a health probe aimed at it)."""


class CutOff(ConnectionError):
    """A request cut because its server stopped answering its health probes (the module note)."""


def held_version(response) -> int | None:
    """The weights version a server answered under (its version header), or None: no header, or
    one that is not a number (left for the reply's parser to call malformed)."""
    value = response.headers.get(VERSION_HEADER)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def stale(version: int | None, confirmed: int | None) -> bool:
    """True when a server answered under weights older than every rank confirmed it holds."""
    return version is not None and confirmed is not None and version < confirmed


def head_dtype_problem(info: dict) -> str | None:
    """Why a server's logits are not the trainer's (`saccade.models.head`), from its /saccade/info,
    or None. A low-precision model whose lm_head rounds the logits to its own dtype samples from a
    coarser distribution than the one the trainer scores."""
    dtype, head = info.get("dtype"), info.get("head_dtype")
    if dtype is None or head is None or head == "float32" or dtype == "float32":
        return None  # an older server that does not say; or nothing is rounded
    return (f"computes its {dtype} model's logits in {head}, rounded to about 3 significant digits, while the "
            f"trainer sums the lm_head in float32; restart it with `saccade serve` (which sets --hf-overrides "
            f"'{{\"head_dtype\": \"float32\"}}'), or pass that flag to vLLM yourself")


class ServerClient:
    """The servers at `urls`, as one HTTP client sees them. `limits` and `lora` are what a
    server must match to be put back (its image bounds; LoRA support when the run pushes
    adapters)."""

    def __init__(
        self,
        urls: list[str],
        *,
        limits: ImagesConfig,
        lora: bool,
        api_key: str | None = None,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        health_interval_s: float = 2.0,
        no_server_wait_s: float = 60.0,
        hang_after_s: float = 60.0,
    ):
        self.pool = ServerPool([u.rstrip("/") for u in urls])
        self.limits = limits
        self.lora = lora
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self.no_server_wait_s = no_server_wait_s
        self.hang_after_s = hang_after_s
        self._pushed: tuple[str, int] | None = None  # the weights folder every server must hold, and its version
        self.confirmed: int | None = None  # the version every live server holds, as every rank saw (module note)
        # Set while the engine's transport rejoins servers at a sync (the collective): it sends a server
        # that answers again the whole model and puts it back; the health check only notes that it answers.
        self.weights_by_collective = False
        self.model: tuple[str, str] | None = None  # the trainer's model (path, fingerprint): a server must serve it
        # The push check puts rejoining servers back (module note): admit(server, version) -> True (in), a
        # str (why not) or None (parked: judged after the next push); url -> the version a parked one holds.
        self.checked_rejoins = False
        self.admit = None
        self.parked: dict[str, int] = {}
        self._refused: dict[str, tuple[int, str]] = {}  # url -> (version, why) the check refused it at
        # Made on first use, on the loop: the thread, the client, the request gate, the lock
        # that keeps pushes and rejoins apart, the health check.
        self._loop: LoopThread | None = None
        self._loop_guard = threading.Lock()
        self._http_client = None
        self.gate: asyncio.Semaphore | None = None  # at most max_concurrency requests in flight
        self._weights_lock: asyncio.Lock | None = None
        self._health_task: asyncio.Task | None = None
        # The watch on busy servers (module note): its loop, its probes' own client, the probe
        # running per server, and per server the future that cuts its requests in flight.
        self._watch_task: asyncio.Task | None = None
        self._probe_client = None
        self._probes: dict[str, asyncio.Task] = {}
        self._cut_signals: dict[str, asyncio.Future] = {}

    @property
    def urls(self) -> list[str]:
        return list(self.pool.servers)

    # --- the event loop, server choice and HTTP ------------------------------------------
    def run(self, coro):
        """Run a coroutine on the client's event loop (started on first use) and wait for it."""
        with self._loop_guard:
            if self._loop is None:
                self._loop = LoopThread("saccade-vllm-engine")
        return self._loop.run(coro)

    def submit(self, coro):
        """Start a coroutine on the client's event loop; a concurrent.futures.Future of its result
        (for a caller that must do something else meanwhile, e.g. broadcast the tensors a server's
        request is waiting for: saccade.transports.collective)."""
        self.run(asyncio.sleep(0))  # the loop, started on first use
        return asyncio.run_coroutine_threadsafe(coro, self._loop.loop)

    def http(self):
        """The one HTTP client, with the gate and lock that live on its loop."""
        import httpx

        if self._http_client is None:
            # Idle connections are dropped after 2 s, before the server's keep-alive timeout (uvicorn's
            # and vLLM's default: 5 s) closes them: a request sent on a connection the server is
            # closing at that instant fails with ReadError, which would take a healthy server out
            # (seen on the vLLM demo between the GRPO and the control runs).
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency,
                                  keepalive_expiry=KEEPALIVE_EXPIRY_S)
            self._http_client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            self.gate = asyncio.Semaphore(self.max_concurrency)
            self._weights_lock = asyncio.Lock()
            if self.health_interval_s > 0:
                loop = asyncio.get_running_loop()
                self._probe_client = httpx.AsyncClient(timeout=self.hang_after_s,
                                                       limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
                self._health_task = loop.create_task(self._health_loop())
                self._watch_task = loop.create_task(self._watch_loop())
        return self._http_client

    def close(self) -> None:
        """Stop the health check, close the client and the loop's thread."""
        if self._loop is None:
            return

        async def shut():
            for task in (self._health_task, self._watch_task, *self._probes.values()):
                if task is not None:
                    task.cancel()
            for client in (self._http_client, self._probe_client):
                if client is not None:
                    await client.aclose()
        try:
            self._loop.run(shut())
        finally:
            self._loop.close()
            self._loop = self._http_client = self._probe_client = None
            self._probes.clear()
            self._cut_signals.clear()

    async def _live_server(self, tried: set[str]) -> Server:
        """The least-loaded live server, preferring ones this request has not failed on; with
        none live, wait up to no_server_wait_s for the health check to bring one back."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            try:
                return self.pool.pick(exclude=tried)
            except NoServerError as err:
                if time.monotonic() >= deadline:
                    raise NoServerError(
                        f"{err}, for {self.no_server_wait_s:.0f} s. Start them again (saccade serve MODEL ...) "
                        "at the run's engine.urls"
                    ) from None
                await asyncio.sleep(min(0.5, self.health_interval_s or 0.5))

    async def post(self, path: str, *, json_body: Any, server: Server | None = None,
                   parse=None, once: bool = False) -> tuple[Any, Server]:
        """POST to the least-loaded live server, or to `server` only; returns the response and
        the server that gave it. A connection refused, dropped or timed out takes the server
        out and sends the request to another (aimed at one server: raises Unreachable); a 5xx
        is retried with backoff; a 4xx raises at once with the server's reason. `parse(response,
        server)`, when given, makes what is returned from the response; a `MalformedReply` from it
        is asked once more of the server, then takes the server out (see the module note). `once`:
        a 5xx is not retried (a phase of a weight transfer, which cannot be asked twice)."""
        import httpx

        client = self.http()
        tried: set[str] = set()
        attempt = reroutes = 0
        malformed: dict[str, int] = {}  # malformed replies per server, this request
        again: Server | None = None  # the server to ask once more after a malformed reply

        def reroute(target: Server, failure: str, err: Exception) -> None:
            """Take `target` out and count the request's move to another server; past a bound
            of moves, every server has failed it."""
            nonlocal reroutes
            if self.pool.take_out(target, failure):
                log.warning("server %s taken out (%s); its requests go to the others", target.url, failure)
            tried.add(target.url)
            self.pool.counters.rerouted += 1
            reroutes += 1
            if reroutes > 4 * len(self.pool.servers) + self.retries:
                raise ServerError(f"{path}: every server failed, last {failure}") from err

        while True:
            target = server or again or await self._live_server(tried)
            again = None
            confirmed = self.confirmed  # as the request is sent: an answer to it must be at least this fresh
            self.pool.begin(target)
            try:
                response = await self._unless_cut_off(
                    target, client.post(target.url + path, json=json_body, headers=self.headers))
            except (httpx.TransportError, CutOff) as err:  # timeouts included
                failure = f"{type(err).__name__} on {path}: {err}".strip()
                if server is not None:
                    raise Unreachable(f"{target.url}: {failure}") from err
                reroute(target, failure, err)
                continue
            finally:
                self.pool.end(target)
            held = held_version(response)
            if server is None and response.status_code < 400 and stale(held, confirmed):
                failure = f"answered under weights v{held}, older than v{confirmed} (missed a push)"
                reroute(target, failure, ServerError(failure))
                continue
            if response.status_code < 400 and parse is None:
                return response, target
            if response.status_code < 400:
                try:
                    return parse(response, target), target
                except MalformedReply as err:
                    malformed[target.url] = malformed.get(target.url, 0) + 1
                    failure = f"malformed reply to {path}: {err}"
                    if malformed[target.url] < 2:  # once more of the same server: a garbled transfer
                        self.pool.counters.retried += 1
                        again = target
                        continue
                    if server is not None:  # aimed at this server: the caller decides
                        raise
                    reroute(target, failure, err)
                    continue
            if response.status_code < 500:
                raise ServerError(f"{target.url}{path}: HTTP {response.status_code}: {response.text[:500]}")
            if attempt >= self.retries or once:
                raise ServerError(f"{target.url}{path}: HTTP {response.status_code} after {attempt + 1} attempts: "
                                  f"{response.text[:500]}")
            self.pool.counters.retried += 1
            await asyncio.sleep(self.backoff_s * 2**attempt)
            attempt += 1

    async def _unless_cut_off(self, server: Server, request):
        """The response to `request` (a coroutine) sent to `server`; CutOff if the watch on busy
        servers takes `server` out first (the request is then cancelled)."""
        cut = self._cut_signals.get(server.url)
        if cut is None or cut.done():
            cut = self._cut_signals[server.url] = asyncio.get_running_loop().create_future()
        sent = asyncio.ensure_future(request)
        try:
            await asyncio.wait((sent, cut), return_when=asyncio.FIRST_COMPLETED)
            if sent.done():
                return sent.result()
            raise CutOff(cut.result())
        finally:
            if not sent.done():  # cut off, or the caller cancelled: the request goes with it
                sent.cancel()

    async def served_model(self) -> str:
        """The model a live server serves (the first of its /v1/models)."""
        server = await self._live_server(set())
        response = await self.http().get(server.url + "/v1/models", headers=self.headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    # --- servers that leave and come back ------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            for server in self.pool.down:
                try:
                    await self._rejoin(server)
                except Exception as err:  # still out; probed again next round
                    server.last_error = f"{type(err).__name__}: {err}"[:300]

    async def _watch_loop(self) -> None:
        """Every health_interval_s, a probe of each busy server that has none running (module note).
        A loop of its own beside `_health_loop`, whose rejoins wait for slow probes and weight loads
        one server after another; each probe a task of its own, so that one server's silence never
        delays another's probe."""
        while True:
            await asyncio.sleep(self.health_interval_s)
            for server in self.pool.busy:
                running = self._probes.get(server.url)
                if running is None or running.done():
                    self._probes[server.url] = asyncio.get_running_loop().create_task(self._probe_busy(server))

    async def _probe_busy(self, server: Server) -> None:
        """Ask a busy server's /health (waiting at most hang_after_s); past hang_after_s of silence,
        take it out and cut its requests in flight."""
        import httpx

        asked_at = self.pool.now()
        try:
            response = await self._probe_client.get(server.url + "/health", headers=self.headers)
            answered, last = response.status_code == 200, f"HTTP {response.status_code}"
        except httpx.HTTPError as err:
            answered, last = False, type(err).__name__
        silent = self.pool.probed(server, answered=answered, asked_at=asked_at)
        if silent < self.hang_after_s or not server.alive or not server.in_flight:
            return
        why = (f"has not answered /health for {silent:.0f} s (engine.hang_after_s {self.hang_after_s:g} s; last "
               f"probe: {last}) with {server.in_flight} requests in flight")
        if self.pool.take_out(server, why):
            log.warning("server %s %s: taken out, its requests go to the others", server.url, why)
        cut = self._cut_signals.pop(server.url, None)
        if cut is not None and not cut.done():
            cut.set_result(f"{server.url} {why}")

    async def _rejoin(self, server: Server) -> None:
        """Put a server back that answers again (or a new one): same image limits, LoRA when
        the run pushes adapters, a float32 lm_head, and the current weights loaded first. With
        `weights_by_collective`, the next sync gives it the weights and puts it back instead."""
        info = await self.fit_to_rejoin(server)
        if self.weights_by_collective:
            raise ServerError(f"{server.url} answers: out until the next weight sync has sent it the weights")
        if server.url in self.parked:
            return  # it holds the run's weights: the push check after the next sync decides
        async with self._weights_lock:
            version = info.get("policy_version")
            if self._pushed is None and self.checked_rejoins:  # another rank pushes, and checks
                raise ServerError(f"{server.url} answers: out until the pushing rank's push check lets it in")
            if self._pushed is None and stale(version, self.confirmed):  # another rank pushes: wait for it
                raise ServerError(f"{server.url} holds weights v{version}, the run's are v{self.confirmed}: "
                                  "out until the pushing rank has loaded them")
            if self._pushed is not None:
                folder, version = self._pushed
                refused = self._refused.get(server.url)
                if refused is not None and refused[0] == version:  # not loaded and checked again before a push
                    raise ServerError(refused[1])
                await self._load(server, folder, version)
            if self.checked_rejoins and not await self._admitted(server, version):
                return
            self.pool.put_back(server, version)
        log.info("server %s is back in, with weights version %s", server.url, version)

    async def _admitted(self, server: Server, version: int) -> bool:
        """The push check on `server`, which now holds `version`: True lets it in; else it is parked, or
        refused (a ServerError with why)."""
        verdict = await self.admit(server, version) if self.admit is not None else None
        if verdict is True:
            self._refused.pop(server.url, None)
            return True
        if isinstance(verdict, str):
            if self._refused.get(server.url) != (version, verdict):
                log.warning("server %s not put back: %s", server.url, verdict)
            self._refused[server.url] = (version, verdict)
            raise ServerError(verdict)
        self.park(server, version)
        return False

    def park(self, server: Server, version: int) -> None:
        """`server` (out) holds weights `version`: it gets every push from now on, and the push check
        after the next one puts it back or keeps it out (module note)."""
        self.parked[server.url] = version
        server.last_error = f"holds weights v{version}: out until the push check after the next sync lets it in"
        log.info("server %s answers again and holds weights v%s: the push check decides at the next sync",
                 server.url, version)

    def put_back_after_sync(self, server: Server, version: int) -> bool:
        """A server a transport gave the whole model at a sync (`rejoins_at_sync`): put back at `version`
        once the push check lets it in (module note). True: put back."""
        if self.checked_rejoins:
            try:
                if not self.run(self._admitted(server, version)):
                    return False
            except ServerError as err:
                server.last_error = str(err)
                return False
        self.pool.put_back(server, version)
        return True

    def unpark(self, url: str, version: int) -> None:
        """The push check found `url` to hold weights `version`: back in (a live one stays in)."""
        server = self.pool.servers.get(url)
        self.parked.pop(url, None)
        self._refused.pop(url, None)
        if server is not None and not server.alive:
            self.pool.put_back(server, version)
            log.info("server %s is back in, with weights version %s (the push check let it in)", url, version)

    def refuse(self, url: str, version: int, why: str) -> bool:
        """The push check found `url` far from the trainer's weights `version`: out with `why`, not
        loaded again at this version. True when it was live until now."""
        server = self.pool.servers.get(url)
        self.parked.pop(url, None)
        self._refused[url] = (version, why)
        return server is not None and self.pool.take_out(server, why)

    async def fit_to_rejoin(self, server: Server) -> dict:
        """A server that is out, asked whether it can come back: it answers, resizes images as the
        run does, has LoRA when the run pushes adapters, and computes its head in float32. Returns
        its /saccade/info; raises Unreachable or ServerError (why not) otherwise."""
        import httpx

        client = self.http()
        try:
            health = await client.get(server.url + "/health", headers=self.headers, timeout=5)
            info = (await client.get(server.url + INFO, headers=self.headers, timeout=10)).json()
        except httpx.HTTPError as err:
            raise Unreachable(f"{server.url}: {err}") from None
        if health.status_code != 200:
            raise Unreachable(f"{server.url}/health: HTTP {health.status_code}")
        served = (info["min_pixels"], info["max_pixels"])
        if served != (self.limits.min_pixels, self.limits.max_pixels):
            raise ServerError(f"{server.url} resizes images to {served}, the run to "
                              f"{(self.limits.min_pixels, self.limits.max_pixels)}: not put back")
        if self.lora and not info.get("lora_enabled"):
            raise ServerError(f"{server.url} has no LoRA support (--enable-lora): not put back")
        other_model = self.model and fingerprint_mismatch(server.url, info, *self.model)
        if other_model:
            raise ServerError(f"{other_model}: not put back")
        problem = head_dtype_problem(info)
        if problem:
            raise ServerError(f"{server.url} {problem}: not put back")
        return info

    def add_server(self, url: str) -> None:
        """Bring a new server into the run: the health check gives it the current weights and
        puts it in (within health_interval_s of its answering)."""
        self.pool.add(url.rstrip("/"))
        self.run(self._started())

    async def _started(self) -> None:
        self.http()  # the client, and the health check with it

    def stats(self) -> dict[str, float]:
        """Counters since the client was made (a step's figures are differences)."""
        c = self.pool.counters
        return {"requests_retried": float(c.retried), "requests_rerouted": float(c.rerouted),
                "servers_taken_out": float(c.taken_out), "servers_rejoined": float(c.rejoined),
                "engine_idle_s": self.pool.idle_seconds() / max(1, len(self.pool.servers)),
                "servers_alive": float(len(self.pool.alive))}

    # --- weights --------------------------------------------------------------------------
    def confirm(self, version: int) -> None:
        """Every rank has seen the push of `version` return (see the module note)."""
        self.confirmed = version

    async def push(self, folder: str, version: int) -> None:
        """Every live server loads the folder, and every parked one (module note); one that does not
        answer is taken out (it gets the folder when it is back); NoServerError when no live one took it."""
        self.http()
        async with self._weights_lock:
            self._pushed = (str(folder), version)
            live = self.pool.alive
            parked = [s for url, s in self.pool.servers.items() if url in self.parked and not s.alive]
            results = await asyncio.gather(*(self._load(s, str(folder), version) for s in live + parked),
                                           return_exceptions=True)
            for server, result in zip(parked, results[len(live):], strict=True):
                if isinstance(result, BaseException):  # back to the health check
                    self.parked.pop(server.url, None)
                    server.last_error = f"loading weights v{version}: {type(result).__name__}: {result}"[:300]
                else:
                    self.parked[server.url] = version
            for server, result in zip(live, results, strict=False):
                if isinstance(result, Unreachable):
                    if self.pool.take_out(server, str(result)):
                        log.warning("server %s taken out while loading weights v%s (%s)", server.url, version, result)
                elif isinstance(result, BaseException):
                    raise result
            if not self.pool.alive:
                raise NoServerError(f"{self.pool.describe_down()}; weights v{version} reached none. Start them "
                                    "again (saccade serve MODEL ...) at the run's engine.urls")

    async def _load(self, server: Server, folder: str, version: int) -> None:
        """One server loads the folder. An adapter only means something on the weights it was
        trained on: a server that loaded full weights since it started (another run's) first
        reloads its checkpoint."""
        if self.lora and server.version is None:
            info = (await self.http().get(server.url + INFO, headers=self.headers, timeout=30)).json()
            if info.get("base_modified"):
                await self.post(UPDATE_WEIGHTS, json_body={"restore_base": True, "version": version}, server=server)
        await self.post(UPDATE_WEIGHTS, json_body={"path": folder, "version": version, "lora": self.lora},
                        server=server)
        server.version = version
        server.versions_loaded.append(version)

    def info(self) -> list[dict]:
        """The /saccade/info of every server that answers; those that do not are taken out (the
        health check brings them back). None answering, or an answer that is not `saccade
        serve`'s, is an error that says what to do."""
        import httpx

        out, failures = [], []
        for server in list(self.pool.servers.values()):
            try:
                response = httpx.get(server.url + INFO, headers=self.headers, timeout=30)
            except httpx.HTTPError as err:
                failures.append(f"{server.url} ({err})")
                self.pool.take_out(server, str(err))
                continue
            if response.status_code != 200:
                raise ValueError(
                    f"{server.url}/saccade/info: HTTP {response.status_code} {response.text[:200]}; is it `saccade "
                    "serve` (plain `vllm serve` lacks /encode_images and /update_weights), with the right API key?"
                )
            out.append(response.json())
        if not out:
            raise ValueError(
                f"no server answers at {', '.join(failures)}; start one with `saccade serve MODEL`, or fix engine.urls"
            )
        if failures:
            log.warning("%s not answering: out until the health check finds it up", ", ".join(failures))
        return out
