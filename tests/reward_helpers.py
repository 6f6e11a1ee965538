"""Reward functions for the worker tests (tests/rewards/test_user_workers.py), named by import path
("reward_helpers:pid"): tests/ is on the test process's sys.path, which a worker is given.
Each returns its worker's pid (as a float), so a test sees which process served a call; the
completion says how to misbehave. And `worker_pids`: the test process's live workers (also
counted by tests/loops/test_rl.py, which is why this file sits at the top of tests/). And `hash_spread`,
a reward in [0, 1] from a hash of the reply, that docs/recipes.md's OpenMMReasoner clip figure used
(`PYTHONPATH=tests`, "reward_helpers:hash_spread"): a random tiny model's groups then carry advantages."""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import os
import subprocess
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux: /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids() -> set[int]:
    """This process's live reward workers (Linux: /proc)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z" and b"saccade.rewards.user_child" in command:
            pids.add(int(stat.parent.name))
    return pids


def pid(completion):
    """'sleep' overruns any limit, 'exit' ends the worker, 'segfault' crashes it."""
    if completion == "sleep":
        time.sleep(600)
    if completion == "exit":
        os._exit(1)
    if completion == "segfault":
        ctypes.string_at(0)
    return float(os.getpid())


async def async_pid(completion):
    """'block' blocks the worker's event loop (a sync call inside async def); 'slow' only overruns."""
    if completion == "block":
        time.sleep(600)
    if completion == "slow":
        await asyncio.sleep(600)
    return float(os.getpid())


def spawns(completion):
    """Starts a process (its pid written to the file named by `completion`), then overruns."""
    child = subprocess.Popen(["sleep", "600"])
    Path(completion).write_text(str(child.pid))
    time.sleep(600)


def takes_sample(completion, sample):
    return float(sample.answer == completion)


def returns_generator(completion):
    return (x for x in [1.0])


def hash_spread(completion: str, **kwargs) -> float:
    return int(hashlib.blake2b(completion.encode(), digest_size=2).hexdigest(), 16) / 65535
