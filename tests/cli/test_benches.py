"""`saccade bench ...` configured like a run: each bench's options are its config type's fields
(saccade.config.bench), read by `load_config` (a TOML file, the options, dotted overrides),
`--dry-run` printing what loads back; every command line the docs show still parses, and
every flag the argparse blocks had is still there."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from saccade.cli import main
from saccade.cli.benches import BENCHES
from saccade.config import load_config
from saccade.config.bench import (
    AsyncBenchConfig, DistributedBenchConfig, GpuBenchConfig, KillBenchConfig, RolloutBenchConfig, StepBenchConfig,
    TrainerBenchConfig,
)
from saccade.config.options import option_name

ROOT = Path(__file__).resolve().parents[2]

# Every flag of the eleven argparse blocks the benches had before their config types (but
# bench gpu's internal --record, whose child now gets a job file): each must still be an option.
OLD_FLAGS = {
    "parity": {"--model", "--json", "--dtype", "--device"},
    "trainer": {"--preset", "--steps", "--batch", "--device", "--full-finetune", "--max-side", "--max-tokens", "--attn",
                "--peak-tflops", "--json"},
    "step": {"--preset", "--dtype", "--image-size", "--lora", "--steps", "--device", "--max-tokens", "--trace", "--json"},
    "distributed": {"--nproc", "--preset", "--lora", "--steps", "--seq-len", "--max-tokens", "--device", "--json"},
    "async": {"--url", "--world-sizes", "--seeds", "--out", "--json"},
    "kill": {"--kills", "--steps", "--seed", "--out", "--json"},
    "soak": {"--steps", "--warmup", "--out", "--json"},
    "engine-parity": {"--engine", "--url", "--temperature", "--dtype", "--model", "--json"},
    "rollout": {"--no-vllm", "--url", "--model", "--json"},
    "render": {"--size", "--renders", "--rooms", "--device", "--threads", "--json"},
    "gpu": {"--device", "--quick", "--out", "--stage", "--force", "--budget", "--in-process", "--list"},
    "weight-sync": {"--model", "--url", "--repeats", "--timeout-s", "--json"},  # new since, with its config type
    "video-memory": {"--frames", "--side", "--samples", "--json"},  # new since, with its config type
    "changed-weights": {"--presets", "--lrs", "--steps", "--json"},  # new since, with its config type
}


def bench_parsers() -> dict:
    import argparse

    from saccade.cli import build_parser

    def subparsers(parser):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices

    return dict(subparsers(subparsers(build_parser())["bench"]))


def test_every_old_flag_is_still_an_option_and_every_field_is_one():
    parsers = bench_parsers()
    assert set(parsers) == set(OLD_FLAGS) == {b.name for b in BENCHES}
    for bench in BENCHES:
        flags = {s for a in parsers[bench.name]._actions for s in a.option_strings} - {"-h", "--help"}
        assert OLD_FLAGS[bench.name] <= flags, (bench.name, OLD_FLAGS[bench.name] - flags)
        fields = {option_name(n, i) for n, i in bench.config.model_fields.items() if n not in ("config", "overrides")}
        assert flags == fields | {"--dry-run"} | ({"--list"} if bench.name == "gpu" else {"--json"}), bench.name


def test_every_field_has_a_description():
    for bench in BENCHES:
        assert bench.config.__doc__
        for name, info in bench.config.model_fields.items():
            assert info.description, f"{bench.config.__name__}.{name}"


def dry_run(capsys, *argv: str) -> dict:
    """The resolved options `--dry-run` prints, read back as TOML."""
    capsys.readouterr()
    assert main(["bench", *argv, "--dry-run"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_a_command_line_is_the_typed_config_and_dry_run_loads_back(capsys, tmp_path):
    printed = dry_run(capsys, "step", "--preset", "small", "--image-size", "448", "--lora", "--steps", "2",
                      "--max-tokens", "512", "--trace", str(tmp_path))
    expected = StepBenchConfig(preset="small", image_size=448, lora=True, steps=2, max_tokens=512, trace=str(tmp_path))
    assert StepBenchConfig.model_validate(printed) == expected
    (tmp_path / "step.toml").write_text(tomllib_dump(printed))
    assert load_config(StepBenchConfig, tmp_path / "step.toml") == expected
    # A TOML file of the bench's keys, then the options over it; `--lora false` as a run's overrides read it.
    again = dry_run(capsys, "step", str(tmp_path / "step.toml"), "--steps", "5", "--lora", "false")
    assert StepBenchConfig.model_validate(again) == expected.model_copy(update={"steps": 5, "lora": False})

    assert TrainerBenchConfig.model_validate(dry_run(capsys, "trainer", "--full-finetune", "--attn", "sdpa")) == \
        TrainerBenchConfig(full_finetune=True, attn="sdpa")
    assert RolloutBenchConfig.model_validate(dry_run(capsys, "rollout", "--no-vllm")).vllm is False
    gpu = GpuBenchConfig.model_validate(dry_run(capsys, "gpu", "--stage", "render", "--stage", "syncs", "--budget", "9"))
    assert gpu.stage == ["render", "syncs"] and gpu.budget == 9.0
    # The benches that run `saccade rl`: CONFIG and the dotted overrides are the runs'.
    run = AsyncBenchConfig.model_validate(dry_run(capsys, "async", "configs/views.toml", "--world-sizes", "1,2",
                                                  "--trainer.steps", "40"))
    assert run == AsyncBenchConfig(config="configs/views.toml", world_sizes=(1, 2), overrides=["--trainer.steps", "40"])
    assert KillBenchConfig.model_validate(dry_run(capsys, "kill", "--kills", "3")) == KillBenchConfig(kills=3)


def tomllib_dump(data: dict) -> str:
    from saccade.config import config_to_toml

    return config_to_toml(StepBenchConfig.model_validate(data))


@pytest.mark.parametrize(("argv", "message"), [
    (["step", "--steps", "0"], "--steps: input should be greater than or equal to 1 (got 0)"),
    (["step", "--trainer.lr", "1e-5"], "--trainer.lr: unknown key 'trainer'"),  # once silently ignored
    (["trainer", "--preset", "big"], "--preset: input should be 'tiny', 'small'"),
    (["async", "--world-sizes", "1,x"], "--world-sizes: comma-separated whole numbers, e.g. 1,2; got '1,x'"),
    (["kill", "--trainer.lrr", "1"], "--trainer.lrr: unknown key 'trainer.lrr'; did you mean 'trainer.lr'?"),
    (["gpu", "--device", "tpu"], "--device: input should be 'auto', 'cuda' or 'cpu'"),
])
def test_a_bad_option_is_refused_naming_it(capsys, argv, message):
    assert main(["bench", *argv, "--dry-run"]) == 2
    assert message in capsys.readouterr().err


# Placeholders the docs write, and a value of each kind for --dry-run.
PLACEHOLDERS = {"PATH_OR_HUB_ID": "tiny", "PATH": "out.json", "URL": "http://127.0.0.1:8000", "F": "out.json",
                "P": "small", "PX": "448", "M": "tiny", "N": "1", "$m": "qwen2.5vl-3b", "$t": "2048", "$a": "sdpa",
                "my.toml": "configs/demo.toml", "--section.key": "--trainer.steps", "VALUE": "40"}


def documented_bench_commands() -> list[str]:
    """Every `saccade bench ...` in the README's and the docs' code blocks and code spans (the
    generated docs/cli.md aside)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "cli.md":
            continue
        text = page.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
        spans = re.findall(r"`([^`]*saccade bench [^`]*)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for chunk in [*blocks, *spans]:
            for line in re.sub(r"\\\n\s*", " ", chunk).splitlines():
                if "saccade bench " in line and "$(" not in line and "saccade bench ..." not in line:
                    found.append(line.split("saccade bench ", 1)[1].split(";")[0].split("  #")[0].strip())
    return found


def test_every_documented_bench_command_line_still_parses(capsys, tmp_path):
    commands = documented_bench_commands()
    assert len(commands) > 40
    (tmp_path / "step.toml").write_text("steps = 2\n")  # the docs' bench TOML file
    names = {**PLACEHOLDERS, "step.toml": str(tmp_path / "step.toml")}
    for command in commands:
        argv = []
        for token in command.replace("[", " ").replace("]", " ").replace("...", " ").split():
            token = token.split("|")[0]  # --device auto|cpu|cuda: the first
            argv.append(re.sub(r"\$[mta]|\b[A-Z_]+\b|my\.toml|step\.toml|--section\.key",
                               lambda m: names.get(m.group(0), m.group(0)), token))
        argv = [a for a in argv if a != "CONFIG"]
        assert main(["bench", *argv, "--dry-run"]) == 0, (command, capsys.readouterr().err)


def test_a_worker_gets_its_bench_config_serialized(tmp_path):
    from saccade.tools.bench import read_job, write_job
    from saccade.tools.bench.distributed import DistributedJob

    job = DistributedJob(bench=DistributedBenchConfig(nproc=4, lora=True, seq_len=64), out="r.json", export_dir="e")
    assert read_job(DistributedJob, [str(write_job(job, tmp_path / "job.json"))]) == job
    with pytest.raises(SystemExit, match="JOB.json"):
        read_job(DistributedJob, ["--preset", "small"])  # the old worker command line
