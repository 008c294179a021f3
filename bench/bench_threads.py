"""`reslab train` speed alone and beside a CPU-bound process, per torch thread count.

    python bench/bench_threads.py [--preset tiny --steps 200 --threads 2,default]

Each cell is one real `reslab train --preset tiny --steps 200` (a fresh run directory, the stdlib
corpus, evals included), run as a subprocess: `train` tokens/s from its summary and the wall time
of the whole command. "beside a hog" starts `python -c 'while True: pass'` first and stops it
after. `default` is what `reslab train` picks without `--threads` (orchestrator.attempt.threads.default_threads);
the thread count of all the machine's cores is torch's own default, what `train` used before.
Run it on an otherwise idle machine (`uptime` load < 1): other load skews every cell.
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

RESLAB = [sys.executable, "-m", "reslab.orchestrator.cli"]


def train_once(preset: str, steps: int, threads: str, out: Path) -> tuple[float, float]:
    """(training tokens/s, wall seconds of the whole command)."""
    summary = out / "summary.json"
    cmd = [*RESLAB, "train", "--preset", preset, "--steps", str(steps), "--out", str(out / "run"), "--no-resume",
           "--summary-json", str(summary)]
    if threads != "default":
        cmd += ["--threads", threads]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    return json.loads(summary.read_text())["summary"]["tokens_per_s"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", default=f"{len(os.sched_getaffinity(0))},default",
                        help="comma-separated thread counts; `default` lets `reslab train` choose")
    args = parser.parse_args()

    from reslab.orchestrator.attempt.threads import default_threads

    print(f"{len(os.sched_getaffinity(0))} CPUs; `reslab train` default threads: {default_threads()}; "
          f"load before: {os.getloadavg()[0]:.2f}\n")
    print("| threads | alone tok/s | alone wall s | beside a hog tok/s | beside a hog wall s | slowdown |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.threads.split(","):
            alone_tps, alone_wall = train_once(args.preset, args.steps, threads, Path(tmp) / f"a{threads}")
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                hog_tps, hog_wall = train_once(args.preset, args.steps, threads, Path(tmp) / f"h{threads}")
            finally:
                hog.kill()
                hog.wait()
            label = f"default ({default_threads()})" if threads == "default" else threads
            print(f"| {label} | {alone_tps:,.0f} | {alone_wall:.1f} | {hog_tps:,.0f} | {hog_wall:.1f} | "
                  f"{hog_wall / alone_wall:.2f}x |", flush=True)
    print(f"\nload after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
