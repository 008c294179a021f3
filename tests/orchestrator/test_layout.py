"""The orchestrator's folders by role (issue 32): each folder imports only what its `__init__` docstring
allows, and imports between the folders form no cycle. Imports are read with `ast` as
tests/test_import_direction.py reads them (lazy and TYPE_CHECKING ones included)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from test_import_direction import reslab_imports

ROOT = Path(__file__).resolve().parents[2]
ORCH = ROOT / "orchestrator"
# folder -> the orchestrator parts (sub-folders, top-level modules) it may import; the layers below the
# orchestrator (experiments, models, kernels, results, common) are tests/test_import_direction.py's business
ALLOWED = {
    "durability": {"tasks"},
    "attempt": {"durability", "tasks"},
    "driving": {"attempt", "dispatch", "durability", "tracking", "tasks"},
    "gathering": {"attempt", "durability", "tracking"},
}


def _part(module: str) -> str | None:
    """The orchestrator part a module (without `reslab.`) lies in: its sub-folder or top-level module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "orchestrator" and len(parts) > 1 else None


def _edges() -> dict[str, dict[str, list[str]]]:
    """{part: {imported part: ["file:line", ...]}} over every module of the orchestrator."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ORCH.rglob("*.py")):
        rel = path.relative_to(ORCH)
        here = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, name in reslab_imports(path):
            there = _part(name)
            if there is not None and there != here:
                edges[here][there].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_a_folder_imports_only_what_its_docstring_allows(folder):
    assert (ORCH / folder / "__init__.py").read_text().startswith('"""')
    bad = {there: sites for there, sites in _edges()[folder].items() if there not in ALLOWED[folder]}
    assert not bad, f"orchestrator/{folder} imports {sorted(bad)} (at {sorted({s for v in bad.values() for s in v})})"


def test_no_cycle_between_the_orchestrators_parts():
    edges = _edges()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle between orchestrator parts: " + " -> ".join(path[path.index(node):]
                                                                                          + [node]))
        if node in done:
            return
        for nxt in edges.get(node, {}):
            visit(nxt, [*path, node])
        done.add(node)

    for node in list(edges):
        visit(node, [])
