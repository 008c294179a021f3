"""results/gate_results.py (a gates study read out) and results/power.py's gates simulation: the replay against
`results.gates.run_gates` (the simulation's own loop) on complete ladders, the states of a study under way, the
throughput-adjusted interval against a brute-force bootstrap written out here (the same seed draws, each fixed-floor
law refitted by `np.polyfit`, k inverted by hand, the rate ratio of the resampled seeds' mean FLOP rates, the
bootstrap-SE t interval with scipy's t quantile), the saving counted by hand over the runs, the plot's decisions,
and the power table against `results.gates.simulate` called directly."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from reslab.results.gate_results import GatesDesign, gates_readout
from reslab.results.gates import Gate, GatePlan, Scenario, fixed_plan, run_gates, simulate
from reslab.results.gates_power import GATES_KS, gates_power, gates_scenarios
from reslab.results.plots import gates_plot
from reslab.results.projection import LawForm, backtest
from reslab.results.scaling import Ladder, PowerLaw

FLOOR = 1.6
ALPHA = 0.0943  # Marin's baseline through 2.534 at 1e21 and 2.205 at 1e23 over a floor of 1.6
CONTROL = PowerLaw(FLOOR, 0.934 * 1e21**ALPHA, ALPHA)
RUNGS = np.array([3.82e17, 2.81e18, 1.16e19, 3.46e19])
KEYS = ("r0", "r1", "r2", "r3")
PLAN = GatePlan((Gate((0, 1), name="gate 1"), Gate((0, 1, 2, 3), target=1e21, name="gate 2")), looks=(4, 6, 8),
                treatments=2, form=LawForm(FLOOR), draws=200)
TOKENS = RUNGS / 6e8
SPEED = {"control": 1e5, "good": 8e4, "null": 1e5}  # training tokens/s


def shifted(k: float) -> PowerLaw:
    return PowerLaw(FLOOR, CONTROL.A * k**-ALPHA, ALPHA)


def _ladders(seed: int = 0) -> dict[str, Ladder]:
    rng = np.random.default_rng(seed)
    control, good = Scenario("", CONTROL, shifted(1.3), RUNGS).draw(rng, 8)
    _, null = Scenario("", CONTROL, CONTROL, RUNGS).draw(rng, 8)
    return {"control": control, "good": good, "null": null}


def _runs(ladders: dict[str, Ladder], tps: dict[str, np.ndarray], keep=lambda arm, seed, rung: True) -> pd.DataFrame:
    rows = []
    for arm, ladder in ladders.items():
        for s in range(ladder.loss.shape[0]):
            for j, key in enumerate(KEYS):
                if keep(arm, s, j):
                    rows.append({"run_id": f"{arm}-{s}-{key}", "arm": arm, "grid_key": key, "seed": s,
                                 "status": "FINISHED", "val_loss": ladder.loss[s, j], "tokens_per_s": tps[arm][s, j],
                                 "tokens": TOKENS[j]})
    return pd.DataFrame(rows)


def _speeds(seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {arm: v * rng.lognormal(0, 0.05, (8, 4)) for arm, v in SPEED.items()}


FLOPS = {(arm, key): float(RUNGS[j]) for arm in SPEED for j, key in enumerate(KEYS)}
DESIGN = GatesDesign(PLAN, "control", ("good", "null"), KEYS, targets=(1e21, 1e23), seed=3)


@pytest.fixture(scope="module")
def complete():
    ladders, tps = _ladders(), _speeds()
    return ladders, tps, gates_readout(_runs(ladders, tps), DESIGN, FLOPS)


def test_the_replay_is_the_simulations_loop_on_a_complete_ladder(complete):
    ladders, _, result = complete
    outcomes, _ = run_gates(PLAN, ladders["control"], {"good": ladders["good"], "null": ladders["null"]},
                            seed=DESIGN.seed)
    want = {(o.gate, o.treatment): (o.decision, o.seeds, [look.n for look in o.looks]) for o in outcomes}
    got = result.decisions.drop_duplicates(["gate", "treatment"])
    reached = got[got["decision"] != "not reached"]
    assert {(r["gate"], r["treatment"]): (r["decision"], r["seeds"], [int(n) for n in r["looks"].split(",")])
            for r in reached.to_dict("records")} == want
    # a treatment not promoted at gate 1 is not read at gate 2
    assert want[0, "good"][0] == "promote" and want[0, "null"][0] != "promote"
    assert got.set_index(["gate", "treatment"]).loc[(1, "null"), "decision"] == "not reached"
    for o in outcomes:  # k and its bounds at the last look, at each of the gate's points
        rows = result.decisions[(result.decisions["gate"] == o.gate) & (result.decisions["treatment"] == o.treatment)]
        np.testing.assert_allclose(rows[["k", "k_low", "k_high"]].to_numpy().T, [o.last.k, o.last.low, o.last.high])
    looks = result.looks[(result.looks["gate"] == 0) & (result.looks["treatment"] == "null")]
    assert list(looks["seeds"]) == want[0, "null"][2]


def test_a_study_under_way_waits_and_a_dropped_arm_trains_nothing_more():
    ladders, tps = _ladders(), _speeds()
    # good: 3 seeds finished at gate 1 (the first look reads 4); null: its gate 2 runs never ran
    runs = _runs(ladders, tps, keep=lambda arm, s, j: not (arm == "good" and s >= 3) and not (arm == "null" and j > 1))
    result = gates_readout(runs, DESIGN, FLOPS)
    states = result.decisions.drop_duplicates(["gate", "treatment"]).set_index(["gate", "treatment"])["decision"]
    assert states[0, "good"] == "waiting" and states[1, "good"] == "not reached"
    # the saving, counted by hand: each recorded run's FLOPs against 3 arms x 4 rungs x 8 seeds
    used = 8 * RUNGS.sum() + 3 * RUNGS.sum() + 8 * RUNGS[:2].sum()
    full = 3 * 8 * RUNGS.sum()
    total = result.saving.set_index("arm").loc["all"]
    assert total["flops_used"] == pytest.approx(used) and total["flops_full"] == pytest.approx(full)
    assert total["saved"] == pytest.approx(1 - used / full) and total["runs"] == 32 + 12 + 16


def _brute_wall(ladders: dict[str, Ladder], tps: dict[str, np.ndarray], arm: str, target: float, level: float,
                draws: int, seed: int) -> tuple[float, float, float]:
    """k_wall and its interval by brute force (the module doc): every draw's laws refitted by np.polyfit."""
    n = ladders["control"].loss.shape[0]
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    log_c = np.log(RUNGS)
    rate = {a: RUNGS[None, :] * tps[a] / TOKENS[None, :] for a in ("control", arm)}
    rung = int(np.argmax(RUNGS))  # a target past the ladder reads the largest rung's rates

    def log_k_wall(rows: np.ndarray) -> float:
        laws = {}
        for a in ("control", arm):
            slope, intercept = np.polyfit(log_c, np.log(ladders[a].loss[rows] - FLOOR).mean(axis=0), 1)
            laws[a] = (math.exp(intercept), -slope)
        arm_loss = FLOOR + laws[arm][0] * target ** -laws[arm][1]
        need = (laws["control"][0] / (arm_loss - FLOOR)) ** (1 / laws["control"][1])
        ratio = rate[arm][rows, rung].mean() / rate["control"][rows, rung].mean()
        return math.log(need / target) + math.log(ratio)

    estimate = log_k_wall(np.arange(n))
    sd = np.std([log_k_wall(p) for p in picks], ddof=1)
    half = sps.t.ppf(0.5 + level / 2, n - 1) * math.sqrt(n / (n - 1)) * sd
    return math.exp(estimate), math.exp(estimate - half), math.exp(estimate + half)


