"""Paired statistics over seed-matched runs.

Everything here is a pure function of arrays or of the tidy runs table (one row per run:
``run_id``, ``arm``, ``grid_key``, ``seed``, ``status`` and one numeric column per metric).
A delta is always treatment minus control on the same (grid_key, seed) pair.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

__all__ = [
    "COMPARE_COLUMNS",
    "Comparison",
    "benjamini_hochberg",
    "compare",
    "holm",
    "paired_summary",
]

Direction = Literal["minimize", "maximize"]

_DIRECTIONS = ("minimize", "maximize")
_KEY_COLUMNS = ("run_id", "arm", "grid_key", "seed", "status")
_FINISHED = "FINISHED"
# Up to 2**20 sign patterns are enumerated exactly; beyond that a seeded Monte-Carlo estimate.
_EXACT_MAX_N = 20
_MC_DRAWS = 200_000
_MC_SEED = 0
_CHUNK = 1 << 16
_PERM_RTOL = 1e-12
_WILCOXON_MIN_N = 6

COMPARE_COLUMNS: tuple[str, ...] = (
    "comparison",
    "family",
    "metric",
    "direction",
    "grid_key",
    "control",
    "treatment",
    "n",
    "control_mean",
    "control_sd",
    "treatment_mean",
    "treatment_sd",
    "mean_delta",
    "sd",
    "se",
    "ci_low",
    "ci_high",
    "t_p",
    "perm_p",
    "perm_method",
    "wilcoxon_p",
    "d_z",
    "wins",
    "losses",
    "ties",
    "p_holm",
    "p_bh",
    "seeds",
    "control_run_ids",
    "treatment_run_ids",
    "missing",
    "flags",
)


@dataclass(frozen=True)
class Comparison:
    """One declared comparison: each treatment arm against the control arm on one metric.

    Args:
        name: label carried into every output row.
        control: the control arm.
        treatments: treatment arms, each compared with ``control`` separately.
        metric: the metric column of the runs table. Default: ``"val_loss_tail"``.
        direction: ``"minimize"`` when lower is better. Default: ``"minimize"``.
        family: rows sharing a family are corrected together (Holm, BH). Default: ``"default"``.
    """

    name: str
    control: str
    treatments: tuple[str, ...]
    metric: str = "val_loss_tail"
    direction: Direction = "minimize"
    family: str = "default"

    def __post_init__(self) -> None:
        treatments = (self.treatments,) if isinstance(self.treatments, str) else tuple(self.treatments)
        object.__setattr__(self, "treatments", treatments)
        if not treatments:
            raise ValueError(f"comparison {self.name!r}: treatments is empty; give at least one arm")
        if self.control in treatments:
            raise ValueError(f"comparison {self.name!r}: control arm {self.control!r} is also a treatment")
        if len(set(treatments)) != len(treatments):
            raise ValueError(f"comparison {self.name!r}: treatments repeat an arm: {list(treatments)}")
        if self.direction not in _DIRECTIONS:
            raise ValueError(
                f"comparison {self.name!r}: direction {self.direction!r} is not one of {list(_DIRECTIONS)}"
            )


def _sign_flip_exact(deltas: np.ndarray) -> float:
    """Two-sided exact sign-flip p over all 2**n patterns (observed pattern included)."""
    n = deltas.size
    abs_d = np.abs(deltas)
    observed = abs(float(deltas.sum()))
    # Sums from other patterns carry rounding of order eps * sum|d|, so the tie tolerance scales with it.
    threshold = observed - _PERM_RTOL * float(abs_d.sum())
    # Flipping signs of d or of |d| reaches the same set of sums. |sum| is symmetric under flipping
    # every sign, so fixing the last sign and enumerating 2**(n-1) patterns gives the same fraction.
    free = n - 1
    num_patterns = 1 << free
    bits = np.arange(free, dtype=np.int64)
    count = 0
    for start in range(0, num_patterns, _CHUNK):
        idx = np.arange(start, min(start + _CHUNK, num_patterns), dtype=np.int64)
        signs = 1.0 - 2.0 * ((idx[:, None] >> bits) & 1)  # [P, n-1]
        sums = signs @ abs_d[:free] + abs_d[free]  # [P]
        count += int(np.count_nonzero(np.abs(sums) >= threshold))
    return count / num_patterns


def _sign_flip_monte_carlo(deltas: np.ndarray) -> float:
    """Two-sided Monte-Carlo sign-flip p, (hits + 1) / (draws + 1) so it is never 0."""
    rng = np.random.default_rng(_MC_SEED)
    observed = abs(float(deltas.sum()))
    threshold = observed - _PERM_RTOL * float(np.abs(deltas).sum())
    hits = 0
    chunk = max(1, _CHUNK // 4)
    for start in range(0, _MC_DRAWS, chunk):
        size = min(chunk, _MC_DRAWS - start)
        signs = 2.0 * rng.integers(0, 2, size=(size, deltas.size)) - 1.0  # [size, n]
        hits += int(np.count_nonzero(np.abs(signs @ deltas) >= threshold))
    return (hits + 1) / (_MC_DRAWS + 1)


def _fmt_num(x: float) -> str:
    return f"{x:.3g}"


def paired_summary(
    deltas: np.ndarray | list[float], *, direction: Direction = "minimize", alpha: float = 0.05
) -> dict:
    """Summarise per-seed paired deltas (treatment minus control).

    Returns a dict with ``n, mean, sd (ddof=1), se, ci_low, ci_high`` (paired-t, level
    ``1 - alpha``), ``t_p`` (two-sided one-sample t against 0), ``perm_p`` and ``perm_method``
    (exact sign flip over all 2**n patterns for n <= 20, else seeded Monte Carlo with 200k draws;
    a pattern counts when its |sum| reaches the observed |sum| within 1e-12 of sum|d|),
    ``wilcoxon_p`` (n >= 6 only), ``d_z = mean / sd``, ``wins, losses, ties`` (a win is a delta in
    the better ``direction``), ``min_attainable_p`` (2 / 2**n exact, 1 / (draws + 1) Monte Carlo)
    and ``flags`` (a tuple of strings).
    Undefined statistics are NaN: everything at n=0; sd, se, CI, t_p and d_z at n=1; t_p and
    d_z when all deltas are equal (sd=0).
    """
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction {direction!r} is not one of {list(_DIRECTIONS)}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    d = np.asarray(deltas, dtype=np.float64)
    if d.ndim != 1:
        raise ValueError(f"deltas must be 1-D, got shape {d.shape}")
    if not np.all(np.isfinite(d)):
        raise ValueError(f"deltas must be finite, got {d.tolist()}")
    n = int(d.size)
    nan = math.nan
    flags: list[str] = []

    if n == 0:
        return {
            "n": 0, "mean": nan, "sd": nan, "se": nan, "ci_low": nan, "ci_high": nan,
            "t_p": nan, "perm_p": nan, "perm_method": "none", "wilcoxon_p": nan, "d_z": nan,
            "wins": 0, "losses": 0, "ties": 0, "min_attainable_p": nan, "flags": ("no pairs",),
        }

    mean = float(d.mean())
    # Identical deltas give sd exactly 0 rather than rounding noise of order 1e-17.
    constant = bool(np.all(d == d[0]))
    if n < 2:
        sd = se = ci_low = ci_high = t_p = nan
    else:
        sd = 0.0 if constant else float(d.std(ddof=1))
        se = sd / math.sqrt(n)
        half = float(sps.t.ppf(1.0 - alpha / 2.0, n - 1)) * se
        ci_low, ci_high = mean - half, mean + half
        t_p = nan if sd == 0.0 else float(2.0 * sps.t.sf(abs(mean / se), n - 1))
        if sd == 0.0:
            flags.append("zero variance: all deltas equal, t-test undefined")
    d_z = mean / sd if n >= 2 and sd > 0.0 else nan

    if n <= _EXACT_MAX_N:
        perm_p, perm_method = _sign_flip_exact(d), "exact"
        min_p = 2.0 / 2.0**n
    else:
        perm_p, perm_method = _sign_flip_monte_carlo(d), "monte-carlo"
        min_p = 1.0 / (_MC_DRAWS + 1)
    if min_p > alpha:
        flags.append(f"underpowered: n={n}, smallest attainable p={_fmt_num(min_p)} > alpha={alpha:g}")

    if n < _WILCOXON_MIN_N:
        wilcoxon_p = nan
    elif not np.any(d):
        # scipy returns 1.0 here too, but only after a divide-by-zero warning.
        wilcoxon_p = 1.0
    else:
        with warnings.catch_warnings():
            # Ties and zeros make scipy switch to the normal approximation and say so; that is expected.
            warnings.simplefilter("ignore", UserWarning)
            wilcoxon_p = float(sps.wilcoxon(d, alternative="two-sided").pvalue)

    better = d < 0 if direction == "minimize" else d > 0
    worse = d > 0 if direction == "minimize" else d < 0
    return {
        "n": n,
        "mean": mean,
        "sd": sd,
        "se": se,
        "ci_low": ci_low,
        "ci_high": ci_high,
        "t_p": t_p,
        "perm_p": perm_p,
        "perm_method": perm_method,
        "wilcoxon_p": wilcoxon_p,
        "d_z": d_z,
        "wins": int(better.sum()),
        "losses": int(worse.sum()),
        "ties": int((d == 0).sum()),
        "min_attainable_p": min_p,
        "flags": tuple(flags),
    }


def _check_pvals(pvals: np.ndarray | list[float]) -> np.ndarray:
    p = np.asarray(pvals, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"p-values must be 1-D, got shape {p.shape}")
    finite = p[~np.isnan(p)]
    if np.any((finite < 0.0) | (finite > 1.0)):
        raise ValueError(f"p-values must lie in [0, 1], got {p.tolist()}")
    return p


def holm(pvals: np.ndarray | list[float]) -> np.ndarray:
    """Holm step-down adjusted p-values; NaNs stay NaN and do not count towards m."""
    p = _check_pvals(pvals)
    out = np.full_like(p, np.nan)
    idx = np.flatnonzero(~np.isnan(p))
    m = idx.size
    if m == 0:
        return out
    order = idx[np.argsort(p[idx], kind="stable")]
    scaled = (m - np.arange(m)) * p[order]
    out[order] = np.minimum(np.maximum.accumulate(scaled), 1.0)
    return out


def benjamini_hochberg(pvals: np.ndarray | list[float]) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (FDR); NaNs stay NaN and do not count towards m."""
    p = _check_pvals(pvals)
    out = np.full_like(p, np.nan)
    idx = np.flatnonzero(~np.isnan(p))
    m = idx.size
    if m == 0:
        return out
    order = idx[np.argsort(p[idx], kind="stable")]
    scaled = p[order] * m / np.arange(1, m + 1)
    out[order] = np.minimum(np.minimum.accumulate(scaled[::-1])[::-1], 1.0)
    return out


