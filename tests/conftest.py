"""Shared fixtures: one tiny Qwen3-VL per test session, built offline (cached across sessions)."""

from __future__ import annotations

import os

import pytest
import torch

# The suite runs in pytest-xdist workers (`-n 2` in pyproject's addopts; `-n 0` runs it in this
# process). Each worker takes its share of the cores and never more (oversubscription costs 10x
# here): one thread each on this 2-core machine. Tests whose figures depend on the thread count
# set it themselves (test_golden.py), and parity tests compare two paths at the same count.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# Files that take a minute or more, first, so that the two workers end together: xdist hands out
# whole files in this order (the longest-first rule; `pytest_xdist_make_scheduler` below), and a
# long file left to the end runs alone. tests/serving is one unit: its tests share one vLLM
# server (tests/serving/conftest.py).
LONG_FIRST = (
    "tests/serving/",
    "tests/distributed/test_distributed_rl.py",
    "tests/tools/launcher/test_launch_vllm.py",
    "tests/test_kills.py",
    "tests/tools/bench/test_bench_gpu.py",
    "tests/trainer/checkpoint/test_checkpoint_distributed.py",
    "tests/distributed/test_mixed_precision.py",
    "tests/models/test_qwen3_vl_moe.py",
    "tests/models/test_qwen3_5_vllm.py",
    "tests/test_distributed.py",
)


def xdist_unit(path: str) -> str:
    """The unit a worker runs whole: the serving package, else the test's file (so that module
    fixtures, which start servers and train runs, are made once)."""
    return "tests/serving/" if path.startswith("tests/serving/") else path


def long_first_rank(unit: str) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if unit.startswith(prefix)), len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    """The long units first. The sort is stable and the same in every worker, as xdist requires."""
    items.sort(key=lambda item: long_first_rank(xdist_unit(item.path.relative_to(config.rootpath).as_posix())))


def pytest_xdist_make_scheduler(config, log):
    """xdist's file scheduling, with tests/serving as one unit, in the order collected (long
    first). Not `--dist loadgroup` with markers: with pytest 9 its group suffix never reaches
    the node ids (xdist 3.8 sets `item._nodeid`; pytest 9's `nodeid` reads `item._id`), so
    every test went its own way and module fixtures were made in both workers."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_unit(nodeid.split("::")[0])

    return ByUnit(config, log)


@pytest.fixture(autouse=True)
def torch_threads_restored():
    """A run with `trainer.torch_threads` sets torch's thread count for the whole process: put
    it back after each test, so no test runs at another test's count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_rewards():
    """`saccade.rewards.weighted.Rewards(...)` whose reward workers (processes) are closed when the test ends."""
    from saccade.rewards.weighted import Rewards

    made: list[Rewards] = []

    def make(weights, **kwargs) -> Rewards:
        made.append(Rewards(weights, **kwargs))
        return made[-1]

    yield make
    for rewards in made:
        rewards.close()


@pytest.fixture(scope="session")
def tiny_path():
    from saccade.models.presets import preset_path

    return preset_path("tiny", seed=0)


@pytest.fixture(scope="session")
def limits():
    from saccade.config import ImagesConfig

    return ImagesConfig(min_pixels=32 * 32, max_pixels=256 * 256)


@pytest.fixture(scope="session")
def processor(tiny_path):
    from saccade.models.loading import load_processor

    return load_processor(tiny_path)


@pytest.fixture(scope="session")
def full_model(tiny_path):
    from saccade.models.loading import load_full_model

    return load_full_model(tiny_path)


@pytest.fixture(scope="session")
def tower(tiny_path):
    from saccade.models.loading import load_vision_tower

    return load_vision_tower(tiny_path)


@pytest.fixture()
def encoder(tower, processor, limits):
    from saccade.models.vision import EmbeddingCache, VisionEncoder

    return VisionEncoder(tower, processor, limits=limits, cache=EmbeddingCache())


@pytest.fixture(scope="session")
def policy(tiny_path):
    """The trainer's LM-only model. Tests must not modify it (load their own to train)."""
    from saccade.models.lm import load_policy_lm

    return load_policy_lm(tiny_path).eval()


# A short real RL run that writes everything a run folder holds: metrics (eval every 2 steps),
# samples.jsonl at every step with its images, TensorBoard events, checkpoints at steps 2 and 4.
# tests/loops/test_sample_log.py and tests/tools/test_report.py read it; tests that change it copy it first.
SHORT_RUN = [
    "--trainer.steps", "4", "--trainer.seed", "3",
    "--rollout.prompts_per_step", "2", "--rollout.group_size", "4", "--rollout.filter_zero_variance", "false",
    "--sampling.max_tokens", "4", "--loss.max_completion_tokens", "4",
    "--eval.prompts", "4", "--eval.every_steps", "2",
    "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "2",
    "--log.samples_every", "1", "--log.samples_prompts", "2", "--log.tensorboard", "true",
]


@pytest.fixture(scope="session")
def short_rl_run(tmp_path_factory):
    """(config, train_rl's result) of SHORT_RUN on the tiny model with stub rewards."""
    from stub_tasks import scored_task

    from saccade.config import RunConfig, load_config
    from saccade.loops.rl import train_rl

    run_dir = tmp_path_factory.mktemp("short-rl") / "run"
    cfg = load_config(RunConfig, "configs/demo.toml", [*SHORT_RUN, "--log.dir", str(run_dir)])
    return cfg, train_rl(cfg, run_dir=cfg.run_dir, task=scored_task(cfg), progress=False)


# A LoRA run of the tiny model (2 RL steps), and its merged and adapter exports: tests/tools/test_export.py
# loads them in transformers and peft, tests/serving/test_vllm_export.py serves them on vLLM.
@pytest.fixture(scope="session")
def lora_run(tiny_path, tmp_path_factory):
    """(run folder, the trained PeftModel)."""
    from export_runs import LORA, train_run

    return train_run(tmp_path_factory.mktemp("lora-run"), tiny_path, LORA)


@pytest.fixture(scope="session")
def merged(lora_run, tmp_path_factory):
    from saccade.tools.export import export_merged

    run_dir, _ = lora_run
    return export_merged(run_dir, tmp_path_factory.mktemp("exports") / "merged")  # a run folder: its latest


@pytest.fixture(scope="session")
def adapter(lora_run, tmp_path_factory):
    from saccade.tools.export import export_adapter

    run_dir, _ = lora_run
    return export_adapter(run_dir / "checkpoints" / "step_000002", tmp_path_factory.mktemp("exports") / "adapter")



@pytest.fixture(scope="session")
def dataset_fixtures():
    """tests/data/dataset_fixtures.py (small data-set folders written on the spot), as a module."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("dataset_fixtures", Path(__file__).parent / "data" / "dataset_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def mathvista_run(dataset_fixtures, tmp_path_factory):
    """(overrides, checkpoint): the tiny model fine-tuned (SFT) on the MathVista fixture's 6 rows,
    so that evaluations of it hold right and wrong answers. tests/orchestrator/test_evaluation.py evaluates
    it on the embedded engine, tests/serving/test_vllm_eval.py on vLLM: one fine-tune for both."""
    from saccade.config import RunConfig, load_config

    fx = dataset_fixtures
    root = tmp_path_factory.mktemp("mathvista-eval")
    overrides = fx.mathvista_overrides(fx.write_mathvista(root / "mathvista"), root / "run")
    return overrides, fx.fine_tune_and_checkpoint(load_config(RunConfig, "configs/demo.toml", overrides))
