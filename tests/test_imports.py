"""The package's imports form no cycle, and run only down its layers (docs/architecture.md).

Every import counts, those inside functions too: a cycle closed by a local import still ties the
two files into one piece that cannot be read, tested or moved apart (issue 29 found
`models/tiny.py` importing `demo` to resolve a model name, so that `saccade serve tiny-warm`
would have trained a model inside the vLLM server).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its file. `from a import b` counts
    as importing `a.b` when that is a module, else `a`; a package's `__init__` is not counted as
    imported by its own submodules' `from . import` lines unless they name it."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")
                    anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            for target in targets:
                while target and target not in files:  # `import a.b.c` of a non-module name: its module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected pieces of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            piece = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                piece.append(w)
                if w == v:
                    break
            if len(piece) > 1:
                found.append(sorted(piece))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(piece: list[str], graph: dict[str, set[str]]) -> str:
    members = set(piece)
    arrows = [f"  {a} -> {b}" for a in piece for b in sorted(graph[a] & members)]
    return "cycle of %d modules:\n%s" % (len(piece), "\n".join(arrows))


def test_saccade_has_no_import_cycle():
    graph = import_graph(SRC, "saccade")
    assert len(graph) > 50, "the graph should cover the whole package"
    found = cycles(graph)
    assert not found, "\n".join(describe(piece, graph) for piece in found)


# The layers, top first (docs/architecture.md): a module may import its own layer's modules
# (without a cycle) and those of any layer below, never one above. What no layer names is a
# utility (metrics, timing, distributed, plugins, ...): the ground floor.
LAYERS: list[tuple[str, ...]] = [
    ("saccade.__main__", "saccade.cli"),  # entry
    ("saccade.tools",),  # benches, demos, doctor, memory, parity, export, report, plot, launcher
    ("saccade.loops",),  # the loops and the run parts only they use
    ("saccade.orchestrator",),  # steps: rollouts, advantages, evaluation
    ("saccade.run",),  # a run's parts: setup, tasks
    ("saccade.envs",),
    ("saccade.transports",),  # the trainer's weights to the servers: over the engines' client and the trainer's plan
    ("saccade.inference", "saccade.trainer", "saccade.serving"),
    ("saccade.models", "saccade.scenes"),
    ("saccade.data",),
    ("saccade.config",),
    ("saccade.rewards",),  # built-in rewards, published protocols, their worker processes
]


def layer_of(module: str) -> int:
    """0 for the top layer, len(LAYERS) for the utilities."""
    for depth, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return depth
    return len(LAYERS)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if layer_of(b) < layer_of(a)]


def test_imports_only_go_down_the_layers():
    graph = import_graph(SRC, "saccade")
    named = [m for m in graph if layer_of(m) < len(LAYERS)]
    assert len(named) > 40, "the layers should name most of the package"
    assert not upward_imports(graph), "imports that run back up the layers:\n" + "\n".join(upward_imports(graph))


def test_an_upward_import_is_found():
    graph = {"saccade.models.lm": {"saccade.loops.rl"}, "saccade.loops.rl": {"saccade.models.lm"}, "saccade.timing": set()}
    assert upward_imports(graph) == ["saccade.models.lm -> saccade.loops.rl"]
    assert upward_imports({"saccade.loops.rl": {"saccade.models.lm", "saccade.timing"}}) == []


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_added_on_purpose_is_found(tmp_path):
    """The detector sees a cycle closed by a function-local, relative import three files long,
    and a package without one passes."""
    write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "def f():\n    from pkg.sub.top import g\n    return g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/mid.py": "from pkg import low\n",
        "pkg/sub/top.py": "from . import mid\n\ndef g():\n    return mid\n",
        "pkg/apart.py": "import pkg.low\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.top"] == {"pkg.sub.mid"}
    assert graph["pkg.apart"] == {"pkg.low"}
    assert cycles(graph) == [["pkg.low", "pkg.sub.mid", "pkg.sub.top"]]

    write(tmp_path, {"pkg/low.py": "def f():\n    return None\n"})
    assert cycles(import_graph(tmp_path, "pkg")) == []
