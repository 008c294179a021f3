"""The verdict rules of issue 20, one edge case per test: identical arms can be equivalent, every
equivalence claim reads the family-adjusted TOST p, and "better" tests against 0, not the MEI.

References: brute-force enumeration of sign patterns, statsmodels' `multipletests` (Holm, BH), scipy's
t distribution, and hand arithmetic stated beside each value.
"""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps
from statsmodels.stats.multitest import multipletests

from reslab.results.comparison import Comparison
from reslab.results.export import format_table
from reslab.results.power import sign_flip_tost_power
from reslab.results.stats import compare, paired_summary

pytestmark = pytest.mark.filterwarnings("error")


def runs(deltas: dict[str, np.ndarray], grid_key: str = "") -> list[dict]:
    """Control arm "a" plus one arm per key, whose per-seed metric is the control's plus its deltas."""
    n = len(next(iter(deltas.values())))
    base = 3.3 + 0.05 * np.random.default_rng(0).standard_normal(n)
    rows = [{"run_id": f"a{grid_key}{i}", "arm": "a", "grid_key": grid_key, "seed": i, "status": "FINISHED",
             "val_loss_tail": float(base[i])} for i in range(n)]
    for arm, d in deltas.items():
        rows += [{"run_id": f"{arm}{grid_key}{i}", "arm": arm, "grid_key": grid_key, "seed": i, "status": "FINISHED",
                  "val_loss_tail": float(base[i] + d[i])} for i in range(n)]
    return rows


def brute_force_tost(d, margin):
    """max of the two one-sided sign-flip p, every pattern enumerated."""
    def one_sided(values, greater):
        obs = values.sum()
        sums = [np.dot(signs, values) for signs in itertools.product((1.0, -1.0), repeat=values.size)]
        return np.mean([x >= obs - 1e-12 if greater else x <= obs + 1e-12 for x in sums])

    return max(one_sided(d + margin, True), one_sided(d - margin, False))


# identical arms


def test_identical_arms_are_equivalent():
    zero = np.zeros(8)
    # Brute force: d + margin is +margin in every pair, and only the all-plus pattern reaches its sum: 1/256.
    assert brute_force_tost(zero, 0.02) == 1 / 256
    s = paired_summary(zero, threshold=0.02)
    assert s["tost_perm_p"] == 1 / 256 and s["n_tost"] == 8
    # sd = 0: the 90% CI is [0, 0], inside +-0.02, and the TOST-t p is its limit, 0.
    assert (s["tost_ci_low"], s["tost_ci_high"], s["tost_p"]) == (0.0, 0.0, 0.0)

    table = compare(pd.DataFrame(runs({"b": zero})), [
        Comparison(name="eq", control="a", treatments=("b",), kind="equivalence", margin=0.02, family="eq"),
        Comparison(name="sup", control="a", treatments=("b",), mei=0.02, family="sup")])
    eq, sup = table.iloc[0], table.iloc[1]
    assert eq["verdict"] == "equivalent" and eq["p_adj"] == 1 / 256
    assert eq["attainable_p"] == 1 / 256  # the TOST's floor counts pairs off the margin: all 8
    assert eq["flags"].split(";") == ["zero variance: all deltas equal, so the t p, TOST-t p and CIs are their "
                                      "limits at SD 0"]  # and not "underpowered"
    assert sup["verdict"] == "equivalent" and sup["tost_perm_p_adj"] == 1 / 256


def test_identical_arms_pooled_are_equivalent():
    rows = runs({"b": np.zeros(4)}, "model.preset=small") + runs({"b": np.zeros(4)}, "model.preset=big")
    table = compare(pd.DataFrame(rows), [Comparison(name="eq", control="a", treatments=("b",), kind="equivalence",
                                                    margin=0.02, pool=("model.preset",))])
    pooled = table[table["role"] == "pooled"].iloc[0]
    # 8 pairs, each stratum's d + margin scaled by its mean square: only the all-plus pattern, 1/256.
    assert pooled["p_adj"] == 1 / 256 and pooled["tost_p"] == 0.0
    assert pooled["verdict"] == "equivalent"


# the adjusted TOST p everywhere a verdict reads it


def five_rows(seeds):
    rng = np.random.default_rng(5)
    return {f"t{k}": 0.002 * rng.standard_normal(seeds) for k in range(5)}  # all well inside +-0.05