def test_the_wall_clock_interval_is_a_brute_force_bootstrap_of_k_times_the_rate_ratio(complete):
    ladders, tps, result = complete
    row = result.projection[(result.projection["treatment"] == "good")].set_index("target").loc[1e23]
    want = _brute_wall(ladders, tps, "good", 1e23, 0.95, PLAN.draws, DESIGN.seed)
    np.testing.assert_allclose([row["k_wall"], row["k_wall_low"], row["k_wall_high"]], want, rtol=1e-9)
    # the arm trains at 0.8x the control's tokens/s: wall-clock k about 0.8 k; its interval is not k's scaled
    # (the ratio is resampled with the seeds)
    assert row["k_wall"] == pytest.approx(0.8 * row["k"], rel=0.05)
    scaled = row["k_wall"] / row["k"]
    assert abs(row["k_wall_low"] - scaled * row["k_low"]) > 1e-3


def test_the_projection_flags_targets_past_max_decades_and_backtests(complete):
    ladders, _, result = complete
    good = result.projection[result.projection["treatment"] == "good"].set_index("target")
    assert good["decades_past"].to_numpy() == pytest.approx(np.log10([1e21, 1e23]) - math.log10(RUNGS[-1]))
    assert list(good["extrapolated"]) == [False, True] and "decades past" in good.loc[1e23, "note"]
    null = result.projection[result.projection["treatment"] == "null"]
    assert set(null["rungs"]) == {2}  # projected from the rungs gate 1 read, the only ones it trained
    want = backtest(ladders["control"], ladders["good"], form=PLAN.form, level=0.95, draws=PLAN.draws,
                    seed=DESIGN.seed)
    row = result.backtest.set_index("treatment").loc["good"]
    assert row["gap_error"] == pytest.approx(want.gap_error) and row["k_ratio"] == pytest.approx(want.k_ratio)
    assert list(result.backtest["treatment"]) == ["good"]  # two rungs leave the fixed-floor law none to predict


