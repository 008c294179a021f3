"""results/costs.py: the ratio rows of a study's declared costs against hand computations on synthetic runs
tables, the interval's coverage by simulation (lognormal costs, a seed effect shared by the pair), the
deterministic costs' zero-width interval, the one line for a cost the runs never recorded, the Pareto front,
and the loss-versus-cost plot."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison
from reslab.results.costs import COST_COLUMNS, check_recorded, cost_points, cost_table, pareto_front, ratio_interval
from reslab.results.plots import cost_plot

ARMS = ("control", "attnres", "block")
SPEED = {"control": 1.0, "attnres": 0.9, "block": 0.97}  # true decode tokens/s ratios to the control
STATE = {"control": 4096.0, "attnres": 6144.0, "block": 4608.0}  # deterministic state bytes per token
POINTS = ("optim.lr=0.001", "optim.lr=0.002")


def runs_table(seeds: int = 5, *, drop: tuple[str, str, int] | None = None, seed: int = 0) -> pd.DataFrame:
    """Three arms x two grid points x `seeds`: decode_tps lognormal with a seed effect shared by every arm,
    decode_state_bytes and params_total the same on every seed; `drop` = (arm, point, seed) failed."""
    rng = np.random.default_rng(seed)
    rows = []
    for point in POINTS:
        shared = rng.normal(0.0, 0.3, seeds)  # the machine, the data order: the same for every arm of a seed
        for arm in ARMS:
            noise = rng.normal(0.0, 0.02, seeds)
            for s in range(seeds):
                failed = drop == (arm, point, s)
                rows.append({
                    "run_id": f"{arm}-{point}-{s}", "arm": arm, "grid_key": point, "seed": s,
                    "status": "FAILED" if failed else "FINISHED",
                    "val_loss_tail": math.nan if failed else 3.0 - 0.05 * (arm != "control") + 0.01 * s,
                    "decode_tps": math.nan if failed else 200.0 * SPEED[arm] * math.exp(shared[s] + noise[s]),
                    "decode_state_bytes": math.nan if failed else STATE[arm],
                    "params_total": math.nan if failed else 1.0e6,
                })
    table = pd.DataFrame(rows)
    table["seed"] = table["seed"].astype("Int64")
    return table


COMP = Comparison(name="main", control="control", treatments=("attnres", "block"))


def test_a_row_is_the_geometric_mean_of_the_per_seed_ratios_with_the_t_interval_of_their_logs():
    runs = runs_table(seeds=6)
    table = cost_table(runs, [COMP], ["decode_tps"], alpha=0.1)
    assert list(table.columns) == list(COST_COLUMNS) and len(table) == 2 * 2  # 2 treatments x 2 grid points
    row = table[(table["treatment"] == "attnres") & (table["grid_key"] == POINTS[1])].iloc[0]
    at = runs[runs["grid_key"] == POINTS[1]].set_index(["arm", "seed"])["decode_tps"]
    c, t = at["control"].to_numpy(), at["attnres"].to_numpy()
    logs = np.log(t / c)
    half = sps.t.ppf(0.95, 5) * logs.std(ddof=1) / math.sqrt(6)
    assert row["ratio"] == pytest.approx(math.exp(logs.mean()), rel=1e-12)
    assert row["ratio"] == pytest.approx(sps.gmean(t / c), rel=1e-12)
    assert (row["ratio_low"], row["ratio_high"]) == pytest.approx((math.exp(logs.mean() - half),
                                                                   math.exp(logs.mean() + half)), rel=1e-12)
    assert row["n"] == 6 and row["df"] == 5 and row["delta"] == "treatment / control" and row["role"] == "cost"
    assert row["control_median"] == pytest.approx(np.median(c)) and row["treatment_mean"] == pytest.approx(t.mean())
    assert row["direction"] == "maximize" and row["verdict"] == "slower" and row["ratio_high"] < 1
    assert row["wins"] + row["losses"] == 6 and row["wins"] == int((t > c).sum())
    assert row["seeds"] == "0,1,2,3,4,5" and row["control_run_ids"].split(";")[0] == f"control-{POINTS[1]}-0"
    assert table.attrs["alpha"] == 0.1


def test_deterministic_costs_give_a_zero_width_interval_without_warnings():
    runs = runs_table()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning from a zero SD, no NaN
        table = cost_table(runs, [COMP], ["decode_state_bytes", "params_total"])
    state = table[table["metric"] == "decode_state_bytes"].set_index(["treatment", "grid_key"])
    for arm in ("attnres", "block"):
        row = state.loc[(arm, POINTS[0])]
        assert row["ratio"] == row["ratio_low"] == row["ratio_high"] == pytest.approx(STATE[arm] / STATE["control"])
        assert row["log_sd"] == 0.0 and row["verdict"] == "larger" and "deterministic" in row["flags"]
    params = table[table["metric"] == "params_total"]
    assert (params["ratio"] == 1.0).all() and (params["ratio_low"] == 1.0).all()
    assert set(params["verdict"]) == {"no difference"} and set(params["ties"]) == {5}
    assert not table[["ratio", "ratio_low", "ratio_high"]].isna().any().any()


def test_a_missing_run_leaves_its_seed_out_and_says_so():
    runs = runs_table(drop=("block", POINTS[0], 2))
    table = cost_table(runs, [COMP], ["decode_tps"]).set_index(["treatment", "grid_key"])
    row = table.loc[("block", POINTS[0])]
    assert row["n"] == 4 and row["seeds"] == "0,1,3,4"
    assert row["missing"] == "seed 2: no usable block run"
    assert row["flags"] == "incomplete: seed 2 has no usable block run with decode_tps"
    assert table.loc[("attnres", POINTS[0]), "n"] == 5 and table.loc[("attnres", POINTS[0]), "missing"] == ""


def test_one_pair_and_no_pair_have_no_interval():
    one = ratio_interval([math.log(1.2)])
    assert one["ratio"] == pytest.approx(1.2) and math.isnan(one["low"]) and math.isnan(one["sd"])
    none = ratio_interval(np.zeros((3, 0)))
    assert none["ratio"].shape == (3,) and np.isnan(none["ratio"]).all()
    runs = runs_table(seeds=1)
    row = cost_table(runs, [COMP], ["decode_tps"]).iloc[0]
    assert row["n"] == 1 and row["verdict"] == "too few pairs" and "one pair" in row["flags"]


def test_a_non_positive_cost_has_no_log_ratio_and_is_left_out_with_a_flag():
    runs = runs_table()
    runs.loc[(runs["arm"] == "attnres") & (runs["seed"] == 0), "decode_tps"] = 0.0
    row = cost_table(runs, [COMP], ["decode_tps"]).iloc[0]
    assert row["n"] == 4 and "seed(s) 0: decode_tps <= 0" in row["flags"] and np.isfinite(row["ratio"])


def test_the_interval_covers_the_true_ratio_at_its_level():
    """Lognormal per-seed costs: log cost = mu + log(true ratio) [treatment] + u_seed + e, u_seed ~ N(0, 0.5)
    shared by the pair (a large seed effect: the machine, the data order), e ~ N(0, 0.05) per run. The log
    ratio is log(true ratio) + e_t - e_c, normal, so the exponentiated t interval of its mean is exact:
    coverage 95% at every n, whatever the seed effect. 4000 studies per n (the estimate's SE is 0.34%)."""
    rng = np.random.default_rng(20260611)
    studies, true_ratio = 4000, 0.83
    for n in (2, 3, 5, 8):
        shared = rng.normal(0.0, 0.5, (studies, n))
        control = np.exp(np.log(150.0) + shared + rng.normal(0.0, 0.05, (studies, n)))
        treatment = np.exp(np.log(150.0 * true_ratio) + shared + rng.normal(0.0, 0.05, (studies, n)))
        out = ratio_interval(np.log(treatment) - np.log(control), alpha=0.05)
        covered = float(np.mean((out["low"] <= true_ratio) & (true_ratio <= out["high"])))
        assert 0.93 <= covered <= 0.97, (n, covered)
        if n >= 3:  # the shared seed effect cancels: about 0.35 wide in log at 3 pairs (3.5 if it did not)
            assert float(np.median(np.log(out["high"] / out["low"]))) < 0.5


def test_a_cost_no_finished_run_recorded_is_one_line_naming_what_was_recorded():
    runs = runs_table()
    runs["decode_tps"] = math.nan  # a store written before reslab measured serving cost
    with pytest.raises(ConfigError) as err:
        check_recorded(runs, ["decode_tps", "params_total"], "s")
    message = str(err.value)
    assert "\n" not in message and message.startswith("study s: costs: decode_tps was not recorded by any of its 30")
    assert "the runs recorded: decode_state_bytes, params_total" in message
    check_recorded(runs.drop(columns=["decode_tps"]).assign(status="RUNNING"), ["decode_tps"], "s")  # none finished
    with pytest.raises(ConfigError, match="recorded none of the cost metrics"):
        check_recorded(runs[["run_id", "arm", "grid_key", "seed", "status"]], ["flops_per_token"], "s")


def test_the_pareto_front_keeps_the_arms_nothing_beats_on_both_axes():
    # loss lower is better; decode tokens/s higher is better
    tps = np.array([100.0, 90.0, 80.0, 95.0, np.nan, 100.0])
    loss = np.array([3.00, 2.95, 2.90, 2.99, 2.0, 3.00])
    front = pareto_front(tps, loss, "maximize", "minimize")
    # each finite point trades speed for loss against the others; 0 and 5 are equal: both kept; NaN never
    assert front.tolist() == [True, True, True, True, False, True]
    dominated = pareto_front(np.array([100.0, 110.0]), np.array([3.0, 2.9]), "maximize", "minimize")
    assert dominated.tolist() == [False, True]
    # state bytes lower is better: the same points with the direction flipped keep the other end
    assert pareto_front(np.array([1.0, 2.0]), np.array([3.0, 2.9]), "minimize", "minimize").tolist() == [True, True]
    assert pareto_front(np.array([1.0, 2.0]), np.array([2.9, 3.0]), "minimize", "minimize").tolist() == [True, False]


def test_the_loss_versus_cost_plot_draws_each_arm_its_seeds_and_the_front():
    runs = runs_table()
    points = cost_points(runs, ["control", "attnres", "block"], "decode_tps", "val_loss_tail", POINTS[0])
    assert list(points["arm"].unique()) == ["control", "attnres", "block"] and len(points) == 15
    plot = cost_plot(points, "decode_tps", "val_loss_tail", cost_direction="maximize", metric_direction="minimize")
    arms = plot.data["arms"]
    control = points[points["arm"] == "control"]
    assert arms["control"]["mean_cost"] == pytest.approx(sps.gmean(control["cost"]))
    assert arms["control"]["mean_loss"] == pytest.approx(control["loss"].mean())
    assert len(arms["block"]["cost"]) == 5
    # control: fastest, worst loss; block: lower loss than control, faster than attnres; attnres: same loss as
    # block, slower: dominated
    assert plot.data["front"] == ["control", "block"]
    assert points["cost"].max() / points["cost"].min() < 3 and plot.data["log_x"] is False
    wide = points.assign(cost=np.where(points["arm"] == "block", points["cost"] * 10, points["cost"]))
    assert cost_plot(wide, "decode_tps", "val_loss_tail", cost_direction="maximize",
                     metric_direction="minimize").data["log_x"] is True
    with pytest.raises(ValueError, match="no run has both"):
        cost_plot(points.iloc[:0], "decode_tps", "val_loss_tail", cost_direction="maximize",
                  metric_direction="minimize")


def test_the_arms_are_shown_as_geometric_means_whose_quotient_is_the_ratio():
    """Issue 51, item 5: scipy's `gmean` of each arm over the pairs; their quotient is the geometric-mean ratio
    (the arithmetic means' quotient is not)."""
    runs = runs_table(seeds=6)
    row = cost_table(runs, [COMP], ["decode_tps"]).iloc[0]
    at = runs[runs["grid_key"] == row["grid_key"]].set_index(["arm", "seed"])["decode_tps"]
    c, t = at["control"].to_numpy(), at[row["treatment"]].to_numpy()
    assert (row["control_geomean"], row["treatment_geomean"]) == pytest.approx((sps.gmean(c), sps.gmean(t)), rel=1e-12)
    assert row["treatment_geomean"] / row["control_geomean"] == pytest.approx(row["ratio"], rel=1e-12)
    assert abs(row["treatment_mean"] / row["control_mean"] - row["ratio"]) > 1e-4


def test_a_pair_timed_on_different_machines_is_left_out_and_flagged():
    """Issue 51, item 5: seed 2's treatment run was timed on another GPU: its decode ratio is left out and the row
    says so; a cost no machine measures (parameters) keeps the pair; runs without the tag are not checked."""
    runs = runs_table(seeds=5)
    runs["machine"] = "NVIDIA H100 80GB HBM3"
    runs.loc[(runs["arm"] == "attnres") & (runs["seed"] == 2), "machine"] = "NVIDIA A100-SXM4-40GB"
    table = cost_table(runs, [COMP], ["decode_tps", "params_total"])
    decode = table[(table["metric"] == "decode_tps") & (table["treatment"] == "attnres")]
    for row in decode.to_dict("records"):
        assert row["n"] == 4 and row["seeds"] == "0,1,3,4" and row["machines"] == "NVIDIA H100 80GB HBM3"
        assert ("seed 2: control timed on NVIDIA H100 80GB HBM3, attnres on NVIDIA A100-SXM4-40GB: not one kind of "
                "machine, left out") in row["flags"]
        at = runs[runs["grid_key"] == row["grid_key"]].set_index(["arm", "seed"])["decode_tps"]
        keep = [0, 1, 3, 4]
        assert row["ratio"] == pytest.approx(sps.gmean(at["attnres"].loc[keep].to_numpy()
                                                       / at["control"].loc[keep].to_numpy()), rel=1e-12)
    params = table[(table["metric"] == "params_total") & (table["treatment"] == "attnres")]
    assert (params["n"] == 5).all() and not params["flags"].str.contains("machine").any()
    block = table[(table["metric"] == "decode_tps") & (table["treatment"] == "block")]
    assert (block["n"] == 5).all()
    untagged = cost_table(runs.assign(machine=None), [COMP], ["decode_tps"])
    assert (untagged["n"] == 5).all() and (untagged["machines"] == "").all()