@pytest.mark.parametrize("correction", ["holm", "bh"])
@pytest.mark.parametrize("seeds", [6, 8])
def test_five_row_family_reads_the_adjusted_tost_p(seeds, correction):
    deltas = five_rows(seeds)
    data = pd.DataFrame(runs(deltas))
    arms = tuple(deltas)
    sup = compare(data, [Comparison(name="s", control="a", treatments=arms, mei=0.05, correction=correction)])
    eq = compare(data, [Comparison(name="e", control="a", treatments=arms, kind="equivalence", margin=0.05,
                                   correction=correction)])
    raw = sup["tost_perm_p"].to_numpy()
    np.testing.assert_array_equal(raw, [brute_force_tost(d, 0.05) for d in deltas.values()])  # 1 / 2**seeds
    method = {"holm": "holm", "bh": "fdr_bh"}[correction]
    ref = multipletests(raw, method=method)[1]
    np.testing.assert_allclose(sup["tost_perm_p_adj"], ref, rtol=1e-12)
    np.testing.assert_allclose(eq["p_adj"], ref, rtol=1e-12)
    np.testing.assert_allclose(eq["tost_perm_p_adj"], ref, rtol=1e-12)
    # Holm at 6 seeds: 5 x 1/64 = 0.078 > 0.05, though each raw 1/64 passes: no row may claim equivalence.
    # At 8 seeds 5/256 = 0.0195 passes; BH's adjusted p of five equal p is that p.
    expected = "inconclusive" if (seeds, correction) == (6, "holm") else "equivalent"
    assert set(sup["verdict"]) == set(eq["verdict"]) == {expected}


def test_adjustment_bounds_false_equivalence_claims_in_a_five_row_family():
    """At the boundary of the null (true delta = MEI), each row's sign-flip TOST claims equivalence at rate ~alpha
    (`sign_flip_tost_power`, checked against brute force in test_results_power.py): five unadjusted rows claim at
    least once ~1 - (1 - alpha)**5 = 23% of the time; at Holm's first step (alpha / 5) at most alpha."""
    raw, se = sign_flip_tost_power(0.02, 0.01, 8, 0.02, 0.05)
    first_step, se5 = sign_flip_tost_power(0.02, 0.01, 8, 0.02, 0.01)
    assert 1 - (1 - raw) ** 5 > 3 * 0.05
    assert 1 - (1 - first_step) ** 5 <= 0.05 + 5 * 4 * se5


# the MEI rule


def test_better_tests_against_zero_not_the_mei():
    """The issue's row: mean -0.019, 95% CI [-0.024, -0.014], MEI 0.02 -> "better". The CI reaches inside
    +-MEI, so the effect may be smaller than the MEI, but it is real, and the MEI is the effect the seeds were
    sized to detect against 0 (a test of "beyond the MEI" has at most 50% power there)."""
    z = np.array([-1.5, -1.0, -0.5, -0.1, 0.1, 0.5, 1.0, 1.5])
    d = -0.019 + 0.006 * (z - z.mean()) / z.std(ddof=1)
    row = compare(pd.DataFrame(runs({"b": d})), [Comparison(name="m", control="a", treatments=("b",),
                                                            mei=0.02)]).iloc[0]
    half = sps.t.ppf(0.975, 7) * 0.006 / math.sqrt(8)  # 0.0050
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((-0.019 - half, -0.019 + half), abs=1e-6)
    assert (round(row["ci_low"], 3), round(row["ci_high"], 3)) == (-0.024, -0.014)
    assert row["p_adj"] == 2 / 256  # all 8 deltas negative
    assert row["tost_ci_low"] < -0.02  # TOST fails: not equivalent
    assert row["verdict"] == "better"

    # Significant but inside the MEI: TOST passes, so "equivalent" (real, smaller than the MEI) wins over "better".
    small = -0.01 + 0.003 * (z - z.mean()) / z.std(ddof=1)
    inside = compare(pd.DataFrame(runs({"b": small})), [Comparison(name="m", control="a", treatments=("b",),
                                                                   mei=0.02)]).iloc[0]
    assert inside["p_adj"] == 2 / 256 and -0.02 < inside["tost_ci_low"] < inside["tost_ci_high"] < 0
    assert inside["verdict"] == "equivalent"

    # The docstring and the printed footnote state this rule.
    assert "not against the mei" in " ".join(Comparison.__doc__.split())
    table = compare(pd.DataFrame(runs({"b": d})), [Comparison(name="m", control="a", treatments=("b",), mei=0.02)])
    assert "the CI excludes 0, tested against 0, not the MEI" in format_table(table)
