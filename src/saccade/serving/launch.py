"""Start a `saccade serve` process and wait until it answers: for tests, benchmarks and demos."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

# The tiny model on vLLM's CPU build: fp32, eager (no compile), a small KV cache.
CPU_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(model: str, *, args: tuple[str, ...] = CPU_ARGS, log_path: str | Path, timeout_s: float = 300.0,
           kv_cache_gb: int | None = 1):
    """Run `saccade serve MODEL ARGS` on a free local port; yield its base URL; stop it after.

    `kv_cache_gb`: VLLM_CPU_KVCACHE_SPACE for a CPU server; None leaves it unset, so that
    `saccade serve` chooses (as for a user who starts it by hand). A server that exits or does
    not answer /health within timeout_s raises RuntimeError with the end of its log.
    """
    import httpx

    port = free_port()
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if kv_cache_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
    cmd = [sys.executable, "-m", "saccade.serving.server", str(model), *args, "--port", str(port)]
    log_path = Path(log_path)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"saccade serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"saccade serve did not answer in {timeout_s:.0f} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
