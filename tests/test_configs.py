"""The shipped configs: each loads and passes `saccade rl CONFIG --dry-run`; the real-model ones
(every family's, at the hub ids) carry memory estimates in their headers that must equal
`saccade.tools.memory`'s output, and the commands in their headers must agree with their bodies."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
import typing
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import BaseModel

import saccade
from saccade.cli import build_parser, main
from saccade.config import LegacyConfigWarning, RunConfig, load_config, split_overrides
from saccade.tools.launcher.plan import node_plan
from saccade.tools.memory import estimate_run, header_lines

CONFIGS = Path(saccade.__file__).parent / "configs"
SHIPPED = sorted(CONFIGS.glob("*.toml"))


@dataclass(frozen=True)
class Real:
    """A shipped config for a real checkpoint, and what its header and body must agree on."""

    name: str
    hub_id: str
    pixels_per_token: int  # (patch x merge)^2: 1024 for Qwen3-VL's 16-px patches, 784 for Qwen2.5-VL's 14
    world_size: int = 1  # the trainer's torchrun ranks as shipped
    ports: tuple[int, ...] = (8001,)  # the servers' ports (engine.urls, the layout's)

    @property
    def path(self) -> Path:
        return CONFIGS / self.name

    @property
    def one_gpu(self) -> bool:
        return self.name.endswith("-1gpu.toml")


SEVEN = tuple(range(8001, 8008))  # 8 GPUs: the trainer on GPU 0, seven servers beside it
FOUR = tuple(range(8001, 8005))  # 8 GPUs: the trainer on GPUs 0-3, four servers on 4-7
REAL = [
    *(Real(f"qwen3vl-{size}-{layout}.toml", f"Qwen/Qwen3-VL-{size.upper()}-Instruct", 1024,
           ports=(8001,) if layout == "1gpu" else SEVEN)
      for size in ("2b", "4b", "8b") for layout in ("1gpu", "8gpu")),
    Real("qwen2.5vl-7b-1gpu.toml", "Qwen/Qwen2.5-VL-7B-Instruct", 784),
    Real("qwen2.5vl-7b-8gpu.toml", "Qwen/Qwen2.5-VL-7B-Instruct", 784, ports=SEVEN),
    # no 1-GPU config: the trainer's and a server's bf16 weights alone exceed one 80 GB GPU (its header)
    Real("qwen3vl-30b-a3b-8gpu.toml", "Qwen/Qwen3-VL-30B-A3B-Instruct", 1024, world_size=4, ports=FOUR),
    Real("qwen3.5-9b-1gpu.toml", "Qwen/Qwen3.5-9B", 1024),
    Real("qwen3.5-35b-a3b-8gpu.toml", "Qwen/Qwen3.5-35B-A3B", 1024, world_size=4, ports=FOUR),
]
QWEN = [r.path for r in REAL if r.name.startswith(("qwen3vl-2b", "qwen3vl-4b", "qwen3vl-8b"))]  # the first six
ids = lambda r: r.name  # noqa: E731


def test_the_real_model_configs_are_shipped():
    assert sorted(p.name for p in CONFIGS.glob("qwen*.toml")) == sorted(r.name for r in REAL)
    # configs/ at the repository root is a link to the package's configs
    root = Path(saccade.__file__).parents[2] / "configs"
    if root.exists():
        assert root.resolve() == CONFIGS.resolve()


@pytest.mark.parametrize("real", REAL, ids=ids)
def test_the_async_configs_train_with_what_made_one_step_ahead_learn(real):
    """Every real config samples one step ahead at one optimizer step per batch: TIS there
    (pi / pi_old is 1 at the gradient) bounded nothing and one step ahead collapsed, while the
    clip against the engine's logprobs is the bound (docs/async.md, "One step ahead that breaks")."""
    from saccade.config.run import effective_loss

    cfg = load_config(RunConfig, real.path)
    assert cfg.rollout.max_async_level == 1 and cfg.trainer.num_iterations == 1
    loss = effective_loss(cfg)
    assert (loss.tis_cap, loss.is_mask) == (None, "off")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_config_loads_and_dry_runs(path, capsys, tmp_path):
    cfg = load_config(RunConfig, path)
    assert main(["rl", str(path), "--dry-run"]) == 0
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(capsys.readouterr().out)
    assert load_config(RunConfig, resolved) == cfg  # --dry-run prints every value in effect


