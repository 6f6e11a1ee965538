"""The command line `saccade serve` hands vLLM: saccade's defaults, a float32 lm_head, the CPU
build's dtype and KV cache, and the refusal to listen beyond loopback without a key. Pure
functions of argv and the environment; `saccade.serving.server.main` calls them before vLLM
parses what is left."""

import json
import os
from pathlib import Path

from saccade.config import is_loopback
from saccade.serving.wire import GLOO_BACKEND

WORKER_EXTENSION = "saccade.serving.worker.SaccadeWorker"
# vLLM fetches remote media from any host when --allowed-media-domains is unset. saccade's guard
# refuses remote URLs on every route it knows the format of; this default makes vLLM's own
# check (its media connector, which every route's fetch goes through) refuse them too, whatever
# the format: a reserved name (RFC 2606) that no URL's host can be and that resolves nowhere.
NO_REMOTE_MEDIA = "no-remote-media.invalid"

# What `saccade serve` adds to vLLM's defaults unless the user gave the flag.
DEFAULT_FLAGS = {
    "--host": "127.0.0.1",  # local by default; elsewhere needs an API key
    # The logprobs of the distribution actually sampled from (temperature applied), which is
    # what the trainer's ratio needs; vLLM's default reports them before temperature.
    "--logprobs-mode": "processed_logprobs",
    "--worker-extension-cls": WORKER_EXTENSION,
    # Token-in/token-out sampling (/inference/v1/generate): multi-turn rollouts send the
    # trajectory's own token ids, never text that vLLM would re-tokenize.
    "--enable-scale-out": None,
    # No multimodal processor cache: with it, a request refused after its images were processed
    # (e.g. max_tokens=-1, n=0) leaves the front end believing the engine holds those images, and
    # the next valid request with the same image fails with a 500 (vLLM 0.32: "P0/P1 cache drift",
    # only a retry recovers). Without it, every request carries its processed images; measured
    # here, 20 chat requests with one 200x200 image each were no slower (1.7 s vs 4.1 s on a busy
    # machine; 1.2 s vs 1.6 s with the same image 20 times).
    "--mm-processor-cache-gb": "0",
    "--allowed-media-domains": NO_REMOTE_MEDIA,
    # A clip's own frame rate and frame numbers (media_io_kwargs) and the video processor's bounds
    # (mm_processor_kwargs) on each chat request: without them vLLM takes a clip sent as frames for
    # 1 fps from frame 0, and Qwen3-VL's timestamps and Qwen2.5-VL's temporal positions differ from
    # the trainer's. Only key holders reach the server, and the guard lets through only what
    # saccade's client sends, within bounds (validation.check_request_mm_kwargs).
    "--trust-request-mm-kwargs": None,
    # The weight-transfer engine the workers build (saccade.serving.transfer, registered by the
    # worker extension): the trainer may then send new weights over a process group instead of a
    # folder (engine.weight_sync = "collective"). Building it costs nothing until a trainer joins.
    "--weight-transfer-config": json.dumps({"backend": GLOO_BACKEND}),
}


def with_defaults(vllm_args: list[str]) -> list[str]:
    """vLLM's argv with saccade's defaults for the flags the user did not give, and a float32
    lm_head (`with_float32_head`)."""
    given = {a.split("=", 1)[0] for a in vllm_args if a.startswith("--")}
    out = list(vllm_args)
    for flag, value in DEFAULT_FLAGS.items():
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return with_float32_head(out)


# The lm_head's products summed and returned in float32 (vLLM: "required for RL training-inference
# consistency"), as the trainer and the embedded engine compute them (saccade.models.head). vLLM's
# default rounds the logits to the model's dtype (bf16: about 3 significant digits) before its
# float32 softmax. In a float32 model the two are the same.
HEAD_DTYPE = "float32"


