"""How `reslab plan` scales with a study's size (issue 39): generated studies of 10^4 to 10^6 runs
(`bench_validate.write_study`: 4 arms x `--points` grid points x seeds, tiny preset), planned in a
subprocess against an empty workspace and against one where `--recorded` runs have a run directory
(a status file each, SUCCESS), its wall time and peak memory printed as a markdown table.

    python bench/bench_plan.py [--runs 10000,100000,1000000] [--points 250] [--recorded 1000]
                               [--python /other/venv/bin/python] [--ids]

`--python` runs another checkout's reslab (e.g. main's venv, for the "before" column); `--ids` plans with
`--ids` (every run's line, written to /dev/null). Peak memory is each child's own maximum resident set
(`os.wait4`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_validate import write_study  # noqa: E402


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit status) of one command, its output discarded."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and proc.stderr is not None:
        print(proc.stderr.read().decode()[-2000:], file=sys.stderr)
    return wall, usage.ru_maxrss / 1024, proc.returncode


def record_runs(python: str, spec: Path, workspace: Path, count: int, env: dict[str, str]) -> None:
    """`count` of the study's first runs given a run directory as a worker leaves it finished: its spec, a SUCCESS
    status and a summary."""
    code = f"""
import json, sys
from itertools import islice
from pathlib import Path
from reslab.experiments import expand
from reslab.experiments.spec import load_study
study = load_study({str(spec)!r}, [], None)
seeds = study.seeds[:max(1, -(-{count} // (len(study.arms) * len(study.grid_points()))))]
for run in islice(expand(study, seeds), {count}):
    d = Path({str(workspace)!r}) / "runs" / study.name / run.run_id
    d.mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps(run.to_dict()))
    (d / "status").write_text(json.dumps({{"state": "SUCCESS"}}))
    (d / "summary.json").write_text(json.dumps({{"summary": {{"val_loss": 3.0}}, "info": {{}}}}))
"""
    subprocess.run([python, "-c", code], check=True, env=env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="10000,100000,1000000")
    parser.add_argument("--points", type=int, default=250, help="grid points (a multiple of 10)")
    parser.add_argument("--recorded", type=int, default=1000, help="runs given a run directory (0: none)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--ids", action="store_true")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    print(f"reslab of {args.python}; plan{' --ids' if args.ids else ''}")
    print("| runs | arms x grid points x seeds | empty workspace s | peak MiB | "
          f"{args.recorded:,} recorded s | peak MiB |")
    print("|---:|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for runs in (int(x) for x in args.runs.split(",")):
            spec = write_study(Path(tmp), runs, args.points)
            cells = []
            for recorded in (0, args.recorded) if args.recorded else (0,):
                ws = Path(tmp) / f"ws{runs}-{recorded}"
                if recorded:
                    record_runs(args.python, spec, ws, recorded, env)
                argv = [args.python, "-m", "reslab.orchestrator.cli", "plan", str(spec), "--workspace", str(ws),
                        *(["--ids"] if args.ids else [])]
                wall, peak, rc = timed(argv, env)
                cells += [f"{wall:.1f}" if rc == 0 else f"exit {rc}", f"{peak:.0f}"]
            shape = f"4 x {args.points} x {runs // (4 * args.points)}"
            print(f"| {runs:,} | {shape} | {' | '.join(cells)} |", flush=True)
    print(json.dumps({"python": args.python}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
