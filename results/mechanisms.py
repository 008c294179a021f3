"""Mechanisms as paired delta rows (issue 36, item 3): a study's declared mechanism summaries (`mechanisms:`,
names from `common.metrics.MECHANISM_METRICS`: `growth`, `grad_cv`, `route_max_late`, and what the
interventions add) compared like any metric, per comparison, treatment, grid point and mechanism.

The input is long: one row per (arm, grid point, seed, metric) with its value (`VALUE_COLUMNS`), from the
runs' summaries (`summary_values`) and from whatever else records a per-run mechanism (interventions). Each
row of the table pairs the control's and the treatment's values on the same grid point and seed
(`results.collect.matched_seeds`) and summarises the per-seed deltas d = treatment - control with the paired
table's own statistics (`results.stats.paired_summary`): the mean delta, its paired-t interval at level
1 - alpha, the paired t p and the exact sign-flip p. The rows say how a mechanism differs between the arms, not
which arm is better, so there is no verdict; a row is marked when its paired t p, corrected over its family (every
mechanism row of the comparisons that share the comparison's `family`, by that family's correction, Holm or BH,
as the paired table corrects its rows), is at most alpha (issue 51: the rows had no family, and at 3 seeds the
sign-flip p, the only p shown, cannot go below 0.25; the t p reaches any level from 2 seeds).

The depth profiles (`results.readouts.mechanisms.profile_plot`) draw a per-layer (or per-site) magnitude of
the runs' records at one evaluation, one line per arm: the mean over seeds with a min-max band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from reslab.common.errors import ConfigError
from reslab.common.metrics import MECHANISM_METRICS, METRICS
from reslab.results.collect import matched_seeds, usable
from reslab.results.comparison import Comparison
from reslab.results.stats import _natural_key, benjamini_hochberg, holm, paired_summary

__all__ = ["HEAD", "MECHANISM_COLUMNS", "VALUE_COLUMNS", "check_recorded", "format_mechanisms", "mechanism_caption",
           "mechanism_cells", "mechanism_table", "summary_values"]

VALUE_COLUMNS: tuple[str, ...] = ("arm", "grid_key", "seed", "metric", "value")
SIGN = "treatment - control"
MECHANISM_COLUMNS: tuple[str, ...] = (
    "comparison", "role", "metric", "delta", "grid_key", "control", "treatment", "n", "control_mean",
    "treatment_mean", "mean_delta", "sd", "ci_low", "ci_high", "t_p", "p_adj", "marked", "family", "perm_p",
    "perm_method", "wins", "losses", "ties", "seeds", "control_run_ids", "treatment_run_ids", "missing", "flags",
)


def summary_values(runs: pd.DataFrame, metrics: Iterable[str] = MECHANISM_METRICS) -> pd.DataFrame:
    """The finished runs' mechanism summaries as long rows (`VALUE_COLUMNS`), one per run and recorded metric
    (a run that did not record one, NaN in the runs table, has no row for it)."""
    finished = runs[usable(runs)]
    frames = []
    for metric in metrics:
        if metric not in finished:
            continue
        mine = finished[usable(finished, metric)]
        frames.append(pd.DataFrame({"arm": mine["arm"].astype(str), "grid_key": mine["grid_key"].fillna("").astype(str),
                                    "seed": mine["seed"].astype(np.int64), "metric": metric,
                                    "value": mine[metric].astype(np.float64)}))
    if not frames:
        return pd.DataFrame(columns=list(VALUE_COLUMNS))
    return pd.concat(frames, ignore_index=True)[list(VALUE_COLUMNS)]


def check_recorded(values: pd.DataFrame, metrics: Iterable[str], study: str, finished: int) -> None:
    """A declared mechanism that no finished run recorded (runs from before reslab recorded it, a variant
    without routing for `route_max_late`) is one line naming it and what the runs did record. No finished run
    yet: nothing to say."""
    if finished == 0:
        return
    recorded = list(dict.fromkeys(values["metric"]))
    absent = [m for m in metrics if m not in recorded]
    if absent:
        have = f"recorded: {', '.join(recorded)}" if recorded else "recorded none of the mechanisms"
        raise ConfigError(f"study {study}: mechanisms: {', '.join(absent)} {'was' if len(absent) == 1 else 'were'} "
                          f"not recorded by any of its {finished} finished runs; the runs {have}. Remove it from "
                          "`mechanisms:` or train the runs again with this code (train.magnitudes: true)")


def _wide(runs: pd.DataFrame, values: pd.DataFrame, metric: str) -> pd.DataFrame:
    """A runs-table-shaped frame for `matched_seeds`: every run of `runs` (its status and id) with its value of
    `metric` from the long `values` (NaN: none)."""
    mine = values[values["metric"] == metric].drop_duplicates(["arm", "grid_key", "seed"])
    keys = runs[["run_id", "arm", "grid_key", "seed", "status"]].assign(
        grid_key=runs["grid_key"].fillna("").astype(str))
    keys = keys[keys["seed"].notna()].assign(seed=lambda f: f["seed"].astype(np.int64))
    wide = keys.merge(mine[["arm", "grid_key", "seed", "value"]].astype({"seed": np.int64}),
                      on=["arm", "grid_key", "seed"], how="left")
    return wide.rename(columns={"value": metric})


def _join(values: Iterable[object]) -> str:
    return ",".join(str(v) for v in values)


def _row(comp: Comparison, treatment: str, metric: str, cell: pd.DataFrame, alpha: float) -> dict[str, object]:
    cv = cell[f"value/{comp.control}"].to_numpy(dtype=np.float64)
    tv = cell[f"value/{treatment}"].to_numpy(dtype=np.float64)
    seeds = cell["seed"].to_numpy()
    ok = np.isfinite(cv) & np.isfinite(tv)
    missing = [f"seed {s}: no {' or '.join(a for a, v in ((comp.control, c), (treatment, t)) if not math.isfinite(v))}"
               f" value" for s, c, t in zip(seeds[~ok], cv[~ok], tv[~ok], strict=True)]
    direction = METRICS[metric].direction if metric in METRICS else "minimize"
    s = paired_summary(tv[ok] - cv[ok], direction=direction, alpha=alpha)
    flags = [*s["flags"], *(["incomplete: " + "; ".join(missing)] if missing else [])]
    return {
        "comparison": comp.name, "role": "mechanism", "metric": metric, "delta": SIGN, "control": comp.control,
        "treatment": treatment, "n": s["n"], "control_mean": float(cv[ok].mean()) if ok.any() else math.nan,
        "treatment_mean": float(tv[ok].mean()) if ok.any() else math.nan, "mean_delta": s["mean"], "sd": s["sd"],
        "ci_low": s["ci_low"], "ci_high": s["ci_high"], "t_p": s["t_p"], "family": comp.family,
        "perm_p": s["perm_p"], "perm_method": s["perm_method"],
        "wins": s["wins"], "losses": s["losses"], "ties": s["ties"], "seeds": _join(seeds[ok]),
        "control_run_ids": ";".join(str(r) for r in cell[f"run_id/{comp.control}"].to_numpy()[ok]),
        "treatment_run_ids": ";".join(str(r) for r in cell[f"run_id/{treatment}"].to_numpy()[ok]),
        "missing": "; ".join(missing), "flags": ";".join(flags),
    }


def mechanism_table(runs: pd.DataFrame, values: pd.DataFrame, comparisons: Iterable[Comparison],
                    metrics: Sequence[str], *, alpha: float = 0.05) -> pd.DataFrame:
    """One row per declared mechanism, comparison, treatment and grid point (`MECHANISM_COLUMNS`; mechanisms in
    declared order): the paired deltas treatment - control of `values` (`VALUE_COLUMNS`) over the seeds where
    both arms have one, their mean, paired-t interval, t p and sign-flip p (`results.stats.paired_summary`), the
    t p corrected over the row's family (`p_adj`; `marked` at most alpha: the module doc), the arms' means over
    those pairs and W/L/ties (a win: a delta in the registry's direction of the metric). `runs` (the runs table)
    names each pair's runs. `alpha` is in `attrs["alpha"]`."""
    comparisons = list(comparisons)
    rows = []
    for metric in metrics:
        wide = _wide(runs, values, metric)
        for comp in comparisons:
            for treatment in comp.treatments:
                matched = matched_seeds(wide, (comp.control, treatment), metric)
                for key in sorted(set(matched["grid_key"]), key=_natural_key):
                    rows.append(_row(comp, treatment, metric, matched[matched["grid_key"] == key], alpha)
                                | {"grid_key": key})
    table = pd.DataFrame(rows, columns=list(MECHANISM_COLUMNS))
    for col in ("n", "wins", "losses", "ties"):
        table[col] = table[col].astype(np.int64)
    correction = {comp.family: comp.correction for comp in comparisons}
    table["p_adj"] = np.nan
    for family, part in table.groupby("family", sort=False):
        adjust = holm if correction[family] == "holm" else benjamini_hochberg
        table.loc[part.index, "p_adj"] = adjust(part["t_p"].to_numpy(dtype=np.float64))
    table["marked"] = (table["p_adj"] <= alpha).to_numpy(dtype=bool)
    table.attrs["alpha"] = alpha
    return table


def _num(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.4g}"


def _p(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3g}"


HEAD = ("mechanism", "treatment vs control", "grid", "n", "control", "treatment", "delta [CI]", "t p", "adj p",
        "sign-flip p", "notes")


def mechanism_cells(r: dict, labels: Callable[[str], str] = str) -> list[str]:
    """One mechanism row's cells (`HEAD`); `labels` names a grid point (the report: its short label)."""
    return [r["metric"], f"{r['treatment']} vs {r['control']}", labels(r["grid_key"]) if r["grid_key"] else "-",
            str(r["n"]), _num(r["control_mean"]), _num(r["treatment_mean"]),
            f"{_num(r['mean_delta'])} [{_num(r['ci_low'])}, {_num(r['ci_high'])}]", _p(r["t_p"]),
            _p(r["p_adj"]) + (" *" if r["marked"] else ""), _p(r["perm_p"]), r["flags"].replace(";", "; ")]


def mechanism_caption(alpha: float) -> str:
    return (f"mechanisms: paired delta treatment - control over seeds, mean with its {1 - alpha:.0%} paired-t "
            "interval, the paired t p, that p corrected over the comparison's family (its correction; * at most "
            f"alpha = {alpha:g}) and the exact sign-flip p (no verdict)")


def format_mechanisms(table: pd.DataFrame, fmt: str = "text") -> str:
    """The mechanism rows as aligned text (``"text"``) or a Markdown table (``"md"``), one block per comparison."""
    if not len(table):
        return "no mechanism rows\n"
    alpha = table.attrs.get("alpha", 0.05)
    out = []
    for comparison, block in table.groupby("comparison", sort=False):
        rows = [mechanism_cells(r) for r in block.to_dict("records")]
        caption = f"{mechanism_caption(alpha)}; {comparison}"
        if fmt == "md":
            out += [f"**{caption}**", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        else:
            widths = [max(len(x) for x in col) for col in zip(HEAD, *rows, strict=True)]
            out += [caption] + ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                                for row in [list(HEAD), *rows]]
        out.append("")
    return "\n".join(out) + "\n"