def with_float32_head(vllm_args: list[str]) -> list[str]:
    """`--hf-overrides` with head_dtype = float32 added, merged into the user's own overrides (a
    JSON object, given as `--hf-overrides JSON` or `--hf-overrides=JSON`); a head_dtype the user
    set is kept."""
    out, overrides, at = [], {}, None
    args = iter(vllm_args)
    for arg in args:
        if arg == "--hf-overrides" or arg.startswith("--hf-overrides="):
            text = arg.split("=", 1)[1] if "=" in arg else next(args, "{}")
            try:
                overrides = json.loads(text)
            except json.JSONDecodeError as err:
                raise SystemExit(f"saccade serve: --hf-overrides must be a JSON object ({err}): {text!r}") from None
            if not isinstance(overrides, dict):
                raise SystemExit(f"saccade serve: --hf-overrides must be a JSON object, not {text!r}")
            at = len(out)
            continue
        out.append(arg)
    overrides.setdefault("head_dtype", HEAD_DTYPE)
    flag = ["--hf-overrides", json.dumps(overrides)]
    return out[:at] + flag + out[at:] if at is not None else out + flag


# vLLM's --dtype spellings -> torch's names.
DTYPE_NAMES = {"float": "float32", "float32": "float32", "half": "float16", "float16": "float16",
               "bfloat16": "bfloat16", "auto": "auto"}


def with_cpu_dtype(vllm_args: list[str], family) -> tuple[list[str], str | None]:
    """vLLM's argv for a CPU server of `family`: where vLLM's CPU build serves the family in one
    dtype only (`family.vllm_cpu_dtype`), --dtype is set to it when absent or "auto" (returned with
    the line that says so), and another dtype is refused with a SystemExit that says what to do:
    vLLM itself would start and then kill its engine at the first request."""
    if family.vllm_cpu_dtype is None:
        return list(vllm_args), None
    want, why = family.vllm_cpu_dtype
    out, given = list(vllm_args), None
    while (value := pop_option(out, "--dtype")) is not None:  # vLLM's parser keeps the last one given
        given = value
    if given is not None and DTYPE_NAMES.get(given, given) not in (want, "auto"):
        raise SystemExit(
            f"saccade serve: vLLM's CPU build serves {family.name} in {want} only, not {given} ({why}). "
            f"Pass --dtype {want}, or leave --dtype out and it is chosen. A float32 trainer can sample from "
            f"it (its logprob gap is then {want}'s rounding: docs/families.md, {family.name}). vLLM's GPU "
            "kernels have no such limit (untested here)")
    note = None if given == want else (
        f"saccade serve: {family.name} on vLLM's CPU build: --dtype {want} ({why})")
    return out + ["--dtype", want], note


CPU_KV_CACHE_MAX_GIB = 4


