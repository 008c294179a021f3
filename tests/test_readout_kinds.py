"""The kinds of result are known in one place (issue 32). A study's result is the ordered list of readouts
in `results/readout.py`; adding a kind is one module in `results/readouts/` and one line in that list.
So: only the list imports a kind's module; the orchestrator and the CLI import no renderer of a kind (no
text, section, plot, table or export of one) and hold no test of a run's status; in results/ the word for
a finished run is written once and the run-status tests live in `collect`, beside the one seed matcher."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KINDS = sorted(p.stem for p in (ROOT / "results" / "readouts").glob("*.py") if p.stem not in ("__init__", "base"))
PACKAGES = ("common", "models", "kernels", "experiments", "orchestrator", "results")
# what renders a result, wherever it lives in results/: the orchestrator and the CLI call none of it
RENDERING_MODULES = {"reslab.results.report", "reslab.results.plots", "reslab.results.export"}
RENDERER = re.compile(r"(_text|_section|_plot|_readout|_series|contrast_table|sequential_lines|format_table|"
                      r"export_table|render_report|rich_renderables)$")


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from ... import name` in the file, lazy imports included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
    return out


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def test_the_kinds_are_the_list():
    from reslab.results.readout import READOUTS

    assert [r.name for r in READOUTS] == ["sequential", "gates", "paired", "costs", "mechanisms", "ladder",
                                          "contrasts", "tasks", "interventions", "curves"]
    assert sorted(r.name for r in READOUTS) == KINDS  # every module in readouts/ is in the list, once


def test_an_export_keeps_the_order_it_had_before_the_readouts_owned_it():
    """`StudyReadout.export` follows the list within `export_rank`: the paired rows, the cost rows, the task rows,
    then the mechanism rows, as `export_table(..., costs=, tasks=, mechanisms=)` wrote them (issue 50)."""
    from reslab.results.readout import READOUTS, _exports

    exporting = sorted((r for r in READOUTS if _exports(r)), key=lambda r: r.export_rank)
    assert [r.name for r in exporting] == ["gates", "paired", "costs", "tasks", "mechanisms"]


def test_only_the_list_imports_a_kind():
    kind_modules = {f"reslab.results.readouts.{k}" for k in KINDS}
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p in _sources(*PACKAGES) for m, _ in _imports(p)
           if m in kind_modules and p != ROOT / "results" / "readout.py"
           and p.parent != ROOT / "results" / "readouts"]  # a kind may use another's pure helpers
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", ["orchestrator", "experiments"])
def test_the_orchestrator_renders_no_kind(folder):
    bad = []
    for path in _sources(folder):
        for module, name in _imports(path):
            if module in RENDERING_MODULES or (module.startswith("reslab.results") and RENDERER.search(name)):
                bad.append(f"{path.relative_to(ROOT)}: from {module} import {name}")
    assert not bad, "render results through results.readout.StudyReadout:\n" + "\n".join(bad)


def test_finished_is_written_once_and_status_tests_live_in_collect():
    finished = [f"{p.relative_to(ROOT)}" for p in _sources("results") for _ in re.finditer('"FINISHED"', p.read_text())]
    assert finished == ["results/collect.py"]
    status_tests = re.compile(r"""\[["']status["']\]\s*[!=]=""")
    bad = [str(p.relative_to(ROOT)) for p in _sources("results", "orchestrator/gathering", "orchestrator/cli")
           if status_tests.search(p.read_text()) and p != ROOT / "results" / "collect.py"]
    assert not bad, f"use results.collect.usable / recorded: {bad}"


# The modules every kind goes through: the page frame and table model, the list, the gatherer (issue 50). Outside
# a kind's own module, nothing in them names a kind: an export, a report section, a fact or an MLflow record of a
# kind is the readout's, and a new kind's data is a field of `StudyData` with one reader in `gather.READERS`.
SHARED = ("results/export.py", "results/report.py", "results/readout.py", "orchestrator/gathering/gather.py")


def _kind_words() -> set[str]:
    from reslab.results.readout import READOUTS

    return {w for r in READOUTS for w in (r.name, r.name.removesuffix("s"))}


def _names(node: ast.AST) -> list[str]:
    """Every identifier written in `node` (names, attributes, definitions, arguments, keywords) and every string
    constant short enough to be a name (a docstring is prose)."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.append(n.id)
        elif isinstance(n, ast.Attribute):
            out.append(n.attr)
        elif isinstance(n, ast.FunctionDef | ast.ClassDef):
            out.append(n.name)
        elif isinstance(n, ast.arg) or isinstance(n, ast.keyword) and n.arg:
            out.append(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"\w+", n.value):
            out.append(n.value)
    return out


def _assigned(node: ast.stmt) -> str | None:
    """The name a module-level assignment binds (`X = ...`, `X: T = ...`), else None."""
    target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0] if isinstance(node, ast.Assign) \
        else None
    return target.id if isinstance(target, ast.Name) else None


def _readers(tree: ast.Module) -> set[str]:
    """The gatherer's readers: `READERS` and every function of the module it calls, and they call, in turn."""
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    readers = next(n for n in tree.body if _assigned(n) == "READERS")
    todo, found = [readers], {"READERS"}
    while todo:
        for name in _names(todo.pop()):
            if name in defs and name not in found:
                found.add(name)
                todo.append(defs[name])
    return found


def _kind_names(path: Path, words: set[str]) -> list[str]:
    """`path`'s identifiers that name a kind of result, outside the list (`READOUTS` and the imports of the
    kinds' modules) and the readers (`gather.READERS` and what it calls)."""
    tree = ast.parse(path.read_text())
    skip = _readers(tree) if path.name == "gather.py" else {"READOUTS"}
    bad = []
    for node in tree.body:
        if (isinstance(node, ast.FunctionDef) and node.name in skip) or _assigned(node) in skip or (
                isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reslab.results.readouts.")):
            continue
        bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in _names(node)
                if any(w in name.lower() for w in words)]
    return bad


def test_no_shared_module_names_a_kind():
    words = _kind_words()
    assert {"costs", "cost", "tasks", "task", "mechanisms", "paired", "ladder"} <= words
    bad = [line for rel in SHARED for line in _kind_names(ROOT / rel, words)]
    assert not bad, "a kind's pieces go into its readout (results/readouts/<kind>.py):\n" + "\n".join(bad)


def test_the_check_sees_a_kind_named_in_a_shared_module(tmp_path):
    """The check above is not vacuous: the branches the export and the gatherer once held are caught."""
    words = _kind_words()
    (tmp_path / "export.py").write_text("def export_table(table, costs=None):\n    if costs is not None:\n"
                                        "        table = table + costs\n    return table\n")
    (tmp_path / "gather.py").write_text("READERS = {'name': lambda s: s.study.name}\n\n\n"
                                        "def study_facts(study):\n    return [('costs', study.costs)]\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert len(_kind_names(tmp_path / "export.py", words)) == 3
        assert len(_kind_names(tmp_path / "gather.py", words)) == 2
    finally:
        ROOT = root
