"""Frames a reader can hold: no function outside `kernels/` longer than 80 lines, none taking more
than 8 parameters (`self`/`cls` not counted; a dataclass of options where more are needed), and no
class in `orchestrator/` or `models/` longer than 300 lines (a longer one is split by role, issue 50).
Kernels are exempt: a Triton kernel's body and its constexpr parameters are its specification."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("common", "models", "experiments", "orchestrator", "results", "api", "bench")
MAX_LINES = 80
MAX_PARAMS = 8
MAX_CLASS_LINES = 300
CLASS_CHECKED = ("orchestrator", "models")


def frames(source: str) -> list[tuple[str, int, int, int]]:
    """(name, first line, lines, parameters) of every function and method in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs]
            count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
            if params and params[0].arg in ("self", "cls"):
                count -= 1
            out.append((node.name, node.lineno, node.end_lineno - node.lineno + 1, count))
    return sorted(out, key=lambda f: f[1])


def test_the_measure_counts_lines_and_parameters():
    source = "class A:\n    def f(self, a, *b, c, **d):\n        pass\n\n\ndef g():\n    x = 1\n    return x\n"
    assert frames(source) == [("f", 2, 2, 4), ("g", 6, 3, 0)]


def test_no_long_or_wide_function():
    bad = []
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, line, lines, params in frames(path.read_text()):
                if lines > MAX_LINES or params > MAX_PARAMS:
                    bad.append(f"{path.relative_to(ROOT)}:{line} {name}: {lines} lines, {params} parameters")
    assert not bad, f"at most {MAX_LINES} lines and {MAX_PARAMS} parameters per function:\n" + "\n".join(bad)


def classes(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every class in `source`, nested ones included."""
    return sorted(((n.name, n.lineno, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
                   if isinstance(n, ast.ClassDef)), key=lambda c: c[1])


def test_the_measure_counts_a_class_from_its_header_to_its_last_line():
    source = "class A:\n    x = 1\n\n    class B:\n        pass\n\n\ny = 2\n"
    assert classes(source) == [("A", 1, 5), ("B", 4, 2)]


def test_no_long_class():
    long = {}
    for folder in CLASS_CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for name, line, lines in classes(path.read_text()):
                if lines > MAX_CLASS_LINES:
                    long[f"{path.relative_to(ROOT)}:{name}"] = f"line {line}: {lines} lines"
    assert not long, f"at most {MAX_CLASS_LINES} lines per class:\n" + "\n".join(f"{k} ({v})" for k, v in long.items())