def cpu_kv_cache_gib(available_bytes: int) -> int:
    """The KV cache a CPU server takes when VLLM_CPU_KVCACHE_SPACE is unset: a quarter of the
    memory available now, at least 1 and at most CPU_KV_CACHE_MAX_GIB GiB. Left to itself,
    vLLM's CPU build asks for 92% of a NUMA node and refuses to start when that much is not
    free (here: "Available memory on node 0 (8.95/10.71 GiB) ... is less than desired")."""
    return max(1, min(CPU_KV_CACHE_MAX_GIB, available_bytes // 4 // 2**30))


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def choose_cpu_kv_cache(environ: dict[str, str]) -> str | None:
    """On a machine without CUDA, set VLLM_CPU_KVCACHE_SPACE when the user has not; returns the
    line that says so (None when nothing was chosen)."""
    if "VLLM_CPU_KVCACHE_SPACE" in environ:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    gib = cpu_kv_cache_gib(available_memory_bytes())
    environ["VLLM_CPU_KVCACHE_SPACE"] = str(gib)
    return (f"saccade serve: no GPU, so a {gib} GiB KV cache in host memory (a quarter of what is free, "
            f"1-{CPU_KV_CACHE_MAX_GIB} GiB); set VLLM_CPU_KVCACHE_SPACE=<GiB> to choose another size")


def api_keys(given: list[str] | str | None, environ) -> tuple[str, ...]:
    """Every key the server accepts: each `--api-key` value, else VLLM_API_KEY (vLLM's precedence)."""
    given = [given] if isinstance(given, str) else list(given or [])
    return tuple(k for k in (given or [environ.get("VLLM_API_KEY")]) if k)


def check_exposure(host: str, api_keys: tuple[str, ...]) -> str | None:
    """SystemExit for a server beyond loopback without a key; the warning to print for one on
    loopback without a key (any local user or process may then sample, push weights, pause it)."""
    if api_keys:
        return None
    if not is_loopback(host):
        raise SystemExit(
            f"saccade serve: refusing to listen on {host!r} without an API key: pass --api-key KEY "
            "(or VLLM_API_KEY), or keep the default --host 127.0.0.1"
        )
    return ("saccade serve: warning: no API key, so every local user and process may use this server (sample, "
            "load weights, pause it); pass --api-key KEY or set VLLM_API_KEY (saccade launch makes one itself)")


def check_dev_mode(environ) -> None:
    """vLLM's dev mode adds routes that run any worker method (/collective_rpc) and its own
    /update_weights, which would shadow saccade's checked one (vLLM's routes are matched first)."""
    if environ.get("VLLM_SERVER_DEV_MODE", "0") not in ("", "0"):
        raise SystemExit("saccade serve: VLLM_SERVER_DEV_MODE is set: its routes (/collective_rpc, its own "
                         "/update_weights in place of saccade's) run anything a client asks; unset it")


# vLLM's weight-transfer backends that need GPUs (serving/transfer.py's saccade_gloo runs anywhere).
GPU_BACKENDS = ("nccl", "ipc", "sparse_nccl", "nccl_m2n", "sharded_rdt")


def transfer_backend(config) -> str | None:
    """The backend --weight-transfer-config names (a dict, vLLM's config object or None)."""
    if config is None:
        return None
    return config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)


def check_weight_transfer(backend: str | None, *, on_cpu: bool, host: str, environ) -> str | None:
    """SystemExit for a GPU backend on a CPU server, or for ipc beyond loopback; for ipc on loopback,
    the note to print once the server lets its workers unpickle the CUDA IPC handles a key holder
    sends (VLLM_ALLOW_INSECURE_SERIALIZATION=1, set in `environ`: vLLM's HTTP client pickles them)."""
    if backend in GPU_BACKENDS and on_cpu:
        raise SystemExit(f"saccade serve: --weight-transfer-config names {backend!r}, which needs GPUs, and this server "
                         f"runs on the CPU (vLLM's CPU build): leave the flag out (the default is "
                         f"{GLOO_BACKEND}, which runs anywhere)")
    if backend != "ipc":
        return None
    if not is_loopback(host):
        raise SystemExit(f"saccade serve: --weight-transfer-config names 'ipc' (the trainer on this server's GPU), and "
                         f"--host is {host!r}: an ipc server unpickles the handles its trainer sends, so it listens "
                         "on loopback only")
    environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return ("saccade serve: weight transfer over CUDA IPC: the workers unpickle the handles a key holder sends "
            "(VLLM_ALLOW_INSECURE_SERIALIZATION=1; docs/security.md)")


USAGE = ("usage: saccade serve MODEL [--max-body-mb N] [--weights-root DIR] "
         "[vLLM arguments, e.g. --dtype float32 --enforce-eager]")
WEIGHTS_ROOT_HELP = (
    "--weights-root DIR: /update_weights loads only folders whose real path (symlinks resolved) is "
    "under DIR, or the served checkpoint itself; anything else gets a 403. Default: the directory "
    "`saccade serve` was started in, which holds the trainer's default engine.weights_dir "
    "(<run_dir>/engine-weights, run_dir relative) when trainer and server start in the same "
    "directory, as in the README. A trainer writing elsewhere (an absolute run_dir or "
    "engine.weights_dir) needs --weights-root set to that folder or a parent of it."
)


def pop_option(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` or `flag=VALUE` from `args` (saccade's own options, before vLLM
    parses the rest); its value, or None when absent."""
    for i, arg in enumerate(args):
        if arg == flag:
            if i + 1 >= len(args):
                raise SystemExit(f"saccade serve: {flag} needs a value")
            value = args[i + 1]
            del args[i : i + 2]
            return value
        if arg.startswith(flag + "="):
            del args[i]
            return arg.split("=", 1)[1]
    return None
