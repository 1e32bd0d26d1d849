"""The module graph of ARCHITECTURE.md: no import circles, and the three processes never import each other.

Imports inside functions count too: a lazy import hides a circle, it does not remove it. Imports under
`if TYPE_CHECKING:` do not: they name a type for annotations and never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

PROCESSES = ("tandem.trainer", "tandem.orchestrator", "tandem.inference")


def import_graph() -> dict[str, set[str]]:
    """Module name -> the tandem modules it imports (anywhere in its body)."""
    root = Path(tandem.__file__).parent
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = _typing_only_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def _typing_only_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside `if TYPE_CHECKING:` blocks."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"]
    return {id(n) for block in blocks for n in ast.walk(block)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_imports_are_not_edges(tmp_path):
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nimport b\n")
    typing_only = _typing_only_nodes(tree)
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in typing_only for a in n.names]
    assert imported == ["b"]


def test_no_import_circles():
    assert find_cycle(import_graph()) is None


def _is_in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_processes_never_import_each_other():
    offending = [(src, dst) for src, dsts in import_graph().items() for dst in dsts
                 for p in PROCESSES for q in PROCESSES if p != q and _is_in(src, p) and _is_in(dst, q)]
    assert offending == []


def test_the_launcher_imports_no_process():
    """`tandem.launch` starts the processes and reads what they write; their code runs only in them."""
    offending = [(src, dst) for src, dsts in import_graph().items() if _is_in(src, "tandem.launch") for dst in dsts
                 if any(_is_in(dst, p) for p in PROCESSES)]
    assert offending == []