def _natural_key(text: str) -> list:
    # "heads=8" sorts before "heads=16".
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def _seed_list(seeds: list[int]) -> str:
    return ",".join(str(s) for s in seeds)


def _incomplete_flag(seeds: list[int], arm: str) -> str:
    if len(seeds) == 1:
        return f"incomplete: seed {seeds[0]} has no finished {arm} run"
    return f"incomplete: seeds {_seed_list(seeds)} have no finished {arm} run"


def _prepare(runs: pd.DataFrame) -> pd.DataFrame:
    missing_cols = [c for c in _KEY_COLUMNS if c not in runs.columns]
    if missing_cols:
        raise ValueError(
            f"runs table lacks required columns {missing_cols}; it needs {list(_KEY_COLUMNS)} "
            "plus one numeric column per metric"
        )
    df = runs.copy()
    df["grid_key"] = df["grid_key"].fillna("").astype(str)
    df["arm"] = df["arm"].astype(str)
    df["run_id"] = df["run_id"].astype(str)
    df["status"] = df["status"].astype(str)
    if df["seed"].isna().any():
        bad = df.loc[df["seed"].isna(), "run_id"].tolist()
        raise ValueError(f"runs {bad} have no seed")
    df["seed"] = df["seed"].astype(np.int64)

    finished = df[df["status"] == _FINISHED]
    dup = finished[finished.duplicated(["arm", "grid_key", "seed"], keep=False)]
    if not dup.empty:
        groups = [
            f"(arm={arm!r}, grid_key={gk!r}, seed={seed}): runs {sorted(g['run_id'])}"
            for (arm, gk, seed), g in dup.groupby(["arm", "grid_key", "seed"], sort=True)
        ]
        raise ValueError(
            "duplicate finished runs for the same (arm, grid_key, seed); the run store is corrupted: "
            + "; ".join(groups)
        )
    return df


