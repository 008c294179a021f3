"""Classes a reader can hold (issue 50): none in `models/` longer than 300 lines; a class that grows past it
is split by role (as `Trainer` was: the step's placement behind `Parallel.steps`, the checkpoint's progress in
`models.progress`, the model's seeding and the serving cost in functions of `models.training`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 300


def classes(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every class in `source`, nested ones included."""
    return sorted(((n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.ClassDef)), key=lambda c: c[1])


def test_the_measure_counts_a_class_from_its_line_to_its_last():
    assert classes("class A:\n    x = 1\n\n    class B:\n        pass\n") == [("A", 1, 5), ("B", 4, 2)]


@pytest.mark.parametrize("folder", ["models"])
def test_no_class_over_300_lines(folder):
    bad = [f"{path.relative_to(ROOT)}:{line} {name}: {lines} lines"
           for path in sorted((ROOT / folder).rglob("*.py")) for name, line, lines in classes(path.read_text())
           if lines > MAX_LINES]
    assert not bad, "\n".join(bad)
