"""What `saccade launch` would run (saccade.tools.launcher.plan, the [launch] layout): the commands of
each node, checked against the config that made them; the layout's own checks."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import saccade
from saccade.cli import main
from saccade.config import ConfigError, RunConfig, load_config
from saccade.tools.launcher.plan import dry_run_text, node_plan

CONFIGS = Path(saccade.__file__).parent / "configs"


def layout(tmp_path, text: str, *overrides: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(RunConfig, path, list(overrides))


TWO_NODES = """
[model]
path = "Qwen/Qwen3-VL-8B-Instruct"
dtype = "bfloat16"
[engine]
kind = "vllm"
weight_sync = { kind = "adapter" }
[lora]
rank = 16
[images]
min_pixels = 65536
max_pixels = 802816
[log]
name = "two-nodes"
[launch]
server_port = 9001
gpu_memory_utilization = 0.85
[[launch.nodes]]
host = "10.0.0.1"
trainer_gpus = [0, 1, 2, 3]
server_gpus = [[4], [5], [6, 7]]
[[launch.nodes]]
host = "10.0.0.2"
trainer_gpus = [4, 5, 6, 7]
server_gpus = [[0, 1], [2], [3]]
"""


def test_the_8_gpu_configs_dry_run_prints_the_commands_the_config_implies(capsys):
    name = "qwen3vl-2b-8gpu.toml"
    assert main(["launch", str(CONFIGS / name), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    cfg = load_config(RunConfig, CONFIGS / name)
    assert lines[0].startswith("# node 0 (127.0.0.1): 7 vLLM server(s), 1 trainer rank(s), on GPUs")
    commands = [shlex.split(line) for line in lines[1:]]
    assert len(commands) == 8  # seven servers, then the trainer
    for gpu, argv in enumerate(commands[:7], start=1):
        env = dict(a.split("=", 1) for a in argv[:1])
        assert env == {"CUDA_VISIBLE_DEVICES": str(gpu)}
        serve = argv[1:]
        flag = lambda f: serve[serve.index(f) + 1]  # noqa: E731
        assert serve[1:5] == ["-m", "saccade", "serve", "Qwen/Qwen3-VL-2B-Instruct"]
        assert int(flag("--port")) == 8000 + gpu and f"http://127.0.0.1:{8000 + gpu}" == cfg.engine.urls[gpu - 1]
        assert json.loads(flag("--mm-processor-kwargs")) == {"size": {"shortest_edge": 65536, "longest_edge": 802816}}
        assert flag("--max-lora-rank") == "32" and "--enable-lora" in serve
        assert flag("--gpu-memory-utilization") == "0.9" and flag("--dtype") == "bfloat16"
        assert flag("--max-model-len") == str(cfg.trainer.max_tokens)
        assert json.loads(flag("--limit-mm-per-prompt")) == {"image": 4, "video": 0}
        assert Path(flag("--weights-root")) == (Path.cwd() / "runs" / "qwen3vl-2b-8gpu")
        assert "--host" not in serve and "--tensor-parallel-size" not in serve
    trainer = commands[7]
    assert trainer[:2] == ["CUDA_VISIBLE_DEVICES=0", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert trainer[3:] == ["-m", "saccade", "rl", str(CONFIGS / name)]  # one rank: no torchrun


def test_a_sharded_layout_runs_the_trainer_under_torchrun_with_the_same_overrides(capsys):
    nodes = '[{"trainer_gpus": [0, 1, 2, 3], "server_gpus": [[4], [5], [6], [7]]}]'
    argv = [str(CONFIGS / "qwen3vl-2b-8gpu.toml"), "--lora", "false", "--engine.weight_sync.kind", "files",
            "--launch.nodes", nodes]
    assert main(["launch", *argv, "--dry-run", "--resume"]) == 0
    *servers, trainer = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()[1:]]
    assert len(servers) == 4 and all("--enable-lora" not in s for s in servers)  # full weights are pushed
    assert [s[0] for s in servers] == [f"CUDA_VISIBLE_DEVICES={g}" for g in (4, 5, 6, 7)]
    assert trainer[0] == "CUDA_VISIBLE_DEVICES=0,1,2,3"
    at = trainer.index("torch.distributed.run")
    assert trainer[at + 1:at + 4] == ["--standalone", "--nproc-per-node", "4"]
    assert trainer[at + 4:] == ["-m", "saccade", "rl", *argv, "--resume"]  # the launcher's overrides, passed on


def test_two_nodes_number_the_servers_across_the_layout_and_meet_at_the_first_trainer_node(tmp_path):
    cfg = layout(tmp_path, TWO_NODES)
    assert cfg.engine.urls == [f"http://10.0.0.{1 + (i >= 3)}:{9001 + i}" for i in range(6)]
    assert cfg.launch.world_size == 8
    plans = [node_plan(cfg, r, config="run.toml", overrides=[], python="python") for r in (0, 1)]
    for rank, plan in enumerate(plans):
        *servers, trainer = plan
        assert [s.url for s in servers] == cfg.engine.urls[3 * rank:3 * rank + 3]
        for server in servers:
            argv = list(server.argv)
            assert argv[argv.index("--host") + 1] == f"10.0.0.{rank + 1}"  # listens where the trainer reaches it
            assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85"
            assert argv[argv.index("--max-lora-rank") + 1] == "16"
        assert trainer.argv[3:13] == ("--nnodes", "2", "--nproc-per-node", "4", "--node-rank", str(rank),
                                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500")
        assert trainer.argv[13:15] == ("--rdzv-id", "two-nodes")
        # torchrun's rank 0 may be on either node: each trainer knows its node's host, where a
        # collective weight sync's servers reach rank 0 (saccade.run.setup)
        assert trainer.env["SACCADE_NODE_HOST"] == f"10.0.0.{rank + 1}"
    tp = [list(s.argv) for s in plans[0][:3] + plans[1][:3]]
    assert [a[a.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in a else "1" for a in tp] == \
        ["1", "1", "2", "2", "1", "1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in plans[1][:3]] == ["0,1", "2", "3"]
    text = dry_run_text(cfg, config="run.toml", overrides=[], python="python")
    assert "on that machine: saccade launch run.toml --node-rank 1" in text


def test_hosts_from_the_command_line_replace_the_layouts(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(TWO_NODES)
    assert main(["launch", str(path), "--hosts", "gpu-a,gpu-b", "--node-rank", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--rdzv-endpoint gpu-a:29500" in out and "--host gpu-b" in out and "10.0.0" not in out
    # the trainer reads the same hosts: they travel as an override
    assert "--launch.nodes" in out.splitlines()[-1]
    assert main(["launch", str(path), "--hosts", "gpu-a", "--dry-run"]) == 2
    assert "--hosts names 1 host(s), but the layout has 2 node(s)" in capsys.readouterr().err
    assert main(["launch", str(path), "--node-rank", "2", "--dry-run"]) == 2
    assert "--node-rank 2: the layout has 2 node(s), 0..1" in capsys.readouterr().err


def test_cpu_nodes_serve_on_vllms_cpu_build_in_the_familys_dtype(tmp_path):
    text = '[engine]\nkind = "vllm"\n[[launch.nodes]]\ntrainer_ranks = 2\nservers = 2\n'
    cfg = layout(tmp_path, text)
    *servers, trainer = node_plan(cfg, 0, config="run.toml", overrides=[], python="python")
    assert trainer.argv[1:5] == ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node") and trainer.env == {}
    for server in servers:
        argv = list(server.argv)
        assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
        assert "--gpu-memory-utilization" not in argv and server.env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    # vLLM's CPU build serves Qwen3.5 in bf16 only: its servers get that, the trainer keeps float32
    cfg = layout(tmp_path, text, "--model.path", "qwen3.5-tiny")
    argv = list(node_plan(cfg, 0, config="run.toml", overrides=[], python="python")[0].argv)
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and cfg.model.dtype == "float32"


@pytest.mark.parametrize("text, message", [
    ("[[launch.nodes]]\ntrainer_gpus = [0]\ntrainer_ranks = 2\n", "trainer_ranks = 2 but trainer_gpus names 1"),
    ("[[launch.nodes]]\ntrainer_gpus = [0]\nserver_gpus = [[1], [1]]\n", "two servers cannot share a GPU"),
    ("[[launch.nodes]]\nservers = 1\n", "no node runs the trainer"),
    ("[[launch.nodes]]\ntrainer_gpus = [0]\n[[launch.nodes]]\ntrainer_gpus = [0, 1]\n",
     "every node that trains runs as many trainer ranks"),
    ('[engine]\nkind = "vllm"\nurls = ["http://127.0.0.1:8000"]\n[[launch.nodes]]\ntrainer_gpus = [0]\nserver_gpus = [[1]]\n',
     "engine.urls .* are not the servers launch.nodes start"),
    ("[[launch.nodes]]\ntrainer_gpus = [0]\nserver_gpus = [[1]]\n", "engine.kind is 'embedded'"),
])
def test_a_layout_that_cannot_run_is_refused_when_the_config_loads(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        layout(tmp_path, text)


def test_a_config_without_a_layout_says_what_to_add(capsys):
    assert main(["launch", str(CONFIGS / "demo.toml"), "--dry-run"]) == 2
    assert "the config has no [launch] layout: add [[launch.nodes]]" in capsys.readouterr().err


def test_every_shipped_layout_dry_runs_and_each_gpu_is_used_once_or_shared_by_a_trainer_and_a_server(capsys):
    for path in sorted(CONFIGS.glob("qwen*.toml")):
        cfg = load_config(RunConfig, path)
        assert main(["launch", str(path), "--dry-run"]) == 0, path.name
        out = capsys.readouterr().out
        assert out.count("-m saccade serve ") == cfg.launch.servers == len(cfg.engine.urls)
        assert out.count("-m saccade rl ") == 1
        [node] = cfg.launch.nodes
        servers = [g for gpus in node.server_gpus for g in gpus]
        assert len(set(servers)) == len(servers) and set(servers) | set(node.trainer_gpus) <= set(range(8))
