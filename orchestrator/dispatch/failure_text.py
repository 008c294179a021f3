"""A backend's failure text in one line: Ray's out-of-memory report is ~45 lines (the node's memory, every
worker it considered, the top 10 memory users, its advice), and reslab records a failure's text in the run's
status file, MLflow, the driver's lines and `compare`/`status` (issue 52, item 10). The one line keeps what
was decided ("out of memory: N workers killed ... 21.7/23.5 GB") and points to the full text, saved in the
run's folder. Standard library only; `ray_backend` passes the text in.
"""

from __future__ import annotations

import re
from pathlib import Path

from reslab.common.io import write_atomic

# Ray's raylet (src/ray/raylet/node_manager.cc; the format strings of ray 2.60's raylet binary):
# "%d worker(s) were killed due to the node running low on memory. %s"
_KILLED = re.compile(r"(\d+) worker\(s\) were killed due to the node running low on memory")
# "Memory on the node (IP: %s, ID: %s) was %sGB used / %sGB limit (%f)"; before ray 2.56 "... where the task
# (...) was running was %sGB / %sGB (%f), which exceeds the memory usage threshold of %f"
_USAGE = re.compile(r"Memory on the node \(IP: ([^,]+), ID: [^)]*\)(?: where .*? was running)? was "
                    r"([\d.]+)\s*GB(?: used)? / ([\d.]+)\s*GB", re.DOTALL)
REPORT_NAME = "ray_error.attempt{attempt}.txt"


def one_line(text: str, report: Path | None = None) -> str:
    """`text` as one line: for Ray's out-of-memory report what it decided, else its first line; with `report`
    (where the whole text is saved) when anything was left out."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    killed, usage = _KILLED.search(text), _USAGE.search(text)
    if killed or usage or "running low on memory" in text:
        parts = ["out of memory:"]
        if killed:
            n = int(killed.group(1))
            parts.append(f"{n} worker{'s' if n != 1 else ''} killed by Ray")
        else:
            parts.append("Ray killed the worker")
        if usage:
            host, used, limit = usage.group(1).strip(), float(usage.group(2)), float(usage.group(3))
            parts.append(f"on {host} ({used:.1f}/{limit:.1f} GB used)")
        line = " ".join(parts)
    else:
        line = lines[0] if lines else ""
        if len(lines) <= 1 and len(line) <= 300:
            return line
        line = line[:300]
    return f"{line}; Ray's full report: {report}" if report is not None else line


def save_report(text: str, run_dir: Path, attempt: int) -> Path | None:
    """The whole text in the run's folder (None where that folder is not on this machine)."""
    if not run_dir.is_dir():
        return None
    try:
        return write_atomic(run_dir / REPORT_NAME.format(attempt=attempt), text)
    except OSError:
        return None
