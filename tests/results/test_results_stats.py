import itertools
import math
import os
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from reslab.results import stats as rstats
from reslab.results.stats import (
    COMPARE_COLUMNS,
    Comparison,
    benjamini_hochberg,
    compare,
    holm,
    paired_summary,
    sign_flip_p,
)

pytestmark = pytest.mark.filterwarnings("error")


def brute_force_sign_flip(d):
    d = np.asarray(d, dtype=float)
    observed = abs(d.mean())
    hits = 0
    for signs in itertools.product((1.0, -1.0), repeat=d.size):
        hits += abs(np.mean(np.array(signs) * d)) >= observed * (1 - 1e-12) - 1e-15
    return hits / 2**d.size


DATASETS = [
    np.array([0.12, -0.03, 0.08, 0.05, 0.11, -0.01, 0.07]),
    np.array([-0.02, -0.015, -0.03, -0.01, -0.025, -0.02, 0.005, -0.018]),
    np.array([1.0, -1.0, 2.0, -2.0, 3.0, 0.0, 1.0, -3.0, 2.0, 0.0]),  # ties and zeros
    np.random.default_rng(7).normal(0.3, 1.0, size=12),
]


# paired_summary against scipy


@pytest.mark.parametrize("d", DATASETS)
def test_t_test_and_ci_match_scipy(d):
    s = paired_summary(d)
    ref = sps.ttest_1samp(d, 0.0)
    assert s["n"] == d.size
    assert s["mean"] == pytest.approx(d.mean())
    assert s["sd"] == pytest.approx(d.std(ddof=1))
    assert s["se"] == pytest.approx(sps.sem(d))
    assert s["t_p"] == pytest.approx(ref.pvalue, rel=1e-10)
    ci = ref.confidence_interval(0.95)
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-10)
    assert s["d_z"] == pytest.approx(d.mean() / d.std(ddof=1))


def test_paired_t_matches_ttest_rel():
    rng = np.random.default_rng(3)
    control = rng.normal(3.2, 0.05, size=9)
    treatment = control + rng.normal(-0.01, 0.01, size=9)
    s = paired_summary(treatment - control)
    assert s["t_p"] == pytest.approx(sps.ttest_rel(treatment, control).pvalue, rel=1e-8)


def test_ci_level_follows_alpha():
    d = DATASETS[0]
    s = paired_summary(d, alpha=0.1)
    ci = sps.ttest_1samp(d, 0.0).confidence_interval(0.9)
    assert (s["ci_low"], s["ci_high"]) == pytest.approx((ci.low, ci.high), rel=1e-10)


@pytest.mark.parametrize("d", DATASETS)
def test_wilcoxon_matches_scipy(d):
    with warnings.catch_warnings():
        # scipy notes when ties or zeros force the normal approximation.
        warnings.simplefilter("ignore")
        ref = sps.wilcoxon(d).pvalue
    assert paired_summary(d)["wilcoxon_p"] == pytest.approx(ref, rel=1e-12)


def test_wilcoxon_only_from_six_pairs():
    assert math.isnan(paired_summary([0.1, 0.2, -0.05, 0.3, 0.1])["wilcoxon_p"])
    assert not math.isnan(paired_summary([0.1, 0.2, -0.05, 0.3, 0.1, 0.15])["wilcoxon_p"])


@pytest.mark.parametrize("d", DATASETS)
def test_exact_sign_flip_matches_brute_force(d):
    s = paired_summary(d)
    assert s["perm_method"] == "exact"
    assert s["perm_p"] == pytest.approx(brute_force_sign_flip(d), abs=1e-15)


@pytest.mark.parametrize("d", DATASETS[:3])
def test_exact_sign_flip_matches_scipy_permutation_test(d):
    control = np.full(d.size, 3.0)
    treatment = control + d

    def mean_diff(x, y, axis):
        return np.mean(x - y, axis=axis)

    ref = sps.permutation_test(
        (treatment, control), mean_diff, permutation_type="samples", vectorized=True,
        n_resamples=np.inf, alternative="two-sided",
    )
    assert paired_summary(treatment - control)["perm_p"] == pytest.approx(ref.pvalue, rel=1e-12)


