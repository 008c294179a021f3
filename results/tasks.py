"""Downstream tasks, paired over seeds and items: the two-level statistics of the task readout.

Pure functions of arrays and of the tidy item table (one row per (arm, grid_key, seed, task, doc_id) with the
task's metric `value`: 0/1 correctness for accuracy, any score otherwise), as the evaluations record it.

The design. Two arms share their training seeds (seed s initialises and orders the data identically in both)
and are scored on the same benchmark items, so the paired difference d[s, i] = treatment - control of seed s
on item i is a crossed seeds x items table. The estimate is its grand mean. Both seeds and items are samples:
another seed would train other models, another benchmark of the same kind would hold other questions; a
published gain should survive both (Sellam et al. 2022, "The MultiBERTs", whose Multi-Bootstrap resamples
seeds and items jointly; Madaan et al. 2024, "Quantifying Variance in Evaluation Benchmarks", on seed
variance across checkpoints; Miller 2024, "Adding Error Bars to Evals", on clustered and paired standard
errors over items).

The interval: a variance-components estimate with a Satterthwaite t, chosen over Multi-Bootstrap's two-way
bootstrap because studies here have 2-10 seeds, where a bootstrap over seeds under-covers (it has no small-
sample correction and reads the seed variance with an (S-1)/S bias). With the ANOVA decomposition of any
crossed design with independently drawn seeds and items (additivity is not assumed),

    Var(dbar) = s2_seed / S + s2_item / N + s2_inter / (S N),

and with the row (seed) means, the column (item) means and the interaction residual of the table,

    V_seed = var(row means) / S          E = s2_seed / S + s2_inter / (S N)
    V_item = var(column means) / N       E = s2_item / N + s2_inter / (S N)
    V_res  = MS_residual / (S N)         E = s2_inter / (S N)

so V = V_seed + V_item - V_res is unbiased for Var(dbar); it is floored at V_res (a negative estimate says
only that the main effects are too small to see). Its degrees of freedom are Satterthwaite's,
V^2 / (V_seed^2 / (S-1) + V_item^2 / (N-1) + V_res^2 / ((S-1)(N-1))), and the interval is the t interval
on them; the p is the matching two-sided t test against 0. The shares of variance are V's three parts
(seeds, items, interaction), each clipped at 0, over their sum. `tests/results/test_task_coverage.py` shows
95% coverage with both components present, and that `item_only` (what one model's stderr gives) does not.

A suite average (the mean over tasks of each task's delta, every task weighted equally as the papers'
averages are) uses the same three parts with task k weighted 1/K: the seeds are shared across tasks (one
V_seed over the per-seed suite deltas), each task's items are its own (V_item and V_res summed over tasks
with weight 1/K^2).

One seed pair cannot see the seed component: its row is McNemar's exact test on the discordant items (for
0/1 metrics; a paired t over items otherwise) with the item-only interval, flagged. Holm adjusts the task
rows of one (comparison, treatment, grid point) together; the suite row is a summary of those rows, outside
the family.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy import stats as sps

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.stats import holm

__all__ = ["ITEM_COLUMNS", "SUITE", "TASK_COLUMNS", "TwoWay", "item_only", "mcnemar_exact", "task_table", "two_way"]

SUITE = "suite average"
ITEM_COLUMNS = ("arm", "grid_key", "seed", "task", "doc_id", "value")
TASK_COLUMNS: tuple[str, ...] = (
    "comparison", "family", "grid_key", "control", "treatment", "task", "metric", "n_seeds", "n_items",
    "control_mean", "treatment_mean", "delta", "se", "df", "ci_low", "ci_high", "p", "p_holm", "method",
    "share_seeds", "share_items", "share_interaction", "item_ci_low", "item_ci_high", "seeds", "flags",
)


@dataclass(frozen=True)
class TwoWay:
    """The paired delta of a crossed seeds x items design: estimate, standard error, Satterthwaite df, the
    (1 - alpha) t interval, the two-sided p against 0, and the variance's three parts (`module docstring`)."""

    estimate: float
    se: float
    df: float
    ci_low: float
    ci_high: float
    p: float
    seed_part: float
    item_part: float
    interaction_part: float

    @property
    def shares(self) -> tuple[float, float, float]:
        """The seeds', items' and interaction's shares of the delta's variance (each part clipped at 0)."""
        parts = np.clip([self.seed_part, self.item_part, self.interaction_part], 0.0, None)
        total = parts.sum()
        if total <= 0:
            return (math.nan, math.nan, math.nan)
        s, i, r = (parts / total).tolist()
        return (s, i, r)


