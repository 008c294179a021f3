"""Cost as paired ratio rows (issue 33, item 4): what a treatment costs relative to its control, per
comparison, treatment, grid point and declared cost metric (a study's `costs:`, names from
`common.metrics.COST_METRICS`: decode and prefill tokens/s, decode state bytes, peak memory, FLOPs
per token, training tokens/s, parameters).

The ratio. Costs are compared as ratios, treatment / control, on the same grid point and seed: a seed
fixes the initialisation and the data order in both arms, and a run's measured speed shares the
machine's state of the moment with its pair only loosely, but a per-seed ratio still cancels what
the two runs of a seed share multiplicatively. With l_s = log(treatment_s) - log(control_s) over the
n complete pairs, the row's ratio is the geometric mean of the per-seed ratios, exp(mean l), and its
interval is the one-sample t interval of the mean log ratio at level 1 - alpha, exponentiated:

    exp(mean l -+ t(1 - alpha/2, n - 1) sd(l) / sqrt(n))

(the standard interval for a ratio of lognormal paired measurements: a t interval on the log scale,
back-transformed; e.g. Kirkwood's geometric mean ratio, or FDA bioequivalence's log-scale paired
analysis). Assumption: the log ratios are independent draws from one normal distribution; a
multiplicative seed effect shared by the pair cancels in l_s whatever its size.
`tests/results/test_costs.py` checks the coverage by simulation. The interval is descriptive, like
the arms' means: no test, no multiplicity correction; its plain word says which side of 1 it lies on.

The machine (issue 51). A measured cost (a throughput, a peak memory: `MEASURED`) is only a ratio between two
runs timed on the same kind of machine: where the runs table names each run's machine (`machine`, the run's
`cost/machine` tag: the CPU with its threads, or the GPU), a pair whose runs were timed on different machines is
left out of the row and the row's flags say which seeds and machines; `machines` lists the machines of the
pairs kept. A run without the tag (an older run) is not checked.

The arms' values are shown as geometric means over the pairs kept (`control_geomean`, `treatment_geomean`):
their quotient is the row's ratio exactly, where the arithmetic means' quotient is not (it weighs the fast seeds
more); the arithmetic means and medians stay in the table.

Deterministic costs (parameters, FLOPs, state bytes: the same on every seed) give equal log ratios:
the SD is exactly 0 and the interval is the point, without warnings. A pair with a non-positive value
has no log ratio and is left out with a flag; a seed where either arm has no usable value is named in
`missing`. Rows are per grid point (a comparison's `pool:` applies to its deltas, not to its costs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as sps

from reslab.common.errors import ConfigError
from reslab.common.metrics import COST_METRICS, METRICS
from reslab.results.collect import matched_seeds, usable
from reslab.results.comparison import Comparison
from reslab.results.stats import _natural_key

__all__ = ["COST_COLUMNS", "RATIO_CONVENTION", "check_recorded", "cost_points", "cost_table", "pareto_front",
           "ratio_interval", "ratio_word"]

RATIO_CONVENTION = "treatment / control"
NO_DIFFERENCE = "no difference"
TOO_FEW = "too few pairs"
# the word for a ratio above 1 and below 1, by which way the metric is better
_WORDS = {"maximize": ("faster", "slower"), "minimize": ("larger", "smaller")}

COST_COLUMNS: tuple[str, ...] = (
    "comparison", "role", "metric", "direction", "delta", "grid_key", "control", "treatment", "n", "n_nonzero",
    "control_mean", "control_median", "control_geomean", "treatment_mean", "treatment_median", "treatment_geomean",
    "ratio", "ratio_low", "ratio_high", "log_mean", "log_sd", "df", "wins", "losses", "ties", "exploratory",
    "verdict", "seeds", "machines", "control_run_ids", "treatment_run_ids", "missing", "flags",
)
# the costs a machine measures (timed, or its memory): a ratio only between runs on the same kind of machine
MEASURED: tuple[str, ...] = ("prefill_tps", "decode_tps", "decode_tps_batch", "decode_peak_mem_mb", "tokens_per_s",
                             "peak_mem_mb")


def ratio_interval(log_ratios: np.ndarray | Sequence[float], alpha: float = 0.05) -> dict[str, np.ndarray]:
    """The geometric mean ratio and its seed-paired interval from per-seed log ratios, over the last axis
    (vectorised: [..., n] gives arrays of shape [...]). Keys: `ratio` = exp(mean), `low`/`high` = exp of
    the 1 - alpha t interval of the mean, `mean`, `sd` (ddof 1; exactly 0 when every log ratio is the
    same), `df` = n - 1. With n < 2 the interval, sd and df are NaN; with n = 0 everything is."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    lr = np.asarray(log_ratios, dtype=np.float64)
    n = lr.shape[-1]
    shape = lr.shape[:-1]
    nan = np.full(shape, np.nan)
    if n == 0:
        return {"ratio": nan, "low": nan.copy(), "high": nan.copy(), "mean": nan.copy(), "sd": nan.copy(),
                "df": nan.copy()}
    same = (lr == lr[..., :1]).all(axis=-1)
    mean = np.where(same, lr[..., 0], lr.mean(axis=-1))  # identical values: exactly that value, no rounding
    if n < 2:
        return {"ratio": np.exp(mean), "low": nan, "high": nan.copy(), "mean": mean, "sd": nan.copy(),
                "df": nan.copy()}
    sd = np.where(same, 0.0, lr.std(axis=-1, ddof=1))
    half = float(sps.t.ppf(1.0 - alpha / 2.0, n - 1)) * sd / math.sqrt(n)
    return {"ratio": np.exp(mean), "low": np.exp(mean - half), "high": np.exp(mean + half), "mean": mean, "sd": sd,
            "df": np.full(shape, float(n - 1))}


