"""Power before compute, equivalence, pooling and effect sizes, each pinned to an independent reference.

References: statsmodels (`ttost_paired`, `TTestPower`), scipy's t distribution, brute-force
enumeration of sign patterns, hand-computed floors and closed forms, and seeded simulations.
"""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import special
from scipy import stats as sps
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.power import (
    POWER_DRAWS,
    UnderpoweredStudy,
    attainable_p,
    check_confirmatory,
    family_sizes,
    paired_t_power,
    pilot_sd,
    plan_attainable,
    power_rows,
    seeds_for_floor,
    sign_flip_floor,
    sign_flip_power,
    sign_flip_tost_power,
    tost_power,
)
from reslab.results.stats import compare, hedges_j, paired_summary, pooled_summary, stratified_flip_interval

pytestmark = pytest.mark.filterwarnings("error")


def comp(**kw):
    kw.setdefault("name", "c")
    kw.setdefault("control", "a")
    kw.setdefault("treatments", ("b",))
    return Comparison(**kw)


# the family-aware floor, by hand


def test_floor_hand_values():
    # The issue's case: 6 seeds, 5 treatments in one Holm family: 5 x 2 / 2**6.
    assert attainable_p(6, 5, "holm") == 0.15625
    assert attainable_p(6, 1, "holm") == 2 / 64
    assert attainable_p(6, 5, "bh") == 2 / 64  # BH's best case: every row at the floor
    assert attainable_p(5, 1) == 0.0625
    assert attainable_p(8, 4, "holm") == 4 * 2 / 256
    # TOST's p is a one-sided p: floor 1 / 2**n.
    assert attainable_p(5, 1, "holm", "equivalence") == 1 / 32
    assert attainable_p(0, 3) == 1.0
    assert sign_flip_floor(3) == 0.25 and sign_flip_floor(3, "one-sided") == 0.125


def test_floor_counts_only_nonzero_pairs_and_the_family():
    # The issue's table: five arms win 6/6 seeds, paired-t p ~1e-7, sign-flip p 0.031, Holm 0.156.
    rng = np.random.default_rng(0)
    rows = []
    for seed in range(6):
        base = 3.3 + 0.02 * rng.standard_normal()
        rows.append({"run_id": f"c{seed}", "arm": "control", "grid_key": "", "seed": seed, "status": "FINISHED",
                     "val_loss_tail": base})
        for k in range(5):
            rows.append({"run_id": f"t{k}{seed}", "arm": f"t{k}", "grid_key": "", "seed": seed, "status": "FINISHED",
                         "val_loss_tail": base - 0.05 + 0.001 * rng.standard_normal()})
    table = compare(pd.DataFrame(rows), [Comparison(name="sweep", control="control",
                                                    treatments=tuple(f"t{k}" for k in range(5)))])
    assert (table["t_p"] < 1e-6).all()
    np.testing.assert_allclose(table["perm_p"], 2 / 64)
    np.testing.assert_allclose(table["p_holm"], 0.15625)
    np.testing.assert_allclose(table["attainable_p"], 0.15625)
    for flags in table["flags"]:
        assert ("underpowered: with 6 non-zero pairs and holm over a family of 5, the smallest attainable p is "
                "0.156 > alpha=0.05") in flags.split(";")
    assert set(table["verdict"]) == {"inconclusive"}

    # A zero delta lowers the effective n: 2 / 2**(n - k).
    zero = [dict(r) for r in rows if r["arm"] in ("control", "t0")]
    for r in zero:
        if r["arm"] == "t0" and r["seed"] == 0:
            r["val_loss_tail"] = next(c["val_loss_tail"] for c in zero if c["arm"] == "control" and c["seed"] == 0)
    row = compare(pd.DataFrame(zero), [Comparison(name="z", control="control", treatments=("t0",))]).iloc[0]
    assert row["n"] == 6 and row["n_nonzero"] == 5 and row["ties"] == 1
    assert row["attainable_p"] == 2 / 32