def test_the_plot_marks_each_gates_decision(complete):
    _, _, result = complete
    plot = gates_plot(result, "val_loss")
    states = result.decisions.drop_duplicates(["gate", "treatment"])
    assert plot.data["decisions"] == {(r["name"], r["treatment"]): r["decision"] for r in states.to_dict("records")}
    assert plot.data["gates"] == {"gate 1": (RUNGS[0], RUNGS[1]), "gate 2": (RUNGS[2], RUNGS[3])}
    labels = plot.figure.axes[0].get_legend_handles_labels()[1]
    assert "good: gate 1 promoted" in labels
    np.testing.assert_allclose(plot.data["k good"]["k_wall"], result.projections["good"].k_wall)


def test_the_power_table_is_simulate_through_the_same_code():
    plan = GatePlan((Gate((0, 1), name="gate 1"), Gate((0, 1, 2, 3), target=1e21, name="gate 2")), looks=(3, 4),
                    form=PLAN.form, draws=100)
    scenarios = gates_scenarios(plan, RUNGS, CONTROL.loss(RUNGS), own=0.004)
    assert [s.name for s in scenarios] == [f"k={k:g}" for k in GATES_KS] + ["k 1.3 -> 0.95 (exponents differ)"]
    # the control's law through the losses given: Marin's baseline back; the treatments worth k by construction
    assert (scenarios[0].control.A, scenarios[0].control.alpha) == pytest.approx((CONTROL.A, CONTROL.alpha))
    assert scenarios[2].true_k(RUNGS) == pytest.approx(np.full(4, 1.25))
    assert scenarios[3].true_k(np.array([RUNGS[0], 1e21])) == pytest.approx([1.3, 0.95])
    rows = gates_power(plan, scenarios[1:3], reps=6, seed=5)
    for row, s in zip(rows, scenarios[1:3], strict=True):
        assert row.gates == simulate(plan, s, 6, 5)
        assert row.fixed == simulate(fixed_plan(plan, 4), s, 6, 5)
        assert row.saved == pytest.approx(1 - row.gates.mean_compute / row.fixed.mean_compute)