def _t_row(estimate: float, var: float, df: float, alpha: float) -> tuple[float, float, float, float]:
    """(se, ci_low, ci_high, p) of a t statistic on `df` degrees of freedom; NaN where undefined."""
    se = math.sqrt(var) if var >= 0 else math.nan
    if not (se > 0 and df > 0):
        exact = se == 0 and estimate == 0
        return se, estimate if se == 0 else math.nan, estimate if se == 0 else math.nan, 1.0 if exact else math.nan
    q = float(sps.t.ppf(1 - alpha / 2, df))
    p = float(2 * sps.t.sf(abs(estimate) / se, df))
    return se, estimate - q * se, estimate + q * se, p


def _check_tables(tables: Sequence[np.ndarray]) -> list[np.ndarray]:
    out = [np.asarray(t, dtype=np.float64) for t in tables]
    if not out or any(t.ndim != 2 for t in out):
        raise ValueError("two_way: expected one or more 2-D [seeds, items] tables")
    seeds = {t.shape[0] for t in out}
    if len(seeds) != 1 or min(seeds) < 2 or any(t.shape[1] < 2 for t in out):
        raise ValueError(f"two_way: every table needs the same seeds (>= 2) and >= 2 items; got shapes "
                         f"{[t.shape for t in out]}")
    if any(not np.isfinite(t).all() for t in out):
        raise ValueError("two_way: the tables hold NaN or infinite values")
    return out


def two_way(tables: Sequence[np.ndarray] | np.ndarray, alpha: float = 0.05) -> TwoWay:
    """The crossed design's paired delta and its interval (module docstring). `tables` is one [S, N] table of
    per-(seed, item) paired differences, or K tables [S, N_k] of K tasks sharing the S seeds in the same
    order (the suite average: the mean of the K tasks' deltas)."""
    parts = _check_tables([tables] if isinstance(tables, np.ndarray) else tables)
    k, s = len(parts), parts[0].shape[0]
    per_seed = np.mean([t.mean(axis=1) for t in parts], axis=0)                 # [S] suite delta per seed
    estimate = float(per_seed.mean())
    v_seed = float(per_seed.var(ddof=1)) / s
    v_item = v_res = 0.0
    item_dfs: list[tuple[float, float]] = []   # (part, df) of each task's item and residual parts
    for t in parts:
        n = t.shape[1]
        rows, cols = t.mean(axis=1), t.mean(axis=0)
        residual = t - rows[:, None] - cols[None, :] + t.mean()
        item = float(cols.var(ddof=1)) / n / k**2
        res = float((residual**2).sum()) / ((s - 1) * (n - 1)) / (s * n) / k**2
        v_item += item
        v_res += res
        item_dfs += [(item, n - 1.0), (res, (s - 1.0) * (n - 1.0))]
    var = max(v_seed + v_item - v_res, v_res)
    denominator = v_seed**2 / (s - 1) + sum(part**2 / df for part, df in item_dfs)
    df = var**2 / denominator if denominator > 0 else math.inf
    se, low, high, p = _t_row(estimate, var, df, alpha)
    # V_seed and V_item each hold the interaction's part once: the three parts sum to V before the floor
    return TwoWay(estimate=estimate, se=se, df=df, ci_low=low, ci_high=high, p=p, seed_part=v_seed - v_res,
                  item_part=v_item - v_res, interaction_part=v_res)


def item_only(table: np.ndarray, alpha: float = 0.05) -> tuple[float, float, float, float]:
    """What a single model's stderr gives, for a paired [S, N] table: the items' standard error of the
    seed-averaged per-item difference, sd(column means) / sqrt(N), with a normal interval (lm-eval's
    stderr, made paired). It ignores the seed component. Returns (estimate, se, ci_low, ci_high)."""
    t = np.asarray(table, dtype=np.float64)
    cols = t.mean(axis=0)
    estimate = float(cols.mean())
    se = float(cols.std(ddof=1)) / math.sqrt(cols.size) if cols.size > 1 else math.nan
    z = float(sps.norm.ppf(1 - alpha / 2))
    return estimate, se, estimate - z * se, estimate + z * se


