"""Answers across scale: loss-against-compute fits, the compute-equivalent multiplier `k` with a
paired seed bootstrap, and the paired test of a trend in an arm's gain with size (issue 21).

The law. Each arm's loss against compute (FLOPs, or wall-clock seconds for the wall-clock
multiplier) is fitted as

    L(C) = E + A * C**-alpha

the way Hoffmann et al. (2022, arXiv 2203.15556) fit their approach 3 and Besiroglu et al. (2024,
arXiv 2404.10102) redid it: parameters (e, a, alpha) with E = exp(e), A = exp(a), so log L(C) =
logsumexp(a - alpha log C, e); the Huber loss of the log residuals, summed over every (seed, rung)
point, with its delta scaled to the residual noise (below); minimised from a grid of starts (scipy's trust-region
`least_squares` with its Huber loss, the same objective Hoffmann et al. gave L-BFGS), run to tight
tolerances (Besiroglu et al. traced Hoffmann et al.'s implausibly narrow intervals partly to an
optimizer stopped early), the best optimum kept. Compute is scaled by its geometric mean before
the fit (`alpha` does not change; `A` is reported on the original scale), which keeps the problem
well conditioned at 1e15+ FLOPs.

The loss's delta (issue 35). Hoffmann et al.'s delta 1e-3 is far below a ladder's log-loss noise
(1e-3 to 1e-2), where Huber acts as least absolute deviations: over simulated ladders the SD of
log k was 1.57x that of least squares, about 2.5x the seeds for the same interval. So the fit runs
twice: first at `PILOT_DELTA` (1e-3, robust to a bad run), then from that optimum with delta
`HUBER_K` (3) x the residuals' MAD scale (1.4826 x their median absolute deviation), so that a run
far off the curve still counts only linearly. Not the classical 1.345: a ladder's residuals come in
clusters (each seed's shared offset), which makes the MAD scale of 6 seeds' residuals noisy and
often small; over simulated 6-seed ladders the SD of log k over least squares' was 1.14 and 1.02
(two seed sets of 60) at 1.345, 1.07 and 1.04 at 2, 1.04 and 1.01 at 3, while one run 0.3 nats off
moved log k by 0.03 at each (least squares: over 0.1). A bootstrap refit keeps the full data's
delta (the scale is not re-estimated per resample). tests/results/test_scaling.py checks both.

The multiplier. `k(C) = C_control^-1(L_arm(C)) / C`: the compute the control needs to reach the
arm's fitted loss at C, as a multiple of C. "Block AttnRes matches the baseline at 1.25x compute"
(Kimi Team, arXiv 2603.15031, section 5's scaling laws: Block, not Full, AttnRes) is k = 1.25. It
is reported at each rung's compute, and it is one number only when it does not drift: `constant`
is False when the paired-bootstrap interval of log k at the last rung minus log k at the first
excludes 0, or when those two rungs' intervals are disjoint (then k drifts with C and the table
says so). The interval of the exponents' gap alpha_arm - alpha_control is reported beside it but
no longer decides: alpha is poorly identified next to the floor E, and with exponents 0.12 and
0.14 (k from 0.79 to 1.98 over the rungs) it flagged the drift in half the simulated ladders.
k is infinite where the arm's loss is below the control's fitted floor E (no amount of control compute reaches it).

The interval. Seeds are resampled jointly (the same seed draws for both arms and every rung: the
pairing that makes the seeds' shared noise cancel), both arms are refitted (warm-started from the
full-data fit) and k recomputed. With the 4-16 seeds a ladder can afford, percentile intervals of
a bootstrap are too narrow (a bootstrap SD is the plug-in SD, short by sqrt((n-1)/n), and the
normal quantile ignores that the SD is itself estimated), so the interval is the bootstrap-SE t
interval on log k: log k_hat -/+ t(1 - (1-level)/2, n-1) * sqrt(n/(n-1)) * SE(log k). Over 100 simulated 6-seed
ladders (tests/results/test_scaling.py) it covered k in 94-96% of them at each rung.

The SE (issue 51). The resampled k(C) curves of one ladder tend to cross near one compute (a tilt of the curve
dominates the resamples of a few seeds), so the bootstrap SD at a rung there can be a third of its neighbours'
while the true sampling SD is not: in 300 simulated 8-seed, 5-rung ladders (`bench/sim_ladder.py`) 19% had an
inner rung under half its neighbours' width, and those intervals covered 86%. An inner point's SE is therefore
smooth across log compute: the geometric mean of its own bootstrap SD and the SD interpolated (log-linearly in
compute) between the rungs on either side (`smooth_sd`; the end rungs keep their own). On the same 300 ladders
it covered 94.0, 95.7, 95.0, 96.7 and 95.0% at the five rungs and 96.6% at the narrow rungs (a floor at the
neighbours' interpolation: 97.7-98.3% at the inner rungs, too wide; the bootstrap SD alone: 94-95%, 86% narrow).

The trend. `trend_test`: per seed, the ordinary least-squares slope of its delta (arm - control)
on log(size) across the rungs; the exact two-sided sign flip (`stats.sign_flip_p`) on those
slopes. A negative mean slope with a small p says the arm's gain grows with size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize
from scipy import stats as sps

from reslab.results.stats import sign_flip_p

PILOT_DELTA = 1e-3  # Hoffmann et al.'s delta: the first, robust pass
HUBER_K = 3.0  # the second pass's delta in units of the residuals' MAD scale
_MIN_DELTA = 1e-9  # an exact fit (no residual noise) keeps a positive delta
# starts: e (log floor) x alpha x a (log coefficient at the scaled compute) = 36 starts
_START_E = (-1.0, 0.0, 0.5, 1.0)
_START_ALPHA = (0.1, 0.3, 0.6)
_START_A = (-3.0, 0.0, 2.0)
_SCOUT_EVALS = 20
_WARM_EVALS = 200
_POLISHED = 3


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A * C**-alpha, on the caller's compute scale."""

    E: float
    A: float
    alpha: float
    delta: float = math.nan  # the Huber delta of its fit (a bootstrap refit reuses it); inf: least squares

    def loss(self, compute: np.ndarray | float) -> np.ndarray:
        return self.E + self.A * np.asarray(compute, dtype=np.float64) ** -self.alpha

    def compute_for(self, loss: np.ndarray | float) -> np.ndarray:
        """The compute at which the law reaches `loss`; inf at or below its floor E."""
        gap = np.asarray(loss, dtype=np.float64) - self.E
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(gap > 0, (self.A / np.where(gap > 0, gap, 1.0)) ** (1.0 / self.alpha), np.inf)


