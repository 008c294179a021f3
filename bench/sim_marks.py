"""False marks on a null knock-out heatmap (issue 51, item 4): 12 sites x 15 sources = 180 cells, every delta
N(0, 1) (no effect anywhere), `--seeds` seeds, through `interventions.cell_table`. Per heatmap: the cells marked
before issue 51 (the t interval over seeds excludes 0, uncorrected: the t p at most 0.05), after (the t p
Holm-corrected over the heatmap; the `bh` correction beside it), and the share of heatmaps with any mark. Also
the smallest exact sign-flip p a cell can reach at these seeds (2 / 2^seeds: what the mechanism rows showed).
Deterministic: heatmap i draws from default_rng(i).

    python bench/sim_marks.py [--heatmaps 200] [--seeds 3]
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd
from _args import at_least

from reslab.results.interventions import cell_table

SITES, SOURCES = 12, 15


def heatmap(i: int, seeds: int) -> pd.DataFrame:
    rng = np.random.default_rng(i)
    return pd.DataFrame([{"arm": "a", "grid_key": "", "seed": s, "kind": "source", "site": site, "source": f"s{j}",
                          "mode": "zero", "loss": 3.0, "base_loss": 3.0, "delta": rng.standard_normal(), "tokens": 1}
                         for site in range(SITES) for j in range(SOURCES) for s in range(seeds)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heatmaps", type=at_least(10), default=200)
    parser.add_argument("--seeds", type=at_least(2), default=3)
    args = parser.parse_args()
    before, holm, bh = [], [], []
    for i in range(args.heatmaps):
        frame = heatmap(i, args.seeds)
        cells = cell_table(frame)
        before.append(int((cells["p"] <= 0.05).sum()))
        holm.append(int(cells["marked"].sum()))
        bh.append(int(cell_table(frame, correction="bh")["marked"].sum()))
    n = args.heatmaps
    print(f"{n} null heatmaps of {SITES * SOURCES} cells, {args.seeds} seeds, alpha 0.05; the sign flip's floor at "
          f"{args.seeds} seeds: {2 / 2 ** args.seeds:.3g}")
    print("| marks | false marks a heatmap (mean) | share of cells | heatmaps with any mark |")
    print("|---|---|---|---|")
    for name, marks in (("before: t interval excludes 0, uncorrected", before), ("after: t p, Holm over the heatmap",
                        holm), ("option: t p, BH over the heatmap", bh)):
        m = np.array(marks)
        print(f"| {name} | {m.mean():.2f} | {m.mean() / (SITES * SOURCES):.4f} | {np.mean(m > 0):.3f} |")


if __name__ == "__main__":
    main()
