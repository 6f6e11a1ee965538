"""One rule on every route of `saccade serve`, as a plain ASGI middleware around the whole app:
vLLM's routes, saccade's, and any route a later vLLM adds.

- The API key: with one set (`--api-key K1 [K2 ...]`, else VLLM_API_KEY), every request but the
  health probe, of any method, needs `Authorization: Bearer K` with one of them. vLLM 0.32's own check covers
  only paths under /v1, /v2, /inference and /cohere (serve/middleware/authenticate.py), which
  left /invocations, /tokenize, /scale_elastic_ep, /metrics and saccade's routes to anyone who
  reached the port. Keys are compared as SHA-256 digests with `hmac.compare_digest`, every key
  every time: the time taken says nothing about which key, or how much of one, matched. The
  path is taken below `--root-path`, so a prefix does not move a route out of reach of the rule.
- Body size: Content-Length over the limit gets a 413; a body sent without one (chunked) is
  read up to the limit, then 413.
- Media URLs (`validation.check_media_urls`) in the JSON body of every POST to vLLM's routes:
  whatever the route's format, a remote URL whose host was not allowed is refused before vLLM
  could fetch it. saccade's own routes check their bodies themselves (data: URLs only).
- Per-request multimodal settings (`validation.check_request_mm_kwargs`): only those saccade's
  client sends a clip with, within bounds (vLLM trusts them: --trust-request-mm-kwargs).
- Every response carries the policy version the server held when the request arrived.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Iterable
from typing import Any

from saccade.serving.validation import MediaPolicy, RequestError, check_media_urls, check_request_mm_kwargs
from saccade.serving.wire import HEALTH, SACCADE_ROUTES, VERSION_HEADER

UNAUTHORIZED = "missing or wrong API key (Authorization: Bearer KEY)"


def key_digests(keys: Iterable[str | None]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys if k)


def key_accepted(authorization: str | None, digests: tuple[bytes, ...]) -> bool:
    """Whether an Authorization header carries one of the keys. Digests of equal length are
    compared, all of them, so neither a key's length nor which key matched shows in the timing."""
    scheme, _, given = (authorization or "").partition(" ")
    given_digest = hashlib.sha256(given.strip().encode()).digest()
    match = False
    for digest in digests:
        match |= hmac.compare_digest(given_digest, digest)
    return match and scheme.lower() == "bearer"


def route_path(scope: dict) -> str:
    """The path the app routes on: below --root-path when the server has one."""
    path, root = scope.get("path", "/"), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


def needs_key(path: str) -> bool:
    """Every request needs the key but the health probe, whatever its method: a `Mount` (vLLM's
    /metrics) answers every method, OPTIONS and HEAD included, with the route's content. A
    browser's CORS preflight (OPTIONS, which browsers send without credentials) gets the 401 too:
    the servers answer the trainer, not pages."""
    return path != HEALTH


def is_saccade_route(path: str) -> bool:
    return path.startswith(SACCADE_ROUTES)


def error_body(path: str, message: str, status: int) -> dict:
    """saccade's routes answer {"error": reason}; vLLM's answer in OpenAI's error shape."""
    if is_saccade_route(path) or status == 401:
        return {"error": message}
    return {"error": {"message": message, "type": "BadRequestError", "code": status}}


def header(scope: dict, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class Guard:
    """The ASGI middleware. `version()`: the policy version now; `media_policy()`: what may be
    fetched (read from vLLM's model config once the app has one)."""

    def __init__(self, app, *, keys: Iterable[str | None], max_body_bytes: int,
                 version: Callable[[], int], media_policy: Callable[[], MediaPolicy]):
        self.app = app
        self.digests = key_digests(keys)
        self.max_body_bytes = max_body_bytes
        self.version = version
        self.media_policy = media_policy

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        path = route_path(scope)
        method = scope.get("method", "GET")
        if self.digests and needs_key(path) and not key_accepted(header(scope, b"authorization"), self.digests):
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008, "reason": "API key"})
            return await respond(send, 401, error_body(path, UNAUTHORIZED, 401))
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        version = self.version()  # as the request arrives (server.py's module note)
        try:
            length = header(scope, b"content-length")
            if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
                raise RequestError(f"request body of {int(length)} bytes exceeds the limit of "
                                   f"{self.max_body_bytes} (--max-body-mb)", 413)
            if method in ("POST", "PUT", "PATCH"):
                body = await read_body(receive, self.max_body_bytes)
                if not is_saccade_route(path):
                    check_body_media(body, self.media_policy())
                receive = replay(body, receive)
        except RequestError as err:
            return await respond(send, err.status, error_body(path, str(err), err.status))
        await self.app(scope, receive, with_header(send, VERSION_HEADER, str(version)))


def check_body_media(raw: bytes, policy: MediaPolicy) -> None:
    """A body that is not JSON is left to the route (vLLM refuses it with a 400)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return
    check_media_urls(body, policy)
    check_request_mm_kwargs(body)


async def read_body(receive, max_bytes: int) -> bytes:
    """The whole request body, at most `max_bytes` (413 beyond, also when sent chunked)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise RequestError(f"request body exceeds the limit of {max_bytes} bytes (--max-body-mb)", 413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def replay(body: bytes, receive):
    """A `receive` that hands the route the body already read, then waits on the client's."""
    done = False

    async def receive_again() -> dict[str, Any]:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def with_header(send, name: str, value: str):
    async def send_with_header(message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (name.encode(), value.encode())]}
        await send(message)

    return send_with_header


async def respond(send, status: int, body: dict) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
