"""The kinds of work after training are known in one place (issue 50, item 3). An evaluation or an intervention is
a unit of work that a source wrapped around the study's releases (`orchestrator.driving.after.AfterSource`); its
task carries its function (`RunTask.work`). So the loop, the study's and the search's sources, the worker and the
backends hold no branch on what kind of work a task is: no test names a kind of work or its fields, no isinstance
on one, and the loop does not even look at a task's work (the worker runs its function, a backend asks it for its
resources). On 7652683 the same count was 19: 2 in the loop, 14 in the study's source and its submission, 1 in
the worker and 2 in the Ray backend."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "orchestrator"
MODULES = ("driving/loop.py", "driving/submit.py", "driving/tune.py", "attempt/worker.py", "dispatch/__init__.py",
           "dispatch/ray_backend.py", "dispatch/local_backend.py")
# what names a kind of work after training: its fields on a task or a job, its types, its driver-side kinds
KIND_ATTRS = {"after", "evals", "interventions", "evaluate", "units"}
KIND_NAMES = {"AfterTraining", "AfterWork", "AfterSource", "EvalJob", "InterventionJob", "Evaluations",
              "Interventions"}
# what the loop never reads: a task's work is the worker's and the backend's business
LOOP_NEVER = {"work"}


def _names(node: ast.AST) -> set[str]:
    """The attribute and plain names an expression mentions."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Name):
            out.add(n.id)
    return out


def branches_on_kinds(source: str, never: set[str] = frozenset()) -> list[tuple[int, str]]:
    """(line, what) of every branch whose test names a kind of work, every isinstance on one, and every mention
    of a name in `never`."""
    kinds = KIND_ATTRS | KIND_NAMES
    out = []
    for node in ast.walk(ast.parse(source)):
        tests: list[ast.AST] = []
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests += node.ifs
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance",
                                                                                                "issubclass"):
            tests += node.args[1:]
        out += [(t.lineno, ", ".join(sorted(_names(t) & kinds))) for t in tests if _names(t) & kinds]
        if isinstance(node, ast.Attribute) and node.attr in never:
            out.append((node.lineno, node.attr))
    return sorted(set(out))


def test_the_measure_finds_each_shape_of_branch():
    source = ("if task.after is not None:\n    pass\n"
              "x = 1 if isinstance(w, EvalJob) else 2\n"
              "y = [t for t in q if t.after is None]\n"
              "assert job.evals\n"
              "z = task.work\n"
              "if task.run_id:\n    pass\n")
    assert branches_on_kinds(source, LOOP_NEVER) == [(1, "after"), (3, "EvalJob"), (4, "after"), (5, "evals"),
                                                     (6, "work")]


def test_no_branch_on_a_kind_of_work_in_the_loop_the_sources_the_worker_and_the_backends():
    bad = [f"orchestrator/{m}:{line}: {what}" for m in MODULES
           for line, what in branches_on_kinds((ROOT / m).read_text(), LOOP_NEVER if m == "driving/loop.py" else set())]
    assert bad == [], "\n".join(bad)
