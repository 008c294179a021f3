"""Power before compute, equivalence, pooling and effect sizes, each pinned to an independent reference.

References: statsmodels (`ttost_paired`, `TTestPower`, `combine_effects`), brute-force enumeration
of sign patterns, hand-computed floors, and a seeded simulation for TOST power.
"""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from scipy import special
from statsmodels.stats.meta_analysis import combine_effects
from statsmodels.stats.power import TTestPower
from statsmodels.stats.weightstats import ttost_paired

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.power import (
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
    tost_power,
)
from reslab.results.stats import compare, hedges_j, paired_summary, pooled_summary

pytestmark = pytest.mark.filterwarnings("error")


def comp(**kw):
    kw.setdefault("name", "c")
    kw.setdefault("control", "a")
    kw.setdefault("treatments", ("b",))
    return Comparison(**kw)


# the family-aware floor, by hand


def test_floor_hand_values():
    # The case: 6 seeds, 5 treatments in one Holm family: 5 x 2 / 2**6.
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
    # The table: five arms win 6/6 seeds, paired-t p ~1e-7, sign-flip p 0.031, Holm 0.156.
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


# pooling: stratified sign flip by brute force, the pooled CI against statsmodels' fixed-effect meta-analysis


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


def test_pooled_ci_matches_statsmodels_fixed_effect():
    strata = [np.array([-0.03, -0.02, -0.035, -0.01, -0.025]), np.array([-0.02, -0.028, -0.015, -0.03, -0.022])]
    means = np.array([s.mean() for s in strata])
    variances = np.array([s.var(ddof=1) / s.size for s in strata])
    ref = combine_effects(means, variances, use_t=False)
    s = pooled_summary(strata)
    assert s["mean"] == pytest.approx(ref.mean_effect_fe, rel=1e-12)
    assert s["se"] == pytest.approx(ref.sd_eff_w_fe, rel=1e-12)
    assert s["df"] == 8
    half = (s["ci_high"] - s["ci_low"]) / 2
    assert half == pytest.approx(2.306004135204166 * ref.sd_eff_w_fe, rel=1e-9)  # t(0.975, 8)


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
    assert pooled["mean_delta"] == pytest.approx(
        sum(r["mean_delta"] / r["se"] ** 2 for r in strata) / sum(1 / r["se"] ** 2 for r in strata))
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
    for target, got in ((0.8, row.seeds_80), (0.9, row.seeds_90)):
        n = TTestPower().solve_power(effect_size=mei / sd, power=target, alpha=alpha / 4, alternative="two-sided")
        assert got == math.ceil(n)
    assert row.seeds_floor == 8  # 4 x 2 / 2**8 = 0.031 <= 0.05 < 4 x 2 / 2**7 = 0.0625
    assert attainable_p(row.seeds_floor, 4) <= alpha < attainable_p(row.seeds_floor - 1, 4)
    assert row.seeds_recommended == max(row.seeds_80, row.seeds_floor)


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
