"""results/scaling.py held to independent references: the law's fit against scipy's own
least-squares fitter (`scipy.optimize.curve_fit`, a different objective and optimizer) on the
same points; the compute multiplier on synthetic ladders whose k is known by construction
(L_arm(C) = L_control(k C)), its interval's coverage by simulation; the trend test's p against
brute-force enumeration of the 2^n sign patterns, and its rejection rates with and without a slope.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy.optimize import curve_fit

from reslab.results.scaling import Ladder, PowerLaw, compute_multiplier, fit_power_law, multiplier, trend_test

CONTROL = PowerLaw(E=1.8, A=400.0, alpha=0.15)
RUNGS = np.array([1e17, 1e18, 1e19, 1e20])  # FLOPs


def shifted(law: PowerLaw, k: float) -> PowerLaw:
    """The law of an arm worth k x compute: L(C) = law(k C)."""
    return PowerLaw(E=law.E, A=law.A * k**-law.alpha, alpha=law.alpha)


def ladders(rng: np.random.Generator, arm: PowerLaw, seeds: int = 6, shared: float = 0.01,
            own: float = 0.004) -> tuple[Ladder, Ladder]:
    """Seed-paired ladders: a seed's shared offset in both arms at every rung, plus own noise."""
    offset = rng.normal(0, shared, size=(seeds, 1))
    control = CONTROL.loss(RUNGS)[None, :] + offset + rng.normal(0, own, size=(seeds, RUNGS.size))
    treated = arm.loss(RUNGS)[None, :] + offset + rng.normal(0, own, size=(seeds, RUNGS.size))
    return Ladder(RUNGS, control), Ladder(RUNGS, treated)


def test_the_fit_agrees_with_scipys_least_squares():
    compute = np.array([1e17, 3e17, 1e18, 3e18, 1e19, 3e19])
    exact = fit_power_law(compute, CONTROL.loss(compute))
    reference, _ = curve_fit(lambda c, e, a, alpha: e + a * c**-alpha, compute, CONTROL.loss(compute),
                             p0=[1.5, 100.0, 0.2], maxfev=20000)
    assert (exact.E, exact.A, exact.alpha) == pytest.approx((1.8, 400.0, 0.15), rel=1e-6)
    assert tuple(reference) == pytest.approx((exact.E, exact.A, exact.alpha), rel=1e-5)
    # noisy points: a Huber fit of log residuals and a least-squares fit of the losses differ in
    # objective, not in the curve they find, to within the noise
    noisy = CONTROL.loss(compute) * np.exp(np.random.default_rng(3).normal(0, 0.002, compute.size))
    huber = fit_power_law(compute, noisy)
    reference, _ = curve_fit(lambda c, e, a, alpha: e + a * c**-alpha, compute, noisy, p0=[1.5, 100.0, 0.2],
                             maxfev=20000)
    least_squares = PowerLaw(*reference)
    assert np.max(np.abs(huber.loss(compute) / least_squares.loss(compute) - 1)) < 2e-3


def test_a_known_multiplier_is_recovered_inside_its_interval():
    # seed 12: a ladder whose intervals hold 1.25 at every rung (the coverage over many is the slow test's; with
    # the noise-scaled fit of issue 35 the intervals are narrower, and seed 11's last rung misses it)
    control, arm = ladders(np.random.default_rng(12), shifted(CONTROL, 1.25))
    m = compute_multiplier(control, arm, draws=200)
    assert np.all((m.low <= 1.25) & (m.high >= 1.25)), (m.low, m.high)
    assert m.k == pytest.approx(np.full(RUNGS.size, 1.25), rel=0.1) and m.constant and m.n_seeds == 6
    # no gain: k = 1
    control, arm = ladders(np.random.default_rng(13), CONTROL)
    m = compute_multiplier(control, arm, draws=200)
    assert np.all((m.low <= 1.0) & (m.high >= 1.0))


def test_exponents_that_differ_are_not_one_multiplier():
    steeper = PowerLaw(E=CONTROL.E, A=CONTROL.A * 8.0, alpha=0.2)  # below the control at large C only
    control, arm = ladders(np.random.default_rng(5), steeper, own=0.001)
    m = compute_multiplier(control, arm, draws=200)
    assert not m.constant and m.alpha_gap_low > 0
    assert np.all(np.diff(m.k) > 0)  # k grows with compute
    assert multiplier(CONTROL, steeper, RUNGS) == pytest.approx(m.k, rel=0.1)