def test_sign_flip_counts_exact_ties():
    # Magnitudes 1,1,3: |sums| are 5,3,3,1, each twice. Observed |sum|=3 -> 6 of 8 patterns.
    assert paired_summary([1.0, -1.0, 3.0])["perm_p"] == pytest.approx(0.75)
    # Float rounding must not break ties: 0.1+0.2 vs 0.3.
    assert paired_summary([0.1, 0.2, -0.3, 0.3])["perm_p"] == pytest.approx(
        brute_force_sign_flip([0.1, 0.2, -0.3, 0.3])
    )


def test_sign_flip_smallest_p():
    s = paired_summary([-0.01] * 5 + [-0.02])
    assert s["perm_p"] == pytest.approx(2 / 2**6)
    assert s["min_attainable_p"] == pytest.approx(2 / 2**6)


def test_monte_carlo_above_twenty_and_agrees_with_exact(monkeypatch):
    d = np.random.default_rng(11).normal(0.2, 1.0, size=21)
    s = paired_summary(d)
    assert s["perm_method"] == "monte-carlo (200000 draws, seed 0)"
    assert paired_summary(d)["perm_p"] == s["perm_p"]  # fixed seed
    # Same estimator on a size where the exact answer is cheap: within 4 Monte-Carlo SEs.
    d12 = DATASETS[3]
    exact, _ = sign_flip_p(d12)
    monkeypatch.setattr(rstats, "EXACT_MAX_N", 5)
    mc, method = sign_flip_p(d12)
    assert method.startswith("monte-carlo")
    assert abs(mc - exact) < 4 * math.sqrt(exact * (1 - exact) / rstats.MC_DRAWS) + 1e-5


@pytest.mark.parametrize("alternative", ["greater", "less"])
def test_one_sided_sign_flip_matches_brute_force(alternative):
    d = np.array([0.3, -0.1, 0.25, 0.4, -0.05, 0.2, 0.0])
    sums = [float(np.dot(signs, d)) for signs in itertools.product((1.0, -1.0), repeat=d.size)]
    obs = float(d.sum())
    ref = np.mean([x >= obs - 1e-12 for x in sums] if alternative == "greater" else [x <= obs + 1e-12 for x in sums])
    assert sign_flip_p(d, alternative)[0] == pytest.approx(ref, abs=1e-15)


# edge cases


def test_n0():
    s = paired_summary([])
    assert s["n"] == 0
    for key in ("mean", "sd", "se", "ci_low", "ci_high", "t_p", "perm_p", "wilcoxon_p", "d_z", "min_attainable_p"):
        assert math.isnan(s[key]), key
    assert (s["wins"], s["losses"], s["ties"]) == (0, 0, 0)
    assert "no pairs" in s["flags"]


def test_n1():
    s = paired_summary([-0.02])
    assert s["n"] == 1 and s["mean"] == pytest.approx(-0.02)
    for key in ("sd", "se", "ci_low", "ci_high", "t_p", "d_z", "wilcoxon_p"):
        assert math.isnan(s[key]), key
    assert s["perm_p"] == 1.0
    assert s["min_attainable_p"] == 1.0
    assert s["wins"] == 1


def test_n2():
    d = np.array([-0.02, -0.01])
    s = paired_summary(d)
    assert s["t_p"] == pytest.approx(sps.ttest_1samp(d, 0).pvalue)
    assert s["perm_p"] == pytest.approx(0.5)
    assert s["min_attainable_p"] == 0.5


def test_zero_variance():
    # sd = 0: the CI is the point and the t p is its limit as the SD goes to 0 (t -> inf: p -> 0, by hand);
    # d_z = mean / 0 stays undefined.
    s = paired_summary([0.1, 0.1, 0.1])
    assert s["sd"] == 0.0 and s["se"] == 0.0
    assert s["ci_low"] == s["ci_high"] == pytest.approx(0.1)
    assert s["t_p"] == 0.0 and math.isnan(s["d_z"])
    assert s["perm_p"] == pytest.approx(0.25)
    assert any(f.startswith("zero variance") for f in s["flags"])
    # The limit of 0 / 0 is no evidence: p = 1.
    assert paired_summary([0.0, 0.0, 0.0])["t_p"] == 1.0