def test_plan_and_refusal():
    grid = {"model.preset": 2}
    comps = [
        comp(name="main", treatments=("b", "c"), family="main"),
        comp(name="pooled", treatments=("b",), family="pooled", pool=("model.preset",)),
        comp(name="explore", treatments=("b", "c", "d", "e", "f"), family="x", exploratory=True),
    ]
    assert family_sizes(comps, grid) == {"main": 4, "pooled": 1, "x": 10}
    plan = {a.comparison.name: a for a in plan_attainable(comps, 5, grid)}
    assert plan["main"].p == 4 * 2 / 32 and not plan["main"].reachable
    assert plan["pooled"].n_pairs == 10 and plan["pooled"].p == 2 / 1024
    with pytest.raises(UnderpoweredStudy, match=r"main \(smallest attainable p 0.25 with 5 seeds, family of 4; "
                                                r"needs 8 seeds\)"):
        check_confirmatory(comps, 5, grid)
    assert isinstance(UnderpoweredStudy("x"), ConfigError)
    check_confirmatory(comps, 8, grid)  # 4 x 2/256 = 0.031
    check_confirmatory([comps[2]], 2, grid)  # exploratory only: nothing to refuse
    assert seeds_for_floor(4, "holm", "superiority", 0.05) == 8


# TOST against statsmodels