def _validate(df: pd.DataFrame, comparisons: list[Comparison]) -> None:
    metrics = sorted(c for c in df.columns if c not in _KEY_COLUMNS and pd.api.types.is_numeric_dtype(df[c]))
    arms = sorted(df["arm"].unique())
    for comp in comparisons:
        if not isinstance(comp, Comparison):
            raise ValueError(f"expected Comparison objects, got {type(comp).__name__}: {comp!r}")
        if comp.metric not in metrics:
            what = "is not numeric" if comp.metric in df.columns else "is not a column"
            raise ValueError(
                f"comparison {comp.name!r}: metric {comp.metric!r} {what}; numeric metric columns: {metrics}"
            )
        unknown = [a for a in (comp.control, *comp.treatments) if a not in arms]
        if unknown:
            raise ValueError(f"comparison {comp.name!r}: unknown arms {unknown}; arms in the runs table: {arms}")


def _arm_cell(df: pd.DataFrame, arm: str, metric: str) -> tuple[dict[int, tuple[str, float]], dict[int, str]]:
    """Usable runs of one arm at one grid point by seed, and why the other seeds are unusable."""
    usable: dict[int, tuple[str, float]] = {}
    problems: dict[int, list[str]] = {}
    df = df.sort_values(["seed", "run_id"])
    # Metric names such as "val/loss" are not identifiers, so no itertuples attribute access.
    for seed, run_id, status, value in zip(df["seed"], df["run_id"], df["status"], df[metric]):
        seed = int(seed)
        if status == _FINISHED and pd.notna(value) and np.isfinite(float(value)):
            usable[seed] = (run_id, float(value))
        elif status == _FINISHED:
            problems.setdefault(seed, []).append(f"{arm} run {run_id} finished with {metric}={value}")
        else:
            problems.setdefault(seed, []).append(f"{arm} run {run_id} is {status}")
    reasons = {seed: ", ".join(msgs) for seed, msgs in problems.items() if seed not in usable}
    return usable, reasons