def test_all_zero_deltas():
    s = paired_summary([0.0] * 6)
    # Zero deltas carry no sign: the sign-flip floor and Wilcoxon's effective n count non-zero pairs only.
    assert s["perm_p"] == 1.0 and math.isnan(s["wilcoxon_p"])
    assert s["n_nonzero"] == 0 and s["min_attainable_p"] == 1.0
    three_zero = paired_summary([0.0, 0.0, 0.0, -0.1, -0.2, -0.3])
    assert three_zero["min_attainable_p"] == pytest.approx(2 / 2**3)
    assert three_zero["perm_p"] == pytest.approx(brute_force_sign_flip([0.0, 0.0, 0.0, -0.1, -0.2, -0.3]))
    assert (s["wins"], s["losses"], s["ties"]) == (0, 0, 6)


def test_wins_losses_ties_follow_direction():
    d = [-0.1, -0.2, 0.3, 0.0]
    assert [paired_summary(d)[k] for k in ("wins", "losses", "ties")] == [2, 1, 1]
    assert [paired_summary(d, direction="maximize")[k] for k in ("wins", "losses", "ties")] == [1, 2, 1]


def test_paired_summary_rejects_bad_input():
    with pytest.raises(ValueError, match="finite"):
        paired_summary([0.1, float("nan")])
    with pytest.raises(ValueError, match="direction"):
        paired_summary([0.1], direction="lower")
    with pytest.raises(ValueError, match="1-D"):
        paired_summary(np.zeros((2, 2)))


# multiple-comparison corrections


def test_holm_hand_example():
    # Sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> running max 0.02, 0.03, 0.06, 0.06.
    got = holm([0.01, np.nan, 0.04, 0.03, 0.005])
    np.testing.assert_allclose(got, [0.03, np.nan, 0.06, 0.06, 0.02])


