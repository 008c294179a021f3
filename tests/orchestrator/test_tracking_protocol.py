"""The driver sees a tracker through `tracking.protocol.DriverTracker`: every tracker method the
orchestrator calls is in the Protocol, `GuardedTracker`, the `MlflowWriter` it wraps and `NullTracker`
implement each with the Protocol's parameters, and the package keeps mlflow (~3 s to import) out of
every import until a client is made."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.protocol import DriverTracker, NullTracker
from reslab.orchestrator.tracking.writer import MlflowWriter

ROOT = Path(__file__).resolve().parents[2]
TRACKING = ROOT / "orchestrator" / "tracking"


def protocol_members() -> set[str]:
    tree = ast.parse((TRACKING / "protocol.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DriverTracker")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} | {
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def tracker_calls(path: Path) -> set[str]:
    """The attributes read off anything named `tracker` (`tracker.x`, `self.tracker.x`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "tracker":
                out.add(node.attr)
    return out


def test_the_protocol_covers_what_the_orchestrator_asks_of_a_tracker():
    members = protocol_members()
    used = {}
    for path in sorted((ROOT / "orchestrator").rglob("*.py")):
        if TRACKING not in path.parents:
            for name in tracker_calls(path):
                used.setdefault(name, path.relative_to(ROOT))
    assert {"begin", "on_event", "flush", "finish", "fail", "end", "uri"} <= set(used)  # the scan finds the driver
    missing = {name: str(where) for name, where in used.items() if name not in members}
    assert not missing, f"tracker members used but not in DriverTracker: {missing}"


ATTRIBUTES = {"uri", "publisher"}  # the protocol's data members; the rest are methods


@pytest.mark.parametrize("tracker", [GuardedTracker, MlflowWriter, NullTracker], ids=lambda c: c.__name__)
def test_tracker_implements_every_method_with_the_protocols_parameters(tracker):
    assert protocol_members() >= ATTRIBUTES
    for name in protocol_members() - ATTRIBUTES:
        want = inspect.signature(getattr(DriverTracker, name)).parameters
        have = inspect.signature(getattr(tracker, name)).parameters
        assert [(p.name, p.kind, p.default) for p in have.values()] == \
               [(p.name, p.kind, p.default) for p in want.values()], name
    if tracker is NullTracker:
        assert NullTracker.uri == "" and NullTracker.publisher is None
        return
    init = ast.parse(textwrap.dedent(inspect.getsource(tracker.__init__)))
    set_in_init = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign | ast.AnnAssign)
                   for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Attribute)}
    assert set_in_init >= ATTRIBUTES


def test_no_tracking_module_imports_mlflow_until_used():
    modules = sorted(f"reslab.orchestrator.tracking.{p.stem}" for p in TRACKING.glob("*.py") if p.stem != "__init__")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            "assert 'mlflow' not in sys.modules, sorted(m for m in sys.modules if m.startswith('mlflow'))\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_only_the_tracking_package_imports_mlflow():
    found = []
    for folder in ("common", "kernels", "models", "experiments", "orchestrator", "results"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                if any(n == "mlflow" or n.startswith("mlflow.") for n in names):
                    found.append(str(path.relative_to(ROOT)))
    assert sorted(set(found)) == ["orchestrator/tracking/client.py", "orchestrator/tracking/store.py",
                                  "orchestrator/tracking/template.py"]
