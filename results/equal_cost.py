"""Comparisons at equal cost (issue 21, item 5): every arm of a comparison read at the FLOPs or
wall-clock that all of them reached, instead of at equal tokens.

A routing arm that costs 1.1x pre-norm's FLOPs per token has spent 10% more compute by the end of
the same number of steps; at equal FLOPs it is read at 1/1.1 of its run. Per grid point and seed,
the matched cost is the smallest final cost among the comparison's arms' finished runs; each run's
`val_loss` is read from its eval curve at that cost, linearly interpolated in log cost between the
two evals around it (the run's last eval when the run is the cheapest). A run whose first eval
comes after the matched cost cannot be read and is left without a value, so its pair counts as
incomplete rather than being read off an extrapolation.

The cost of a run so far, at each eval: FLOPs = step x the run's training FLOPs per step
(`experiments.budget`); wall-clock = step x tokens per step / the run's measured training tokens/s
(evals excluded). A pure function of tables the orchestrator gathers.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from reslab.results.collect import usable
from reslab.results.comparison import CURVE_METRIC

__all__ = ["at_matched_cost", "value_at"]


def value_at(cost: np.ndarray, value: np.ndarray, target: float) -> float:
    """The curve (cost, value), sorted by cost, read at `target`: linear in log cost between the
    evals around it; NaN before the first eval or past the last."""
    if cost.size == 0 or target < cost[0] * (1 - 1e-12) or target > cost[-1] * (1 + 1e-12):
        return float("nan")
    if target >= cost[-1]:
        return float(value[-1])
    return float(np.interp(np.log(target), np.log(cost), value))


def at_matched_cost(runs: pd.DataFrame, curves: pd.DataFrame, arms: Iterable[str]) -> pd.DataFrame:
    """A copy of the runs table in which every finished run of `arms` has its `val_loss` read at the
    matched cost of its grid point and seed (the module doc).

    `curves`: one row per eval, ``run_id, cost, val_loss``, cost the run's FLOPs or train seconds
    so far. Runs of `arms` without a curve get NaN."""
    out = runs.copy()
    arms = list(arms)
    mine = out[out["arm"].isin(arms) & usable(out)]
    by_run = {rid: g.sort_values("cost") for rid, g in curves.groupby("run_id")}
    final = {rid: float(g["cost"].iloc[-1]) for rid, g in by_run.items()}
    for _, group in mine.groupby([mine["grid_key"].fillna(""), "seed"]):
        reached = [final[rid] for rid in group["run_id"] if rid in final]
        target = min(reached) if reached else float("nan")
        for idx, rid in zip(group.index, group["run_id"], strict=True):
            curve = by_run.get(rid)
            out.loc[idx, CURVE_METRIC] = (float("nan") if curve is None else
                                          value_at(curve["cost"].to_numpy(dtype=np.float64),
                                                   curve[CURVE_METRIC].to_numpy(dtype=np.float64), target))
    return out