@pytest.mark.parametrize("margin", [0.01, 0.03])
def test_tost_matches_statsmodels(margin):
    rng = np.random.default_rng(4)
    control = 3.2 + 0.05 * rng.standard_normal(9)
    treatment = control + 0.004 + 0.008 * rng.standard_normal(9)
    s = paired_summary(treatment - control, threshold=margin, alpha=0.05)
    p, (_, p_low, _), (_, p_high, _) = ttost_paired(treatment, control, -margin, margin)
    assert s["tost_p"] == pytest.approx(p, rel=1e-10)
    assert s["tost_p"] == pytest.approx(max(p_low, p_high), rel=1e-10)
    # The matching CI is the 90% paired-t CI: TOST passes at 0.05 exactly when it lies inside the margin.
    assert (s["tost_p"] < 0.05) == (-margin < s["tost_ci_low"] and s["tost_ci_high"] < margin)
    d = treatment - control
    half = 1.8595480375228424 * d.std(ddof=1) / 3  # t(0.95, 8); printed t tables give 1.860
    assert (s["tost_ci_low"], s["tost_ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half), rel=1e-9)


def test_sign_flip_tost_matches_brute_force():
    d = np.array([0.004, -0.006, 0.009, 0.001, -0.002, 0.012])
    margin = 0.01

    def one_sided(values, greater):
        obs = values.sum()
        sums = [np.dot(signs, values) for signs in itertools.product((1.0, -1.0), repeat=values.size)]
        return np.mean([x >= obs - 1e-12 if greater else x <= obs + 1e-12 for x in sums])

    ref = max(one_sided(d + margin, True), one_sided(d - margin, False))
    assert paired_summary(d, threshold=margin)["tost_perm_p"] == pytest.approx(ref, abs=1e-15)


def test_equivalence_verdict():
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(8):
        base = 3.3 + 0.03 * rng.standard_normal()
        rows += [{"run_id": f"f{seed}", "arm": "full", "grid_key": "", "seed": seed, "status": "FINISHED",
                  "val_loss_tail": base},
                 {"run_id": f"b{seed}", "arm": "block", "grid_key": "", "seed": seed, "status": "FINISHED",
                  "val_loss_tail": base + 0.002 + 0.003 * rng.standard_normal()}]
    runs = pd.DataFrame(rows)
    wide = compare(runs, [comp(control="full", treatments=("block",), kind="equivalence", margin=0.02)]).iloc[0]
    assert wide["p_primary"] == wide["tost_perm_p"] == 1 / 256
    assert wide["verdict"] == "equivalent"
    narrow = compare(runs, [comp(control="full", treatments=("block",), kind="equivalence", margin=0.001)]).iloc[0]
    assert narrow["verdict"] == "inconclusive"


# pooling: stratified sign flip by brute force, the pooled CI by hand with scipy's t quantiles


def brute_force_stratified(strata):
    def stat(groups):
        return sum(g.sum() / np.mean(g**2) for g in groups)

    sizes = [s.size for s in strata]
    flat = np.concatenate(strata)
    observed = abs(stat(strata))
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=flat.size):
        flipped = np.asarray(signs) * flat
        groups = np.split(flipped, np.cumsum(sizes)[:-1])
        hits += abs(stat(groups)) >= observed * (1 - 1e-12)
    return hits / 2**flat.size


@pytest.mark.parametrize("strata", [
    [np.array([-0.03, -0.02, 0.01, -0.04]), np.array([-0.3, 0.1, -0.5, -0.2, -0.1])],
    [np.array([0.5, -1.0, 2.0]), np.array([0.01, 0.02, -0.005]), np.array([-3.0, 1.0, 4.0, 2.0])],
])
def test_stratified_sign_flip_matches_brute_force(strata):
    s = pooled_summary(strata)
    assert s["perm_method"] == "exact"
    assert s["perm_p"] == pytest.approx(brute_force_stratified(strata), abs=1e-15)
    # Plain pooling (no scaling) would give a different p when strata differ in scale.
    assert s["perm_p"] != pytest.approx(paired_summary(np.concatenate(strata))["perm_p"])


def test_pooled_ci_by_hand():
    # The mean of the stratum means, se^2 = sum(s_s^2 / n_s) / S^2, t with the smallest stratum's n - 1 df
    # (results/stats.py's module docstring), computed here with numpy and scipy's t distribution.
    strata = [np.array([-0.03, -0.02, -0.035, -0.01, -0.025]), np.array([-0.02, -0.028, -0.015]),
              np.array([-0.05, 0.01, -0.04, -0.03])]
    mean = np.mean([s.mean() for s in strata])
    se = math.sqrt(sum(s.var(ddof=1) / s.size for s in strata)) / 3
    df = 2  # min(5, 3, 4) - 1
    got = pooled_summary(strata, threshold=0.04)
    assert got["mean"] == pytest.approx(mean, rel=1e-12)
    assert got["se"] == pytest.approx(se, rel=1e-12) and got["df"] == df
    # the CI and TOST CI the verdict reads invert the stratified sign flip (issue 35, item 21:
    # tests/results/test_pooled_interval.py); the t quantities stay as printed
    assert (got["ci_low"], got["ci_high"]) == stratified_flip_interval(strata, 0.05)
    assert got["t_p"] == pytest.approx(2 * sps.t.sf(abs(mean) / se, df), rel=1e-10)
    tost = max(sps.t.sf((mean + 0.04) / se, df), sps.t.cdf((mean - 0.04) / se, df))
    assert got["tost_p"] == pytest.approx(tost, rel=1e-10)
    assert got["tost_ci_low"] == stratified_flip_interval(strata, 0.05, "greater")[0]
    assert got["tost_ci_high"] == stratified_flip_interval(strata, 0.05, "less")[1]
    # One stratum is the paired t (scipy's one-sample t).
    one = pooled_summary(strata[:1])
    ref = sps.ttest_1samp(strata[0], 0.0)
    assert one["t_p"] == pytest.approx(ref.pvalue, rel=1e-10)
    ci = ref.confidence_interval(0.95)
    assert (one["ci_low"], one["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-10)


def test_pooled_ci_needs_two_pairs_per_stratum_but_not_a_variance():
    # A stratum of one pair has no variance estimate: no t. A stratum of equal deltas (s = 0) is fine.
    lone = pooled_summary([np.array([-0.02, -0.03, -0.01]), np.array([-0.02])])
    assert math.isnan(lone["t_p"])
    assert "a stratum has fewer than 2 pairs: no pooled t interval" in lone["flags"]
    assert (lone["ci_low"], lone["ci_high"]) == (-math.inf, math.inf)  # the sign flip's: 4 pairs, floor 2/16
    assert lone["mean"] == pytest.approx((-0.02 + -0.02) / 2)
    flat = pooled_summary([np.array([-0.02, -0.03, -0.01]), np.array([-0.02, -0.02])])
    se = math.sqrt(np.var([-0.02, -0.03, -0.01], ddof=1) / 3) / 2
    assert flat["se"] == pytest.approx(se) and flat["df"] == 1


def test_compare_pools_over_a_grid_axis():
    rng = np.random.default_rng(2)
    rows = []
    for preset, scale in (("small", 0.01), ("gpt2-124m", 0.004)):
        for seed in range(5):
            base = 3.0 + 0.05 * rng.standard_normal()
            rows += [{"run_id": f"b{preset}{seed}", "arm": "block", "grid_key": f"model.preset={preset}",
                      "seed": seed, "status": "FINISHED", "val_loss_tail": base},
                     {"run_id": f"r{preset}{seed}", "arm": "rd", "grid_key": f"model.preset={preset}",
                      "seed": seed, "status": "FINISHED", "val_loss_tail": base - 0.03 + scale * rng.standard_normal()}]
    table = compare(pd.DataFrame(rows), [comp(control="block", treatments=("rd",), pool=("model.preset",))])
    assert table["role"].tolist() == ["stratum", "stratum", "pooled"]
    pooled = table.iloc[2]
    assert pooled["grid_key"] == "model.preset=*" and pooled["n"] == 10 and pooled["wins"] == 10
    # "RD beats Block at both scales, 10/10 wins": 5 seeds per scale cannot (2/32 > 0.05); pooled they can.
    assert (table.iloc[:2]["perm_p"] == 2 / 32).all()
    assert pooled["perm_p"] == 2 / 1024 and pooled["p_holm"] == 2 / 1024
    assert pooled["verdict"] == "better"
    strata = [table.iloc[i] for i in range(2)]
    assert table.iloc[:2]["p_holm"].isna().all()  # strata are descriptive, outside the family
    # The pooled row is the mean of its strata: their mean deltas, se = sqrt(se_1^2 + se_2^2) / 2, df 5 - 1.
    assert pooled["mean_delta"] == pytest.approx((strata[0]["mean_delta"] + strata[1]["mean_delta"]) / 2)
    assert pooled["se"] == pytest.approx(math.hypot(strata[0]["se"], strata[1]["se"]) / 2)
    assert pooled["df"] == 4
    with pytest.raises(ConfigError, match=r"pool axes \['optim.lr'\] are not grid axes.*model.preset"):
        compare(pd.DataFrame(rows), [comp(control="block", treatments=("rd",), pool=("optim.lr",))])


# effect sizes


def test_hedges_j_and_g_z():
    # J(5) = Gamma(2.5) / (sqrt(2.5) Gamma(2)) = (3/4 sqrt(pi)) / sqrt(2.5) = 0.840749, by hand.
    assert hedges_j(5) == pytest.approx(0.75 * math.sqrt(math.pi) / math.sqrt(2.5), rel=1e-12)
    assert hedges_j(5) == pytest.approx(0.840749, abs=1e-6)
    assert hedges_j(40) == pytest.approx(1 - 3 / (4 * 40 - 1), abs=1e-4)  # Hedges' approximation
    assert hedges_j(9) == pytest.approx(math.exp(special.gammaln(4.5) - special.gammaln(4)) / math.sqrt(4.5))
    d = np.array([-0.02, -0.01, -0.03, 0.005, -0.015, -0.025])
    s = paired_summary(d)
    assert s["d_z"] == pytest.approx(d.mean() / d.std(ddof=1))
    assert s["g_z"] == pytest.approx(s["d_z"] * hedges_j(5))


# power against statsmodels' noncentral t


@pytest.mark.parametrize("effect,sd,n,alpha", [(0.5, 1.0, 10, 0.05), (0.02, 0.012, 6, 0.01), (0.01, 0.012, 15, 0.0125)])
def test_paired_t_power_matches_statsmodels(effect, sd, n, alpha):
    ref = TTestPower().power(effect_size=effect / sd, nobs=n, alpha=alpha, alternative="two-sided")
    assert paired_t_power(effect, sd, n, alpha) == pytest.approx(ref, rel=1e-9)


def test_seeds_needed_matches_statsmodels_solve_power():
    sd, mei, alpha = 0.012, 0.01, 0.05
    rows = power_rows([comp(name="h", treatments=("b", "c", "d", "e"), mei=mei)], 5, {}, sd, alpha)
    row = rows[0]
    assert row.family_size == 4 and row.level == alpha / 4
    for target, got in ((0.8, row.t_seeds_80), (0.9, row.t_seeds_90)):
        n = TTestPower().solve_power(effect_size=mei / sd, power=target, alpha=alpha / 4, alternative="two-sided")
        assert got == math.ceil(n)
    assert row.t_power_now == pytest.approx(
        TTestPower().power(effect_size=mei / sd, nobs=5, alpha=alpha / 4, alternative="two-sided"), rel=1e-9)
    assert row.seeds_floor == 8  # 4 x 2 / 2**8 = 0.031 <= 0.05 < 4 x 2 / 2**7 = 0.0625
    assert attainable_p(row.seeds_floor, 4) <= alpha < attainable_p(row.seeds_floor - 1, 4)
    # The recommendation is the sign flip's: the t's seeds never suffice here (below 8 seeds its floor 2 / 2**7
    # exceeds the level 0.0125, so its power is 0), and it is at least the floor.
    assert row.seeds_80 >= max(row.t_seeds_80, row.seeds_floor)
    assert row.seeds_recommended == max(row.seeds_80, row.seeds_floor) == row.seeds_80
    assert row.power_now == 0.0 and row.power_now_se == 0.0  # 5 seeds: below the floor, exactly 0
    # 90% needs 24 seeds by the t: past 20 pairs the t's answer stands in for the sign flip's, and says so.
    assert row.approximate == ("90%",) and row.seeds_90 == row.t_seeds_90 == 24


def test_tost_power_matches_simulation():
    rng = np.random.default_rng(12)
    n, sd, margin, true_delta, alpha = 8, 0.012, 0.02, 0.005, 0.05
    sims = 20_000
    d = true_delta + sd * rng.standard_normal((sims, n))
    passes = 0
    for p, _, _ in (ttost_paired(x, np.zeros(n), -margin, margin) for x in d[:2000]):
        passes += p < alpha
    mean, se = d.mean(1), d.std(1, ddof=1) / math.sqrt(n)
    crit = 1.894578605061305  # t(0.95, 7)
    simulated = np.mean((mean - crit * se > -margin) & (mean + crit * se < margin))
    got = tost_power(true_delta, sd, n, margin, alpha)
    assert abs(got - simulated) < 4 * math.sqrt(simulated * (1 - simulated) / sims)
    assert abs(passes / 2000 - got) < 4 * math.sqrt(got * (1 - got) / 2000)  # statsmodels' TOST, same decisions


def test_pilot_sd_pools_within_rows():
    a, b = np.array([0.01, 0.03, 0.02]), np.array([-0.01, 0.0, 0.02, 0.03])
    expected = math.sqrt((a.var(ddof=1) * 2 + b.var(ddof=1) * 3) / 5)
    assert pilot_sd([a, b, np.array([0.5])]) == pytest.approx(expected)
    with pytest.raises(ConfigError, match="paired SD"):
        pilot_sd([np.array([0.1])])


def test_paired_t_power_stays_finite_far_past_the_answer():
    """scipy's nct.sf returns NaN for a large noncentrality (n=200, effect/sd=1.67 here); power must stay a
    number in [0, 1] and never fall as seeds are added, or the seed search can stop on a NaN."""
    powers = [paired_t_power(0.02, 0.012, n, 0.025) for n in (5, 50, 100, 200, 1000, 10000)]
    assert all(0.0 <= p <= 1.0 for p in powers), powers
    assert powers == sorted(powers)


# sign-flip power: closed forms by hand, and brute-force enumeration of sign patterns on independent draws


def brute_force_power(mean, sd, seeds, level, *, strata=1, margin=None, draws=4000):
    """Share of independent normal draws (seed 99, not the library's) whose sign-flip p, every sign pattern
    enumerated, is <= level; each stratum scaled by its mean square as the stratified flip. (power, SE)."""
    d = mean + sd * np.random.default_rng(99).standard_normal((draws, strata, seeds))
    n = strata * seeds
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # row 0 is the observed pattern

    def p_values(values, alternative):
        x = (values / np.mean(values**2, axis=2, keepdims=True)).reshape(draws, n)
        sums = x @ signs.T
        obs, tol = sums[:, :1], 1e-12 * np.abs(x).sum(axis=1, keepdims=True)
        if alternative == "two-sided":
            return np.mean(np.abs(sums) >= np.abs(obs) - tol, axis=1)
        if alternative == "greater":
            return np.mean(sums >= obs - tol, axis=1)
        return np.mean(sums <= obs + tol, axis=1)

    if margin is None:
        reject = p_values(d, "two-sided") <= level
    else:
        reject = np.maximum(p_values(d + margin, "greater"), p_values(d - margin, "less")) <= level
    p = float(reject.mean())
    return p, math.sqrt(p * (1 - p) / draws)


def close(got, ref):
    (p, se), (q, se_ref) = got, ref
    return abs(p - q) <= 4 * math.sqrt(se**2 + se_ref**2) + 1e-12


@pytest.mark.parametrize("effect,sd,seeds,strata,level", [
    (0.8, 1.0, 7, 1, 0.05), (1.6, 2.0, 7, 1, 0.05), (0.5, 1.0, 8, 1, 0.1), (1.0, 1.0, 4, 2, 0.05),
    (0.7, 1.0, 3, 3, 0.05), (0.0, 1.0, 8, 1, 0.05), (0.6, 1.0, 12, 1, 0.01),  # 12 pairs: the sorted-merge count
])
def test_sign_flip_power_matches_brute_force(effect, sd, seeds, strata, level):
    got = sign_flip_power(effect, sd, seeds, level, strata=strata)
    assert close(got, brute_force_power(effect, sd, seeds, level, strata=strata))
    assert got[1] == pytest.approx(math.sqrt(got[0] * (1 - got[0]) / POWER_DRAWS))
    if effect == 0:
        assert got[0] <= level + 4 * got[1]  # the exact test's size


@pytest.mark.parametrize("true_delta,sd,seeds,strata,margin,level", [
    (0.0, 1.0, 7, 1, 1.5, 0.05), (0.5, 1.0, 8, 1, 1.2, 0.025), (0.2, 1.0, 4, 2, 1.0, 0.05),
    (1.0, 1.0, 8, 1, 1.0, 0.05),  # at the margin: the TOST's size
    (0.3, 1.0, 6, 2, 0.8, 0.01),
])
def test_sign_flip_tost_power_matches_brute_force(true_delta, sd, seeds, strata, margin, level):
    got = sign_flip_tost_power(true_delta, sd, seeds, margin, level, strata=strata)
    assert close(got, brute_force_power(true_delta, sd, seeds, level, strata=strata, margin=margin))
    if true_delta >= margin:
        assert got[0] <= level + 4 * got[1]


def test_sign_flip_power_below_the_floor_is_exactly_zero():
    # 6 pairs: the two-sided floor 2/64 exceeds 0.025, the one-sided 1/64 does not reach 0.01.
    assert sign_flip_power(5.0, 1.0, 6, 0.025) == (0.0, 0.0)
    assert sign_flip_tost_power(0.0, 1.0, 6, 1.0, 0.01) == (0.0, 0.0)


@pytest.mark.parametrize("seeds,level", [(8, 0.01), (7, 0.025)])
def test_sign_flip_power_issue_examples(seeds, level):
    """Issue 20: d = 2, n=8 at 0.01 and n=7 at 0.025 (attnres_vs_prenorm's family of 2). By hand: only the two
    one-sign patterns reach p = 2 / 2**n <= level (the next p is 4 / 2**n > level), so the power is
    P(all deltas of one sign) = Phi(2)**n + Phi(-2)**n; the paired t's is statsmodels'."""
    exact = sps.norm.cdf(2.0) ** seeds + sps.norm.cdf(-2.0) ** seeds
    power, se = sign_flip_power(2.0, 1.0, seeds, level)
    assert abs(power - exact) <= 4 * se
    t = TTestPower().power(effect_size=2.0, nobs=seeds, alpha=level, alternative="two-sided")
    assert (round(exact, 2), round(t, 2)) == {8: (0.83, 0.95), 7: (0.85, 0.97)}[seeds]
    assert paired_t_power(2.0, 1.0, seeds, level) == pytest.approx(t, rel=1e-9)


def test_power_rows_size_seeds_by_the_sign_flip():
    # attnres_vs_prenorm's routing comparison: mei 0.02, paired SD 0.01, Holm over a family of 2 (level 0.025).
    rows = power_rows([comp(name="r", treatments=("b", "c"), mei=0.02)], 7, {}, 0.01)
    row = rows[0]
    assert row.level == 0.025 and row.approximate == ()
    assert abs(row.power_now - (sps.norm.cdf(2.0) ** 7 + sps.norm.cdf(-2.0) ** 7)) <= 4 * row.power_now_se
    assert row.t_power_now == pytest.approx(0.967, abs=5e-4)
    assert (row.t_seeds_80, row.t_seeds_90) == (6, 6)  # statsmodels: solve_power(2, 0.8 | 0.9, 0.025) = 5.4 | 6.0
    # Sign flip: 6 seeds cannot reach 0.025 (floor 2/64); 7 give 0.851 (by hand above); 8 give ~0.98.
    assert brute_force_power(2.0, 1.0, 8, 0.025)[0] > 0.95
    assert (row.seeds_80, row.seeds_90, row.seeds_floor, row.seeds_recommended) == (7, 8, 7, 7)


def test_power_rows_equivalence_uses_the_sign_flip_tost():
    rows = power_rows([comp(name="e", kind="equivalence", margin=0.015)], 8, {}, 0.01, true_delta=0.0)
    row = rows[0]
    assert close((row.power_now, row.power_now_se), brute_force_power(0.0, 0.01, 8, 0.05, margin=0.015))
    assert row.t_power_now == pytest.approx(tost_power(0.0, 0.01, 8, 0.015, 0.05))
    below = sign_flip_tost_power(0.0, 0.01, row.seeds_80 - 1, 0.015, 0.05)[0]
    assert below < 0.8 <= sign_flip_tost_power(0.0, 0.01, row.seeds_80, 0.015, 0.05)[0]


def test_power_rows_beyond_exact_pairs_fall_back_to_the_t_and_say_so():
    row = power_rows([comp(name="small", mei=0.005)], 5, {}, 0.012)[0]
    assert row.approximate == ("80%", "90%")
    assert (row.seeds_80, row.seeds_90) == (row.t_seeds_80, row.t_seeds_90)
    assert row.t_seeds_80 > 20
    pooled = power_rows([comp(name="p", mei=0.005, pool=("preset",))], 8, {"preset": 3}, 0.012)[0]
    assert pooled.approximate[0] == "power now" and math.isnan(pooled.power_now_se)  # 24 pairs
    assert pooled.power_now == pooled.t_power_now
