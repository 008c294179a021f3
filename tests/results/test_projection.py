"""results/projection.py held to independent references: the fixed-floor law against numpy's own
least-squares line (`np.polyfit`) through log(L - E); projections on synthetic ladders whose k and gap
are known by construction (L_arm(C) = L_control(k C)); the fitted-floor intervals against
`scaling.compute_multiplier` (the same bootstrap draws); the intervals' coverage, and the
throughput-adjusted multiplier's, by simulation (brute force over synthetic ladders).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from reslab.results.projection import LawForm, Throughput, backtest, project
from reslab.results.scaling import Ladder, PowerLaw, compute_multiplier

CONTROL = PowerLaw(E=1.8, A=400.0, alpha=0.15)
RUNGS = np.array([1e17, 1e18, 1e19, 1e20])
INSIDE = np.array([3e17, 10**18.5, 3e19])


def shifted(law: PowerLaw, k: float) -> PowerLaw:
    return PowerLaw(E=law.E, A=law.A * k**-law.alpha, alpha=law.alpha)


def ladders(rng: np.random.Generator, arm: PowerLaw, seeds: int = 6, shared: float = 0.01,
            own: float = 0.004, control: PowerLaw = CONTROL) -> tuple[Ladder, Ladder]:
    offset = rng.normal(0, shared, size=(seeds, 1))
    return (Ladder(RUNGS, control.loss(RUNGS)[None, :] + offset + rng.normal(0, own, size=(seeds, RUNGS.size))),
            Ladder(RUNGS, arm.loss(RUNGS)[None, :] + offset + rng.normal(0, own, size=(seeds, RUNGS.size))))


def test_the_fixed_floor_law_is_numpys_line_through_log_excess():
    control, _ = ladders(np.random.default_rng(0), CONTROL)
    law = LawForm(floor=1.8).fit(control)
    slope, intercept = np.polyfit(np.tile(np.log(RUNGS), 6), np.log(control.loss.ravel() - 1.8), 1)
    assert (law.E, law.alpha, law.A) == pytest.approx((1.8, -slope, math.exp(intercept)), rel=1e-9)


@pytest.mark.parametrize("floor", [None, 1.8])
def test_an_exact_ladder_projects_its_known_gap_and_multiplier(floor):
    arm = shifted(CONTROL, 1.25)
    exact = Ladder(RUNGS, np.tile(CONTROL.loss(RUNGS), (4, 1)))
    treated = Ladder(RUNGS, np.tile(arm.loss(RUNGS), (4, 1)))
    at = np.array([1e19, 1e21, 1e23])
    p = project(exact, treated, at, form=LawForm(floor), draws=20)
    assert p.k == pytest.approx(np.full(3, 1.25), rel=1e-4)
    assert p.gap == pytest.approx(arm.loss(at) - CONTROL.loss(at), abs=1e-6)
    assert p.losses[:, 0] == pytest.approx(np.stack([CONTROL.loss(at), arm.loss(at)]), abs=1e-6)
    assert list(p.extrapolated()) == [False, False, True]  # 1e23 is 3 decades past 1e20; the default flags past 2
    assert p.decades_past == pytest.approx([-1.0, 1.0, 3.0])
    assert list(p.extrapolated(max_decades=0.5)) == [False, True, True]


def test_the_fitted_floor_interval_is_compute_multipliers():
    # the same seed draws (one generator, seeds drawn in the same order) give the same k interval: the
    # projection adds the gap and k_wall to scaling's bootstrap, it does not change it
    control, arm = ladders(np.random.default_rng(4), shifted(CONTROL, 1.2))
    p = project(control, arm, INSIDE, draws=30, seed=5)
    m = compute_multiplier(control, arm, draws=30, seed=5, at=INSIDE)
    assert p.k == pytest.approx(m.k, rel=1e-9)
    assert p.k_low == pytest.approx(m.low, rel=1e-6) and p.k_high == pytest.approx(m.high, rel=1e-6)


def _coverage(floor: float | None, reps: int, throughput: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shares of `reps` 6-seed ladders whose 95% intervals hold the true k, gap and k_wall at `INSIDE`."""
    k, ratio = 1.25, 0.8
    arm = shifted(CONTROL, k)
    gap = arm.loss(INSIDE) - CONTROL.loss(INSIDE)
    rng = np.random.default_rng(1)
    hits = np.zeros((4, INSIDE.size))
    tokens = RUNGS / 6e8
    for rep in range(reps):
        control, treated = ladders(rng, arm)
        tps = (Throughput(1e5 * rng.lognormal(0, 0.05, (6, 4)), tokens),
               Throughput(ratio * 1e5 * rng.lognormal(0, 0.05, (6, 4)), tokens)) if throughput else None
        p = project(control, treated, INSIDE, form=LawForm(floor), draws=200, seed=rep, throughput=tps)
        hits += [(p.k_low <= k) & (k <= p.k_high), (p.gap_low <= gap) & (gap <= p.gap_high),
                 (p.k_wall_low <= k * ratio) & (k * ratio <= p.k_wall_high),
                 (p.losses[1, 1] <= arm.loss(INSIDE)) & (arm.loss(INSIDE) <= p.losses[1, 2])]
    return hits[0] / reps, hits[1] / reps, hits[2] / reps, hits[3] / reps


