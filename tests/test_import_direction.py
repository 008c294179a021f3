"""Dependencies point one way: api -> orchestrator -> experiments -> models -> kernels -> common; results takes
plain records (DESIGN.md, "Decisions taken in the second round"); and no two modules import each other,
directly or around a circle, inside a folder or across folders (DESIGN.md, third round).

Reads every module's imports with `ast` (imports inside functions and under TYPE_CHECKING
included, relative imports resolved), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("common", "kernels", "models", "experiments", "orchestrator", "results", "api")
# folder -> the reslab folders its modules may import; `common` (the error family, atomic writes, the
# metric registry) imports only the standard library, so every layer, kernels included, may use it
ALLOWED: dict[str, tuple[str, ...]] = {
    "common": ("common",),
    "kernels": ("kernels", "common"),
    "models": ("models", "kernels", "common"),
    "experiments": ("experiments", "models", "kernels", "results", "common"),
    "results": ("results", "common"),
    "orchestrator": ("orchestrator", "experiments", "models", "kernels", "results", "common"),
    "api": FOLDERS,  # `reslab.api`, the Python interface: above the orchestrator, which never imports it
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def reslab_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, imported module without the `reslab.` prefix) for every reslab import in the file."""
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                names = [f"reslab.{base}"]
            else:
                names = [node.module or ""]
            # `from reslab.models import metrics` imports the module reslab.common.metrics
            names += [f"{names[0]}.{a.name}" for a in node.names]
        else:
            continue
        out += [(node.lineno, n.removeprefix("reslab.")) for n in names if n.startswith("reslab.")]
    return out


def _allowed(target: str, allowed: tuple[str, ...]) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_the_walker_sees_lazy_and_relative_imports():
    source = ("def f():\n    from reslab.orchestrator import tracking\n\n"
              "from . import stats\nimport reslab.common.metrics\n")
    found = {name for _, name in reslab_imports(ROOT / "results" / "probe.py", source)}
    assert {"orchestrator", "orchestrator.tracking", "results.stats", "common.metrics"} <= found
    assert not _allowed("orchestrator.tracking", ALLOWED["results"]) and _allowed("common.io", ALLOWED["results"])


@pytest.mark.parametrize("folder", FOLDERS)
def test_imports_point_one_way(folder):
    bad: dict[str, None] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, target in reslab_imports(path):
            # `from reslab.models import metrics`: judge the module it names, not the package
            if not _is_module(target) and "." in target:
                target = target.rsplit(".", 1)[0]
            if not _allowed(target, ALLOWED[folder]):
                bad[f"{path.relative_to(ROOT)}:{line} imports reslab.{target}"] = None
    assert not bad, f"{folder}/ may import only {ALLOWED[folder]}:\n" + "\n".join(bad)


def module_graph() -> dict[str, set[str]]:
    """module -> the reslab modules it imports (a package's `__init__` is the package's module)."""
    graph: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            here = _module_name(path)
            targets = set()
            for _, target in reslab_imports(path):
                while target and not _is_module(target):  # `from pkg import name` names the package
                    target = target.rpartition(".")[0]
                if target and target != here:
                    targets.add(target)
            graph[here] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_cycle_finder_finds_a_circle_through_a_package():
    graph = {"a.x": {"a"}, "a": {"a.y"}, "a.y": {"a.x"}, "b": {"a"}}
    assert import_cycles(graph) == [["a", "a.x", "a.y"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_modules():
    cycles = import_cycles(module_graph())
    assert not cycles, "modules that import each other (lazy imports count):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)
