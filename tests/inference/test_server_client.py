"""A rank that does not push (saccade.inference.server_client): once every rank has seen a push
return, a server still answering under older weights missed it (the pushing rank took it out,
this rank did not): it is taken out here too, the request goes to another, and the health check
puts it back only once it holds the confirmed version. The HTTP is httpx's mock transport; the
client's routing, failure and rejoin code is the real one."""

from __future__ import annotations

import httpx
import pytest

from saccade.config import ImagesConfig
from saccade.inference.server_client import ServerClient, ServerError
from saccade.serving.wire import INFO, VERSION_HEADER

LIMITS = ImagesConfig()


class Servers:
    """Two servers by host name, each holding a weights version; every request is noted."""

    def __init__(self, **versions: int):
        self.versions = dict(versions)
        self.asked: list[str] = []
        self.during_request = None  # called as a request is answered (a push confirmed meanwhile)

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        self.asked.append(host)
        version = self.versions[host]
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == INFO:
            return httpx.Response(200, json={"policy_version": version, "min_pixels": LIMITS.min_pixels,
                                             "max_pixels": LIMITS.max_pixels})
        if self.during_request is not None:
            self.during_request()
        return httpx.Response(200, json={"from": host}, headers={VERSION_HEADER: str(version)})


def make(**versions: int) -> tuple[ServerClient, Servers]:
    return ServerClient(["http://stale", "http://fresh"], limits=LIMITS, lora=False, health_interval_s=0,
                        backoff_s=0), Servers(**versions)


def run(client: ServerClient, servers: Servers, coro_fn):
    """`coro_fn()` on the client's loop, its HTTP going to `servers`."""
    async def on_loop():
        client.http()  # the gate and the weights lock, made on the loop
        client._http_client = httpx.AsyncClient(transport=httpx.MockTransport(servers.handler))
        return await coro_fn()
    try:
        return client.run(on_loop())
    finally:
        client.close()


def test_after_a_confirmed_push_a_server_that_missed_it_is_taken_out_and_the_request_goes_on():
    client, servers = make(stale=0, fresh=146)
    client.confirm(146)  # rank 0 pushed v146 (to "fresh" only) and every rank saw it return

    async def three_requests():
        return [await client.post("/v1/chat/completions", json_body={}) for _ in range(3)]

    results = run(client, servers, three_requests)
    assert [r.json()["from"] for r, _ in results] == ["fresh"] * 3
    assert servers.asked == ["stale", "fresh", "fresh", "fresh"]  # asked once, then out
    stale = client.pool.servers["http://stale"]
    assert not stale.alive and "answered under weights v0, older than v146" in stale.last_error
    assert client.pool.counters.taken_out == 1 and client.pool.counters.rerouted == 1


def test_before_any_confirmation_or_under_the_confirmed_version_every_answer_is_taken():
    client, servers = make(stale=3, fresh=3)

    async def requests():
        first = [await client.post("/v1/chat/completions", json_body={}) for _ in range(2)]
        client.confirm(3)
        return first + [await client.post("/v1/chat/completions", json_body={}) for _ in range(2)]

    results = run(client, servers, requests)
    assert sorted(r.json()["from"] for r, _ in results) == ["fresh", "fresh", "stale", "stale"]
    assert client.pool.counters.taken_out == 0


def test_a_request_sent_before_the_confirmation_may_be_answered_under_the_version_before():
    # Sampled ahead: the request ran before the servers paused for the update, and its answer
    # arrives after every rank confirmed the push.
    client, servers = make(stale=4, fresh=4)
    servers.during_request = lambda: client.confirm(5)

    async def one():
        return await client.post("/v1/chat/completions", json_body={})

    response, server = run(client, servers, one)
    assert response.headers[VERSION_HEADER] == "4" and server.alive and client.pool.counters.taken_out == 0


