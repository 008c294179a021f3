"""results/gates.py: the plan's error split written out by hand, decisions on ladders whose k is known by
construction, the compute a run of gates spends counted by brute force over its runs, and the error rates
by simulation through the same code (wrong promotions and wrong drops within the plan's alpha)."""

from __future__ import annotations

import numpy as np
import pytest

from reslab.common.errors import ConfigError
from reslab.results.gates import (
    GATE_COLUMNS,
    Gate,
    GatePlan,
    Scenario,
    decide_look,
    fixed_plan,
    gate_rows,
    run_gates,
    simulate,
)
from reslab.results.projection import LawForm
from reslab.results.scaling import Ladder, PowerLaw

FLOOR = 1.6
ALPHA = 0.0943  # Marin's baseline through 2.534 at 1e21 and 2.205 at 1e23 over a floor of 1.6
CONTROL = PowerLaw(FLOOR, 0.934 * 1e21**ALPHA, ALPHA)
RUNGS = np.array([3.82e17, 2.81e18, 1.16e19, 3.46e19])  # Marin's gates' computes
PLAN = GatePlan((Gate((0, 1)), Gate((0, 1, 2, 3), target=1e21)), looks=(4, 6, 8), form=LawForm(FLOOR), draws=200)


def shifted(k: float) -> PowerLaw:
    return PowerLaw(FLOOR, CONTROL.A * k**-ALPHA, ALPHA)


def test_the_error_is_split_over_gates_treatments_looks_and_points():
    plan = GatePlan(PLAN.gates, looks=(4, 6, 8), alpha=0.05, treatments=2, form=LawForm(FLOOR))
    assert plan.gate_alpha() == pytest.approx(0.05 / 4)
    # each kind of error: lower bounds one-sided at alpha_g / looks, upper at alpha_g / (looks x points)
    assert plan.levels(0) == pytest.approx((1 - 2 * 0.05 / (2 * 2 * 3), 1 - 2 * 0.05 / (2 * 2 * 3 * 2)))
    assert plan.levels(1) == pytest.approx((1 - 2 * 0.05 / (2 * 2 * 3),) * 2)  # gate 2 reads one target
    joint = GatePlan(PLAN.gates, looks=(4, 6, 8), alpha=0.05, treatments=2, form=LawForm(FLOOR), errors="joint")
    assert joint.levels(0) == pytest.approx((1 - 0.05 / (2 * 2 * 3 * 2),) * 2)
    assert joint.levels(1) == pytest.approx((1 - 0.05 / (2 * 2 * 3),) * 2)


def test_a_look_promotes_drops_or_asks_for_seeds():
    rng = np.random.default_rng(0)
    scenario = Scenario("k", CONTROL, shifted(2.0), RUNGS)
    control, arm = scenario.draw(rng, 8)
    look = decide_look(PLAN, 0, control, arm)
    assert look.decision == "promote" and np.all(look.low > 1.0) and look.points.tolist() == RUNGS[:2].tolist()
    control, arm = Scenario("k", CONTROL, shifted(0.5), RUNGS).draw(rng, 8)
    assert decide_look(PLAN, 1, control, arm).decision == "drop"
    control, arm = Scenario("k", CONTROL, shifted(1.0), RUNGS).draw(rng, 8)
    first = decide_look(PLAN, 0, Ladder(RUNGS, control.loss[:4]), Ladder(RUNGS, arm.loss[:4]))
    last = decide_look(PLAN, 0, control, arm)
    assert (first.decision, last.decision) == ("continue", "undecided")
    with pytest.raises(ValueError, match="seed counts"):
        decide_look(PLAN, 0, Ladder(RUNGS, control.loss[:5]), Ladder(RUNGS, arm.loss[:5]))


