"""results/contrasts.py against independent references: the contrast's sign-flip p against
brute-force enumeration of the 2^n sign patterns; Fieller's closed form against the inversion of
scipy's one-sample t test (`scipy.stats.ttest_1samp` on a - r b, its boundary found by root
finding); the interval's coverage by simulation (it is exact under normal seeds)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps

from reslab.results.contrasts import fraction_kept, linear_contrast


def brute_force_p(values: np.ndarray, alternative: str = "two-sided") -> float:
    observed, patterns = values.sum(), list(itertools.product((-1.0, 1.0), repeat=values.size))
    sums = np.array([np.dot(s, values) for s in patterns])
    tol = 1e-12 * np.abs(values).sum()
    if alternative == "less":
        return float(np.mean(sums <= observed + tol))
    return float(np.mean(np.abs(sums) >= abs(observed) - tol))


def test_a_contrast_is_the_sign_flip_of_its_per_seed_values():
    rng = np.random.default_rng(4)
    seed = rng.normal(0, 0.02, 7)  # a seed's shared offset in every arm
    losses = {"h4": 3.02 + seed + rng.normal(0, 0.004, 7), "h8": 3.00 + seed + rng.normal(0, 0.004, 7),
              "h16": 3.01 + seed + rng.normal(0, 0.004, 7)}
    u_shape = linear_contrast(losses, {"h4": -1, "h8": 2, "h16": -1})
    expected = 2 * losses["h8"] - losses["h4"] - losses["h16"]
    assert u_shape.values == pytest.approx(expected) and u_shape.estimate == pytest.approx(expected.mean())
    assert u_shape.p == pytest.approx(brute_force_p(expected)) and u_shape.p < 0.05
    # non-inferiority: h16 worse than h8 by less than 0.03?
    ni = linear_contrast(losses, {"h16": 1, "h8": -1}, margin=0.03)
    assert ni.p == pytest.approx(brute_force_p(losses["h16"] - losses["h8"] - 0.03, "less"))
    assert ni.p == pytest.approx(1 / 2**7)  # every seed's gap is under the margin


def _t_inversion(a: np.ndarray, b: np.ndarray, level: float, r: float) -> float:
    return sps.ttest_1samp(a - r * b, 0.0).pvalue - (1 - level)


def test_fieller_matches_the_inverted_paired_t_test():
    rng = np.random.default_rng(8)
    seed = rng.normal(0, 0.02, 8)
    control = 3.0 + seed + rng.normal(0, 0.003, 8)
    full = control - 0.03 + rng.normal(0, 0.003, 8)
    cheaper = control - 0.024 + rng.normal(0, 0.003, 8)
    fr = fraction_kept(control, full, cheaper)
    a, b = cheaper - control, full - control
    assert fr.bounded and fr.estimate == pytest.approx(a.mean() / b.mean()) and fr.low < fr.estimate < fr.high
    low = optimize.brentq(lambda r: _t_inversion(a, b, 0.95, r), fr.estimate - 5, fr.estimate)
    high = optimize.brentq(lambda r: _t_inversion(a, b, 0.95, r), fr.estimate, fr.estimate + 5)
    assert (fr.low, fr.high) == pytest.approx((low, high), rel=1e-6)


def test_a_gain_that_is_not_significant_gives_no_fraction():
    rng = np.random.default_rng(1)
    control = 3.0 + rng.normal(0, 0.01, 5)
    full = control + rng.normal(0, 0.01, 5)  # no gain at all
    fr = fraction_kept(control, full, control - 0.01)
    assert not fr.bounded and fr.low == -np.inf and fr.high == np.inf


def test_fiellers_interval_covers_at_its_level():
    rng, hits, reps = np.random.default_rng(0), 0, 4000
    for _ in range(reps):
        seed = rng.normal(0, 0.02, 6)
        control = 3.0 + seed + rng.normal(0, 0.004, 6)
        full = control - 0.03 + rng.normal(0, 0.004, 6)
        cheaper = control - 0.024 + rng.normal(0, 0.004, 6)  # keeps 0.8 of the gain
        fr = fraction_kept(control, full, cheaper)
        hits += fr.low <= 0.8 <= fr.high
    assert 0.93 <= hits / reps <= 0.97  # 95% nominal; the binomial SE is 0.34%


def test_bad_contrasts_are_named():
    losses = {"a": np.ones(4), "b": np.ones(4) * 2}
    with pytest.raises(ValueError, match="sum to 0"):
        linear_contrast(losses, {"a": 1, "b": 1})
    with pytest.raises(ValueError, match="without losses: c"):
        linear_contrast(losses, {"a": 1, "c": -1})
    with pytest.raises(ValueError, match="same seeds"):
        linear_contrast({"a": np.ones(4), "b": np.ones(5)}, {"a": 1, "b": -1})
    with pytest.raises(ValueError, match="at least 3 seeds"):
        fraction_kept(np.ones(2), np.ones(2), np.ones(2))


def _runs(losses: dict[str, np.ndarray], grid_key: str = "", failed: tuple[str, int] | None = None):
    import pandas as pd

    rows = []
    for arm, values in losses.items():
        for seed, v in enumerate(values):
            status = "FAILED" if failed == (arm, seed) else "FINISHED"
            rows.append({"arm": arm, "grid_key": grid_key, "seed": seed, "status": status,
                         "val_loss_tail": v if status == "FINISHED" else np.nan})
    return pd.DataFrame(rows)


def test_a_studys_contrast_table_tests_each_declared_contrast_on_the_seeds_every_arm_finished():
    from reslab.results.contrasts import ContrastSpec, contrast_table, contrast_text

    rng = np.random.default_rng(11)
    seed = rng.normal(0, 0.02, 6)
    losses = {"control": 3.0 + seed + rng.normal(0, 0.003, 6), "full": 2.97 + seed + rng.normal(0, 0.003, 6),
              "block": 2.975 + seed + rng.normal(0, 0.003, 6)}
    specs = [ContrastSpec(name="keeps", fraction=("control", "full", "block")),
             ContrastSpec(name="ni", weights=(("block", 1.0), ("full", -1.0)), margin=0.02),
             ContrastSpec(name="gap", weights=(("block", 1.0), ("full", -1.0)))]
    table = contrast_table(_runs(losses, failed=("full", 5)), specs).set_index("contrast")
    kept = {a: v[:5] for a, v in losses.items()}  # seed 5's full run failed: every contrast drops the seed
    fr = fraction_kept(kept["control"], kept["full"], kept["block"])
    assert table.loc["keeps", "seeds"] == 5 and table.loc["keeps", "estimate"] == pytest.approx(fr.estimate)
    assert (table.loc["keeps", "ci_low"], table.loc["keeps", "ci_high"]) == pytest.approx((fr.low, fr.high))
    gap = kept["block"] - kept["full"]
    assert table.loc["gap", "p"] == pytest.approx(brute_force_p(gap))
    assert table.loc["ni", "p"] == pytest.approx(brute_force_p(gap - 0.02, "less"))
    half = sps.t.ppf(0.975, 4) * gap.std(ddof=1) / np.sqrt(5)
    assert (table.loc["gap", "ci_low"], table.loc["gap", "ci_high"]) == pytest.approx((gap.mean() - half,
                                                                                       gap.mean() + half))
    # Holm over the two tested rows (the fraction has no p)
    p = sorted([table.loc["gap", "p"], table.loc["ni", "p"]])
    assert sorted(table.loc[["gap", "ni"], "p_holm"]) == pytest.approx([min(1, 2 * p[0]), min(1, max(2 * p[0], p[1]))])
    assert table.loc["ni", "verdict"] == "inconclusive"  # 5 seeds: the smallest one-sided p is 1/32, Holm x2
    assert table.loc["keeps", "verdict"] == "bounded" and table.loc["keeps", "kind"] == "fraction"
    text = contrast_text(table.reset_index())
    assert "keeps: (block - control) / (full - control) on val_loss_tail = " in text
    assert "ni: block - full on val_loss_tail < 0.02 = " in text
