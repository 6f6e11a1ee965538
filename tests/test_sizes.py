"""The sizes the house keeps, held like the layers (tests/test_imports.py): what only a document held
slid within a day (issue 59: `train_rl` went from 73 lines to 98, `build_router` from 116 to 273,
data/datasets.py past 600).

- no source file over `MAX_FILE_LINES` lines (docs/architecture.md, "Where a job lives");
- `train_rl`, the loop a newcomer reads first, at most `MAX_LOOP_LINES` lines;
- no definition over `MAX_DEF_LINES` lines unless it is named in `READS_BETTER_WHOLE` with the
  reason; a named one that shrinks under the bar must leave the list (the list stays short and true).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "saccade"
MAX_FILE_LINES = 600
MAX_LOOP_LINES = 80
MAX_DEF_LINES = 100
LOOP = ("loops/rl.py", "train_rl")

# (file, definition) -> why it reads better as one piece than split.
READS_BETTER_WHOLE: dict[tuple[str, str], str] = {
    ("trainer/loss.py", "policy_loss"): "the objective: every term (ratio, clip, TIS, masked IS, KL, entropy, "
    "normalisation) in the order it is computed, each role commented; split, a reader would chase the loss "
    "through helpers (the design notes name this file the standard for pure functions)",
    ("scenes/render.py", "rasterize"): "one z-buffered scanline loop over the triangles in view; its state (spans, "
    "depths) runs through the whole loop",
}


def file_lines(path: Path) -> int:
    return path.read_text().count("\n")


def definitions(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function and method in the file, nested ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def oversized(root: Path, *, max_file: int = MAX_FILE_LINES, max_def: int = MAX_DEF_LINES,
              whole: dict[tuple[str, str], str] | None = None) -> list[str]:
    """What is over its bar under `root`, said one line each."""
    whole = READS_BETTER_WHOLE if whole is None else whole
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if (n := file_lines(path)) > max_file:
            found.append(f"{rel}: {n} lines (the bar is {max_file}): split it by job")
        for name, lines in definitions(path):
            if lines > max_def and (rel, name) not in whole:
                found.append(f"{rel}: {name} is {lines} lines (the bar is {max_def}): split it, or name it in "
                             "READS_BETTER_WHOLE with the reason it reads better whole")
    return found


def loop_lines(root: Path, loop: tuple[str, str] = LOOP) -> int:
    rel, name = loop
    [lines] = [n for d, n in definitions(root / rel) if d == name]
    return lines


def test_no_file_and_no_definition_is_over_its_bar():
    assert oversized(SRC) == []


def test_the_loop_stays_one_screen():
    assert loop_lines(SRC) <= MAX_LOOP_LINES, f"train_rl is {loop_lines(SRC)} lines: move a guard into a part"


def test_every_named_exception_is_still_over_the_bar_and_still_there():
    sizes = {(path.relative_to(SRC).as_posix(), name): lines
             for path in SRC.rglob("*.py") for name, lines in definitions(path)}
    stale = [key for key in READS_BETTER_WHOLE if sizes.get(key, 0) <= MAX_DEF_LINES]
    assert stale == [], f"under the bar now, or gone: take them off READS_BETTER_WHOLE: {stale}"


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def function(name: str, lines: int) -> str:
    """A function of exactly `lines` lines."""
    return f"def {name}():\n" + "    x = 1\n" * (lines - 2) + "    return x\n"


def test_the_bars_are_found_when_broken_on_purpose(tmp_path):
    write(tmp_path, "loops/rl.py", function("train_rl", MAX_LOOP_LINES))
    write(tmp_path, "fits.py", "x = 1\n" * MAX_FILE_LINES)
    assert oversized(tmp_path, whole={}) == [] and loop_lines(tmp_path) == MAX_LOOP_LINES
    write(tmp_path, "loops/rl.py", function("train_rl", MAX_LOOP_LINES + 1))
    assert loop_lines(tmp_path) == MAX_LOOP_LINES + 1  # an 81-line loop is seen
    write(tmp_path, "big.py", "x = 1\n" * (MAX_FILE_LINES + 1))
    write(tmp_path, "long.py", function("long_one", MAX_DEF_LINES + 1) + function("short_one", MAX_DEF_LINES))
    found = oversized(tmp_path, whole={})
    assert len(found) == 2, found
    assert found[0].startswith("big.py: 601 lines") and found[1].startswith("long.py: long_one is 101 lines")
    assert oversized(tmp_path, whole={("long.py", "long_one"): "a reason"}) == [found[0]]