def test_holm_caps_at_one_and_is_monotone():
    np.testing.assert_allclose(holm([0.5, 0.6]), [1.0, 1.0])
    p = np.random.default_rng(0).uniform(size=30)
    adj = holm(p)
    order = np.argsort(p)
    assert np.all(np.diff(adj[order]) >= 0) and np.all(adj >= p) and np.all(adj <= 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bh_matches_scipy(seed):
    p = np.random.default_rng(seed).uniform(0, 0.2, size=15)
    np.testing.assert_allclose(benjamini_hochberg(p), sps.false_discovery_control(p), rtol=1e-12)


def test_bh_ignores_nan():
    p = np.array([0.01, np.nan, 0.04, 0.03, np.nan, 0.2])
    got = benjamini_hochberg(p)
    ok = ~np.isnan(p)
    assert np.isnan(got[~ok]).all()
    np.testing.assert_allclose(got[ok], sps.false_discovery_control(p[ok]), rtol=1e-12)


def test_corrections_empty_and_all_nan():
    assert holm([]).size == 0 and benjamini_hochberg([]).size == 0
    assert np.isnan(holm([np.nan, np.nan])).all()
    assert np.isnan(benjamini_hochberg([np.nan])).all()
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        holm([0.5, 1.5])


# compare: pairing logic


def make_runs(spec, metric="val_loss_tail"):
    """spec: iterable of (arm, grid_key, seed, value, status)."""
    rows = []
    for i, (arm, gk, seed, value, status) in enumerate(spec):
        rows.append({"run_id": f"{arm}-{gk or 'g'}-s{seed}-{i}", "arm": arm, "grid_key": gk, "seed": seed,
                     "status": status, metric: value, "tokens_per_s": 1000.0 + seed})
    return pd.DataFrame(rows)


CONTROL = {1: 3.30, 2: 3.28, 3: 3.35, 4: 3.31, 5: 3.29, 6: 3.33, 7: 3.27, 8: 3.32}
DELTA = {1: -0.021, 2: -0.015, 3: -0.030, 4: -0.012, 5: -0.019, 6: 0.004, 7: -0.025, 8: -0.017}


def basic_spec():
    spec = [("baseline", "", s, v, "FINISHED") for s, v in CONTROL.items()]
    spec += [("attnres", "", s, CONTROL[s] + DELTA[s], "FINISHED") for s in CONTROL]
    return spec


def test_compare_seed_matched_row_equals_paired_summary():
    runs = make_runs(basic_spec()).sample(frac=1.0, random_state=0)  # row order must not matter
    table = compare(runs, [Comparison(name="attnres vs baseline", control="baseline", treatments=("attnres",))])
    assert list(table.columns) == list(COMPARE_COLUMNS)
    assert len(table) == 1
    row = table.iloc[0]
    d = np.array([DELTA[s] for s in sorted(DELTA)])
    ref = paired_summary(d)
    assert row["n"] == 8
    for col, key in [("mean_delta", "mean"), ("sd", "sd"), ("se", "se"), ("ci_low", "ci_low"),
                     ("ci_high", "ci_high"), ("t_p", "t_p"), ("perm_p", "perm_p"), ("wilcoxon_p", "wilcoxon_p"),
                     ("d_z", "d_z")]:
        assert row[col] == pytest.approx(ref[key], rel=1e-9, abs=1e-12), col
    assert (row["wins"], row["losses"], row["ties"]) == (7, 1, 0)
    assert row["perm_method"] == "exact"
    assert row["seeds"] == "1,2,3,4,5,6,7,8"
    assert row["control_run_ids"].split(";") == [f"baseline-g-s{s}-{s - 1}" for s in range(1, 9)]
    assert row["treatment_run_ids"].split(";") == [f"attnres-g-s{s}-{s + 7}" for s in range(1, 9)]
    assert row["control_mean"] == pytest.approx(np.mean(list(CONTROL.values())))
    assert row["treatment_mean"] - row["control_mean"] == pytest.approx(row["mean_delta"])
    assert row["p_holm"] == pytest.approx(row["perm_p"]) and row["p_bh"] == pytest.approx(row["perm_p"])
    assert row["missing"] == ""
    assert table.attrs["alpha"] == 0.05


def test_compare_incomplete_pair_is_flagged():
    spec = [r for r in basic_spec() if not (r[0] == "attnres" and r[2] == 3)]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["n"] == 7
    assert "3" not in row["seeds"].split(",")
    assert "incomplete: seed 3 has no finished attnres run" in row["flags"].split(";")
    assert "seed 3: no attnres run" in row["missing"]


def test_compare_failed_runs_excluded_and_flagged():
    spec = basic_spec()
    spec = [r if not (r[0] == "attnres" and r[2] in (2, 5)) else (r[0], r[1], r[2], float("nan"), "FAILED")
            for r in spec]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["n"] == 6
    assert row["seeds"] == "1,3,4,6,7,8"
    assert "incomplete: seeds 2,5 have no finished attnres run" in row["flags"].split(";")
    assert "seed 2: attnres run attnres-g-s2-9 is FAILED" in row["missing"]
    assert "seed 5: attnres run attnres-g-s5-12 is FAILED" in row["missing"]


def test_compare_failed_then_retried_seed_pairs_with_the_finished_run():
    spec = basic_spec() + [("attnres", "", 4, float("nan"), "FAILED")]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["n"] == 8 and row["missing"] == ""
    assert "incomplete" not in row["flags"]


def test_compare_finished_run_without_metric_is_flagged():
    spec = [r if not (r[0] == "baseline" and r[2] == 1) else (r[0], r[1], r[2], float("nan"), r[4])
            for r in basic_spec()]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["n"] == 7
    assert "incomplete: seed 1 has no finished baseline run" in row["flags"]
    assert "finished with val_loss_tail=nan" in row["missing"]


def test_compare_underpowered_flag():
    spec = [r for r in basic_spec() if r[2] <= 3]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["n"] == 3
    assert ("underpowered: with 3 non-zero pairs and holm over a family of 1, the smallest attainable p is 0.25 > "
            "alpha=0.05") in row["flags"].split(";")
    assert math.isnan(row["wilcoxon_p"])


def test_compare_zero_pairs_row_is_kept():
    spec = [r if r[0] == "baseline" else (r[0], r[1], r[2], float("nan"), "FAILED") for r in basic_spec()]
    table = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))])
    assert len(table) == 1
    row = table.iloc[0]
    assert row["n"] == 0 and row["seeds"] == "" and row["control_run_ids"] == ""
    assert math.isnan(row["mean_delta"]) and math.isnan(row["perm_p"]) and math.isnan(row["p_holm"])
    assert "no pairs" in row["flags"].split(";")
    assert "incomplete: seeds 1,2,3,4,5,6,7,8 have no finished attnres run" in row["flags"]


