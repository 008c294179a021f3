"""The sequential tests compared (issue 51, item 2): for each test of `seeds.sequential.test` (flip, sign, t), the
seeds a study needs and how often it errs under the null.

Seeds needed: `power --sequential`'s design for a fixed study (seeds 4, +1 per look, at most 16, prior scale the
squared standardised effect), normal deltas; superiority at level 0.025 (alpha 0.05 over a 2-row family) at an
effect of `--effect` SDs (the share decided "better" and the mean seeds), and equivalence within +-`--effect` SDs
at a true delta of 0 (the share decided "equivalent" and the mean seeds). Type-I error: the default looks (4, 6,
..., 16 seeds), alpha 0.05, deltas of mean 0 from each null (normal, t3, bimodal +-1 + N(0, 0.1^2), +-1, centred
lognormal sigma 0.5 and 1, centred exponential): the share of studies that claim a difference. Deterministic: every
simulation draws from seed 0 (the effect) or 5 (the nulls); Monte Carlo SE of a rate p: sqrt(p (1 - p) / reps).

    python bench/sim_sequential.py [--reps 2000] [--effect 1.5]
"""

from __future__ import annotations

import argparse
import math

import numpy as np
from _args import at_least

from reslab.results.sequential import TESTS, RowRule, SequentialDesign, simulate_design


def _lognormal(sigma: float):
    def draw(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
        return rng.lognormal(0.0, sigma, shape) - math.exp(sigma ** 2 / 2)
    return draw


NULLS = {
    "normal": lambda rng, shape: rng.standard_normal(shape),
    "t3": lambda rng, shape: rng.standard_t(3, shape),
    "bimodal": lambda rng, shape: rng.choice([-1.0, 1.0], shape) + 0.1 * rng.standard_normal(shape),
    "+-1": lambda rng, shape: rng.choice([-1.0, 1.0], shape),
    "lognormal .5": _lognormal(0.5),
    "lognormal 1": _lognormal(1.0),
    "exponential": lambda rng, shape: rng.exponential(1.0, shape) - 1.0,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=at_least(100), default=2000)
    parser.add_argument("--effect", type=at_least(0.1, float), default=1.5)
    args = parser.parse_args()
    g = args.effect ** 2
    print(f"{args.reps} simulated studies per cell; effect {args.effect} SD (prior scale {g:g})")
    print("| test | superiority: better | seeds | equivalence: equivalent | seeds | "
          + " | ".join(f"type-I {name}" for name in NULLS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(NULLS))
    for test in TESTS:
        design = SequentialDesign(4, 1, 16, g, test)
        sup = simulate_design(design, -args.effect, 1.0, alpha=0.025, reps=args.reps)
        eq = simulate_design(design, 0.0, 1.0, alpha=0.025, rule=RowRule(bound=args.effect, superiority=False),
                             reps=args.reps)
        nulls = []
        for noise in NULLS.values():
            sim = simulate_design(SequentialDesign(4, 2, 16, 1.0, test), 0.0, 1.0, reps=args.reps, seed=5,
                                  noise=noise)
            nulls.append(sim.decided.get("better", 0.0) + sim.decided.get("worse", 0.0))
        print(f"| {test} | {sup.decided.get('better', 0.0):.3f} | {sup.mean_seeds:.2f} | "
              f"{eq.decided.get('equivalent', 0.0):.3f} | {eq.mean_seeds:.2f} | "
              + " | ".join(f"{100 * p:.1f}%" for p in nulls) + " |", flush=True)


if __name__ == "__main__":
    main()