def estimate_from_command(command: str):
    """The RunEstimate a `saccade memory CONFIG ...` command line in a header describes."""
    argv = shlex.split(command)
    assert argv[:2] == ["saccade", "memory"], command
    known, overrides = split_overrides(argv[1:])
    args = build_parser().parse_args(known)
    args.config = str(CONFIGS / Path(args.config).name)  # configs/ in the repo, the package's here
    cfg = load_config(RunConfig, args.config, overrides)
    return estimate_run(cfg, gpu_memory_utilization=args.gpu_memory_utilization, gpu_gib=args.gpu_gib,
                        shared_gpu=args.shared_gpu, world_size=args.world_size)


def header_of(path: Path) -> str:
    return path.read_text().split("\n[", 1)[0]


@pytest.mark.parametrize("real", REAL, ids=ids)
def test_header_memory_lines_equal_the_estimator(real):
    path = real.path
    header = header_of(path)
    reproduce = re.search(r"#   reproduce: (saccade memory .+)", header)
    assert reproduce, f"{path.name}: no 'reproduce: saccade memory ...' line"
    assert f"configs/{path.name}" in reproduce.group(1)
    est = estimate_from_command(reproduce.group(1))
    for line in header_lines(est):
        assert line in header.splitlines(), f"{path.name}: header out of date; expected line:\n{line}"
    assert est.fits
    assert est.shared_gpu == real.one_gpu
    assert est.world_size == real.world_size


@pytest.mark.parametrize("path", [r.path for r in REAL], ids=lambda p: p.name)
def test_header_claims_that_something_does_not_fit_hold(path):
    # "... does not fit: `saccade memory ...`" (possibly across a line break) must not fit.
    header = " ".join(line.lstrip("# ").rstrip() for line in header_of(path).splitlines())
    for command in re.findall(r"does not fit:? `(saccade memory [^`]+)`", header):
        assert not estimate_from_command(command).fits, command
    for command in re.findall(r"it fits[^`]*`(saccade memory [^`]+)`", header):
        assert estimate_from_command(command).fits, command


@pytest.mark.parametrize("real", REAL, ids=ids)
def test_the_launch_commands_agree_with_the_body(real):
    # What `saccade launch CONFIG` runs (its --dry-run plan) is what the body and the header's memory
    # figures assume: the servers' image bounds, LoRA rank, GPU share and model length; the trainer's ranks.
    path = real.path
    cfg = load_config(RunConfig, path)
    raw = tomllib.loads(path.read_text())
    header = header_of(path)
    assert cfg.model.path == real.hub_id
    assert raw["task"]["kind"] == "openmmreasoner"
    assert cfg.engine.kind == "vllm" and cfg.engine.weight_sync.kind == "adapter" and cfg.lora is not None
    assert "urls" not in raw["engine"]  # the layout's servers
    assert cfg.loss.max_completion_tokens == cfg.sampling.max_tokens
    assert cfg.engine.max_concurrency >= cfg.rollout.prompts_per_step
    assert cfg.rollout.max_async_level == 1  # one step sampled ahead, torchrun trainers too
    ports = tuple(int(u.rsplit(":", 1)[1]) for u in cfg.engine.urls)
    assert ports == real.ports
    [node] = cfg.launch.nodes
    processes = node_plan(cfg, 0, config=f"configs/{path.name}", overrides=[], python="python")
    *servers, trainer = processes
    assert [s.url for s in servers] == cfg.engine.urls and trainer.url is None
    image_tokens = cfg.images.max_pixels // real.pixels_per_token
    assert cfg.images.max_pixels % real.pixels_per_token == 0 and cfg.images.min_pixels % real.pixels_per_token == 0
    used = set()
    for server, gpus in zip(servers, node.server_gpus, strict=True):
        argv = list(server.argv)
        flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
        assert argv[:5] == ["python", "-m", "saccade", "serve", real.hub_id]  # the hub id itself: no copied folder
        assert json.loads(flag("--mm-processor-kwargs")) == {
            "size": {"shortest_edge": cfg.images.min_pixels, "longest_edge": cfg.images.max_pixels}}
        assert int(flag("--max-lora-rank")) >= cfg.lora.rank and "--enable-lora" in argv
        assert int(flag("--max-model-len")) >= cfg.sampling.max_tokens + image_tokens
        assert float(flag("--gpu-memory-utilization")) == cfg.launch.gpu_memory_utilization
        assert flag("--dtype") == cfg.model.dtype
        assert server.env == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        used |= set(gpus)
    assert cfg.trainer.max_tokens >= cfg.sampling.max_tokens + image_tokens  # one longest sample fits a micro-batch
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, node.trainer_gpus))
    assert len(node.trainer_gpus) == real.world_size
    if real.world_size > 1:  # the trainer is sharded as the header's figures assume
        assert "torch.distributed.run" in trainer.argv and f"{real.world_size}" in trainer.argv
    assert (used & set(node.trainer_gpus) != set()) == real.one_gpu  # one GPU: the server beside the trainer
    assert len(used | set(node.trainer_gpus)) == (1 if real.one_gpu else 8)
    assert f"saccade launch configs/{path.name}" in " ".join(line.lstrip("# ") for line in header.splitlines())


