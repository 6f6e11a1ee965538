"""The README stays true and short: every `saccade` command it shows for a run (rl, sft, eval,
launch) passes `--dry-run` offline, through `saccade.cli.main`, with the very arguments the
README gives; a new user who follows its "your own config file" steps for Qwen2.5-VL-7B on
parquet files with their own column names gets a config that `--dry-run` accepts; and the
README is under 350 lines."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from saccade.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

pytestmark = pytest.mark.skipif(not README.exists(), reason="README.md is not shipped with the package")

RUNS = ("rl", "sft", "eval", "launch")  # the commands that take a CONFIG and --dry-run
LAUNCH_ONLY = {"--node-rank": 1, "--hosts": 1, "--resume": 0, "--dry-run": 0}  # launch's own flags, and how many values each takes


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def logical_lines(block: str) -> list[str]:
    """The block's lines with backslash continuations joined, as bash reads them."""
    return [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def readme_commands() -> list[list[str]]:
    """Every `saccade <run command> ...` in the README's bash blocks, as argv after `saccade`,
    with shell variables assigned earlier in the README expanded as bash would."""
    env: dict[str, str] = {}
    found = []
    for block in blocks("bash"):
        for line in logical_lines(block):
            words = shlex.split(line, comments=True)
            if len(words) == 1 and re.fullmatch(r"[A-Z_]+=.*", words[0], re.S):
                name, value = words[0].split("=", 1)
                env[name] = value
                continue
            expanded = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line)
            words = shlex.split(expanded, comments=True)
            if words[:1] == ["saccade"] and words[1:2] and words[1] in RUNS:
                found.append(words[1:])
    return found


def names_a_real_model(argv: list[str]) -> bool:
    return any(re.fullmatch(r"configs/(qwen|example).*\.toml", a) or re.fullmatch(r"Qwen/[\w.-]+", a) for a in argv)


def in_repo(argv: list[str]) -> list[str]:
    """The README's relative config paths, from the repository's root."""
    return [str(ROOT / a) if a.startswith("configs/") else a for a in argv]


def test_readme_is_short():
    assert len(README.read_text().splitlines()) < 350


def test_readme_shows_a_real_model_of_each_family_on_one_and_eight_gpus():
    real = [argv for argv in readme_commands() if names_a_real_model(argv)]
    configs = {a for argv in real for a in argv if a.startswith("configs/")}
    for family in ("qwen3vl-", "qwen2.5vl-", "qwen3vl-30b-a3b", "qwen3.5-9b", "qwen3.5-35b-a3b"):
        assert any(c.startswith(f"configs/{family}") for c in configs), family
    assert any(c.endswith("-1gpu.toml") for c in configs) and any(c.endswith("-8gpu.toml") for c in configs)
    for config in configs:
        assert (ROOT / config).exists(), f"the README names {config}, which is not shipped"


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv[:2]))
def test_readme_command_passes_dry_run(argv, tmp_path, monkeypatch, capsys):
    if not names_a_real_model(argv) and not any(a.endswith(".toml") for a in argv):
        pytest.skip("no config file")
    if any(a == "my-run.toml" for a in argv):
        pytest.skip("the new user's own file: test_a_new_user_writes_a_qwen2_5_vl_config_from_the_readme")
    argv = in_repo(argv)
    monkeypatch.chdir(tmp_path)  # nothing the dry run might write lands in the checkout
    assert main([*argv, *([] if "--dry-run" in argv else ["--dry-run"])]) == 0
    printed = capsys.readouterr().out
    if argv[0] == "launch":  # the commands it would start: the servers, then the trainer with the same overrides
        assert "-m saccade serve " in printed and "-m saccade rl " in printed
        assert all(a in printed.splitlines()[-1] for a in argv[2:] if a not in LAUNCH_ONLY)
    else:
        assert "[model]" in printed


