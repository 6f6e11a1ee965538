"""What this process holds, as figures a run logs each step: resident memory now and at its peak
(and the CUDA peak), open file descriptors and threads. Read from /proc on Linux; fewer figures
elsewhere. The soak benchmark reads the same figures to tell a leak."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


def proc_status_kb(field: str) -> int | None:
    """A field of /proc/self/status in kB (VmRSS, VmHWM, ...), or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def memory_metrics(device=None) -> dict[str, float]:
    """This process's resident memory now and at its peak (`rss_mb`, `peak_rss_mb`), and on CUDA
    the device memory allocated at its peak since the last call (`cuda_peak_mb`; the peak is
    reset, so each call covers the step since the one before)."""
    out: dict[str, float] = {}
    rss, peak = proc_status_kb("VmRSS"), proc_status_kb("VmHWM")
    if rss is None:  # not Linux: ru_maxrss (kB on Linux and BSD, bytes on macOS) is all there is
        import resource

        peak_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        out["peak_rss_mb"] = peak_bytes / 2**20
    else:
        out["rss_mb"] = rss / 1024
        out["peak_rss_mb"] = (peak or rss) / 1024
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        out["cuda_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
    return out


def process_metrics() -> dict[str, float]:
    """What a long run could leak besides memory: this process's open file descriptors
    (`open_fds`, entries of /proc/self/fd, the listing's own included), its OS threads (`threads`, /proc/self/status; torch's
    and the libraries' pools included) and its Python threads (`python_threads`). The first two
    are left out off Linux."""
    out = {"python_threads": float(threading.active_count())}
    threads = proc_status_kb("Threads")  # a count, not kB: the same "Name: value" line
    if threads is not None:
        out["threads"] = float(threads)
    try:
        out["open_fds"] = float(len(os.listdir("/proc/self/fd")))
    except OSError:
        pass
    return out