def test_only_promoted_treatments_go_on_and_their_runs_are_counted_once():
    rng = np.random.default_rng(1)
    control, good = Scenario("k", CONTROL, shifted(2.0), RUNGS).draw(rng, 8)
    bad = Ladder(RUNGS, CONTROL.loss(RUNGS)[None, :] + 0.2 + rng.normal(0, 0.004, (8, 4)))
    outcomes, control_flops = run_gates(PLAN, control, {"good": good, "bad": bad})
    assert [(o.gate, o.treatment, o.decision) for o in outcomes] == [
        (0, "good", "promote"), (0, "bad", "drop"), (1, "good", "promote")]
    # brute force: each (arm, rung) trained to the most seeds any look read there
    runs = {arm: np.zeros(4) for arm in ("good", "bad", "control")}
    for o in outcomes:
        for look in o.looks:
            for r in PLAN.gates[o.gate].rungs:
                runs[o.treatment][r] = max(runs[o.treatment][r], look.n)
                runs["control"][r] = max(runs["control"][r], look.n)
    assert outcomes[-1].compute == pytest.approx(sum(runs["good"] * RUNGS))
    assert outcomes[1].compute == pytest.approx(sum(runs["bad"] * RUNGS))
    assert control_flops == pytest.approx(sum(runs["control"] * RUNGS))
    rows = gate_rows(PLAN, outcomes)
    # gate 1 reads k at its two rungs, gate 2 at its target: 2 + 2 + 1 rows
    assert [(r["gate"], r["treatment"], r["point"]) for r in rows] == [
        (0, "good", RUNGS[0]), (0, "good", RUNGS[1]), (0, "bad", RUNGS[0]), (0, "bad", RUNGS[1]), (1, "good", 1e21)]
    assert all(set(r) == set(GATE_COLUMNS) for r in rows)
    assert rows[-1]["name"] == "gate 2" and rows[-1]["k_low"] > 1.0 and rows[2]["decision"] == "drop"


def test_the_full_ladder_is_one_gate_read_once():
    full = fixed_plan(PLAN, 8)
    assert full.looks == (8,) and full.gates == (Gate((0, 1, 2, 3), 1.0, 1e21, "full ladder"),)
    assert full.levels(0) == pytest.approx((1 - 2 * 0.05,) * 2)


@pytest.mark.parametrize(("alpha", "errors"), [(0.05, "each"), (0.3, "each"), (0.3, "joint")])
def test_no_effect_is_promoted_or_dropped_within_alpha(alpha, errors):
    # k = 1 against a threshold of 1: promoting and dropping are both wrong; 300 ladders (at alpha 0.3 the
    # bound is loose enough for a broken split to show: 3 Monte Carlo SEs above it fails; a plan that read
    # every look at 1 - alpha gave 0.05 wrong promotions and 0.48 wrong drops)
    plan = GatePlan(PLAN.gates, PLAN.looks, alpha=alpha, form=LawForm(FLOOR), draws=200, errors=errors)
    s = simulate(plan, Scenario("k=1", CONTROL, shifted(1.0), RUNGS), reps=300)
    slack = 3 * np.sqrt(alpha * (1 - alpha) / 300)
    if errors == "each":
        assert s.wrong_promotion <= alpha + slack and s.wrong_drop <= alpha + slack, s
    else:
        assert s.wrong_promotion + s.wrong_drop <= alpha + slack, s
    assert s.promoted + s.dropped + s.undecided == pytest.approx(1.0)


def test_a_real_gain_is_promoted_and_not_dropped():
    s = simulate(PLAN, Scenario("k=1.25", CONTROL, shifted(1.25), RUNGS), reps=100)
    assert s.promoted >= 0.9 and s.wrong_drop == 0.0 and s.wrong_promotion == 0.0, s


def test_bad_plans_are_named():
    with pytest.raises(ConfigError, match=r"gates\[0\].rungs: the law needs 3 distinct rungs"):
        GatePlan((Gate((0, 1)),))
    with pytest.raises(ConfigError, match="gates.looks: expected increasing seed counts"):
        GatePlan((Gate((0, 1)),), looks=(6, 4), form=LawForm(FLOOR))
    with pytest.raises(ConfigError, match=r"gates\[0\].threshold"):
        GatePlan((Gate((0, 1), threshold=0.0),), form=LawForm(FLOOR))
    with pytest.raises(ConfigError, match="gates.errors: 'both' is not a budget"):
        GatePlan((Gate((0, 1)),), form=LawForm(FLOOR), errors="both")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="gates: expected at least one gate"):
        GatePlan(())
