"""Seed shopping by simulation (issue 55 item 5), printed as a markdown table: a loop re-submits a null comparison
(both arms one distribution, seed SD 0.03, 10 seeds a study) under new study names and new replicates until its
verdict says "better" or K tries were made; the share of loops that claim "better", without the ledger's correction
(every try at alpha) and with it (the k-th try at alpha * 6 / (pi^2 k^2), `results.tries.spent_alpha`), beside
1 - (1 - p1)^K (p1: one try's rate of "better" at alpha, measured) and the mean tries a loop made. The loop and the
decision are the test's (`tests/results/test_seed_shopping.py`: the paired table's row rule, the real ledger in a
temporary workspace), with a 95% Wilson interval for each rate.

    python bench/sim_seed_shopping.py [--loops 2000]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from statsmodels.stats.proportion import proportion_confint  # noqa: E402

from tests.results.test_seed_shopping import SEED_SD, SEEDS, decide, shop  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=2000)
    args = parser.parse_args()
    print(f"{args.loops} loops per row, {SEEDS} seeds a study, seed SD {SEED_SD}; 95% Wilson intervals\n")
    print("| alpha | K | one try (p1) | 1-(1-p1)^K | FP without | mean tries | FP with the ledger | mean tries |")
    print("|---|---|---|---|---|---|---|---|")
    for alpha in (0.05, 0.10):
        d = np.random.default_rng(7).normal(0, SEED_SD * math.sqrt(2), (8000, SEEDS))
        p1 = sum(w == "better" for w in decide(d, alpha)) / len(d)
        for k in (1, 3, 10, 30):
            cells = []
            for corrected in (False, True):
                with tempfile.TemporaryDirectory() as root:
                    won, tries = shop(Path(root), args.loops, k, alpha, corrected, seed=11 + k)
                low, high = proportion_confint(won, args.loops, method="wilson")
                cells += [f"{won / args.loops:.3f} [{low:.3f}, {high:.3f}]", f"{tries:.2f}"]
            print(f"| {alpha:g} | {k} | {p1:.4f} | {1 - (1 - p1) ** k:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