def _compare_cell(
    comp: Comparison, treatment: str, grid_key: str, ctrl_df: pd.DataFrame, trt_df: pd.DataFrame, alpha: float
) -> dict:
    flags: list[str] = []
    if ctrl_df.empty:
        flags.append(f"grid point {grid_key!r} has runs for treatment {treatment} but none for control {comp.control}")
    if trt_df.empty:
        flags.append(f"grid point {grid_key!r} has runs for control {comp.control} but none for treatment {treatment}")

    ctrl, ctrl_why = _arm_cell(ctrl_df, comp.control, comp.metric)
    trt, trt_why = _arm_cell(trt_df, treatment, comp.metric)
    seeds = sorted(set(ctrl) & set(trt))
    all_seeds = sorted(set(ctrl_df["seed"]) | set(trt_df["seed"]))

    missing: list[str] = []
    no_ctrl: list[int] = []
    no_trt: list[int] = []
    for seed in all_seeds:
        if seed in seeds:
            continue
        reasons = []
        if seed not in ctrl:
            no_ctrl.append(seed)
            reasons.append(ctrl_why.get(seed, f"no {comp.control} run"))
        if seed not in trt:
            no_trt.append(seed)
            reasons.append(trt_why.get(seed, f"no {treatment} run"))
        missing.append(f"seed {seed}: " + ", ".join(reasons))
    # The whole-arm-absent case is already flagged above; per-seed flags would only repeat it.
    if no_ctrl and not ctrl_df.empty:
        flags.append(_incomplete_flag(no_ctrl, comp.control))
    if no_trt and not trt_df.empty:
        flags.append(_incomplete_flag(no_trt, treatment))

    ctrl_vals = np.array([ctrl[s][1] for s in seeds], dtype=np.float64)
    trt_vals = np.array([trt[s][1] for s in seeds], dtype=np.float64)
    summary = paired_summary(trt_vals - ctrl_vals, direction=comp.direction, alpha=alpha)
    flags.extend(summary["flags"])

    # Noise floor: spread of the control across all its usable seeds at this grid point, not only paired ones.
    ctrl_all = np.array([v for _, v in ctrl.values()], dtype=np.float64)
    control_sd = float(ctrl_all.std(ddof=1)) if ctrl_all.size >= 2 else math.nan
    trt_all = np.array([v for _, v in trt.values()], dtype=np.float64)
    treatment_sd = float(trt_all.std(ddof=1)) if trt_all.size >= 2 else math.nan
    if summary["n"] > 0 and np.isfinite(control_sd) and abs(summary["mean"]) < control_sd:
        flags.append(
            f"below noise: |mean delta|={_fmt_num(abs(summary['mean']))} < control SD across seeds={_fmt_num(control_sd)}"
        )

    return {
        "comparison": comp.name,
        "family": comp.family,
        "metric": comp.metric,
        "direction": comp.direction,
        "grid_key": grid_key,
        "control": comp.control,
        "treatment": treatment,
        "n": summary["n"],
        "control_mean": float(ctrl_vals.mean()) if seeds else math.nan,
        "control_sd": control_sd,
        "treatment_mean": float(trt_vals.mean()) if seeds else math.nan,
        "treatment_sd": treatment_sd,
        "mean_delta": summary["mean"],
        "sd": summary["sd"],
        "se": summary["se"],
        "ci_low": summary["ci_low"],
        "ci_high": summary["ci_high"],
        "t_p": summary["t_p"],
        "perm_p": summary["perm_p"],
        "perm_method": summary["perm_method"],
        "wilcoxon_p": summary["wilcoxon_p"],
        "d_z": summary["d_z"],
        "wins": summary["wins"],
        "losses": summary["losses"],
        "ties": summary["ties"],
        "p_holm": math.nan,
        "p_bh": math.nan,
        "seeds": _seed_list(seeds),
        "control_run_ids": ";".join(ctrl[s][0] for s in seeds),
        "treatment_run_ids": ";".join(trt[s][0] for s in seeds),
        "missing": "; ".join(missing),
        "flags": ";".join(flags),
    }


