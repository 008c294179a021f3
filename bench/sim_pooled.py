"""Coverage of a pooled row's interval (issue 51, item 3): strata of 2, 4 and 8 seeds with SDs 10, 1 and 1 (normal
deltas, common delta 0), the 95% interval of the stratified sign flip (`stats.stratified_flip_interval`) against
the one before issue 51 (each end bisected from the mean of the stratum means, assumed accepted).

Per data set: does each interval hold 0; does the test reject the mean of the stratum means (where the old search
started); does the old interval leave out a shift the test accepts (the new interval's ends, or a point of its
scan); and, of 25 evenly spaced shifts inside the new interval, is any rejected (the acceptance region not an
interval: the new interval is its hull). Deterministic: default_rng(51).

    python bench/sim_pooled.py [--reps 1000]
"""

from __future__ import annotations

import argparse

import numpy as np
from _args import at_least

from reslab.results.stats import _flip_edge, _stratified_sign_flip, stratified_flip_interval

SIZES, SDS, LEVEL = (2, 4, 8), (10.0, 1.0, 1.0), 0.05


def old_interval(strata: list[np.ndarray]) -> tuple[float, float]:
    """The interval before issue 51: each end bisected between the mean of the stratum means and a far shift."""
    d = np.concatenate(strata)
    center = float(np.mean([x.mean() for x in strata]))
    reach = float(np.ptp(d)) + abs(float(d.mean())) + 1.0
    return (_flip_edge(strata, "two-sided", LEVEL, center, float(d.min()) - reach),
            _flip_edge(strata, "two-sided", LEVEL, center, float(d.max()) + reach))


def p_at(strata: list[np.ndarray], m: float) -> float:
    return _stratified_sign_flip([x - m for x in strata], "two-sided")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=at_least(10), default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(51)
    old_cover = new_cover = center_rejected = old_misses = holes = 0
    for _ in range(args.reps):
        strata = [sd * rng.standard_normal(n) for n, sd in zip(SIZES, SDS, strict=True)]
        old, new = old_interval(strata), stratified_flip_interval(strata, LEVEL)
        old_cover += old[0] <= 0.0 <= old[1]
        new_cover += new[0] <= 0.0 <= new[1]
        center_rejected += p_at(strata, float(np.mean([x.mean() for x in strata]))) <= LEVEL
        inside = np.linspace(new[0], new[1], 27)[1:-1]
        accepted = [m for m in (*inside, new[0] + 1e-9 * abs(new[0]), new[1] - 1e-9 * abs(new[1]))
                    if p_at(strata, float(m)) > LEVEL]
        old_misses += any(m < old[0] or m > old[1] for m in accepted)
        holes += len(accepted) < inside.size + 2
    n = args.reps
    print(f"{n} data sets: strata of {SIZES} seeds, SDs {SDS}, common delta 0, 95% intervals")
    print("| interval | coverage | the test rejects the mean of stratum means | leaves out an accepted shift |")
    print("|---|---|---|---|")
    print(f"| before (bisected from the mean of stratum means) | {old_cover / n:.3f} | {center_rejected / n:.3f} | "
          f"{old_misses / n:.3f} |")
    print(f"| after (scanned, the hull of the accepted shifts) | {new_cover / n:.3f} | - | 0 by construction |")
    print("new intervals with a rejected shift among 25 inside (the acceptance region not an interval): "
          f"{holes / n:.3f}")


if __name__ == "__main__":
    main()
