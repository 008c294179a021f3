"""Which eval window should `val_loss_tail` average? Evidence from dense evals, printed as a table.

    python bench/bench_tail_window.py [--study experiments/quickstart.yaml] [--seeds 8] [--eval-every 10]

Trains every arm of the study at seeds 1..S (in process, no Ray or MLflow) with an eval every
`--eval-every` steps, then scores each candidate window of the summary metric on the same runs:
the mean of the evals in the last fraction f of training (f = 0: the final eval alone), and the
study's own `eval_every`/`tail_k` window. Per treatment-vs-control row and window it prints the
mean paired delta, the SD of the paired deltas, d_z = mean / SD (the paired effect size, which
sets the seeds a comparison needs), the seeds a two-sided paired t needs for 80% power at
alpha 0.05 (normal approximation), and how far the window's value sits from the final eval
(mean over runs, nats: what the window adds of earlier, higher losses).

The histories are cached in `--out` (one JSON per run id), so a rerun only scores.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from _args import at_least

from reslab.experiments.expand import expand
from reslab.experiments.spec import load_study
from reslab.models.training import train

FRACTIONS = (0.0, 0.05, 0.1, 0.25, 0.5)


def histories(study_path: Path, seeds: int, eval_every: int, out: Path) -> tuple[dict, list, int]:
    """{(arm, seed): [(step, val_loss), ...]} for every run, trained or read from the cache."""
    overrides = [("train.eval_every", eval_every), ("train.checkpoint_every", 0), ("train.diagnostics", False)]
    study = load_study(study_path, overrides)
    runs = expand(study, seeds=tuple(range(1, seeds + 1)))
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for spec in runs:
        cached = out / f"{spec.run_id}.json"
        if not cached.exists():
            tic = time.perf_counter()
            evals = train(spec.config).history["eval"]
            cached.write_text(json.dumps([[e["step"], e["val_loss"]] for e in evals]))
            print(f"trained {spec.arm} seed {spec.seed} in {time.perf_counter() - tic:.0f}s", file=sys.stderr)
        curves[spec.arm, spec.seed] = [(int(s), float(v)) for s, v in json.loads(cached.read_text())]
    return curves, list(study.comparisons), runs[0].config.train.steps


def windows(study_path: Path, steps: int) -> dict[str, Callable[[int], bool]]:
    """Candidate windows: name -> predicate on an eval's step."""
    t = expand(load_study(study_path), seeds=(1,))[0].config.train
    own_steps = {t.steps - i * t.eval_every for i in range(t.tail_k)}
    chosen: dict[str, Callable[[int], bool]] = {}
    for f in FRACTIONS:
        label = "final eval only" if f == 0 else f"last {f:.0%} of steps"
        chosen[label] = (lambda s, f=f: s == steps) if f == 0 else (lambda s, f=f: s > steps * (1 - f))
    chosen[f"study's own (every {t.eval_every}, tail_k {t.tail_k})"] = lambda s: s in own_steps
    return chosen


def seeds_for_power(d_z: float) -> float:
    """Pairs a two-sided paired t needs for 80% power at alpha 0.05 (normal approximation + 1)."""
    return math.inf if d_z == 0 else ((1.959964 + 0.841621) / abs(d_z)) ** 2 + 1


def table(curves: dict, comparisons: list, chosen: dict) -> list[str]:
    seeds = sorted({s for _, s in curves})
    lines = ["| row | window | evals | mean Δ | SD Δ | d_z | seeds for 80% | above final (nats) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for comp in comparisons:
        for treat in comp.treatments:
            for label, keep in chosen.items():
                value = {k: statistics.fmean(v for s, v in c if keep(s)) for k, c in curves.items()}
                deltas = [value[treat, s] - value[comp.control, s] for s in seeds]
                mean, sd = statistics.fmean(deltas), statistics.stdev(deltas)
                above = statistics.fmean(value[k] - c[-1][1] for k, c in curves.items())
                n_evals = sum(keep(s) for s, _ in curves[comp.control, seeds[0]])
                lines.append(f"| {treat} - {comp.control} | {label} | {n_evals} | {mean:+.4f} | {sd:.4f} | "
                             f"{mean / sd:+.2f} | {seeds_for_power(mean / sd):.0f} | {above:.4f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--study", type=Path, default=Path("experiments/quickstart.yaml"),
                    help="the study whose arms to train")
    ap.add_argument("--seeds", type=at_least(3), default=8, help="seeds 1..S of every arm (default 8)")
    ap.add_argument("--eval-every", type=at_least(1), default=10, help="steps between evals (default 10)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/reslab-tail-window"), help="cache of the eval histories")
    args = ap.parse_args()
    torch.set_num_threads(1)
    curves, comparisons, steps = histories(args.study, args.seeds, args.eval_every, args.out)
    print(f"{args.study}: {args.seeds} seeds, evals every {args.eval_every} of {steps} steps\n")
    print("\n".join(table(curves, comparisons, windows(args.study, steps))))


if __name__ == "__main__":
    main()
