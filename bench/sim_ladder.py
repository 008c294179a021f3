"""Coverage of the ladder's k interval per rung (issue 51, item 1): synthetic 5-rung ladders with a known
k = 1.25 (`tests/results/test_ladder.py`'s law: L(C) = 1.8 + 1e4 C^-0.3 over 1e14..1e17 FLOPs; 8 seeds, each
with a shared offset SD 0.01 in both arms and own noise SD 0.003 per run), `scaling.compute_multiplier` on each.

Per rung it prints the true SD of log k (over the simulated ladders), the median bootstrap SD, and the coverage
and median high/low of the interval without the smoothing (the bootstrap SD alone, the interval before
issue 51) and with it (`scaling.smooth_sd`, the interval now). "Narrow" cases are inner rungs whose
interval without the smoothing is under half the mean width of its two neighbours' (the resampled k(C) curves pivot
there); their count and coverage are printed on their own line. Deterministic: ladder i draws from
default_rng(1000 + i), its bootstrap from seed i.

    python bench/sim_ladder.py [--ladders 200] [--draws 100] [--seeds 8]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from _args import at_least
from scipy import stats as sps

from reslab.results.scaling import Ladder, PowerLaw, compute_multiplier, fit_power_law

LAW = PowerLaw(E=1.8, A=1.0e4, alpha=0.3)
FLOPS = np.geomspace(1e14, 1e17, 5)
K = 1.25


def one_ladder(i: int, seeds: int, draws: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(log k, bootstrap SD, SE after the smoothing, t half-width factor) at the rungs of ladder i."""
    rng = np.random.default_rng(1000 + i)
    arm_law = PowerLaw(E=LAW.E, A=LAW.A * K ** -LAW.alpha, alpha=LAW.alpha)
    shared = rng.normal(0, 0.01, size=(seeds, 1))
    control = LAW.loss(FLOPS)[None, :] + shared + rng.normal(0, 0.003, (seeds, FLOPS.size))
    arm = arm_law.loss(FLOPS)[None, :] + shared + rng.normal(0, 0.003, (seeds, FLOPS.size))
    # full-data fits warm-started at the true laws (tests/results/test_scaling.py's `_fits_from_the_truth`)
    fits = (fit_power_law(np.tile(FLOPS, seeds), control.ravel(), start=LAW),
            fit_power_law(np.tile(FLOPS, seeds), arm.ravel(), start=arm_law))
    m = compute_multiplier(Ladder(FLOPS, control), Ladder(FLOPS, arm), draws=draws, seed=i, fits=fits)
    factor = float(sps.t.ppf(0.975, seeds - 1)) * math.sqrt(seeds / (seeds - 1))
    return np.log(m.k), m.sd_boot, m.se, np.full(FLOPS.size, factor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladders", type=at_least(10), default=200)
    parser.add_argument("--draws", type=at_least(20), default=100)
    parser.add_argument("--seeds", type=at_least(3), default=8)
    args = parser.parse_args()
    log_k, sd_boot, se, factor = (np.array(x) for x in zip(*(one_ladder(i, args.seeds, args.draws)
                                                             for i in range(args.ladders)), strict=True))
    truth = math.log(K)
    old_half, new_half = factor * sd_boot, factor * se
    old_cover = np.abs(log_k - truth) <= old_half
    new_cover = np.abs(log_k - truth) <= new_half
    print(f"{args.ladders} ladders, {args.seeds} seeds, 5 rungs, {args.draws} bootstrap draws, k = {K}")
    print("| rung | true SD log k | median boot SD | coverage before | coverage after | high/low before | after |")
    print("|---|---|---|---|---|---|---|")
    for r in range(FLOPS.size):
        print(f"| {r} | {np.std(log_k[:, r], ddof=1):.4f} | {np.median(sd_boot[:, r]):.4f} | "
              f"{old_cover[:, r].mean():.3f} | {new_cover[:, r].mean():.3f} | "
              f"{np.median(np.exp(2 * old_half[:, r])):.3f} | {np.median(np.exp(2 * new_half[:, r])):.3f} |")
    inner = range(1, FLOPS.size - 1)
    narrow = np.array([[old_half[i, r] < 0.5 * (old_half[i, r - 1] + old_half[i, r + 1]) / 2 for r in inner]
                       for i in range(args.ladders)])
    cells_old = np.array([[old_cover[i, r] for r in inner] for i in range(args.ladders)])[narrow]
    cells_new = np.array([[new_cover[i, r] for r in inner] for i in range(args.ladders)])[narrow]
    print(f"narrow inner rungs: {int(narrow.sum())} in {int(narrow.any(axis=1).sum())} of {args.ladders} ladders; "
          f"coverage before {cells_old.mean() if cells_old.size else math.nan:.3f}, "
          f"after {cells_new.mean() if cells_new.size else math.nan:.3f}")


if __name__ == "__main__":
    main()
