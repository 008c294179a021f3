"""Dependencies point one way: orchestrator -> experiments -> models -> kernels; results takes plain
records (DESIGN.md, "Decisions taken in the second round").

Reads every module's imports with `ast` (imports inside functions and under TYPE_CHECKING
included, relative imports resolved), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "models", "experiments", "orchestrator", "results")
# leaf modules (standard library only) that every layer may use: the error family, atomic writes,
# the metric registry
LEAVES = ("models.errors", "models.io", "models.metrics")
# folder -> the reslab folders (or single modules) its modules may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "kernels": ("kernels", *LEAVES),
    "models": ("models", "kernels"),
    "experiments": ("experiments", "models", "kernels", "results"),
    "results": ("results", *LEAVES),
    "orchestrator": FOLDERS,
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
            # `from reslab.models import metrics` imports the module reslab.models.metrics
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
              "from . import stats\nimport reslab.models.metrics\n")
    found = {name for _, name in reslab_imports(ROOT / "results" / "probe.py", source)}
    assert {"orchestrator", "orchestrator.tracking", "results.stats", "models.metrics"} <= found
    assert not _allowed("orchestrator.tracking", ALLOWED["results"]) and _allowed("models.io", ALLOWED["results"])


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
