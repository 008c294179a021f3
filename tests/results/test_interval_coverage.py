"""Coverage of every interval the comparison table prints, by simulation (issue 20).

The table's intervals all come from `stats.stratum_mean_t` and `stats.t_intervals` (the last test pins
that `paired_summary` and `pooled_summary` print exactly theirs): the paired-t CI (1 - alpha), the pooled
CI of a `pool:` row, and the TOST CI (1 - 2 alpha) of both. Reference: independent normal deltas drawn
with numpy, the truth known (the mean over grid points of their true mean deltas). 10,000 draws per
case: the binomial SE at 95% is 0.22% (0.30% at 90%), so the 4-SE bands below tell 95% from 90% many
times over. Small n: 2-8 seeds, 1-4 strata, stratum SDs up to 100x apart, unequal seeds per stratum.
"""

import math

import numpy as np
import pytest

from reslab.results.stats import (
    paired_summary,
    pooled_summary,
    stratified_flip_interval,
    stratum_mean_t,
    t_intervals,
)

pytestmark = pytest.mark.filterwarnings("error")

DRAWS = 10_000
ALPHA = 0.05
MARGIN = 1.0
SE95 = math.sqrt(0.95 * 0.05 / DRAWS)
SE90 = math.sqrt(0.90 * 0.10 / DRAWS)


def draw(sizes, sds, seed):
    """Per stratum a [DRAWS, n_s] array of N(mu_s, sd_s**2) deltas, mu_s = 0.3 s (strata differ in effect too)."""
    rng = np.random.default_rng(seed)
    return [0.3 * s + sd * rng.standard_normal((DRAWS, n)) for s, (n, sd) in enumerate(zip(sizes, sds, strict=True))]


def truth(sizes):
    return float(np.mean([0.3 * s for s in range(len(sizes))]))


def intervals(strata, alpha=ALPHA):
    means = np.stack([d.mean(axis=1) for d in strata], axis=1)
    variances = np.stack([d.var(axis=1, ddof=1) for d in strata], axis=1)
    estimate, se, df = stratum_mean_t(means, variances, [d.shape[1] for d in strata])
    return t_intervals(estimate, se, df, alpha, MARGIN)


def coverage(out, prefix, value):
    return float(np.mean((out[f"{prefix}_low"] <= value) & (value <= out[f"{prefix}_high"])))


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_paired_t_and_tost_cis_cover_at_their_level(n):
    out = intervals(draw((n,), (1.0,), seed=n))
    assert abs(coverage(out, "ci", 0.0) - 0.95) <= 4 * SE95
    assert abs(coverage(out, "tost_ci", 0.0) - 0.90) <= 4 * SE90


POOLED = [
    ((3, 3), (1, 1)), ((4, 4, 4), (1, 1, 1)), ((3, 3, 3, 3), (1, 1, 1, 1)), ((8, 8), (1, 1)),  # the cases
    ((3, 3), (1, 3)), ((2, 2), (1, 10)), ((2, 2, 2), (10, 1, 1)), ((2, 2, 2, 2), (1, 2, 4, 8)),
    ((3, 3, 3, 3), (10, 1, 1, 1)), ((3, 5, 8), (4, 1, 2)), ((2, 8), (1, 5)), ((8, 8, 8, 8), (1, 1, 1, 10)),
    ((2, 2, 2, 2), (1, 1, 1, 1)),
]


@pytest.mark.parametrize("sizes,sds", POOLED)
def test_pooled_cis_cover_at_least_their_level(sizes, sds):
    # Conservative by design where the strata's variances are alike (module docstring of results/stats.py),
    # so only the lower side is bounded here; the next test bounds the upper side where it is exact.
    out = intervals(draw(sizes, sds, seed=len(sizes) * 100 + sum(sizes)))
    assert coverage(out, "ci", truth(sizes)) >= 0.95 - 4 * SE95
    assert coverage(out, "tost_ci", truth(sizes)) >= 0.90 - 4 * SE90


def test_pooled_ci_is_exact_when_the_stratum_with_fewest_pairs_dominates():
    # SD 100 at 2 pairs vs SD 1 at 8: the t ratio is t with 1 df, the df the interval uses.
    out = intervals(draw((2, 8), (100.0, 1.0), seed=7))
    assert abs(coverage(out, "ci", truth((2, 8))) - 0.95) <= 4 * SE95
    assert abs(coverage(out, "tost_ci", truth((2, 8))) - 0.90) <= 4 * SE90


@pytest.mark.parametrize("sizes,sds", [((3, 3), (1, 1)), ((3, 3, 3, 3), (1, 1, 1, 1)), ((2, 2), (1, 10))])
def test_the_harness_fails_the_interval_this_replaced(sizes, sds):
    """The pooled CI before issue 20: weights n_s / s_s**2 from the estimated variances, as if known, with
    sum(n_s - 1) df. On the same draws (a common delta, where that weighted mean is unbiased) this harness
    finds it short (about 83%, 69%, 79%), as the issue's simulation did, and today's interval not."""
    from scipy import stats as sps

    common = [d - 0.3 * s for s, d in enumerate(draw(sizes, sds, seed=11))]  # every stratum's delta is 0
    w = np.stack([d.shape[1] / d.var(axis=1, ddof=1) for d in common], axis=1)
    mean = (w * np.stack([d.mean(axis=1) for d in common], axis=1)).sum(axis=1) / w.sum(axis=1)
    half = sps.t.ppf(0.975, sum(n - 1 for n in sizes)) / np.sqrt(w.sum(axis=1))
    assert np.mean(np.abs(mean) <= half) < 0.95 - 10 * SE95
    assert coverage(intervals(common), "ci", 0.0) >= 0.95 - 4 * SE95


@pytest.mark.parametrize("sizes,sds", [((5,), (1,)), ((3, 5, 8), (4, 1, 2)), ((2, 2, 2, 2), (1, 2, 4, 8))])
def test_the_table_prints_these_intervals(sizes, sds):
    strata = draw(sizes, sds, seed=3)
    out = intervals(strata)
    for i in range(10):
        rows = [d[i] for d in strata]
        s = paired_summary(rows[0], threshold=MARGIN) if len(rows) == 1 else pooled_summary(rows, threshold=MARGIN)
        # a pooled row's CI and TOST CI invert its stratified sign flip instead (issue 35, item 21)
        t_keys = ("t_p", "tost_p") if len(rows) > 1 else ("ci_low", "ci_high", "t_p", "tost_p", "tost_ci_low",
                                                          "tost_ci_high")
        for key in t_keys:
            assert s[key] == pytest.approx(float(out[key][i]), rel=1e-12, abs=1e-15), key
        if len(rows) > 1:
            assert (s["ci_low"], s["ci_high"]) == stratified_flip_interval(rows, 0.05)
            assert s["tost_ci_low"] == stratified_flip_interval(rows, 0.05, "greater")[0]