def mcnemar_exact(control: np.ndarray, treatment: np.ndarray) -> tuple[int, int, float]:
    """McNemar's exact test of one seed pair on the same items (0/1 correctness): (b, c, p) with b the items
    only the control got right, c those only the treatment got right, and p = min(1, 2 * P(Bin(b + c, 1/2)
    <= min(b, c))), the two-sided exact binomial test on the discordant items (statsmodels'
    `mcnemar(exact=True)`). No discordant item: p = 1."""
    c_ok, t_ok = np.asarray(control), np.asarray(treatment)
    if c_ok.shape != t_ok.shape or c_ok.ndim != 1:
        raise ValueError(f"mcnemar_exact: expected two 1-D arrays of one shape, got {c_ok.shape} and {t_ok.shape}")
    if not (np.isin(c_ok, (0, 1)).all() and np.isin(t_ok, (0, 1)).all()):
        raise ValueError("mcnemar_exact: expected 0/1 correctness")
    b = int(((c_ok == 1) & (t_ok == 0)).sum())
    c = int(((c_ok == 0) & (t_ok == 1)).sum())
    if b + c == 0:
        return b, c, 1.0
    return b, c, float(min(1.0, 2 * sps.binom.cdf(min(b, c), b + c, 0.5)))


# ----------------------------------------------------------------------------- the task table


@dataclass(frozen=True)
class _Cell:
    """One task of one (comparison, treatment, grid point): the paired [S, N] tables of both arms."""

    task: str
    metric: str
    seeds: tuple[int, ...]
    control: np.ndarray     # [S, N]
    treatment: np.ndarray   # [S, N]
    flags: tuple[str, ...]

    @property
    def delta(self) -> np.ndarray:
        return self.treatment - self.control


def _check_items(items: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in ITEM_COLUMNS if c not in items]
    if missing:
        raise ConfigError(f"task items: missing column(s) {', '.join(missing)}; allowed: a table with columns "
                          f"{', '.join(ITEM_COLUMNS)} (and `metric`)")
    items = items.copy()
    items["doc_id"] = items["doc_id"].astype(str)
    if "metric" not in items:
        items["metric"] = "acc"
    return items


def _arm_table(rows: pd.DataFrame, seeds: list[int], docs: list[str]) -> np.ndarray:
    wide = rows.pivot_table(index="seed", columns="doc_id", values="value", aggfunc="first")
    return wide.loc[seeds, docs].to_numpy(dtype=np.float64)


def _cell(items: pd.DataFrame, task: str, control: str, treatment: str) -> _Cell | None:
    """The task's paired tables: the seeds both arms evaluated, on the items every (arm, seed) scored."""
    rows = items[items["task"] == task]
    by_arm = {arm: rows[rows["arm"] == arm] for arm in (control, treatment)}
    seeds = sorted(set(by_arm[control]["seed"]) & set(by_arm[treatment]["seed"]))
    if not seeds:
        return None
    flags = []
    for arm, part in by_arm.items():
        lone = sorted(set(part["seed"]) - set(seeds))
        if lone:
            flags.append(f"{arm} seeds {', '.join(map(str, lone))} unpaired, left out")
    cells = [part[part["seed"] == s] for part in by_arm.values() for s in seeds]
    docs = sorted(set.intersection(*(set(c["doc_id"]) for c in cells)))
    if len(docs) < max(len(c) for c in cells):
        flags.append(f"{len(docs)} items scored in every (arm, seed), fewer than some evaluated")
    if not docs:
        return None
    metric = str(rows["metric"].iloc[0])
    return _Cell(task, metric, tuple(int(s) for s in seeds), _arm_table(by_arm[control], seeds, docs),
                 _arm_table(by_arm[treatment], seeds, docs), tuple(flags))


def _binary(table: np.ndarray) -> bool:
    return bool(np.isin(table, (0.0, 1.0)).all())