def compare(runs: pd.DataFrame, comparisons: list[Comparison], *, alpha: float = 0.05) -> pd.DataFrame:
    """Seed-paired comparison table: one row per comparison x treatment x grid_key.

    Control and treatment runs pair on (grid_key, seed); only FINISHED runs with a finite metric
    are usable. ``control_mean``/``treatment_mean`` are over the paired runs, ``control_sd``/
    ``treatment_sd`` over every usable run of the arm at that grid point (the inter-seed noise
    floor). The primary p-value is ``perm_p`` (exact sign flip); ``p_holm`` and ``p_bh`` adjust
    ``perm_p`` across all rows of the same ``family``. Incomplete, underpowered and zero-pair
    rows are kept and flagged, never dropped. ``alpha`` is stored in ``result.attrs["alpha"]``.

    Raises:
        ValueError: a required column is missing, a comparison names an unknown metric or arm,
            or two finished runs share (arm, grid_key, seed).
    """
    df = _prepare(runs)
    comparisons = list(comparisons)
    _validate(df, comparisons)

    rows: list[dict] = []
    for comp in comparisons:
        ctrl_all = df[df["arm"] == comp.control]
        for treatment in comp.treatments:
            trt_all = df[df["arm"] == treatment]
            grid_keys = sorted(set(ctrl_all["grid_key"]) | set(trt_all["grid_key"]), key=_natural_key)
            for gk in grid_keys:
                rows.append(
                    _compare_cell(
                        comp, treatment, gk,
                        ctrl_all[ctrl_all["grid_key"] == gk], trt_all[trt_all["grid_key"] == gk], alpha,
                    )
                )

    table = pd.DataFrame(rows, columns=list(COMPARE_COLUMNS))
    for col in ("n", "wins", "losses", "ties"):
        table[col] = table[col].astype(np.int64)
    for _, idx in table.groupby("family", sort=False).groups.items():
        perm = table.loc[idx, "perm_p"].to_numpy(dtype=np.float64)
        table.loc[idx, "p_holm"] = holm(perm)
        table.loc[idx, "p_bh"] = benjamini_hochberg(perm)
    table.attrs["alpha"] = alpha
    return table