def as_rl(argv: list[str]) -> list[str]:
    """A `saccade launch CONFIG ...` line as the `saccade rl CONFIG ... --dry-run` of its trainer:
    launch's own flags dropped, every config override kept."""
    out, skip = ["rl"], 0
    for arg in argv[1:]:
        if skip:
            skip -= 1
        elif arg in LAUNCH_ONLY:
            skip = LAUNCH_ONLY[arg]
        else:
            out.append(arg)
    return [*out, "--dry-run"]


LAUNCHES = [argv for argv in readme_commands() if argv[0] == "launch" and names_a_real_model(argv)]


def test_the_readme_launches_real_models():
    assert len(LAUNCHES) >= 8


@pytest.mark.parametrize("argv", LAUNCHES, ids=lambda argv: Path(argv[1]).name)
def test_readme_launch_overrides_pass_rl_dry_run(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(in_repo(as_rl(argv))) == 0
    printed = capsys.readouterr().out
    assert 'kind = "dataset"' in printed  # the user's data set replaced the config's own task
    assert 'images = "photo"' in printed


def test_a_new_user_writes_a_qwen2_5_vl_config_from_the_readme(tmp_path, monkeypatch, capsys):
    """Following only the README: copy the shipped 1-GPU Qwen2.5-VL-7B config, replace its [task]
    table with the README's, put parquet files with one's own column names where it says, and
    check the config with the README's own command."""
    text = README.read_text()
    section = text[text.index("**Your own config file.**"):]
    cp = shlex.split(re.search(r"^cp .+$", section, re.M).group(0))
    assert cp[1] == "configs/qwen2.5vl-7b-1gpu.toml"
    task = re.search(r"```toml\n(\[task\].*?)```", section, re.S).group(1)
    check = next(line for line in logical_lines(re.findall(r"```bash\n(.*?)```", section, re.S)[1])
                 if "--dry-run" in line)

    monkeypatch.chdir(tmp_path)
    # The user's data: parquet files with the columns the README's table names.
    import tomllib

    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = tomllib.loads(task)["task"]
    cols = spec["columns"]
    for name in (spec["dataset"], spec["eval_dataset"]):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({cols["images"]: [b"\x89PNG"], cols["prompt"]: ["What is it?"], cols["answer"]: ["a cat"]}),
                       name)
    shutil.copy(ROOT / cp[1], cp[2])
    config = Path(cp[2]).read_text()
    start = config.index("\n[task]\n") + 1
    end = re.search(r"^\[", config[start + 1:], re.M)
    config = config[:start] + task + ("\n" + config[start + 1 + end.start():] if end else "")
    Path(cp[2]).write_text(config)

    argv = shlex.split(check)
    assert argv[:2] == ["saccade", "rl"] and argv[2] == cp[2]
    assert main(argv[1:]) == 0
    printed = capsys.readouterr().out
    assert 'path = "Qwen/Qwen2.5-VL-7B-Instruct"' in printed
    assert f'dataset = "{spec["dataset"]}"' in printed and f'eval_dataset = "{spec["eval_dataset"]}"' in printed
    for key, column in cols.items():
        assert f'{key} = "{column}"' in printed


def test_readme_config_table_equals_the_estimator():
    """The README's table of shipped configs quotes each one's trainer and server estimates as its
    header's `saccade memory` command gives them (tests/test_configs.py checks the Qwen3-VL rows;
    this, every family's)."""
    from test_configs import REAL, estimate_from_command, header_of

    rows = [line for line in README.read_text().splitlines() if line.startswith("| `configs/")]
    for real in REAL:
        row = [r for r in rows if r.startswith(f"| `configs/{real.name}`")]
        assert len(row) == 1, f"README.md: no single row for {real.name}"
        est = estimate_from_command(re.search(r"#   reproduce: (saccade memory .+)", header_of(real.path)).group(1))
        figures = re.findall(r"\d+\.\d", row[0])
        assert f"{est.trainer.total:.1f}" in figures and f"{est.server.total:.1f}" in figures, row[0]