def test_an_arm_below_the_controls_floor_is_worth_infinite_compute():
    lower_floor = PowerLaw(E=1.7, A=CONTROL.A, alpha=CONTROL.alpha)
    k = multiplier(CONTROL, lower_floor, np.array([1e15, 1e30]))
    assert np.isfinite(k[0]) and k[0] > 1 and k[1] == np.inf


def _brute_force_p(values: np.ndarray) -> float:
    observed = abs(values.sum())
    sums = [abs(np.dot(signs, values)) for signs in itertools.product((-1.0, 1.0), repeat=values.size)]
    return float(np.mean([s >= observed - 1e-12 for s in sums]))


def test_the_trend_test_is_the_sign_flip_of_per_seed_slopes():
    rng = np.random.default_rng(2)
    sizes = np.array([20e6, 60e6, 180e6])
    control = 3.0 - 0.1 * np.log(sizes)[None, :] + rng.normal(0, 0.01, size=(6, 3))
    arm = control - 0.01 * np.log(sizes / sizes[0])[None, :] + rng.normal(0, 0.01, size=(6, 3))
    trend = trend_test(control, arm, sizes)
    x = np.log(sizes) - np.log(sizes).mean()
    slopes = np.array([np.polyfit(np.log(sizes), arm[s] - control[s], 1)[0] for s in range(6)])
    assert trend.slopes == pytest.approx(slopes, rel=1e-9) and trend.slope == pytest.approx(slopes.mean())
    assert trend.p == pytest.approx(_brute_force_p(slopes))
    assert x.sum() == pytest.approx(0.0, abs=1e-12)


def test_the_trend_test_rejects_at_its_level_without_a_slope_and_often_with_one():
    rng, sizes, level, datasets = np.random.default_rng(9), np.array([20e6, 60e6, 180e6, 540e6]), 0.05, 400
    base = 3.0 - 0.1 * np.log(sizes)[None, :]

    def rejections(slope: float) -> float:
        hits = 0
        for _ in range(datasets):
            control = base + rng.normal(0, 0.01, size=(8, 4))
            arm = control + slope * np.log(sizes / sizes[0])[None, :] + rng.normal(0, 0.004, size=(8, 4))
            hits += trend_test(control, arm, sizes).p <= level
        return hits / datasets

    null = rejections(0.0)
    assert null <= level + 3 * np.sqrt(level * (1 - level) / datasets)  # exact test: at most its level
    assert rejections(-0.004) >= 0.8  # the gain grows by 0.004 nats per e-fold of size


def test_bad_ladders_are_named():
    with pytest.raises(ValueError, match="at least 3 distinct compute"):
        fit_power_law(np.array([1e17, 1e17, 1e18]), np.array([3.0, 3.0, 2.9]))
    with pytest.raises(ValueError, match="finite and positive"):
        fit_power_law(np.array([1e17, -1.0, 1e18]), np.array([3.0, 3.0, 2.9]))
    with pytest.raises(ValueError, match="same seeds"):
        compute_multiplier(Ladder(RUNGS, np.ones((4, 4)) * 3), Ladder(RUNGS, np.ones((5, 4)) * 3))
    with pytest.raises(ValueError, match="loss\\[seeds, rungs\\]"):
        Ladder(RUNGS, np.ones(4))
    with pytest.raises(ValueError, match="2 distinct sizes"):
        trend_test(np.ones((3, 2)), np.ones((3, 2)), np.array([1e6, 1e6]))


def _fits_from_the_truth(control: Ladder, arm: Ladder, laws: tuple[PowerLaw, PowerLaw],
                         check: bool) -> tuple[PowerLaw, PowerLaw]:
    """Both arms' full-data fits (the noise-scaled default), warm-started at their true laws instead of from the
    36-start grid, for the coverage simulations below: the grid's scouting is 2/3 of a ladder's time, and its job
    (finding the optimum from nowhere) is held by the tests above. The optimum is the same: on the 100 + 40
    ladders of the two simulations the laws agreed with the grid's to 2e-7 (E, A, alpha), the intervals to 1e-6
    in log k on 97 of 100 ladders and to 0.5% on the other 3 (the bootstrap keeps the fit's Huber delta, which the
    pilot pass sets slightly differently), and no ladder's coverage or drift flag changed. `check`: compare with
    the grid's fit (`Ladder.fit`, what `compute_multiplier` does without `fits`) and fail where they differ."""
    fits = (fit_power_law(np.tile(control.compute, control.loss.shape[0]), control.loss.ravel(), start=laws[0]),
            fit_power_law(np.tile(arm.compute, arm.loss.shape[0]), arm.loss.ravel(), start=laws[1]))
    if check:
        for ladder, fit in zip((control, arm), fits, strict=True):
            grid = ladder.fit()
            assert (fit.E, fit.A, fit.alpha) == pytest.approx((grid.E, grid.A, grid.alpha), rel=1e-6), (fit, grid)
    return fits