def _check_points(compute: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    compute, loss = np.asarray(compute, dtype=np.float64), np.asarray(loss, dtype=np.float64)
    if compute.shape != loss.shape or compute.ndim != 1:
        raise ValueError(f"compute and loss must be 1-D and alike, got shapes {compute.shape} and {loss.shape}")
    if not (np.all(np.isfinite(compute)) and np.all(compute > 0) and np.all(np.isfinite(loss)) and np.all(loss > 0)):
        raise ValueError("compute and loss must be finite and positive")
    distinct = np.unique(compute).size
    if distinct < 3:
        raise ValueError(f"a law of 3 parameters needs at least 3 distinct compute values, got {distinct}")
    return compute, loss


def _residuals(params: np.ndarray, log_c: np.ndarray, log_l: np.ndarray) -> np.ndarray:
    """log L(C) - log loss, with log L = logsumexp(a - alpha log C, e)."""
    e, a, alpha = params
    u = a - alpha * log_c
    top = np.maximum(u, e)
    return top + np.log(np.exp(u - top) + np.exp(e - top)) - log_l


def _jacobian(params: np.ndarray, log_c: np.ndarray, log_l: np.ndarray) -> np.ndarray:
    """d residual / d (e, a, alpha): [points, 3]."""
    w = np.exp(params[1] - params[2] * log_c - (_residuals(params, log_c, log_l) + log_l))  # d pred / d u
    return np.stack([1.0 - w, w, -w * log_c], axis=1)


def _minimise(start: np.ndarray, log_c: np.ndarray, log_l: np.ndarray, max_nfev: int = 2000,
              delta: float = PILOT_DELTA) -> optimize.OptimizeResult:
    # scipy's robust loss "huber" with f_scale delta minimises sum(Huber_delta(r)) exactly
    # (cost = f^2 rho(r^2 / f^2) / 2); trust-region reflective converges in a few evaluations
    # where L-BFGS-B on the same objective took hundreds (the loss is linear past delta)
    loss, scale = ("linear", 1.0) if math.isinf(delta) else ("huber", delta)
    return optimize.least_squares(_residuals, start, jac=_jacobian, args=(log_c, log_l), loss=loss,
                                  f_scale=scale, method="trf", bounds=([-10, -30, 1e-3], [10, 30, 3.0]),
                                  xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=max_nfev)


def noise_delta(residuals: np.ndarray) -> float:
    """`HUBER_K` x the MAD scale of the residuals (1.4826 x their median absolute deviation)."""
    r = np.asarray(residuals, dtype=np.float64)
    return max(HUBER_K * 1.4826 * float(np.median(np.abs(r - np.median(r)))), _MIN_DELTA)


def fit_power_law(compute: np.ndarray, loss: np.ndarray, *, start: PowerLaw | None = None,
                  delta: float | None = None) -> PowerLaw:
    """The law through points (compute_i, loss_i), every start of the grid (or only `start`, a
    previous fit's law, for a bootstrap refit, at its delta) tried and the best optimum kept.
    `delta`: the Huber delta (inf: least squares); default the noise-scaled one (module doc)."""
    compute, loss = _check_points(compute, loss)
    scale = float(np.exp(np.log(compute).mean()))
    log_c, log_l = np.log(compute / scale), np.log(loss)
    if start is not None:
        starts = [np.array([math.log(start.E), math.log(start.A) - start.alpha * math.log(scale), start.alpha])]
    else:
        starts = [np.array([e, a, al]) for e in _START_E for al in _START_ALPHA for a in _START_A]
    # Every start gets a short budget, then the best few are run on to tight convergence: a start
    # that is still far off after `_SCOUT_EVALS` evaluations is in a flat valley (a floor E pinned at
    # its bound, an exponent at its cap) and never the best optimum. A warm refit starts at an
    # optimum of nearly the same points and needs a few dozen.
    if start is not None:
        delta = delta if delta is not None else start.delta if not math.isnan(start.delta) else None
        pilot = starts[0]
    else:
        scouts = sorted((_minimise(s, log_c, log_l, _SCOUT_EVALS) for s in starts), key=lambda r: r.cost)
        pilot = min((_minimise(r.x, log_c, log_l) for r in scouts[:_POLISHED]), key=lambda r: r.cost).x
    if delta is None:  # the pilot optimum's residuals set the noise-scaled delta
        if start is not None:
            pilot = _minimise(pilot, log_c, log_l, _WARM_EVALS).x
        delta = noise_delta(_residuals(pilot, log_c, log_l))
    best = _minimise(pilot, log_c, log_l, _WARM_EVALS if start is not None else 2000, delta)
    e, a, alpha = best.x
    return PowerLaw(E=math.exp(e), A=math.exp(a + alpha * math.log(scale)), alpha=float(alpha), delta=delta)


@dataclass(frozen=True)
class Ladder:
    """One arm across the rungs: `compute[r]` (its own: arms differ in FLOPs per token) and
    `loss[s, r]` for seed s (seeds in the same order for every arm of a comparison)."""

    compute: np.ndarray
    loss: np.ndarray

    def __post_init__(self) -> None:
        compute, loss = np.asarray(self.compute, dtype=np.float64), np.asarray(self.loss, dtype=np.float64)
        if loss.ndim != 2 or compute.shape != (loss.shape[1],):
            raise ValueError(f"a ladder is compute[rungs] and loss[seeds, rungs], got {compute.shape} and {loss.shape}")
        object.__setattr__(self, "compute", compute)
        object.__setattr__(self, "loss", loss)

    def fit(self, seeds: np.ndarray | None = None, start: PowerLaw | None = None) -> PowerLaw:
        rows = self.loss if seeds is None else self.loss[seeds]
        return fit_power_law(np.tile(self.compute, rows.shape[0]), rows.ravel(), start=start)


@dataclass(frozen=True)
class Multiplier:
    """k at each rung's compute (the arm's), its interval, and whether one k describes the range."""

    compute: np.ndarray
    k: np.ndarray
    low: np.ndarray
    high: np.ndarray
    alpha_gap: float  # alpha_arm - alpha_control
    alpha_gap_low: float
    alpha_gap_high: float
    level: float
    n_seeds: int
    # log k at the largest compute minus log k at the smallest, with its paired-bootstrap interval
    drift: float = math.nan
    drift_low: float = math.nan
    drift_high: float = math.nan
    # per point, the bootstrap SD of log k and the SE the interval uses (`smooth_sd`)
    sd_boot: np.ndarray = field(default_factory=lambda: np.empty(0))
    se: np.ndarray = field(default_factory=lambda: np.empty(0))

    @property
    def ends(self) -> tuple[int, int]:
        """The indices of the smallest and the largest compute (the first and the last rung)."""
        return int(np.argmin(self.compute)), int(np.argmax(self.compute))

    @property
    def constant(self) -> bool:
        """One k over the range: the drift of log k from the first rung to the last is not distinguishable
        from 0 and the end rungs' intervals overlap (never one k where the end rungs disagree)."""
        first, last = self.ends
        overlap = self.low[first] <= self.high[last] and self.low[last] <= self.high[first]
        return bool(self.drift_low <= 0.0 <= self.drift_high and overlap)


def multiplier(control: PowerLaw, arm: PowerLaw, compute: np.ndarray) -> np.ndarray:
    """k(C) = C_control^-1(L_arm(C)) / C at each C."""
    compute = np.asarray(compute, dtype=np.float64)
    return control.compute_for(arm.loss(compute)) / compute


def _t_half(sd: np.ndarray, n: int, level: float) -> np.ndarray:
    """t(n-1) * sqrt(n/(n-1)) * sd: the half-width of the bootstrap-SE t interval (the module doc)."""
    return float(sps.t.ppf(0.5 + level / 2, n - 1)) * math.sqrt(n / (n - 1)) * sd


def _t_interval(estimate: np.ndarray, draws: np.ndarray, n: int, level: float) -> tuple[np.ndarray, np.ndarray]:
    """estimate -/+ t(n-1) * sqrt(n/(n-1)) * SD over the draws (the module doc), per column."""
    with np.errstate(invalid="ignore"):
        half = _t_half(np.std(draws, axis=0, ddof=1), n, level)
    return estimate - half, estimate + half


def smooth_sd(where: np.ndarray, sd: np.ndarray, rungs: np.ndarray, rung_sd: np.ndarray) -> np.ndarray:
    """Each point's SD of log k, smoothed where rungs lie on both sides of it: the geometric mean of its own
    bootstrap SD and the SD interpolated between the nearest rung below and the nearest above, linearly in
    (log compute, log SD) (the module doc: the resampled curves pivot). `where`, `rungs`: computes;
    `rung_sd[r]`: the bootstrap SD at `rungs[r]`. The end rungs keep their own SD."""
    order = np.argsort(rungs)
    log_r, log_sd = np.log(np.asarray(rungs, dtype=np.float64)[order]), np.log(np.asarray(rung_sd)[order])
    out = np.array(sd, dtype=np.float64)
    for i, x in enumerate(np.log(np.asarray(where, dtype=np.float64))):
        other = ~np.isclose(log_r, x, rtol=0.0, atol=1e-9)
        below, above = np.flatnonzero(other & (log_r < x)), np.flatnonzero(other & (log_r > x))
        if below.size and above.size:
            lo, hi = below[-1], above[0]
            share = (x - log_r[lo]) / (log_r[hi] - log_r[lo])
            out[i] = math.sqrt(out[i] * math.exp((1 - share) * log_sd[lo] + share * log_sd[hi]))
    return out


def compute_multiplier(control: Ladder, arm: Ladder, *, level: float = 0.95, draws: int = 400,
                       seed: int = 0, at: np.ndarray | None = None,
                       fits: tuple[PowerLaw, PowerLaw] | None = None) -> Multiplier:
    """k at the arm's rungs (or at the computes `at`) with the paired seed bootstrap's interval
    (the module doc); `fits`: the (control, arm) laws when the caller has fitted them already."""
    where = arm.compute if at is None else np.asarray(at, dtype=np.float64)
    n = control.loss.shape[0]
    if arm.loss.shape[0] != n:
        raise ValueError(f"paired ladders need the same seeds: control has {n}, the arm {arm.loss.shape[0]}")
    if n < 3:
        raise ValueError(f"an interval for k needs at least 3 seeds, got {n}")
    fit_c, fit_a = fits if fits is not None else (control.fit(), arm.fit())
    log_k = np.log(multiplier(fit_c, fit_a, where))
    gap = fit_a.alpha - fit_c.alpha
    rungs = np.unique(arm.compute)
    points = np.concatenate([where, rungs])  # the rungs' SDs smooth the points between them
    rng = np.random.default_rng(seed)
    boot_k, boot_gap = np.empty((draws, points.size)), np.empty(draws)
    for i in range(draws):
        pick = np.asarray(rng.integers(0, n, size=n))
        c, a = control.fit(pick, start=fit_c), arm.fit(pick, start=fit_a)
        boot_k[i], boot_gap[i] = np.log(multiplier(c, a, points)), a.alpha - c.alpha
    first, last = int(np.argmin(where)), int(np.argmax(where))
    with np.errstate(invalid="ignore"):  # an infinite k (below the control's floor) has no finite interval
        sd_all = np.std(boot_k, axis=0, ddof=1)
        sd_boot = sd_all[:where.size]
        se = smooth_sd(where, sd_boot, rungs, sd_all[where.size:])
        half = _t_half(se, n, level)
        # the paired bootstrap of log k at the last rung minus the first: the same resamples, so the
        # seeds' shared noise cancels in the difference (issue 35: the exponents' gap alone missed
        # half of a real drift)
        drift = log_k[last] - log_k[first]
        drift_low, drift_high = _t_interval(np.array([drift]), (boot_k[:, last] - boot_k[:, first])[:, None], n,
                                            level)
    gap_low, gap_high = _t_interval(np.array([gap]), boot_gap[:, None], n, level)
    return Multiplier(compute=where, k=np.exp(log_k), low=np.exp(log_k - half), high=np.exp(log_k + half),
                      alpha_gap=gap, alpha_gap_low=float(gap_low[0]), alpha_gap_high=float(gap_high[0]),
                      level=level, n_seeds=n, drift=float(drift), drift_low=float(drift_low[0]),
                      drift_high=float(drift_high[0]), sd_boot=sd_boot, se=se)


@dataclass(frozen=True)
class Trend:
    """The paired trend of an arm's delta with log(size): the mean per-seed slope (nats per
    e-fold of size), its exact sign-flip p, and the per-seed slopes."""

    slope: float
    p: float
    slopes: np.ndarray


def trend_test(control: np.ndarray, arm: np.ndarray, sizes: np.ndarray) -> Trend:
    """Does the delta (arm - control) change with size? `control`, `arm`: loss[seed, rung],
    seed-paired; `sizes[r]`: the rung's size (parameters, or compute)."""
    control, arm = np.asarray(control, dtype=np.float64), np.asarray(arm, dtype=np.float64)
    log_size = np.log(np.asarray(sizes, dtype=np.float64))
    if control.shape != arm.shape or control.ndim != 2 or log_size.shape != (control.shape[1],):
        raise ValueError(f"control and arm must be loss[seeds, rungs] alike with sizes[rungs], got "
                         f"{control.shape}, {arm.shape} and {log_size.shape}")
    if np.unique(log_size).size < 2:
        raise ValueError("a trend needs at least 2 distinct sizes")
    x = log_size - log_size.mean()
    slopes = (arm - control) @ x / (x @ x)
    p, _ = sign_flip_p(slopes)
    return Trend(slope=float(slopes.mean()), p=float(p), slopes=slopes)


# Hoffmann et al. (2022), approach 3: L(N, D) = E + A / N**alpha + B / D**beta (nats, their data)
CHINCHILLA_LAW = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def chinchilla_loss(params: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Hoffmann et al.'s fitted loss at N parameters and D tokens: the assumed shape of a ladder
    before it has run (`ladder_interval_ratio`)."""
    c = CHINCHILLA_LAW
    params, tokens = np.asarray(params, dtype=np.float64), np.asarray(tokens, dtype=np.float64)
    return c["E"] + c["A"] / params ** c["alpha"] + c["B"] / tokens ** c["beta"]


def ladder_interval_ratio(compute: np.ndarray, control_loss: np.ndarray, k: float, sd: float, seeds: int, *,
                          level: float = 0.95, replicates: int = 16, draws: int = 60) -> float:
    """How tightly `seeds` seeds bound k: the median, over simulated ladders, of high / low of k's
    interval at the geometric middle of the rungs (1.2: the interval spans k -/+ about 9%).

    The control follows the law fitted through (`compute`, `control_loss`), the treatment the same
    law at `k` x the compute; each run adds independent noise of SD sd / sqrt(2), so a paired delta
    has SD `sd` (what `reslab power --sd` declares). Fits start at the true laws (a sizing
    simulation, not an analysis), so it takes seconds; the draws are seeded (the same figures on
    every call)."""
    compute = np.asarray(compute, dtype=np.float64)
    law = fit_power_law(compute, np.asarray(control_loss, dtype=np.float64))
    treated = PowerLaw(E=law.E, A=law.A * k ** -law.alpha, alpha=law.alpha)
    middle = np.array([math.exp(float(np.log(compute).mean()))])
    rng = np.random.default_rng(0)
    ratios = []
    for rep in range(replicates):
        noise = sd / math.sqrt(2)
        control = Ladder(compute, law.loss(compute)[None, :] + rng.normal(0, noise, (seeds, compute.size)))
        arm = Ladder(compute, treated.loss(compute)[None, :] + rng.normal(0, noise, (seeds, compute.size)))
        try:
            fits = (control.fit(start=law), arm.fit(start=treated))
            m = compute_multiplier(control, arm, level=level, draws=draws, seed=rep, at=middle, fits=fits)
        except ValueError:
            continue
        ratios.append(float(m.high[0] / m.low[0]) if np.isfinite(m.high[0]) else math.inf)
    return float(np.median(ratios)) if ratios else math.nan
