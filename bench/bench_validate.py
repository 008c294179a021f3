"""How `reslab validate` scales with a study's size: generated studies of 10^4 to 10^6 runs, each
validated in a subprocess, its wall time and peak memory printed as a markdown table.

    python bench/bench_validate.py [--runs 10000,100000,1000000] [--repeats 3] [--points 250]

A study of N runs is 4 arms (pre-norm and three AttnRes variants) x `--points` grid points (two
axes: `optim.lr` x `train.eval_every`) x N / (4 x points) seeds, on the tiny preset. Validation
checks every (arm, grid point) config and counts the seeds (`orchestrator.cli.study.cmd_validate`),
so its time grows with arms x grid points, not with the runs. Peak memory is the subprocess's
maximum resident set (`getrusage(RUSAGE_CHILDREN)`, which reports the largest child so far: the
sizes run in increasing order).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STUDY = """
study: big{runs}
base:
  model: {{preset: tiny}}
  optim: {{batch_size: 16, warmup_steps: 20}}
  train: {{steps: 200, eval_windows: 128}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
  block2: {{residual: {{name: block_attnres, options: {{block_size: 2}}}}}}
  block4: {{residual: {{name: block_attnres, options: {{block_size: 4}}}}}}
seeds: {seeds}
limits: {{max_runs: {runs}}}
grid:
  optim.lr: [{lrs}]
  train.eval_every: [{evals}]
comparisons:
  - {{control: control, exploratory: true}}
"""


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, float, int]:
    """(wall s, CPU s (user + system), peak RSS MiB, exit status) of one command in a subprocess, its output
    discarded and its stderr's tail printed when it fails (kept in a file: a pipe nobody reads would stall a
    child that writes more than the pipe holds). On a shared machine the CPU seconds move less with the load
    than the wall time does."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            err.seek(0)
            print(err.read().decode()[-2000:], file=sys.stderr)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, code


def write_study(directory: Path, runs: int, points: int) -> Path:
    n_eval = 10
    n_lr = points // n_eval
    seeds = runs // (4 * n_lr * n_eval)
    text = STUDY.format(runs=runs, seeds=seeds, lrs=", ".join(f"{1e-4 * (i + 1):.4g}" for i in range(n_lr)),
                        evals=", ".join(str(10 * (i + 1)) for i in range(n_eval)))
    path = directory / f"big{runs}.yaml"
    path.write_text(text)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="10000,100000,1000000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--points", type=int, default=250, help="grid points (a multiple of 10)")
    args = parser.parse_args()
    print("| runs | arms x grid points x seeds | validate, median s (min-max) | peak RSS MiB |")
    print("|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for runs in (int(x) for x in args.runs.split(",")):
            spec = write_study(Path(tmp), runs, args.points)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "reslab.orchestrator.cli", "validate", str(spec)],
                                      capture_output=True, text=True)
                times.append(time.perf_counter() - start)
                if done.returncode != 0:
                    print(done.stdout, done.stderr, file=sys.stderr)
                    return 1
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
            shape = f"4 x {args.points} x {runs // (4 * args.points)}"
            print(f"| {runs:,} | {shape} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) "
                  f"| {peak:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