@pytest.mark.slow  # ~15 s: 100 ladders x (2 warm fits + 50 bootstrap draws x 2 arms)
def test_the_multiplier_interval_covers_at_its_nominal_level():
    """100 synthetic 6-seed ladders with k = 1.25: the 95% interval holds k at every rung in at
    least 90% of them (an 85% interval would pass with probability ~8%), and is not bought with
    absurd width: the median high/low is under 1.5 at every rung. Measured with the noise-scaled fit
    (issue 35, item 17): coverage 0.94, 0.95, 0.95, 0.96; median high/low 1.07, 1.08, 1.09, 1.21 (the
    last rung is 10x past the middle of the ladder; Huber at delta 1e-3 gave 0.98-1.00 and 1.12-1.39).

    The same ladders hold issue 35's item 16 for a constant k: flagged as drifting in at most 5% of them,
    8 of 100 allowed (a true 5% exceeds 8 with probability ~6%); measured 6 of 100."""
    rng, covered, widths, flagged, ladders_run = np.random.default_rng(2026), np.zeros(RUNGS.size), [], 0, 100
    for i in range(ladders_run):  # the full-data fits warm (`_fits_from_the_truth`), the first 3 checked
        control, arm = ladders(rng, shifted(CONTROL, 1.25))
        fits = _fits_from_the_truth(control, arm, (CONTROL, shifted(CONTROL, 1.25)), check=i < 3)
        m = compute_multiplier(control, arm, draws=50, seed=i, fits=fits)
        covered += (m.low <= 1.25) & (m.high >= 1.25)
        widths.append(m.high / m.low)
        flagged += not m.constant
    coverage = covered / ladders_run
    assert np.all(coverage >= 0.90), coverage
    assert np.all(np.median(widths, axis=0) < 1.5), np.median(widths, axis=0)
    assert flagged <= 8, flagged


# issue 35, item 16: the setting of the issue: exponents 0.12 (control) and 0.14 (arm), k from 0.79 at
# the first rung to 1.98 at the last; and a constant k = 1.25 at equal exponents
DRIFT_RUNGS = np.geomspace(1e17, 2.5e19, 4)
DRIFT_CONTROL = PowerLaw(E=1.8, A=100.0, alpha=0.12)
DRIFT_ARM = PowerLaw(E=1.8, A=100.0 * 0.79**-0.12 * 1e17**0.02, alpha=0.14)


def drift_ladders(rng: np.random.Generator, arm: PowerLaw, seeds: int = 6) -> tuple[Ladder, Ladder]:
    offset = rng.normal(0, 0.01, size=(seeds, 1))
    control = DRIFT_CONTROL.loss(DRIFT_RUNGS)[None, :] + offset + rng.normal(0, 0.004, (seeds, 4))
    treated = arm.loss(DRIFT_RUNGS)[None, :] + offset + rng.normal(0, 0.004, (seeds, 4))
    return Ladder(DRIFT_RUNGS, control), Ladder(DRIFT_RUNGS, treated)


def test_the_drift_setting_is_the_issues():
    assert multiplier(DRIFT_CONTROL, DRIFT_ARM, DRIFT_RUNGS)[[0, -1]] == pytest.approx([0.79, 1.98], abs=0.01)


def test_one_drifting_ladder_is_not_one_k_and_shows_its_end_rungs():
    from reslab.results.ladder import statement

    m = compute_multiplier(*drift_ladders(np.random.default_rng(7), DRIFT_ARM), draws=100,
                           at=np.append(DRIFT_RUNGS, 1e18))
    assert not m.constant and m.drift_low > 0  # log k grows from the first rung to the last
    text = statement("attnres", "prenorm", m, None)
    assert "drifts" in text and "matches" not in text
    assert f"{m.k[0]:.2f}x" in text and f"{m.k[-2]:.2f}x" in text  # both end rungs' k


