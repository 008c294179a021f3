"""Knock-out effects of a study's runs (issue 36): per (arm, grid point, mode, site, source) the effect averaged
over seeds with its interval, and per run the mechanism values they imply.

Input: one row per (run, intervention), `COLUMNS` (`orchestrator.attempt.intervention.read_rows`): `delta` is
the run's held-out loss with the source removed (or the stream dropped, the gate pinned) minus its loss
without, on the same eval windows. A run is its own control, so the per-seed deltas are paired differences and
a cell's interval is the one-sample t interval of its seeds' deltas (`results.stats.paired_summary`: no new
statistics). A cell is marked when its one-sample t test of "no effect" rejects after the correction over its
family, every cell of one heatmap (grid point, arm and mode: its sites x sources and its stream and gate rows),
by Holm (`results.stats.holm`; `correction="bh"`: Benjamini-Hochberg), as the paired table corrects a family
(issue 51: uncorrected, 5.7% of the cells of a null heatmap at 3 seeds were marked, about 10 of 180;
`bench/sim_marks.py`). The t test reaches any level at 2 seeds; the exact sign flip cannot go below 0.25 at 3.
One seed: no interval, never marked.

Per-run mechanism values (`intervention_values`), a LONG frame [arm, grid_key, seed, metric, value] as the
mechanisms readout takes its summaries, so they become paired rows like any metric:

- `stream<k>_knockout`: the loss increase when stream k is dropped from every read (mode zero; the mean mode's
  is `stream<k>_knockout_mean`); stream k is the k-th stream of the variant's menu (DAR: a, b; HC, mHC, MGR:
  stream0, stream1, ...);
- `imbalance`: stream 0's knock-out effect minus the mean of the other streams' (for two streams, the
  difference of the two streams' effects, DAR's "functional imbalance"; 0 when the streams matter equally;
  `imbalance_mean` for the mean mode). Only runs with two or more streams have it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from reslab.results.stats import benjamini_hochberg, holm, paired_summary

__all__ = ["CELL_COLUMNS", "COLUMNS", "VALUE_COLUMNS", "cell_table", "intervention_values", "site_label"]

COLUMNS = ["arm", "grid_key", "seed", "kind", "site", "source", "mode", "loss", "base_loss", "delta", "tokens"]
CELL_COLUMNS = ["grid_key", "arm", "kind", "mode", "site", "source", "n", "mean", "ci_low", "ci_high", "p", "p_adj",
                "marked", "seeds"]
FAMILY = ["grid_key", "arm", "mode"]  # one heatmap: the cells a mark is corrected over (module docstring)
CORRECTIONS = {"holm": holm, "bh": benjamini_hochberg}
VALUE_COLUMNS = ["arm", "grid_key", "seed", "metric", "value"]


def site_label(site: Any) -> str:
    """A row's site as the tables and heatmaps name it: its number, or `all` (a whole stream, every gate)."""
    return "all" if site is None or (isinstance(site, float) and math.isnan(site)) else str(int(site))


def _frame(records: pd.DataFrame) -> pd.DataFrame:
    out = records.assign(grid_key=records["grid_key"].fillna("").astype(str),
                         site=[site_label(s) for s in records["site"]], delta=records["delta"].astype(np.float64))
    return out[np.isfinite(out["delta"].to_numpy())]


def cell_table(records: pd.DataFrame, alpha: float = 0.05, correction: str = "holm") -> pd.DataFrame:
    """One row per (grid point, arm, kind, mode, site, source), in the records' order: the seeds' mean delta,
    the t interval of level 1 - alpha over seeds, the one-sample t p against 0, that p corrected over the cell's
    heatmap (`FAMILY`) by `correction` ("holm" or "bh"), and `marked` when the corrected p is at most alpha
    (module docstring)."""
    rows: list[dict[str, Any]] = []
    if records.empty:
        return pd.DataFrame(columns=CELL_COLUMNS)
    keys = ["grid_key", "arm", "kind", "mode", "site", "source"]
    for key, part in _frame(records).groupby(keys, sort=False):
        deltas = part.sort_values("seed")["delta"].to_numpy()
        s = paired_summary(deltas, alpha=alpha)
        rows.append({**dict(zip(keys, key, strict=True)), "n": len(deltas), "mean": float(deltas.mean()),
                     "ci_low": s["ci_low"], "ci_high": s["ci_high"], "p": s["t_p"],
                     "seeds": ",".join(str(int(x)) for x in sorted(part["seed"]))})
    table = pd.DataFrame(rows, columns=CELL_COLUMNS)
    adjust = CORRECTIONS[correction]
    table["p_adj"] = np.nan
    for _, part in table.groupby(FAMILY, sort=False):
        table.loc[part.index, "p_adj"] = adjust(part["p"].to_numpy(dtype=np.float64))
    table["marked"] = (table["p_adj"] <= alpha).to_numpy(dtype=bool)
    return table


def _run_values(run: pd.DataFrame) -> list[tuple[str, float]]:
    """One run's (metric, value) pairs from its stream knock-outs (module docstring); stream k is the k-th
    stream its rows name (the variant's menu order)."""
    out: list[tuple[str, float]] = []
    for mode, part in run[run["kind"] == "stream"].groupby("mode", sort=False):
        suffix = "" if mode == "zero" else f"_{mode}"
        effect = [float(d) for d in part.drop_duplicates("source")["delta"]]
        out += [(f"stream{k}_knockout{suffix}", v) for k, v in enumerate(effect)]
        if len(effect) >= 2:
            out.append((f"imbalance{suffix}", effect[0] - sum(effect[1:]) / (len(effect) - 1)))
    return out


def intervention_values(records: pd.DataFrame) -> pd.DataFrame:
    """Per run its mechanism values from its interventions, LONG: [arm, grid_key, seed, metric, value]
    (module docstring); empty when no run dropped a stream."""
    rows: list[dict[str, Any]] = []
    if not records.empty:
        for (arm, key, seed), run in _frame(records).groupby(["arm", "grid_key", "seed"], sort=False):
            rows += [{"arm": arm, "grid_key": key, "seed": int(seed), "metric": m, "value": v}
                     for m, v in _run_values(run)]
    return pd.DataFrame(rows, columns=VALUE_COLUMNS)
