"""`reslab compare`, `status`, `report` and `plan` on a workspace of N finished runs (issue 39), each in a
subprocess, its wall time and peak memory printed as a markdown table.

    python bench/bench_readouts_scale.py DIR [--runs 10000] [--python /other/venv/bin/python]
                                             [--commands compare,status,report,plan]

DIR holds the study and workspace `make_scale_workspace.py` builds (built here when DIR has no
`scale<N>.yaml`). `--python` runs another checkout's reslab on the same workspace (main's venv: the "before").
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_validate import timed  # noqa: E402
from make_scale_workspace import build  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--commands", default="compare,status,report,plan")
    args = parser.parse_args()
    spec = args.directory / f"scale{args.runs}.yaml"
    ws = args.directory / "ws"
    if not spec.is_file():
        spec, ws = build(args.directory, args.runs)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    extra = {"report": ["-o", str(args.directory / "report.html")]}
    print(f"reslab of {args.python}, {args.runs:,} finished runs")
    print("| command | wall s | CPU s | peak RSS MiB | load average (1 min) before, after |")
    print("|---|---:|---:|---:|---|")
    for command in args.commands.split(","):
        argv = [args.python, "-m", "reslab.orchestrator.cli", command, str(spec), "--workspace", str(ws),
                *extra.get(command, [])]
        load = os.getloadavg()[0]
        wall, cpu, peak, rc = timed(argv, env)
        print(f"| {command} | {wall:.1f}{'' if rc == 0 else f' (exit {rc})'} | {cpu:.1f} | {peak:.0f} | "
              f"{load:.1f}, {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