def test_a_pushed_to_server_is_not_checked_against_the_confirmed_version():
    # /update_weights answers under the version the server held as the request arrived.
    client, servers = make(stale=0, fresh=0)
    client.confirm(7)

    async def aimed():
        return await client.post("/update_weights", json_body={}, server=client.pool.servers["http://stale"])

    response, server = run(client, servers, aimed)
    assert response.status_code == 200 and server.alive


def test_on_a_rank_that_does_not_push_a_server_rejoins_only_once_it_holds_the_confirmed_weights():
    client, servers = make(stale=0, fresh=146)
    client.confirm(146)
    stale = client.pool.servers["http://stale"]
    client.pool.take_out(stale, "missed a push")

    async def rejoin_twice():
        with pytest.raises(ServerError, match="holds weights v0, the run's are v146: out until the pushing rank"):
            await client._rejoin(stale)
        assert not stale.alive
        servers.versions["stale"] = 146  # the pushing rank's health check loaded it
        await client._rejoin(stale)

    run(client, servers, rejoin_twice)
    assert stale.alive and stale.version == 146


def test_with_the_push_check_a_rejoining_server_is_parked_given_every_push_and_back_in_only_once_it_passes():
    """`checked_rejoins` (saccade.loops.push_check): a server that answers again loads the run's
    weights and is parked, not put back; pushes load it like a live server; the check then puts it
    back (`unpark`) or keeps it out (`refuse`), and a refused one is not loaded again at that version."""
    client, servers = make(stale=0, fresh=5)
    client.checked_rejoins = True
    client._pushed = ("/weights/v5", 5)  # this rank pushed v5
    stale = client.pool.servers["http://stale"]
    client.pool.take_out(stale, "restarted")

    async def rejoin_push_refuse_rejoin():
        await client._rejoin(stale)
        assert not stale.alive and client.parked == {"http://stale": 5} and stale.versions_loaded == [5]
        await client._rejoin(stale)  # parked: left as it is
        assert stale.versions_loaded == [5]
        await client.push("/weights/v6", 6)  # the next push loads it with the live one
        assert client.parked == {"http://stale": 6} and stale.versions_loaded == [5, 6] and not stale.alive
        client.refuse("http://stale", 6, "answers as the weights of v0")
        assert client.parked == {} and not stale.alive and stale.last_error == "answers as the weights of v0"
        with pytest.raises(ServerError, match="answers as the weights of v0"):
            await client._rejoin(stale)  # refused at v6: not loaded again before the next push
        assert stale.versions_loaded == [5, 6]
        client._pushed = ("/weights/v7", 7)
        await client._rejoin(stale)
        assert client.parked == {"http://stale": 7}
        client.unpark("http://stale", 7)

    run(client, servers, rejoin_push_refuse_rejoin)
    assert stale.alive and stale.version == 7 and client.parked == {}


def test_a_server_serving_another_model_is_not_put_back():
    client, servers = make(stale=0, fresh=0)
    client.model = ("tiny", "fingerprint-of-the-trainers")
    original = servers.handler

    def handler(request):
        response = original(request)
        if request.url.path == INFO:
            return httpx.Response(200, json={**response.json(), "model": "other", "fingerprint": "another"})
        return response

    servers.handler = handler
    stale = client.pool.servers["http://stale"]
    client.pool.take_out(stale, "restarted")
    with pytest.raises(ServerError, match="they are different models.*not put back"):
        run(client, servers, lambda: client.fit_to_rejoin(stale))


def test_a_server_a_transport_gave_the_whole_model_is_parked_for_the_push_check():
    client, _ = make(stale=0, fresh=0)
    server = client.pool.servers["http://stale"]
    client.pool.take_out(server, "killed")
    client.checked_rejoins = True
    assert client.put_back_after_sync(server, 3) is False
    assert not server.alive and client.parked == {"http://stale": 3} and "push check" in server.last_error
    client.checked_rejoins = False
    assert client.put_back_after_sync(server, 4) is True and server.alive and server.version == 4
