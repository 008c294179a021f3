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
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

from reslab.results.stats import sign_flip_p


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
