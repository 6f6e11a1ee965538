"""docs/architecture.md's layer table says what tests/test_imports.py holds: its rows, top first,
name the folders and modules of `LAYERS`, layer by layer, and every folder and top-level module of
src/saccade is in a row (a top-level module with no layer in the utilities' row).

Issue 59 found the table five reward modules short a few days after they landed: what only a
document held had slid, while the import test kept the code in its layers.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "src" / "saccade"


def layer_rows(markdown: str) -> list[tuple[int, str, set[str]]]:
    """The table under "## The layers", top first: (number, layer's name, the modules its second
    column names in backticks: `loops/` is saccade.loops, `__main__` is saccade.__main__). A row
    is a table line whose first cell is a number and a name; the header and the rule are not."""
    found = re.search(r"^## The layers\n(.*?)(?=^## |\Z)", markdown, re.MULTILINE | re.DOTALL)
    assert found, 'no "## The layers" section'
    rows = []
    for line in found.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        layer = re.fullmatch(r"(\d+) (.+)", cells[0]) if line.startswith("|") and len(cells) > 1 else None
        if layer:
            names = {"saccade." + name.rstrip("/").replace("/", ".") for name in re.findall(r"`([^`]+)`", cells[1])}
            rows.append((int(layer.group(1)), layer.group(2), names))
    return rows


def top_level(package: Path) -> set[str]:
    """The package's folders that hold Python and its top-level modules, as dotted names."""
    folders = {p.name for p in package.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    return {f"{package.name}.{name}" for name in folders | modules}


def disagreements(rows: list[tuple[int, str, set[str]]], layers: list[tuple[str, ...]], package: Path) -> list[str]:
    """How the doc's rows differ from `layers` and from the package's folders and modules."""
    problems = []
    numbers = [number for number, _, _ in rows]
    if numbers != list(range(len(layers), -1, -1)):
        problems.append(f"the rows are numbered {numbers}, not {len(layers)} (the top) down to 0 (the utilities)")
    layered = [(number, name, names) for number, name, names in rows if number > 0]
    utilities = set().union(*(names for number, _, names in rows if number == 0))
    for depth, names in enumerate(layers):
        number = len(layers) - depth
        doc = next((row for row in layered if row[0] == number), None)
        if doc is None:
            problems.append(f"layer {number} ({', '.join(names)}) has no row")
        elif doc[2] != set(names):
            problems.append(f"layer {number} ({doc[1]}): the doc names {sorted(doc[2])}, LAYERS {sorted(names)}")
    in_layers = {name for names in layers for name in names}
    problems += [f"{name} is in LAYERS and in the utilities' row" for name in sorted(utilities & in_layers)]
    named = in_layers | utilities | {name for _, _, names in rows for name in names}
    present = top_level(package)
    problems += [f"{name} is in no row of the table" for name in sorted(present - named)]
    problems += [f"the table names {name}, which is no folder or module of src/saccade" for name in sorted(named)
                 if not any(name == p or name.startswith(p + ".") for p in present)]
    return problems


def test_the_layer_table_is_the_import_tests_layers():
    rows = layer_rows(DOC.read_text())
    assert len(rows) > 5, "the table's rows should be read"
    problems = disagreements(rows, LAYERS, PACKAGE)
    assert not problems, "docs/architecture.md's layer table against tests/test_imports.py:\n" + "\n".join(problems)


TABLE = """
## The layers

| layer | folders and modules | what they hold | may import |
|---|---|---|---|
| 2 loops | `loops/` | the loop (not `rl.py` here: only the second column counts) | 1 and below |
| 1 engines, models | `models/`, `inference/` | the engines | the utilities |
| 0 utilities | `timing`, `atomic` | the rest | each other |

## The next section

| 9 nothing | `rewards/` | a table of another section | |
"""


def package(root: Path, names: list[str]) -> Path:
    """A made-up src/saccade: `name/` a folder with a module, `name` a module."""
    for name in names:
        path = root / "saccade" / (f"{name}mod.py" if name.endswith("/") else f"{name}.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    return root / "saccade"


def test_a_table_that_disagrees_is_found(tmp_path):
    """A negative control on a made-up table and package: each kind of drift is named."""
    rows = layer_rows(TABLE)
    assert rows == [(2, "loops", {"saccade.loops"}), (1, "engines, models", {"saccade.models", "saccade.inference"}),
                    (0, "utilities", {"saccade.timing", "saccade.atomic"})]
    layers = [("saccade.loops",), ("saccade.inference", "saccade.models")]
    src = package(tmp_path, ["loops/", "models/", "inference/", "timing", "atomic"])
    (src / "configs").mkdir()  # a folder of data, no Python: not a layer
    assert disagreements(rows, layers, src) == []

    assert disagreements(rows, list(reversed(layers)), src) == [
        "layer 2 (loops): the doc names ['saccade.loops'], LAYERS ['saccade.inference', 'saccade.models']",
        "layer 1 (engines, models): the doc names ['saccade.inference', 'saccade.models'], LAYERS ['saccade.loops']"]
    assert disagreements(rows, [*layers, ("saccade.config",)], package(tmp_path, ["config/"])) == [
        "the rows are numbered [2, 1, 0], not 3 (the top) down to 0 (the utilities)",
        "layer 3 (saccade.loops) has no row",
        "layer 2 (loops): the doc names ['saccade.loops'], LAYERS ['saccade.inference', 'saccade.models']",
        "layer 1 (engines, models): the doc names ['saccade.inference', 'saccade.models'], LAYERS ['saccade.config']"]

    (src / "config").rename(tmp_path / "config")
    package(tmp_path, ["rewards/", "journal"])  # added to the package, named in no row
    (src / "atomic.py").unlink()  # gone from the package, still named
    assert disagreements(rows, layers, src) == [
        "saccade.journal is in no row of the table",
        "saccade.rewards is in no row of the table",
        "the table names saccade.atomic, which is no folder or module of src/saccade"]
    assert disagreements(layer_rows(TABLE.replace("`timing`", "`timing`, `loops/`")), layers, src)[0] == \
        "saccade.loops is in LAYERS and in the utilities' row"