@pytest.mark.slow  # ~10 s: 40 ladders x (2 warm fits + 100 bootstrap draws x 2 arms)
def test_drift_is_flagged_in_at_least_80_percent_of_the_issues_ladders():
    """Passes; a run of the first 20 of these ladders (100 draws) flagged 20/20, the exponents' gap alone (the
    old rule) 8/20. The full-data fits warm-started at the true laws (`_fits_from_the_truth`, the first 2
    checked against the grid's)."""
    flagged = 0
    for i in range(40):
        control, arm = drift_ladders(np.random.default_rng(100 + i), DRIFT_ARM)
        fits = _fits_from_the_truth(control, arm, (DRIFT_CONTROL, DRIFT_ARM), check=i < 2)
        flagged += not compute_multiplier(control, arm, draws=100, seed=i, fits=fits).constant
    assert flagged >= 0.8 * 40, flagged


def _log_k_middle(control: np.ndarray, arm: np.ndarray, delta: float | None) -> float:
    """log k at the ladder's middle, both laws fitted at `delta` (None: the default), warm-started at the
    true laws (the optimum is the same; the 36-start grid would make the simulation minutes long)."""
    compute = np.tile(RUNGS, control.shape[0])
    fit_c = fit_power_law(compute, control.ravel(), start=CONTROL, delta=delta)
    fit_a = fit_power_law(compute, arm.ravel(), start=shifted(CONTROL, 1.25), delta=delta)
    return float(np.log(multiplier(fit_c, fit_a, np.array([10**18.5])))[0])


@pytest.mark.slow  # ~20 s
def test_the_default_fit_is_as_efficient_as_least_squares():
    """Issue 35, item 17: over 80 simulated 6-seed ladders (normal noise), the SD of log k of the default fit
    is within 10% of least squares'. The first 60 of these ladders: 1.04x (Hoffmann et al.'s delta 1e-3, the
    old default: 1.64x on 60 other ladders)."""
    rng = np.random.default_rng(17)
    default, least = [], []
    for _ in range(80):
        control, arm = ladders(rng, shifted(CONTROL, 1.25))
        default.append(_log_k_middle(control.loss, arm.loss, None))
        least.append(_log_k_middle(control.loss, arm.loss, np.inf))
    ratio = np.std(default, ddof=1) / np.std(least, ddof=1)
    assert ratio <= 1.10, ratio


def test_one_bad_run_moves_the_default_fit_little_and_least_squares_much():
    """Item 17's other half: one run of the arm 0.3 nats off its curve (a diverged run) moves log k at the
    middle by under 0.05 in the default fit; the same run moves a least-squares fit by over 0.1."""
    control, arm = ladders(np.random.default_rng(4), shifted(CONTROL, 1.25))
    bad = arm.loss.copy()
    bad[0, 1] += 0.3
    robust = abs(_log_k_middle(control.loss, bad, None) - _log_k_middle(control.loss, arm.loss, None))
    least = abs(_log_k_middle(control.loss, bad, np.inf) - _log_k_middle(control.loss, arm.loss, np.inf))
    assert robust < 0.05 < 0.1 < least, (robust, least)


def test_kimis_multiplier_is_block_attnres():
    """Issue 35, item 22: the paper's 1.25x is Block AttnRes's (reference/variants.md, section 1.5)."""
    import reslab.results.scaling as scaling

    assert "Block AttnRes matches the baseline at 1.25x" in (scaling.__doc__ or "")
    assert "Full AttnRes matches" not in (scaling.__doc__ or "")


# issue 51, item 1: tests/results/test_ladder.py's law, 8 seeds over 5 rungs (bench/sim_ladder.py's setting)
PIVOT_LAW = PowerLaw(E=1.8, A=1.0e4, alpha=0.3)
PIVOT_RUNGS = np.geomspace(1e14, 1e17, 5)


