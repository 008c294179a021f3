"""How often a local Ray instance starts on a loaded machine (issue 52, item 2): K starts and stops of
`RayBackend`'s local instance beside N CPU-bound processes, the "before" and "after" ways taking turns.

    python bench/bench_ray_start.py [--starts 5] [--burners 8] [--timeout 300] [--modes before,after]

Each start is a fresh interpreter (as `reslab run` is) that starts the local instance the way reslab does
(`RayBackend.start`, its warm-up included), then shuts it down. "after" is this code; "before" is the same
with what issue 52 changed taken out: one try (`START_ATTEMPTS = 1`) and no `_metrics_export_port` (the
raylet then waits at most 15 s for the file its dashboard agent writes only once every agent module is
imported). The burners are `while True: pass` processes started before the first start and killed after
the last. Prints per mode: starts that came up, their median wall time, and each failure's first line.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

CHILD = """
import sys, tempfile
from pathlib import Path
import ray
from reslab.orchestrator.dispatch import ray_backend

if sys.argv[1] == "before":
    ray_backend.START_ATTEMPTS = 1
    init = ray.init
    def old_init(*args, **kwargs):
        kwargs.pop("_metrics_export_port", None)
        return init(*args, **kwargs)
    ray.init = old_init
backend = ray_backend.RayBackend("local", workspace=Path(tempfile.mkdtemp()))
try:
    backend.start()
finally:
    backend.shutdown()
"""


def _burn() -> None:
    while True:
        pass


def one_start(mode: str, timeout: float) -> tuple[bool, float, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return False, time.perf_counter() - started, f"no answer within {timeout:g}s (killed)"
    wall = time.perf_counter() - started
    lines = [line for line in err.splitlines() if line.strip()]
    retries = sum("trying again" in line for line in lines)
    why = (lines[-1][:160] if lines else f"exit {proc.returncode}") if proc.returncode else f"{retries} retries"
    return proc.returncode == 0, wall, why


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--burners", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--modes", default="before,after")
    args = parser.parse_args()
    modes = args.modes.split(",")
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    results: dict[str, list[tuple[bool, float, str]]] = {m: [] for m in modes}
    try:
        time.sleep(2)
        for i in range(args.starts):
            for mode in modes:
                result = one_start(mode, args.timeout)
                results[mode].append(result)
                print(f"start {i + 1} {mode}: {'up' if result[0] else 'FAILED'} in {result[1]:.1f}s ({result[2]}) "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        for b in burners:
            b.kill()
    print(f"\n| mode | started | median s (started) | burners {args.burners}, {os.cpu_count()} CPUs |")
    print("|---|---|---|---|")
    for mode, rows in results.items():
        up = [wall for ok, wall, _ in rows if ok]
        median = f"{statistics.median(up):.1f}" if up else "-"
        print(f"| {mode} | {len(up)}/{len(rows)} | {median} | |")


if __name__ == "__main__":
    main()