NEW_FAMILIES = [r.path for r in REAL if r.path not in QWEN]
DOCUMENTED = [("README.md", QWEN), ("docs/qwen3vl.md", QWEN), ("docs/families.md", NEW_FAMILIES)]


@pytest.mark.parametrize("doc, configs", DOCUMENTED, ids=[doc for doc, _ in DOCUMENTED])
def test_documented_estimates_equal_the_estimator(doc, configs):
    # The tables in the README and docs/qwen3vl.md quote each Qwen3-VL config's trainer and server
    # totals; docs/families.md's "Configs" the other families'.
    path = Path(saccade.__file__).parents[2] / doc
    if not path.exists():
        pytest.skip(f"{doc} is not shipped with the package")
    rows = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    for config in configs:
        reproduce = re.search(r"#   reproduce: (saccade memory .+)", header_of(config)).group(1)
        est = estimate_from_command(reproduce)
        short = config.stem.removeprefix("qwen3vl-")
        row = [r for r in rows if r.startswith((f"| `configs/{config.name}`", f"| {short} "))]
        assert len(row) == 1, f"{doc}: no single table row for {config.name}"
        figures = re.findall(r"\d+\.\d", row[0])
        assert f"{est.trainer.total:.1f}" in figures and f"{est.server.total:.1f}" in figures, (doc, row[0])


def test_memory_command(capsys):
    path = str(CONFIGS / "qwen3vl-8b-1gpu.toml")
    args = [path, "--gpu-memory-utilization", "0.30", "--shared-gpu"]
    assert main(["memory", *args, "--header"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == header_lines(estimate_from_command(f"saccade memory configs/qwen3vl-8b-1gpu.toml {' '.join(args[1:])}"))
    assert main(["memory", *args]) == 0  # the tables
    out = capsys.readouterr().out
    assert "activations" in out and "KV cache" in out and "fits" in out
    assert main(["memory", *args, "--trainer.max_tokens", "8192"]) == 1  # does not fit: exit 1
    assert "DOES NOT FIT" in capsys.readouterr().out


DOCS = [Path(saccade.__file__).parents[2] / "README.md", *sorted((Path(saccade.__file__).parents[2] / "docs").glob("*.md"))]


def config_keys() -> set[str]:
    """Every dotted key a run config may have, any task kind's."""
    keys = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            keys.add(prefix + name)
            for sub in typing.get_args(info.annotation) or (info.annotation,):
                if isinstance(sub, type) and issubclass(sub, BaseModel):
                    walk(sub, f"{prefix}{name}.")
            if typing.get_origin(info.annotation) is dict:  # a table of sections (eval.sets): <name> is "*"
                value = typing.get_args(info.annotation)[1]
                for sub in typing.get_args(typing.get_args(value)[0] if hasattr(value, "__metadata__") else value):
                    if isinstance(sub, type) and issubclass(sub, BaseModel):
                        walk(sub, f"{prefix}{name}.*.")

    walk(RunConfig, "")
    return keys


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_configs_and_overrides_use_todays_keys(doc, tmp_path):
    """Every TOML example in the README and docs loads without an old key, and every
    --section.key override they show names a key there is."""
    if not doc.exists():
        pytest.skip(f"{doc.name} is not shipped with the package")
    text = doc.read_text()
    for block in re.findall(r"```toml\n(.*?)```", text, re.S):
        if not set(re.findall(r"^\[(\w+)", block, re.M)) <= set(RunConfig.model_fields):
            continue  # not a run config (pyproject and the like)
        path = tmp_path / "example.toml"
        path.write_text(block)
        with warnings.catch_warnings():
            warnings.simplefilter("error", LegacyConfigWarning)
            load_config(RunConfig, path)
    keys = config_keys()
    sections = "|".join(RunConfig.model_fields)
    for key in re.findall(rf"--((?:{sections})\.[a-z_.]+[a-z_])", text):
        entry = re.sub(r"^eval\.sets\.\w+\.", "eval.sets.*.", key)
        assert key in keys or entry in keys or key.startswith("rollout.reward_weights."), \
            f"{doc.name}: --{key} is no config key"