def _row(comp: Comparison, treatment: str, grid_key: str, cell: _Cell, alpha: float) -> dict:
    """One task's row: the two-way interval from two seeds up; one seed pair: McNemar (or a paired t)."""
    d = cell.delta
    s, n = d.shape
    _, _, item_low, item_high = item_only(d, alpha)
    row = {"comparison": comp.name, "family": comp.family, "grid_key": grid_key, "control": comp.control,
           "treatment": treatment, "task": cell.task, "metric": cell.metric, "n_seeds": s, "n_items": n,
           "control_mean": float(cell.control.mean()), "treatment_mean": float(cell.treatment.mean()),
           "item_ci_low": item_low, "item_ci_high": item_high, "seeds": ",".join(map(str, cell.seeds)),
           "flags": "; ".join(cell.flags)}
    if s >= 2 and n >= 2:
        tw = two_way(d, alpha)
        shares = tw.shares
        return row | {"delta": tw.estimate, "se": tw.se, "df": tw.df, "ci_low": tw.ci_low, "ci_high": tw.ci_high,
                      "p": tw.p, "method": "two-way", "share_seeds": shares[0], "share_items": shares[1],
                      "share_interaction": shares[2]}
    estimate, se, low, high = item_only(d, alpha)
    if _binary(cell.control) and _binary(cell.treatment):
        p, method = mcnemar_exact(cell.control[0], cell.treatment[0])[2], "mcnemar"
    else:
        p = float(2 * sps.t.sf(abs(estimate) / se, n - 1)) if se > 0 else math.nan
        method = "paired-t items"
    flags = "; ".join([*cell.flags, "one seed pair: the interval counts items only"])
    return row | {"delta": estimate, "se": se, "df": float(n - 1), "ci_low": low, "ci_high": high, "p": p,
                  "method": method, "share_seeds": math.nan, "share_items": math.nan,
                  "share_interaction": math.nan, "flags": flags}


def _suite_row(comp: Comparison, treatment: str, grid_key: str, cells: list[_Cell], alpha: float) -> dict | None:
    """The suite average over the tasks that share the same seeds (the seeds every task has)."""
    seeds = sorted(set.intersection(*(set(c.seeds) for c in cells)))
    if len(cells) < 2 or len(seeds) < 2:
        return None
    keep = [[c.seeds.index(s) for s in seeds] for c in cells]
    deltas = [c.delta[k] for c, k in zip(cells, keep, strict=True)]
    tw = two_way(deltas, alpha)
    shares = tw.shares
    return {"comparison": comp.name, "family": comp.family, "grid_key": grid_key, "control": comp.control,
            "treatment": treatment, "task": SUITE, "metric": "mean over tasks", "n_seeds": len(seeds),
            "n_items": sum(d.shape[1] for d in deltas),
            "control_mean": float(np.mean([c.control[k].mean() for c, k in zip(cells, keep, strict=True)])),
            "treatment_mean": float(np.mean([c.treatment[k].mean() for c, k in zip(cells, keep, strict=True)])),
            "delta": tw.estimate, "se": tw.se, "df": tw.df, "ci_low": tw.ci_low, "ci_high": tw.ci_high, "p": tw.p,
            "p_holm": math.nan, "method": "two-way", "share_seeds": shares[0], "share_items": shares[1],
            "share_interaction": shares[2], "item_ci_low": math.nan, "item_ci_high": math.nan,
            "seeds": ",".join(map(str, seeds)), "flags": f"{len(cells)} tasks, each weighted 1/{len(cells)}"}


def task_table(items: pd.DataFrame, comparisons: Sequence[Comparison], *, alpha: float = 0.05) -> pd.DataFrame:
    """One row per (comparison, treatment, grid point, task) and one suite-average row per (comparison,
    treatment, grid point) with two or more tasks: control and treatment accuracy (means over the paired seeds
    and items), the paired delta (treatment - control) with its interval and p, Holm over the tasks, and the
    shares of variance. `items` is the item table (`ITEM_COLUMNS`, plus `metric`: the task's metric name)."""
    items = _check_items(items)
    rows: list[dict] = []
    for comp in comparisons:
        for treatment in comp.treatments:
            for grid_key in sorted(items["grid_key"].unique()):
                at = items[items["grid_key"] == grid_key]
                cells = [c for task in sorted(at["task"].unique())
                         if (c := _cell(at, task, comp.control, treatment)) is not None]
                if not cells:
                    continue
                block = [_row(comp, treatment, grid_key, c, alpha) for c in cells]
                adjusted = holm([r["p"] for r in block])
                for r, p in zip(block, adjusted, strict=True):
                    r["p_holm"] = float(p)
                suite = _suite_row(comp, treatment, grid_key, cells, alpha)
                rows += block + ([suite] if suite is not None else [])
    return pd.DataFrame(rows, columns=list(TASK_COLUMNS))