def ratio_word(metric: str, low: float, high: float) -> str:
    """The plain word of a ratio's interval: faster/slower (a throughput) or larger/smaller (a size,
    memory, FLOPs) when it excludes 1; "no difference" when it includes 1; "too few pairs" without one."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return TOO_FEW
    above, below = _WORDS[METRICS[metric].direction]
    return above if low > 1.0 else below if high < 1.0 else NO_DIFFERENCE


def check_recorded(runs: pd.DataFrame, costs: Iterable[str], study: str) -> None:
    """A declared cost that no finished run recorded (all NaN: runs from before reslab measured it) is one
    line naming it and the cost metrics the finished runs did record. No finished run yet: nothing to say."""
    finished = runs[usable(runs)]
    if finished.empty:
        return
    recorded = [m for m in COST_METRICS if m in finished and usable(finished, m).any()]
    absent = [m for m in costs if m not in recorded]
    if absent:
        have = f"recorded: {', '.join(recorded)}" if recorded else "recorded none of the cost metrics"
        raise ConfigError(f"study {study}: costs: {', '.join(absent)} {'was' if len(absent) == 1 else 'were'} not "
                          f"recorded by any of its {len(finished)} finished runs (runs trained before reslab "
                          f"measured {'it' if len(absent) == 1 else 'them'} have NaN); the runs {have}. Remove "
                          "it from `costs:` or train the runs again with this code")


def _join(values: Iterable[object]) -> str:
    return ",".join(str(v) for v in values)


def _machine_pairs(cell: pd.DataFrame, arms: tuple[str, str], machine: dict[str, str]) -> tuple[np.ndarray, list]:
    """Per pair, whether its two runs were timed on one kind of machine (True where either is not named), and
    each pair's (control machine, treatment machine)."""
    names = [(machine.get(str(c)), machine.get(str(t))) for c, t in zip(cell[f"run_id/{arms[0]}"],
                                                                      cell[f"run_id/{arms[1]}"], strict=True)]
    same = np.array([c is None or t is None or c == t for c, t in names], dtype=bool)
    return same, names


