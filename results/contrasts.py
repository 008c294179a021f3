"""Paired linear contrasts over arms (issue 21, item 4): a weighted sum of arms tested on its
per-seed values with the exact sign flip, and the fraction of a gain a cheaper arm keeps with
Fieller's interval.

A contrast is weights over arms that sum to 0, e.g. (-1, 2, -1) over H = 4, 8, 16 (is H = 8 below
the mean of its neighbours: the optimum of a U) or (1, -1) (a plain paired delta). Each seed gives
one value, sum_a w_a L_a,s, so the seed's shared noise cancels as in a paired delta; the test is
`stats.sign_flip_p` on those values (two-sided), or on value - margin, one-sided, for
non-inferiority ("the cheaper arm is worse by less than the margin").

The fraction kept. With control P, the full arm F and the cheaper arm B, per seed
a_s = B_s - P_s and b_s = F_s - P_s; the fraction is R = mean(a) / mean(b) (Kimi's "Block keeps most
of Full's gain" as a number: R = 0.9 keeps 90%). Fieller's interval (Fieller 1954) is the set of r
at which the paired t test of a - r b does not reject, solved in closed form:

    (b'^2 - t^2 S_bb) r^2 - 2 (a' b' - t^2 S_ab) r + (a'^2 - t^2 S_aa) <= 0

with a', b' the means, S the covariances of the means and t = t(1 - alpha/2, n - 1). It is a
bounded interval only when the full arm's gain itself is significant (b'^2 > t^2 S_bb); otherwise
the fraction is not estimable and the interval is unbounded, which `Fraction.bounded` says rather
than printing a number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pandas as pd

from reslab.results.collect import complete_seeds, matched_seeds
from reslab.results.stats import holm, sign_flip_p


@dataclass(frozen=True)
class Contrast:
    """A contrast's mean over seeds, its per-seed values and its exact sign-flip p."""

    estimate: float
    p: float
    values: np.ndarray


def _seed_matrix(losses: Mapping[str, np.ndarray], arms: list[str]) -> np.ndarray:
    """loss[seed, arm] for `arms`, checking every arm has the same seeds."""
    missing = [a for a in arms if a not in losses]
    if missing:
        raise ValueError(f"the contrast names arms without losses: {', '.join(missing)}; have {', '.join(losses)}")
    columns = [np.asarray(losses[a], dtype=np.float64) for a in arms]
    if len({c.shape for c in columns}) != 1 or columns[0].ndim != 1:
        raise ValueError("every arm needs one loss per seed, the same seeds in the same order")
    return np.stack(columns, axis=1)


def linear_contrast(losses: Mapping[str, np.ndarray], weights: Mapping[str, float], *,
                    margin: float | None = None) -> Contrast:
    """The contrast sum_a weights[a] * losses[a] per seed, two-sided against 0; with `margin`, the
    one-sided non-inferiority test that it is below `margin` (p small: the contrast is < margin)."""
    arms = list(weights)
    w = np.array([weights[a] for a in arms], dtype=np.float64)
    if w.size < 2 or abs(w.sum()) > 1e-9 * np.abs(w).sum() or not np.any(w):
        raise ValueError(f"contrast weights must be at least two, not all 0, and sum to 0; got {dict(weights)}")
    values = _seed_matrix(losses, arms) @ w
    if margin is None:
        p, _ = sign_flip_p(values)
    else:
        p, _ = sign_flip_p(values - margin, "less")
    return Contrast(estimate=float(values.mean()), p=float(p), values=values)


@dataclass(frozen=True)
class Fraction:
    """The fraction of the full arm's gain the cheaper arm keeps, with Fieller's interval;
    `bounded` False when the full arm's gain is not significant (the interval is then the whole
    line, or its complement of a finite interval, and no fraction is reported)."""

    estimate: float
    low: float
    high: float
    bounded: bool
    level: float
    n_seeds: int


def fraction_kept(control: np.ndarray, full: np.ndarray, cheaper: np.ndarray, *, level: float = 0.95) -> Fraction:
    """R = mean(cheaper - control) / mean(full - control), seed-paired, with Fieller's interval."""
    from scipy import stats as sps  # on first use: `reslab status` reads no statistics (issue 39)

    m = _seed_matrix({"control": control, "full": full, "cheaper": cheaper}, ["control", "full", "cheaper"])
    n = m.shape[0]
    if n < 3:
        raise ValueError(f"Fieller's interval needs at least 3 seeds, got {n}")
    a, b = m[:, 2] - m[:, 0], m[:, 1] - m[:, 0]
    cov = np.cov(np.stack([a, b]), ddof=1) / n  # covariances of the two means
    s_aa, s_ab, s_bb = cov[0, 0], cov[0, 1], cov[1, 1]
    t2 = float(sps.t.ppf(0.5 + level / 2, n - 1)) ** 2
    am, bm = float(a.mean()), float(b.mean())
    estimate = am / bm if bm != 0 else math.nan
    qa, qb, qc = bm**2 - t2 * s_bb, am * bm - t2 * s_ab, am**2 - t2 * s_aa
    disc = qb**2 - qa * qc
    if qa <= 0 or disc < 0:
        return Fraction(estimate=estimate, low=-math.inf, high=math.inf, bounded=False, level=level, n_seeds=n)
    root = math.sqrt(disc)
    return Fraction(estimate=estimate, low=(qb - root) / qa, high=(qb + root) / qa, bounded=True, level=level,
                    n_seeds=n)


# ----------------------------------------------------------------------------- a study's contrasts

CONTRAST_COLUMNS: tuple[str, ...] = ("contrast", "kind", "grid_key", "metric", "seeds", "estimate", "ci_low",
                                     "ci_high", "p", "p_holm", "verdict", "definition")


