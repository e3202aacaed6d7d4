"""The package stands in layers: no two of its parts import each other, even through others.

A part is a folder of ``onnxq/`` (``onnxq/core/``, ``onnxq/calibrate/``, ...), one of the two
libraries installed inside it (``patterns/``, ``calibrators/``) or a top-level module
(``onnxq/api.py``). Imports inside functions count: a lazy import is still an arrow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("patterns", "calibrators")  # installed as onnxq.patterns, onnxq.calibrators


def _part_of_module(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "onnxq" or len(parts) == 1:
        return None
    if parts[1] in LIBRARIES or (ROOT / "onnxq" / parts[1]).is_dir():
        return parts[1]
    return parts[1] + ".py" if (ROOT / "onnxq" / f"{parts[1]}.py").exists() else None


def _part_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT).parts
    if rel[0] in LIBRARIES:
        return rel[0]
    return rel[1]  # onnxq/<folder>/... or onnxq/<module>.py


def _sources() -> list[Path]:
    files = [*(ROOT / "onnxq").rglob("*.py")]
    for lib in LIBRARIES:
        files += (ROOT / lib).rglob("*.py")
    return sorted(f for f in files if f.name != "__init__.py" or f.parent.name != "onnxq")


def import_graph() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the files that import it."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in _sources():
        here = _part_of_file(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                there = _part_of_module(name)
                if there and there != here:
                    graph[here][there].add(str(path.relative_to(ROOT)))
    return graph


def _cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_parts_import_each_other():
    graph = import_graph()
    cycles = _cycles(graph)
    detail = [
        f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})"
        for cycle in cycles
        for a in cycle
        for b in cycle
        if b in graph.get(a, {})
    ]
    assert not cycles, detail


def test_core_imports_nothing_else_of_onnxq():
    graph = import_graph()
    assert set(graph.get("core", {})) == set(), dict(graph["core"])


def test_the_check_sees_a_cycle():
    # the check itself: a graph with a loop through three parts is reported
    graph = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b": {"x"}}, "b": {}}) == []


#: modules of onnxq/passes/ that are not passes: what every pass may import
PASS_SHARED = {"manager", "stream", "defaults"}


def test_passes_do_not_import_each_other():
    # a pass is a thin adapter over its stage's code; pipeline.py is the list of them all
    bad = []
    for path in sorted((ROOT / "onnxq" / "passes").glob("*.py")):
        if path.stem in ("pipeline", "__init__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    parts = name.split(".")
                    if parts[:2] == ["onnxq", "passes"] and len(parts) == 3:
                        if parts[2] not in PASS_SHARED and parts[2] != path.stem:
                            bad.append(f"{path.name} imports {name}")
    assert not bad, bad
