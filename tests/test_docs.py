"""The docs stay whole: the mkdocs site builds with --strict (no broken link or anchor, no page
left out of the nav), the README's links reach files and headings that exist, and the two
generated references are what the code says today: docs/cli.md (the argparse parsers) and
docs/config-reference.md (the config's models, every key)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="mkdocs.yml is not shipped with the package")


def build(config: Path, out: Path) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (uv sync installs the dev group)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=config.parent)


def test_site_builds_strict(tmp_path):
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "cli" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    # The negative control: the same site with one link to a page that is not there.
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copy(ROOT / "CHANGELOG.md", tmp_path / "CHANGELOG.md")
    page = tmp_path / "docs" / "index.md"
    page.write_text(page.read_text() + "\nSee [the old page](no-such-page.md).\n")
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr


def slug(title: str) -> str:
    """A heading's anchor as GitHub and the site (pymdownx.slugs, mkdocs.yml) make it."""
    title = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", title.strip())
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_slug_is_githubs():
    assert slug("Qwen3-VL 2B / 4B / 8B: configs") == "qwen3-vl-2b--4b--8b-configs"
    assert slug("Exporting a checkpoint: `saccade export`") == "exporting-a-checkpoint-saccade-export"


def test_readme_links_reach_files_and_headings():
    readme = ROOT / "README.md"
    text = re.sub(r"```.*?```", "", readme.read_text(), flags=re.S)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) > 20
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else readme
        assert target.exists(), f"README.md links to {link}, which is not there"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"README.md links to {link}: no such heading in {target.name}"


def load_reference_script(name: str = "cli_reference"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_what_the_parsers_say():
    reference = load_reference_script().reference()
    assert (DOCS / "cli.md").read_text() == reference, (
        "docs/cli.md differs from the parsers: run `uv run python scripts/cli_reference.py` and commit docs/cli.md")


def test_cli_reference_has_every_command_and_flag():
    import argparse

    from saccade.cli import build_parser

    page = (DOCS / "cli.md").read_text()
    script = load_reference_script()
    seen = 0
    stack = [("saccade", build_parser())]
    while stack:
        name, parser = stack.pop()
        for sub, _, subparser in script._subcommands(parser):
            assert f"## `{name} {sub}`" in page
            stack.append((f"{name} {sub}", subparser))
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}" in page or f", {flag}" in page, f"{name} {flag} is not in docs/cli.md"
                    seen += 1
    assert seen > 60


def test_config_reference_is_what_the_models_say():
    reference = load_reference_script("config_reference").reference()
    assert (DOCS / "config-reference.md").read_text() == reference, (
        "docs/config-reference.md differs from saccade.config: run `uv run python scripts/config_reference.py` "
        "and commit docs/config-reference.md")


def test_every_config_key_is_documented():
    from test_configs import config_keys

    page = (DOCS / "config-reference.md").read_text()
    # An eval set's keys are a data set task's, documented once under task.* (eval.sets says so).
    keys = {re.sub(r"^eval\.sets\.\*\.", "task.", key) for key in config_keys()}
    assert "a data set task's keys" in page
    missing = sorted(key for key in keys if f"| `{key}` |" not in page and f"## `[{key}]`" not in page)
    assert not missing, f"config keys missing from docs/config-reference.md: {missing}"
