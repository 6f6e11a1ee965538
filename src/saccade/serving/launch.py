"""Start a `saccade serve` process and wait until it answers: for tests, benchmarks and demos."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from saccade.parent_death import start_child

# The tiny model on vLLM's CPU build: fp32, eager (no compile), a small KV cache.
CPU_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-model-len", "2048")


def cpu_dtype(model: str | Path, default: str = "float32") -> str:
    """The dtype a CPU server of `model` runs in: `default`, or the family's only one on vLLM's CPU
    build (`vllm_cpu_dtype`: Qwen3.5's bfloat16, which `saccade serve` refuses to replace with
    float32). `model`: a folder or hub id (its config.json is read), or a built-in preset's name,
    or its warm start's (known without building it)."""
    from saccade.models.presets import preset_family, warm_start_base
    from saccade.models.loading import load_family

    name = str(model)
    family = preset_family(warm_start_base(name) or name) or load_family(name)
    only = family.vllm_cpu_dtype
    return default if only is None else only[0]


def cpu_args(model: str | Path, dtype: str | None = None) -> tuple[str, ...]:
    """CPU_ARGS with `--dtype dtype`, by default the model's `cpu_dtype`."""
    dtype = dtype or cpu_dtype(model)
    return tuple(dtype if a == "float32" else a for a in CPU_ARGS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `saccade serve MODEL ARGS` process on a fixed local port, which can be killed and
    started again on the same port (tests of servers that leave and come back). It ends with the
    process that started it, however that one ends (`saccade.parent_death`: SIGTERM, on which
    `saccade serve` stops vLLM's engine processes too), so that a bench or a demo killed by
    SIGKILL leaves no server behind."""

    def __init__(self, model: str, *, args: tuple[str, ...] = CPU_ARGS, log_path: str | Path,
                 kv_cache_gb: int | None = 1, port: int | None = None, env: dict[str, str] | None = None,
                 cores: list[int] | None = None, weights_root: str | Path | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # Where /update_weights may load from; None: the server's default (this process's cwd).
        root = ("--weights-root", str(weights_root)) if weights_root is not None else ()
        self.cmd = [sys.executable, "-m", "saccade.serving.server", str(model), *args, *root, "--port", str(self.port)]
        self.env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", **(env or {})}
        self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if kv_cache_gb is not None:
            self.env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gb)
        self.log_path = Path(log_path)
        self.cores = cores  # run the server and everything it starts on these cores only
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        with open(self.log_path, "a") as log:
            self.proc = start_child(self.cmd, cores=self.cores, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> str:
        """Wait until /health answers; RuntimeError with the end of the log if it exits or times out."""
        import httpx

        deadline = time.time() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"saccade serve exited with {self.proc.returncode}:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"saccade serve did not answer in {timeout_s:.0f} s:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(2)

    def kill(self) -> None:
        """SIGKILL the server and everything it started (vLLM's engine core is a child)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


@contextmanager
def served(model: str, *, args: tuple[str, ...] = CPU_ARGS, log_path: str | Path, timeout_s: float = 300.0,
           kv_cache_gb: int | None = 1, env: dict[str, str] | None = None, cores: list[int] | None = None,
           weights_root: str | Path | None = None):
    """Run `saccade serve MODEL ARGS` on a free local port; yield its base URL; stop it after.

    `kv_cache_gb`: VLLM_CPU_KVCACHE_SPACE for a CPU server; None leaves it unset, so that
    `saccade serve` chooses (as for a user who starts it by hand). `env`: more environment
    (e.g. VLLM_CPU_OMP_THREADS_BIND); `cores`: the CPU cores it may run on. `weights_root`: the
    folder /update_weights may load from (--weights-root; None: the current directory). A server
    that exits or does not answer /health within timeout_s raises RuntimeError with the end of its log.
    """
    Path(log_path).write_text("")
    server = ServerProcess(model, args=args, log_path=log_path, kv_cache_gb=kv_cache_gb, env=env, cores=cores,
                           weights_root=weights_root).start()
    try:
        yield server.wait_ready(timeout_s)
    finally:
        server.stop()
