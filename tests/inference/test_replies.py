"""A vLLM server's reply checked before a run trains on it (saccade.inference.replies), and a
malformed one handled as a server fault by the client: asked again, then the server taken out."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from saccade.config import ImagesConfig
from saccade.inference.replies import check_completions, reply_json, reply_version
from saccade.inference.server_client import MalformedReply, ServerClient


def reply(**choice) -> dict:
    return {"prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "token_ids": [4, 5], "finish_reason": "stop",
                         "logprobs": {"content": [{"logprob": -0.5}, {"logprob": 0.0}]}, **choice}]}


def logprobs(*values) -> dict:
    return {"content": [{"logprob": v} for v in values]}


def test_a_well_formed_reply_passes():
    check_completions(reply(), vocab_size=10)


@pytest.mark.parametrize(("changed", "said"), [
    ({"token_ids": [4, 10]}, r"outside the vocabulary of 10: \[10\]"),
    ({"token_ids": [4, -1]}, r"outside the vocabulary of 10: \[-1\]"),
    ({"token_ids": [4, "5"]}, "not a list of integers"),
    ({"logprobs": logprobs(-0.5, math.nan)}, r"not finite or lie above 0: \[nan\]"),
    ({"logprobs": logprobs(-0.5, math.inf)}, "not finite"),
    ({"logprobs": logprobs(-0.5, 0.3)}, r"lie above 0: \[0.3\]"),
    ({"logprobs": logprobs(-0.5)}, "2 sampled ids but 1 logprobs"),
    ({"logprobs": logprobs(-0.5, "x")}, "are not numbers"),
])
def test_a_malformed_choice_is_the_servers_fault(changed, said):
    with pytest.raises(MalformedReply, match=said):
        check_completions(reply(**changed), vocab_size=10)


def test_garbage_json_and_version_headers_are_the_servers_fault():
    with pytest.raises(MalformedReply, match="not JSON"):
        reply_json(httpx.Response(200, text="<html>oops"))
    with pytest.raises(MalformedReply, match="not an object"):
        reply_json(httpx.Response(200, json=[1]))
    with pytest.raises(MalformedReply, match="no choices"):
        check_completions({"prompt_token_ids": [1], "choices": []}, vocab_size=None)
    assert reply_version("7", newest=7) == 7 and reply_version(None, newest=0) is None
    assert reply_version("12", newest=None) == 12  # before the run's first push: the server as it is
    with pytest.raises(MalformedReply, match="'v7x' is not a number"):
        reply_version("v7x", newest=7)


@pytest.mark.parametrize("header", ["8", "-1"])
def test_a_version_this_run_never_pushed_is_the_servers_fault(header):
    with pytest.raises(MalformedReply, match=rf"policy version header {header}: this run has pushed versions 0..7"):
        reply_version(header, newest=7)


def test_a_server_replying_garbage_is_asked_again_then_taken_out_and_the_request_goes_on():
    asked: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        asked[host] = asked.get(host, 0) + 1
        if host == "bad":
            return httpx.Response(200, text=json.dumps(reply(logprobs=logprobs(-0.5, math.inf))))  # "Infinity"
        return httpx.Response(200, json=reply())

    def parse(response, server):
        data = reply_json(response)
        check_completions(data, vocab_size=10)
        return data

    client = ServerClient(["http://bad", "http://good"], limits=ImagesConfig(), lora=False, health_interval_s=0,
                          backoff_s=0)

    async def post_twice():
        client._http_client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        return [await client.post("/v1/chat/completions", json_body={}, parse=parse) for _ in range(2)]

    try:
        results = client.run(post_twice())
    finally:
        client.close()
    assert all(data == reply() and server.url == "http://good" for data, server in results)
    assert asked["bad"] == 2  # asked once more, then out: the second request never went there
    bad = client.pool.servers["http://bad"]
    assert not bad.alive and "malformed reply to /v1/chat/completions" in bad.last_error
    assert client.pool.counters.taken_out == 1