def _cell(comp: Comparison, treatment: str, metric: str, cell: pd.DataFrame, alpha: float,
          machine: dict[str, str]) -> dict[str, object]:
    """One row: the pairs of one grid point (rows of `matched_seeds`), their log ratios and summary; `machine`:
    run id -> the machine it was timed on (the module doc)."""
    control = comp.control
    cv = cell[f"value/{control}"].to_numpy(dtype=np.float64)
    tv = cell[f"value/{treatment}"].to_numpy(dtype=np.float64)
    seeds = cell["seed"].to_numpy()
    ok = np.isfinite(cv) & np.isfinite(tv)
    same, names = _machine_pairs(cell, (control, treatment), machine if metric in MEASURED else {})
    pos = ok & (cv > 0) & (tv > 0) & same
    missing = []
    for seed, c, t in zip(seeds[~ok], cv[~ok], tv[~ok], strict=True):
        arms = [a for a, v in ((control, c), (treatment, t)) if not np.isfinite(v)]
        missing.append(f"seed {seed}: no usable {' or '.join(arms)} run")
    flags = []
    for arm, values in ((control, cv), (treatment, tv)):
        lacking = seeds[~np.isfinite(values)]
        if lacking.size:
            has = f"seed {lacking[0]} has" if lacking.size == 1 else f"seeds {_join(lacking)} have"
            flags.append(f"incomplete: {has} no usable {arm} run with {metric}")
    if (ok & ~((cv > 0) & (tv > 0))).any():
        flags.append(f"seed(s) {_join(seeds[ok & ~((cv > 0) & (tv > 0))])}: {metric} <= 0, no log ratio; left out")
    for i in np.flatnonzero(ok & ~same):
        flags.append(f"seed {seeds[i]}: {control} timed on {names[i][0]}, {treatment} on {names[i][1]}: not one "
                     "kind of machine, left out")
    lr = np.log(tv[pos]) - np.log(cv[pos])
    s = {k: float(v) for k, v in ratio_interval(lr, alpha).items()}
    n = int(lr.size)
    if n == 1:
        flags.append("one pair: no interval")
    elif n >= 2 and s["sd"] == 0.0:
        flags.append("every pair has the same ratio (a deterministic cost): the interval is the point")
    better = lr > 0 if METRICS[metric].direction == "maximize" else lr < 0
    worse = lr < 0 if METRICS[metric].direction == "maximize" else lr > 0

    def stat(values: np.ndarray, f: str) -> float:
        return float(getattr(np, f)(values)) if values.size else math.nan

    return {
        "comparison": comp.name, "role": "cost", "metric": metric, "direction": METRICS[metric].direction,
        "delta": RATIO_CONVENTION, "control": control, "treatment": treatment, "n": n,
        "n_nonzero": int(np.count_nonzero(lr)),
        "control_mean": stat(cv[pos], "mean"), "control_median": stat(cv[pos], "median"),
        "control_geomean": math.exp(stat(np.log(cv[pos]), "mean")),
        "treatment_mean": stat(tv[pos], "mean"), "treatment_median": stat(tv[pos], "median"),
        "treatment_geomean": math.exp(stat(np.log(tv[pos]), "mean")),
        "ratio": s["ratio"], "ratio_low": s["low"], "ratio_high": s["high"], "log_mean": s["mean"],
        "log_sd": s["sd"], "df": s["df"], "wins": int(better.sum()), "losses": int(worse.sum()),
        "ties": int((lr == 0).sum()), "exploratory": comp.exploratory,
        "verdict": ratio_word(metric, s["low"], s["high"]), "seeds": _join(seeds[pos]),
        "machines": _join(sorted({m for i in np.flatnonzero(pos) for m in names[i] if m is not None})),
        "control_run_ids": ";".join(str(r) for r in cell[f"run_id/{control}"].to_numpy()[pos]),
        "treatment_run_ids": ";".join(str(r) for r in cell[f"run_id/{treatment}"].to_numpy()[pos]),
        "missing": "; ".join(missing), "flags": ";".join(flags),
    }