def test_fixed_floor_intervals_cover_at_their_level_inside_the_ladder():
    # 1000 ladders: a share of 0.95 has a Monte Carlo SE of 0.007; the t interval of a smooth function of
    # the seeds' means should land within 0.925-0.975 (3000 ladders gave 0.942-0.953)
    k, gap, wall, loss = _coverage(1.8, 1000, throughput=True)
    # an arm's own loss carries the seeds' shared offset unpaired: its interval covers at its level too
    assert np.all((loss >= 0.925) & (loss <= 0.975)), loss
    assert np.all((k >= 0.925) & (k <= 0.975)), k
    assert np.all((gap >= 0.925) & (gap <= 0.975)), gap
    assert np.all((wall >= 0.925) & (wall <= 0.975)), wall


def test_the_wall_clock_multiplier_is_k_times_the_rate_ratio():
    control, arm = ladders(np.random.default_rng(2), shifted(CONTROL, 1.25))
    tokens = RUNGS / 6e8
    tps = (Throughput(np.full((6, 4), 2e5), tokens), Throughput(np.full((6, 4), 1.5e5), tokens))
    p = project(control, arm, np.array([1e18, 1e22]), form=LawForm(1.8), draws=50, throughput=tps)
    # throughputs without noise: the ratio 0.75 scales k and its interval exactly
    assert p.k_wall == pytest.approx(0.75 * p.k, rel=1e-9)
    assert p.k_wall_low == pytest.approx(0.75 * p.k_low, rel=1e-9)
    assert p.k_wall_high == pytest.approx(0.75 * p.k_high, rel=1e-9)
    # a rate that differs by rung: the target past the ladder takes the largest rung's
    slow = np.tile([2e5, 2e5, 2e5, 1e5], (6, 1))
    p = project(control, arm, np.array([1e17, 1e22]), form=LawForm(1.8), draws=50,
                throughput=(Throughput(np.full((6, 4), 2e5), tokens), Throughput(slow, tokens)))
    assert p.k_wall / p.k == pytest.approx([1.0, 0.5], rel=1e-9)


def test_a_backtest_on_the_true_law_holds_and_on_a_bent_one_misses():
    control, arm = ladders(np.random.default_rng(3), shifted(CONTROL, 1.25), seeds=8)
    b = backtest(control, arm, form=LawForm(1.8), draws=200)
    assert b.compute == 1e20 and b.gap_covered and b.k_covered
    assert abs(b.gap_error) < 0.01 and abs(math.log(b.k_ratio)) < 0.15
    # the arm's gain vanishes at the last rung (its law bends): a projection from the first three misses it
    bent = arm.loss.copy()
    bent[:, -1] = control.loss[:, -1] + np.random.default_rng(5).normal(0, 0.004, 8)
    b = backtest(control, Ladder(RUNGS, bent), form=LawForm(1.8), draws=200)
    assert not b.gap_covered and b.gap_error < -0.005


def test_the_backtest_covers_at_its_level_on_the_true_law():
    # 600 ladders on the true law: the error's interval (both sides from the same seed draws) holds 0 at
    # about 95% (SE 0.009); the projection's own interval against the noisy observed gap would hold it less
    rng = np.random.default_rng(3)
    arm = shifted(CONTROL, 1.25)
    got = np.array([(b.gap_covered, b.k_covered) for b in
                    (backtest(*ladders(rng, arm), form=LawForm(1.8), draws=200, seed=r) for r in range(600))])
    assert np.all((got.mean(axis=0) >= 0.925) & (got.mean(axis=0) <= 0.975)), got.mean(axis=0)


def test_bad_inputs_are_named():
    control, arm = ladders(np.random.default_rng(0), CONTROL)
    with pytest.raises(ValueError, match="fixed floor 2.5 must lie below every loss"):
        project(control, arm, [1e21], form=LawForm(2.5))
    with pytest.raises(ValueError, match="needs at least 3 rungs, got 2"):
        project(Ladder(RUNGS[:2], control.loss[:, :2]), Ladder(RUNGS[:2], arm.loss[:, :2]), [1e21])
    with pytest.raises(ValueError, match="at least 3 seeds"):
        project(Ladder(RUNGS, control.loss[:2]), Ladder(RUNGS, arm.loss[:2]), [1e21], form=LawForm(1.8))
    with pytest.raises(ValueError, match="a backtest needs 3 rungs"):
        backtest(Ladder(RUNGS[:2], control.loss[:, :2]), Ladder(RUNGS[:2], arm.loss[:, :2]), form=LawForm(1.8))
    with pytest.raises(ValueError, match="positive training tokens/s"):
        project(control, arm, [1e21], form=LawForm(1.8),
                throughput=(Throughput(np.zeros((6, 4)), RUNGS), Throughput(np.ones((6, 4)), RUNGS)))


@pytest.mark.slow
def test_fitted_floor_intervals_cover_inside_the_ladder():
    # scaling's interval on a fitted floor (conservative at 6 seeds: its module doc); 60 ladders
    k, gap, _, _ = _coverage(None, 60)
    assert np.all(k >= 0.88) and np.all(gap >= 0.88), (k, gap)
