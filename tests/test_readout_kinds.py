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

    assert [r.name for r in READOUTS] == ["sequential", "paired", "costs", "mechanisms", "ladder", "contrasts",
                                          "tasks", "interventions", "curves"]
    assert sorted(r.name for r in READOUTS) == KINDS  # every module in readouts/ is in the list, once


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