def test_compare_grid_keys_pair_within_grid_point_and_flag_mismatch():
    spec = []
    for gk, shift in (("residual.options.heads=8", -0.02), ("residual.options.heads=16", -0.01)):
        spec += [("baseline", gk, s, v, "FINISHED") for s, v in CONTROL.items()]
        spec += [("mhar", gk, s, v + shift + DELTA[s] / 10, "FINISHED") for s, v in CONTROL.items()]
    spec += [("mhar", "residual.options.heads=32", s, 3.0, "FINISHED") for s in (1, 2)]
    spec += [("baseline", "residual.options.heads=4", s, 3.0, "FINISHED") for s in (1, 2)]
    table = compare(make_runs(spec), [Comparison(name="heads", control="baseline", treatments=("mhar",))])
    assert table["grid_key"].tolist() == [f"residual.options.heads={h}" for h in (4, 8, 16, 32)]
    by_gk = table.set_index("grid_key")
    expected = -0.02 + np.mean(list(DELTA.values())) / 10
    assert by_gk.loc["residual.options.heads=8", "mean_delta"] == pytest.approx(expected)
    assert by_gk.loc["residual.options.heads=16", "n"] == 8
    only_trt = by_gk.loc["residual.options.heads=32"]
    assert only_trt["n"] == 0 and "none for control baseline" in only_trt["flags"]
    only_ctrl = by_gk.loc["residual.options.heads=4"]
    assert only_ctrl["n"] == 0 and "none for treatment mhar" in only_ctrl["flags"]