def _weight(w: float) -> str:
    return "" if abs(w) == 1 else f"{abs(w):g} "


@dataclass(frozen=True, kw_only=True)
class ContrastSpec:
    """A declared contrast (the study's `contrasts:`): `weights` over arms (summing to 0), tested
    two-sided against 0, or with `margin` the one-sided non-inferiority test that it is below the
    margin; or `fraction` = (control, full, cheaper), the fraction of the full arm's gain the
    cheaper one keeps with Fieller's interval. Evaluated per grid point on `metric`."""

    name: str
    metric: str = "val_loss_tail"
    weights: tuple[tuple[str, float], ...] = ()
    margin: float | None = None
    fraction: tuple[str, str, str] | None = None

    @property
    def kind(self) -> str:
        return "fraction" if self.fraction else "non-inferiority" if self.margin is not None else "linear"

    @property
    def arms(self) -> tuple[str, ...]:
        return self.fraction if self.fraction else tuple(a for a, _ in self.weights)

    def describe(self) -> str:
        if self.fraction:
            control, full, cheaper = self.fraction
            return f"({cheaper} - {control}) / ({full} - {control}) on {self.metric}"
        terms = " ".join(f"{'+' if w >= 0 else '-'} {_weight(w)}{a}" for a, w in self.weights).lstrip("+ ")
        return f"{terms} on {self.metric}" + (f" < {self.margin:g}" if self.margin is not None else "")


def _complete(runs: pd.DataFrame, arms: Iterable[str], grid_key: str, metric: str) -> dict[str, np.ndarray]:
    """Per arm, its metric on the seeds with a usable run in every arm, in seed order."""
    arms = list(arms)
    matched = complete_seeds(matched_seeds(runs, arms, metric), arms)
    matched = matched[matched["grid_key"] == grid_key]
    return {arm: matched[f"value/{arm}"].to_numpy(dtype=np.float64) for arm in arms}


def _contrast_row(spec: ContrastSpec, losses: dict[str, np.ndarray], alpha: float) -> dict[str, object]:
    from scipy import stats as sps  # on first use: `reslab status` reads no statistics (issue 39)

    n = len(next(iter(losses.values())))
    row: dict[str, object] = {"seeds": n, "estimate": math.nan, "ci_low": math.nan, "ci_high": math.nan,
                              "p": math.nan}
    if spec.fraction:
        if n >= 3:
            control, full, cheaper = (losses[a] for a in spec.fraction)
            fr = fraction_kept(control, full, cheaper, level=1 - alpha)
            row.update(estimate=fr.estimate, ci_low=fr.low, ci_high=fr.high)
        return row
    if n >= 1:
        c = linear_contrast(losses, dict(spec.weights), margin=spec.margin)
        half = (float(sps.t.ppf(1 - alpha / 2, n - 1)) * c.values.std(ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
        row.update(estimate=c.estimate, ci_low=c.estimate - half, ci_high=c.estimate + half, p=c.p)
    return row


def _contrast_verdict(kind: str, seeds: int, estimate: float, ci_low: float, p_holm: float, alpha: float) -> str:
    if kind == "fraction":
        if seeds < 3:
            return "too few seeds"
        return "bounded" if math.isfinite(ci_low) else "not estimable (the full arm's gain is not significant)"
    if math.isnan(p_holm) or p_holm > alpha:
        return "inconclusive"
    if kind == "non-inferiority":
        return "non-inferior"
    return "below 0" if estimate < 0 else "above 0"


def contrast_table(runs: pd.DataFrame, specs: Iterable[ContrastSpec], *, alpha: float = 0.05) -> pd.DataFrame:
    """One row per contrast and grid point, on the seeds finished in every arm it names. Holm over
    every tested row (linear and non-inferiority) of the study is `p_holm`, which decides the
    verdict; fractions carry Fieller's 1 - alpha interval and no p."""
    rows = []
    for spec in specs:
        keys = list(dict.fromkeys(runs[runs["arm"].isin(spec.arms)]["grid_key"].fillna("")))  # study order
        for key in keys:
            row = {"contrast": spec.name, "kind": spec.kind, "grid_key": key, "metric": spec.metric,
                   "definition": spec.describe()}
            row.update(_contrast_row(spec, _complete(runs, spec.arms, key, spec.metric), alpha))
            rows.append(row)
    table = pd.DataFrame(rows, columns=list(CONTRAST_COLUMNS))
    tested = table["p"].notna()
    table["p_holm"] = math.nan
    if tested.any():
        table.loc[tested, "p_holm"] = holm(table.loc[tested, "p"].to_numpy(dtype=np.float64))
    table["verdict"] = [_contrast_verdict(r.kind, int(r.seeds), float(r.estimate), float(r.ci_low), float(r.p_holm),
                                          alpha) for r in table.itertuples()]
    return table


def contrast_text(table: pd.DataFrame, alpha: float = 0.05) -> str:
    """The contrasts for the terminal: one line per contrast and grid point."""
    if table.empty:
        return ""
    lines = [f"contrasts: per-seed values, exact sign-flip p (one-sided below the margin for non-inferiority), Holm "
             f"over the study's tested contrasts; {1 - alpha:.0%} paired-t intervals, Fieller's for fractions"]
    for r in table.to_dict("records"):
        where = f" [{r['grid_key']}]" if r["grid_key"] else ""
        ci = f"[{r['ci_low']:.4g}, {r['ci_high']:.4g}]"
        p = "" if math.isnan(r["p"]) else f", p {r['p']:.3g}, Holm p {r['p_holm']:.3g}"
        lines.append(f"  {r['contrast']}{where}: {r['definition']} = {r['estimate']:.4g} {ci} over {r['seeds']} seeds"
                     f"{p}: {r['verdict']}")
    return "\n".join(lines) + "\n"