def cost_table(runs: pd.DataFrame, comparisons: Iterable[Comparison], costs: Sequence[str], *,
               alpha: float = 0.05) -> pd.DataFrame:
    """One row per declared cost, comparison, treatment and grid point (`COST_COLUMNS`; the cost metrics in
    declared order, then as the paired table orders its rows): the geometric mean ratio treatment / control
    over the seeds where both arms have a usable run (`results.collect.matched_seeds`), its 1 - alpha
    seed-paired interval, the arms' means and medians over those pairs, W/L/ties (a win: the treatment's
    cost is better, by the metric's direction) and the word; a measured cost's pairs timed on different machines
    are left out and flagged (the module doc). `alpha` is in `attrs["alpha"]`."""
    comparisons = list(comparisons)
    machine = ({str(r): str(m) for r, m in zip(runs["run_id"], runs["machine"], strict=True)
                if isinstance(m, str) and m} if "machine" in runs else {})
    rows = []
    for metric in costs:
        for comp in comparisons:
            for treatment in comp.treatments:
                matched = matched_seeds(runs, (comp.control, treatment), metric)
                for key in sorted(set(matched["grid_key"]), key=_natural_key):
                    row = _cell(comp, treatment, metric, matched[matched["grid_key"] == key], alpha, machine)
                    rows.append(row | {"grid_key": key})
    table = pd.DataFrame(rows, columns=list(COST_COLUMNS))
    for col in ("n", "n_nonzero", "wins", "losses", "ties"):
        table[col] = table[col].astype(np.int64)
    table["exploratory"] = table["exploratory"].astype(bool)
    table.attrs["alpha"] = alpha
    return table


def cost_points(runs: pd.DataFrame, arms: Sequence[str], cost: str, metric: str, grid_key: str) -> pd.DataFrame:
    """The runs of `arms` at one grid point usable on both `cost` (and positive) and `metric`: one row per
    run, `arm, seed, cost, loss`, arms in the order given (what a loss-versus-cost plot draws)."""
    mine = runs[runs["arm"].isin(arms) & (runs["grid_key"].fillna("") == grid_key)]
    mine = mine[usable(mine, cost) & usable(mine, metric)]
    mine = mine[mine[cost].to_numpy(dtype=np.float64) > 0]
    order = {a: i for i, a in enumerate(arms)}
    out = pd.DataFrame({"arm": mine["arm"].astype(str), "seed": mine["seed"].astype(np.int64),
                        "cost": mine[cost].astype(np.float64), "loss": mine[metric].astype(np.float64)})
    return out.sort_values(["arm", "seed"], key=lambda c: c.map(order) if c.name == "arm" else c,
                           kind="stable").reset_index(drop=True)


def pareto_front(x: np.ndarray | Sequence[float], y: np.ndarray | Sequence[float], x_direction: str,
                 y_direction: str) -> np.ndarray:
    """Which points are on the Pareto front: not dominated, where j dominates i when j is better or equal on
    both axes (by each axis's direction, "minimize" or "maximize") and strictly better on one. NaN points are
    never on it; equal points are both on it."""
    sx = np.where(x_direction == "maximize", -1.0, 1.0) * np.asarray(x, dtype=np.float64)  # lower is better
    sy = np.where(y_direction == "maximize", -1.0, 1.0) * np.asarray(y, dtype=np.float64)
    finite = np.isfinite(sx) & np.isfinite(sy)
    le = (sx[None, :] <= sx[:, None]) & (sy[None, :] <= sy[:, None])  # [i, j]: j at least as good as i
    lt = (sx[None, :] < sx[:, None]) | (sy[None, :] < sy[:, None])
    dominated = (le & lt & finite[None, :]).any(axis=1)
    return finite & ~dominated
