"""How `reslab plan` scales with a study's size (issue 39): generated studies of 10^4 to 10^6 runs
(`bench_validate.write_study`: 4 arms x `--points` grid points x seeds, tiny preset), planned in a
subprocess against an empty workspace and against one where `--recorded` runs have a run directory
(a status file each, SUCCESS), its wall time and peak memory printed as a markdown table.

    python bench/bench_plan.py [--runs 10000,100000,1000000] [--points 250] [--recorded 1000]
                               [--python /other/venv/bin/python] [--ids]

`--python` runs another checkout's reslab (e.g. main's venv, for the "before" column); `--ids` plans with
`--ids` (every run's line, written to /dev/null). Peak memory is each child's own maximum resident set
(`os.wait4`).

`--run` measures `reslab run` instead (issue 39: a 10^6-run study starts dispatching in under 10 s and 1 GB):
the same study named `simulated-*`, its runs simulated (`$RESLAB_SIMULATE`, `orchestrator.attempt.simulate`:
each sleeps `--sleep` s, trains nothing) on a local Ray, `--max-concurrent 2`. From the command's start it
times the line that says the loop starts dispatching (`cluster ...: up to N at once`), the first run's start
and its end; once `--finished` runs have ended it sends a Ctrl-C (SIGINT), which cancels the rest; the peak
RSS is the driver's own (Ray's processes are not in it). A command that has not dispatched within
`--timeout` s is killed (its cells say so).

    python bench/bench_plan.py --run [--runs 100000,1000000] [--finished 3] [--timeout 300] [--python ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_validate import timed, write_study  # noqa: E402


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


MARKS = (("dispatching", re.compile(r"^  cluster .*at once$")), ("first start", re.compile(r"\] start ")),
         ("first end", re.compile(r"\] (succeeded|failed) ")))


def timed_run(argv: list[str], env: dict[str, str], finished: int,
              timeout: float) -> tuple[dict[str, float], float, str]:
    """`reslab run` until `finished` runs ended, then a Ctrl-C: (seconds from the start to each of `MARKS`, peak
    RSS MiB, how it ended)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    seen: dict[str, float] = {}
    ended, tail = 0, []
    timer = threading.Timer(timeout, lambda: proc.poll() is None and proc.kill())
    timer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        tail = (tail + [line])[-20:]
        for name, pattern in MARKS:
            if name not in seen and pattern.search(line):
                seen[name] = time.perf_counter() - start
        if re.search(r"\] (succeeded|failed) ", line):
            ended += 1
            if ended == finished:
                proc.send_signal(signal.SIGINT)
    _, status, usage = os.wait4(proc.pid, 0)
    timer.cancel()
    code = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    how = f"Ctrl-C after {ended} run(s)" if ended >= finished else f"exit {code} after {wall:.0f} s"
    if ended < finished:
        print("".join(tail), file=sys.stderr)
    return seen, usage.ru_maxrss / 1024, how


def run_mode(args: argparse.Namespace, env: dict[str, str]) -> int:
    """`--run`: the table of `reslab run`'s start at each size (module docstring)."""
    env = {**env, "PYTHONUNBUFFERED": "1",
           "RESLAB_SIMULATE": f"sleep={args.sleep},report_every={args.sleep / 2},metrics=4,checkpoint_every=0"}
    print(f"reslab of {args.python}; run (simulated runs of {args.sleep} s, 2 at once), Ctrl-C after "
          f"{args.finished} ended")
    print("| runs | arms x grid points x seeds | to dispatching s | to first start s | to first end s | "
          "peak RSS MiB | ended |")
    print("|---:|---|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for runs in (int(x) for x in args.runs.split(",")):
            spec = write_study(Path(tmp), runs, args.points)
            spec.write_text(spec.read_text().replace(f"study: big{runs}", f"study: simulated-big{runs}"))
            argv = [args.python, "-m", "reslab.orchestrator.cli", "run", str(spec), "--workspace",
                    str(Path(tmp) / f"ws{runs}"), "--max-concurrent", "2", "--cpus-per-run", "1"]
            seen, peak, how = timed_run(argv, env, args.finished, args.timeout)
            cells = [f"{seen[m]:.1f}" if m in seen else "-" for m, _ in MARKS]
            shape = f"4 x {args.points} x {runs // (4 * args.points)}"
            print(f"| {runs:,} | {shape} | {' | '.join(cells)} | {peak:.0f} | {how} |", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="10000,100000,1000000")
    parser.add_argument("--points", type=int, default=250, help="grid points (a multiple of 10)")
    parser.add_argument("--recorded", type=int, default=1000, help="runs given a run directory (0: none)")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--ids", action="store_true")
    parser.add_argument("--run", action="store_true", help="measure `reslab run`'s start instead (docstring)")
    parser.add_argument("--finished", type=int, default=3, help="--run: runs that end before the Ctrl-C")
    parser.add_argument("--sleep", type=float, default=2.0, help="--run: each simulated run's length, s")
    parser.add_argument("--timeout", type=float, default=300.0, help="--run: kill a command after this many s")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if args.run:
        return run_mode(args, env)
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
                wall, _, peak, rc = timed(argv, env)
                cells += [f"{wall:.1f}" if rc == 0 else f"exit {rc}", f"{peak:.0f}"]
            shape = f"4 x {args.points} x {runs // (4 * args.points)}"
            print(f"| {runs:,} | {shape} | {' | '.join(cells)} |", flush=True)
    print(json.dumps({"python": args.python}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
