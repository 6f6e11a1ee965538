"""Every shape suffix in the package is in the legend (docs/architecture.md, "Shape suffixes").

A name like `logits_CV` or `position_ids_4BL` ends in its tensor's shape, a capital letter a
dimension (a digit: a dimension of that size). The legend gives each letter one meaning; this
test reads every name the package defines or uses (variables, arguments, attributes, keywords,
functions; not the prose of docstrings and comments) and fails on a letter the legend does not
have. Whether a name's letters mean what the legend says is for its reader: the test keeps the
alphabet closed, so a new letter comes with its line in the legend.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "saccade"
LEGEND = ROOT / "docs" / "architecture.md"
SCENES = "scenes/"  # a package of its own letters: the second table

# lowercase words joined by `_`, then the suffix: capitals and digits, at least one capital.
SUFFIXED = re.compile(r"^[a-z][a-z0-9]*(?:_[a-z0-9]+)*_(?P<shape>[0-9]*[A-Z][A-Z0-9]*)$")
# Names of other libraries that look like suffixed ones: peft's LoRA matrices.
NOT_SHAPES = {"lora_A", "lora_B"}


def legend_tables(text: str) -> list[dict[str, str]]:
    """The section's tables, in order: {letter: meaning} each."""
    section = text.split("## Shape suffixes", 1)[1].split("\n## ", 1)[0]
    tables: list[dict[str, str]] = []
    for line in section.splitlines():
        if line.startswith("|---"):  # under a table's header: a table begins
            tables.append({})
        elif row := re.match(r"^\| `([A-Z])` \| (.+) \|$", line):
            assert row.group(1) not in tables[-1], f"the legend gives {row.group(1)} twice"
            tables[-1][row.group(1)] = row.group(2)
    return tables


def names(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
    return found


def suffixed_names() -> dict[str, set[str]]:
    """file (relative to the package) -> its suffixed names."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found = {n for n in names(ast.parse(path.read_text(), filename=str(path)))
                 if SUFFIXED.match(n) and n not in NOT_SHAPES}
        if found:
            out[path.relative_to(PACKAGE).as_posix()] = found
    return out


def letters(name: str) -> set[str]:
    return {c for c in SUFFIXED.match(name).group("shape") if c.isalpha()}


def unknown_letters(used: dict[str, set[str]], model: dict[str, str], scenes: dict[str, str]) -> list[str]:
    bad = []
    for file, found in sorted(used.items()):
        legend = scenes if file.startswith(SCENES) else model
        for name in sorted(found):
            if missing := letters(name) - set(legend):
                bad.append(f"{file}: {name} ({', '.join(sorted(missing))} not in the legend)")
    return bad


def test_the_legend_has_the_models_table_and_the_scenes():
    model, scenes = legend_tables(LEGEND.read_text())
    assert {"N", "T", "V", "H", "G", "P", "I", "M"} <= set(model)
    assert {"V", "F", "T"} <= set(scenes)


def test_every_shape_suffix_letter_is_in_the_legend():
    used = suffixed_names()
    assert sum(len(v) for v in used.values()) > 200, "the scan should see the package's tensors"
    bad = unknown_letters(used, *legend_tables(LEGEND.read_text()))
    assert not bad, "letters without a line in docs/architecture.md's shape suffix legend:\n" + "\n".join(bad)


def test_every_letter_of_the_legend_is_used():
    """A letter no name uses any more leaves the legend with it."""
    model, scenes = legend_tables(LEGEND.read_text())
    used = suffixed_names()
    seen_model = set().union(*(letters(n) for f, ns in used.items() if not f.startswith(SCENES) for n in ns))
    seen_scenes = set().union(*(letters(n) for f, ns in used.items() if f.startswith(SCENES) for n in ns))
    assert set(model) - seen_model == set() and set(scenes) - seen_scenes == set()


def test_a_letter_outside_the_legend_is_found():
    used = {"trainer/x.py": {"logits_NV", "weight_QH"}, "scenes/y.py": {"faces_F3", "logits_NV"}}
    model, scenes = {"N": "", "V": "", "H": ""}, {"F": ""}
    assert unknown_letters(used, model, scenes) == [
        "scenes/y.py: logits_NV (N, V not in the legend)", "trainer/x.py: weight_QH (Q not in the legend)"]
    assert SUFFIXED.match("position_ids_4BL") and SUFFIXED.match("hidden_1NH") and SUFFIXED.match("x_N")
    assert not SUFFIXED.match("MAX_N") and not SUFFIXED.match("eye_3") and not SUFFIXED.match("is_NaN")