def test_grid_points_are_in_numeric_order_whatever_the_order_python_hashes_them_in():
    """Issue 39's 50-point lr grid tied "lr=0.01" with "lr=0.001" (the digits were compared as integers, 01 = 001),
    so the paired table's rows came in a set's order, which changes with PYTHONHASHSEED. Each run of Python
    below hashes the keys differently; the order is the numeric one in every run."""
    import json
    import subprocess
    import sys

    keys = ["optim.lr=0.01", "optim.lr=0.001", "optim.lr=0.011", "optim.lr=0.002", "optim.lr=1e-3"]
    script = ("import json, sys\nfrom reslab.results.stats import _natural_key\n"
              "print(json.dumps(sorted(set(json.loads(sys.argv[1])), key=_natural_key)))")
    orders = {subprocess.run([sys.executable, "-c", script, json.dumps(keys)], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
              for seed in range(6)}
    assert [json.loads(o) for o in orders] == [["optim.lr=0.001", "optim.lr=1e-3", "optim.lr=0.002", "optim.lr=0.01",
                                                 "optim.lr=0.011"]]
    assert sorted(["heads=16", "heads=8", "lr=-1", "lr=-2", "block-16", "block-8"], key=rstats._natural_key) == \
        ["block-8", "block-16", "heads=8", "heads=16", "lr=-2", "lr=-1"]


def test_compare_maximize_direction():
    spec = [("baseline", "", s, 1000.0 + s, "FINISHED") for s in range(1, 7)]
    spec += [("attnres", "", s, 1000.0 + s + (20.0 if s != 6 else -5.0), "FINISHED") for s in range(1, 7)]
    runs = make_runs(spec, metric="tokens")
    tp = Comparison(name="tp", control="baseline", treatments=("attnres",), metric="tokens", direction="maximize")
    row = compare(runs, [tp]).iloc[0]
    assert (row["wins"], row["losses"], row["ties"]) == (5, 1, 0)
    assert row["direction"] == "maximize" and row["metric"] == "tokens"


def test_paired_verdict_ignores_the_seed_to_seed_spread():
    # The case: 8/8 wins, CI about [-0.015, -0.0125], while the control's SD across seeds (0.027)
    # exceeds the effect. Pairing removes that spread; a verdict that read an unpaired SD would call it noise.
    d = np.array([-0.0145, -0.0130, -0.0150, -0.0128, -0.0140, -0.0135, -0.0138, -0.0142])
    spec = [("baseline", "", s, v, "FINISHED") for s, v in CONTROL.items()]
    spec += [("attnres", "", s, CONTROL[s] + d[s - 1], "FINISHED") for s in CONTROL]
    row = compare(make_runs(spec), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    assert row["control_sd"] > abs(row["mean_delta"])  # the old "below noise" rule fired here
    assert row["wins"] == 8 and row["perm_p"] == pytest.approx(2 / 2**8)
    assert row["ci_high"] < -0.0125
    assert row["verdict"] == "better"
    assert "noise" not in row["flags"]
    # The same deltas with a tiny seed-to-seed spread give the same verdict and the same statistics.
    calm = [("baseline", "", s, 3.3 + 1e-4 * s, "FINISHED") for s in CONTROL]
    calm += [("attnres", "", s, 3.3 + 1e-4 * s + d[s - 1], "FINISHED") for s in CONTROL]
    row_calm = compare(make_runs(calm), [Comparison(name="c", control="baseline", treatments=("attnres",))]).iloc[0]
    for key in ("verdict", "perm_p", "p_adj"):
        assert row_calm[key] == row[key]
    assert row_calm["ci_low"] == pytest.approx(row["ci_low"], abs=1e-12)


def test_compare_corrections_run_within_family():
    spec = basic_spec()
    spec += [("dar", "", s, CONTROL[s] + DELTA[s] / 3 + 0.004, "FINISHED") for s in CONTROL]
    spec += [("mgr", "", s, CONTROL[s] + 0.01 * (-1) ** s, "FINISHED") for s in CONTROL]
    comps = [
        Comparison(name="main", control="baseline", treatments=("attnres", "dar"), family="main"),
        Comparison(name="side", control="baseline", treatments=("mgr",), family="side"),
    ]
    table = compare(make_runs(spec), comps)
    assert table["treatment"].tolist() == ["attnres", "dar", "mgr"]
    main = table[table["family"] == "main"]
    np.testing.assert_allclose(main["p_holm"], holm(main["perm_p"].to_numpy()))
    np.testing.assert_allclose(main["p_bh"], benjamini_hochberg(main["perm_p"].to_numpy()))
    side = table[table["family"] == "side"].iloc[0]
    assert side["p_holm"] == pytest.approx(side["perm_p"])


def test_compare_metric_name_need_not_be_identifier():
    runs = make_runs(basic_spec(), metric="val/loss")
    row = compare(runs, [Comparison(name="c", control="baseline", treatments=("attnres",), metric="val/loss")]).iloc[0]
    assert row["n"] == 8


def test_compare_duplicate_finished_runs_raise():
    spec = basic_spec() + [("attnres", "", 4, 3.0, "FINISHED")]
    runs = make_runs(spec)
    with pytest.raises(ValueError,
                       match=r"duplicate finished runs.*arm='attnres'.*seed=4.*attnres-g-s4-11.*attnres-g-s4-16"):
        compare(runs, [Comparison(name="c", control="baseline", treatments=("attnres",))])


def test_compare_unknown_metric_and_arm():
    runs = make_runs(basic_spec())
    with pytest.raises(ValueError, match=r"metric 'val_acc' is not a column.*tokens_per_s.*val_loss_tail"):
        compare(runs, [Comparison(name="c", control="baseline", treatments=("attnres",), metric="val_acc")])
    with pytest.raises(ValueError, match=r"metric 'status' is not numeric"):
        compare(runs, [Comparison(name="c", control="baseline", treatments=("attnres",), metric="status")])
    with pytest.raises(ValueError, match=r"unknown arms \['mhar'\].*\['attnres', 'baseline'\]"):
        compare(runs, [Comparison(name="c", control="baseline", treatments=("attnres", "mhar"))])


def test_compare_missing_columns():
    with pytest.raises(ValueError, match=r"lacks required columns \['status'\]"):
        compare(make_runs(basic_spec()).drop(columns="status"),
                [Comparison(name="c", control="baseline", treatments=("attnres",))])


def test_compare_no_comparisons_gives_empty_table():
    table = compare(make_runs(basic_spec()), [])
    assert table.empty and list(table.columns) == list(COMPARE_COLUMNS)


def test_comparison_validation():
    assert Comparison(name="c", control="a", treatments=["b", "c"]).treatments == ("b", "c")
    assert Comparison(name="c", control="a", treatments="b").treatments == ("b",)
    with pytest.raises(ValueError, match="direction"):
        Comparison(name="c", control="a", treatments=("b",), direction="lower")
    with pytest.raises(ValueError, match="also a treatment"):
        Comparison(name="c", control="a", treatments=("a", "b"))
    with pytest.raises(ValueError, match="empty"):
        Comparison(name="c", control="a", treatments=())
