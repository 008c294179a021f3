"""Issue 50's measures of the house, printed: classes over 300 lines in orchestrator/ and models/, references to
`.after` (the old kind-of-work field) in the loop, worker and Ray backend, the kind constants in the shared result
modules, quoted variant names outside models/residual/, and spec.py's length. The layout tests hold each at its
limit (`tests/test_code_shape.py`, `test_work_kinds.py`, `test_readout_kinds.py`, `test_variant_names.py`); this
prints the counts for a note.

    python bench/measure_layout.py [ROOT]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
print("classes over 300 lines in orchestrator/ and models/:")
for path in sorted(p for folder in ("orchestrator", "models") for p in (root / folder).rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and (lines := node.end_lineno - node.lineno + 1) > 300:  # type: ignore[operator]
            print(f"  {path.relative_to(root)}::{node.name} {lines}")
work = ["orchestrator/driving/loop.py", "orchestrator/attempt/worker.py", "orchestrator/dispatch/ray_backend.py"]
print("'.after' in the loop, worker and Ray backend:",
      sum(len(re.findall(r"\.after\b", (root / f).read_text())) for f in work if (root / f).exists()))
shared = [root / "results" / f for f in ("export.py", "report.py", "readout.py")]
for kind in ("COSTS", "TASKS", "MECHANISMS", "costs=", "tasks=", "mechanisms="):
    print(f"'{kind}' in export.py, report.py, readout.py: {sum(p.read_text().count(kind) for p in shared)}")
names = [p.stem for p in (root / "models/residual").glob("*.py") if p.stem not in ("__init__", "base", "depth_cache")]
hits = []
for path in sorted(p for folder in ("common", "kernels", "models", "experiments", "orchestrator", "results")
                   for p in (root / folder).rglob("*.py") if "models/residual" not in str(p)):
    text = path.read_text()
    hits += [f"{path.relative_to(root)}:{text[:m.start()].count(chr(10)) + 1}: {name}"
             for name in names for m in re.finditer(rf"[\"']{name}[\"']", text)]
print(f"quoted variant names outside models/residual/: {len(hits)}", *hits, sep="\n  ")
print("experiments/spec.py lines:", len((root / "experiments/spec.py").read_text().splitlines()))