def pivot_ladder(i: int) -> tuple[Ladder, Ladder, tuple[PowerLaw, PowerLaw]]:
    """Ladder i of bench/sim_ladder.py (k = 1.25), with its full-data fits warm-started at the true laws."""
    rng, arm_law = np.random.default_rng(1000 + i), shifted(PIVOT_LAW, 1.25)
    shared = rng.normal(0, 0.01, size=(8, 1))
    control = PIVOT_LAW.loss(PIVOT_RUNGS)[None, :] + shared + rng.normal(0, 0.003, (8, 5))
    arm = arm_law.loss(PIVOT_RUNGS)[None, :] + shared + rng.normal(0, 0.003, (8, 5))
    fits = (fit_power_law(np.tile(PIVOT_RUNGS, 8), control.ravel(), start=PIVOT_LAW),
            fit_power_law(np.tile(PIVOT_RUNGS, 8), arm.ravel(), start=arm_law))
    return Ladder(PIVOT_RUNGS, control), Ladder(PIVOT_RUNGS, arm), fits


def test_a_rung_where_the_resampled_curves_pivot_is_not_narrower_than_its_sampling_variability():
    # ladder 297 of bench/sim_ladder.py: the bootstrap SD of log k at rung 3 is 0.0097, beside 0.0096 and 0.030
    # at rungs 2 and 4 (a pivot); the bootstrap SD alone gave [1.181, 1.240], which misses k = 1.25 (the true SD
    # of log k there is 0.026 over 300 such ladders)
    control, arm, fits = pivot_ladder(297)
    m = compute_multiplier(control, arm, draws=100, seed=297, fits=fits)
    assert m.sd_boot[3] < 0.5 * (m.sd_boot[2] + m.sd_boot[4]) / 2
    assert m.low[3] <= 1.25 <= m.high[3], (m.low, m.high)
    assert m.se[3] == pytest.approx(np.sqrt(m.sd_boot[3] * np.sqrt(m.sd_boot[2] * m.sd_boot[4])), rel=1e-12)
    assert np.all(m.se[[0, 4]] == m.sd_boot[[0, 4]])  # the end rungs keep their own SD


def test_the_smoothed_sd_interpolates_the_neighbouring_rungs_in_log_compute():
    from reslab.results.scaling import smooth_sd

    rungs, rung_sd = np.array([1e14, 1e16, 1e17]), np.array([0.01, 0.04, 0.02])
    # by hand: 1e15 is halfway between 1e14 and 1e16 in log compute: the neighbours' log-linear value is
    # sqrt(0.01 * 0.04) = 0.02, and the SE the geometric mean of it and the point's own 0.005: 0.01; 1e16 is 2/3
    # of the way from 1e14 to 1e17: 0.01^(1/3) 0.02^(2/3), with its own 0.04; the ends keep theirs
    out = smooth_sd(np.array([1e14, 1e15, 1e16, 1e17, 1e18]), np.array([0.01, 0.005, 0.04, 0.02, 0.5]),
                    rungs, rung_sd)
    assert out == pytest.approx([0.01, 0.01, np.sqrt(0.04 * 0.01 ** (1 / 3) * 0.02 ** (2 / 3)), 0.02, 0.5], rel=1e-12)


@pytest.mark.slow  # ~40 s: 120 ladders x (100 bootstrap draws x 2 arms)
def test_the_interval_covers_at_every_rung_of_an_8_seed_ladder_and_at_its_narrow_rungs():
    """The first 120 of bench/sim_ladder.py's 300 ladders (its full run: 94.0-96.7% at every rung, 96.6% at the
    58 narrow inner rungs, where the bootstrap SD alone covered 86.4%): at least 90% at every rung and at the
    narrow rungs (an inner rung whose bootstrap-SD interval is under half its neighbours' mean width)."""
    covered, narrow_covered, narrow = np.zeros(5), 0, 0
    for i in range(120):
        control, arm, fits = pivot_ladder(i)
        m = compute_multiplier(control, arm, draws=100, seed=i, fits=fits)
        hit = (m.low <= 1.25) & (m.high >= 1.25)
        covered += hit
        for r in (1, 2, 3):
            if m.sd_boot[r] < 0.25 * (m.sd_boot[r - 1] + m.sd_boot[r + 1]):
                narrow, narrow_covered = narrow + 1, narrow_covered + hit[r]
    assert np.all(covered / 120 >= 0.9) and np.all(covered / 120 <= 0.99), covered / 120
    assert narrow >= 10 and narrow_covered / narrow >= 0.9, (narrow, narrow_covered)
