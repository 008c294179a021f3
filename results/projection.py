"""Projection of a ladder's laws to a target compute, with a paired seed-bootstrap interval, a
backtest on the ladder's own rungs, and the throughput-adjusted (wall-clock) multiplier (issue 54).

The law (`LawForm`, a knob). `floor=None` (the default) is reslab's law with its floor fitted:
L(C) = E + A C^-alpha by `scaling.fit_power_law` (Huber in log space, many starts; `scaling`'s
module doc). `floor=E` fixes the floor, as Marin's gates fit `1.6 + A C^-alpha`: then
log(L - E) = log A - alpha log C is a straight line, fitted by least squares over every (seed, rung)
point; two rungs suffice (a fitted floor needs three), and a projection far past the ladder leans on
the fixed E instead of on a floor that a few rungs barely identify. The fixed floor must lie below
every loss, and is right only if the true floor is E: a wrong E biases every projection.

The targets. At each target compute C (the arm's), the loss gap L_arm(C) - L_control(C) (nats,
negative favours the arm) and the compute-equivalent multiplier k(C) = C_control^-1(L_arm(C)) / C
(`scaling.multiplier`: the compute the control needs to reach the arm's loss, over C). A target more
than `max_decades` (a knob, default 2) decades past the largest rung is flagged (`extrapolated`):
its interval is the bootstrap's under the assumption that the law holds out there, which nothing in
the ladder checks.

The interval. Seeds are resampled jointly (the same draws for both arms and every rung, as
`scaling.compute_multiplier`), both arms refitted (a fitted floor warm-started from the full-data
fit; a fixed floor's line in closed form, every draw at once), and the interval is the bootstrap-SE t
interval of `scaling` (estimate -/+ t(n-1) sqrt(n/(n-1)) SD_boot) on log k, on the gap and on log
k_wall. For a fixed floor the fit is linear in the seeds' mean log(L - E) per rung, so the interval
is the paired t interval of a smooth function of a mean and covers at its level inside the fitted
range; for a fitted floor it is `scaling`'s (conservative at 6 seeds). bench/sim_gates.py measures
both, inside and past the range, and prints the coverage whatever it is.

The backtest (`backtest`). Both arms are refitted without the largest rung and projected to it; the
error is the projection minus what the full ladder says there (the mean paired loss gap of the seeds
at that rung; k from the fit on all rungs, as a ratio), with an interval from the same seed draws on
both sides (what is observed there is as noisy as the projection), and `covered` says whether it holds
0: how far a projection of one rung's step has been right on this ladder. A projection's own interval
is for the law's value, not for the noisy observation, and would cover it too rarely.

Wall-clock (`Throughput`). An arm's FLOP rate at a rung is its compute over its wall seconds, tokens
over the measured training tokens/s, per seed: rate[s, r] = compute[r] tokens_per_s[s, r] / tokens[r].
In wall-clock the control needs k C / R_control to reach the arm's loss, which the arm reaches in
C / R_arm, so k_wall = k R_arm / R_control, with R the seeds' mean rate at the rung nearest C in log
compute (the largest rung for a target past the ladder: its throughput is assumed to hold there). The
ratio is resampled with the same seed draws as k, so the interval of log k_wall carries both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reslab.results.scaling import Ladder, PowerLaw, _t_half, _t_interval, smooth_sd

__all__ = ["Backtest", "LawForm", "Projection", "Throughput", "backtest", "project"]

MAX_DECADES = 2.0
DEFAULT_DRAWS = 400


@dataclass(frozen=True)
class LawForm:
    """The law both arms are fitted with: `floor` None fits E (reslab's law, 3 parameters, at least 3
    rungs); a number fixes it (Marin's `1.6 + A C^-alpha`, 2 parameters, at least 2 rungs)."""

    floor: float | None = None

    @property
    def min_rungs(self) -> int:
        return 3 if self.floor is None else 2

    def fit(self, ladder: Ladder, seeds: np.ndarray | None = None, start: PowerLaw | None = None) -> PowerLaw:
        if self.floor is None:
            return ladder.fit(seeds, start=start)
        rows = ladder.loss if seeds is None else ladder.loss[seeds]
        slope, intercept = _line(np.log(ladder.compute), _log_excess(rows, self.floor).mean(axis=0)[None, :])
        return PowerLaw(E=self.floor, A=float(np.exp(intercept[0])), alpha=float(-slope[0]), delta=math.inf)


def _log_excess(loss: np.ndarray, floor: float) -> np.ndarray:
    if np.any(loss <= floor):
        raise ValueError(f"a fixed floor {floor} must lie below every loss (lowest {float(loss.min()):.4g})")
    return np.log(loss - floor)


def _line(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares slope and intercept of each row of y [B, R] on x [R] (equal points per rung: the
    fit of every (seed, rung) point is the fit of the rung means)."""
    xc = x - x.mean()
    slope = (y - y.mean(axis=1, keepdims=True)) @ xc / (xc @ xc)
    return slope, y.mean(axis=1) - slope * x.mean()


@dataclass(frozen=True)
class Throughput:
    """An arm's measured training speed: tokens_per_s[seed, rung] (seeds in the ladder's order) and the
    tokens each run trains, tokens[rung]."""

    tokens_per_s: np.ndarray
    tokens: np.ndarray

    def rates(self, compute: np.ndarray) -> np.ndarray:
        """FLOP/s [seed, rung]: the run's compute over its wall seconds."""
        tps, tokens = np.asarray(self.tokens_per_s, dtype=np.float64), np.asarray(self.tokens, dtype=np.float64)
        if tps.ndim != 2 or tps.shape[1] != compute.size or tokens.shape != compute.shape:
            raise ValueError(f"throughput is tokens_per_s[seeds, rungs] and tokens[rungs] of the ladder's "
                             f"{compute.size} rungs, got {tps.shape} and {tokens.shape}")
        if not (np.all(np.isfinite(tps)) and np.all(tps > 0)):
            raise ValueError("every run needs a measured, positive training tokens/s")
        return compute[None, :] * tps / tokens[None, :]


@dataclass(frozen=True)
class Projection:
    """Per target compute (the arm's): each arm's fitted loss, the loss gap arm - control (nats) and k, each
    with its interval;
    k_wall with its interval where throughputs were given (NaN otherwise); how many decades past the
    largest rung (negative: inside)."""

    compute: np.ndarray
    gap: np.ndarray
    gap_low: np.ndarray
    gap_high: np.ndarray
    k: np.ndarray
    k_low: np.ndarray
    k_high: np.ndarray
    k_wall: np.ndarray
    k_wall_low: np.ndarray
    k_wall_high: np.ndarray
    decades_past: np.ndarray
    level: float
    n_seeds: int
    laws: tuple[PowerLaw, PowerLaw]  # (control, arm) on all the seeds
    losses: np.ndarray  # [2, 3, P]: (control, arm) x (fitted loss, low, high) at each target

    def extrapolated(self, max_decades: float = MAX_DECADES) -> np.ndarray:
        """Per target: more than `max_decades` decades past the largest rung (the row says so)."""
        return self.decades_past > max_decades


def _check(control: Ladder, arm: Ladder, form: LawForm) -> int:
    n = control.loss.shape[0]
    if arm.loss.shape[0] != n:
        raise ValueError(f"paired ladders need the same seeds: control has {n}, the arm {arm.loss.shape[0]}")
    if n < 3:
        raise ValueError(f"an interval needs at least 3 seeds, got {n}")
    rungs = np.unique(control.compute).size
    if rungs < form.min_rungs:
        raise ValueError(f"the law ({'fitted' if form.floor is None else 'fixed'} floor) needs at least "
                         f"{form.min_rungs} rungs, got {rungs}")
    return n


def _laws(law: PowerLaw | tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if isinstance(law, PowerLaw):
        return np.array([law.E]), np.array([law.A]), np.array([law.alpha])
    return law


def _gap_and_log_k(control: tuple, arm: tuple, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Laws as arrays (E, A, alpha)[B] -> gap and log k [B, P] at the computes `where` [P]."""
    (ec, ac, alc), (ea, aa, ala) = (tuple(v[:, None] for v in control), tuple(v[:, None] for v in arm))
    arm_loss = ea + aa * where[None, :] ** -ala
    excess = arm_loss - ec
    with np.errstate(divide="ignore", invalid="ignore"):
        log_need = np.where(excess > 0, (np.log(ac) - np.log(np.where(excess > 0, excess, 1.0))) / alc, np.inf)
    return arm_loss - (ec + ac * where[None, :] ** -alc), log_need - np.log(where)[None, :]


def _boot_laws(ladder: Ladder, form: LawForm, picks: np.ndarray,
               full: PowerLaw) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The law refitted on each row of seed draws picks [B, n], as arrays (E, A, alpha)[B]."""
    if form.floor is not None:
        y = _log_excess(ladder.loss, form.floor)[picks].mean(axis=1)  # [B, R]: the draws' mean per rung
        slope, intercept = _line(np.log(ladder.compute), y)
        return np.full(picks.shape[0], form.floor), np.exp(intercept), -slope
    laws = [form.fit(ladder, pick, start=full) for pick in picks]
    return (np.array([w.E for w in laws]), np.array([w.A for w in laws]), np.array([w.alpha for w in laws]))


def _nearest_rung(compute: np.ndarray, where: np.ndarray) -> np.ndarray:
    return np.argmin(np.abs(np.log(where)[:, None] - np.log(compute)[None, :]), axis=1)


def project(control: Ladder, arm: Ladder, at: np.ndarray | list[float], *, form: LawForm = LawForm(),
            level: float = 0.95, draws: int = DEFAULT_DRAWS, seed: int = 0,
            throughput: tuple[Throughput, Throughput] | None = None) -> Projection:
    """Both arms' laws projected to the computes `at` (the module doc): their losses, the gap and k with the paired seed
    bootstrap's interval, and k_wall where `throughput` (control's, arm's) is given."""
    where = np.atleast_1d(np.asarray(at, dtype=np.float64))
    n = _check(control, arm, form)
    fit_c, fit_a = form.fit(control), form.fit(arm)
    gap, log_k = (v[0] for v in _gap_and_log_k(_laws(fit_c), _laws(fit_a), where))
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    boot_c, boot_a = _boot_laws(control, form, picks, fit_c), _boot_laws(arm, form, picks, fit_a)
    boot_gap, boot_k = _gap_and_log_k(boot_c, boot_a, where)
    losses = np.empty((2, 3, where.size))  # (control, arm) x (value, low, high)
    for i, (fit, boot) in enumerate(((fit_c, boot_c), (fit_a, boot_a))):
        losses[i, 0] = fit.loss(where)
        losses[i, 1:] = _t_interval(losses[i, 0], boot[0][:, None] + boot[1][:, None] * where ** -boot[2][:, None],
                                    n, level)
    with np.errstate(invalid="ignore"):  # an infinite k (below the control's floor) has no finite interval
        gap_low, gap_high = _t_interval(gap, boot_gap, n, level)
        # k's SE smoothed between the rungs as `scaling.compute_multiplier`'s is (issue 51: the resampled curves
        # pivot near a rung, where the bootstrap SD alone collapses)
        rungs = np.unique(arm.compute)
        boot_k_rungs = _gap_and_log_k(boot_c, boot_a, rungs)[1]
        se = smooth_sd(where, np.std(boot_k, axis=0, ddof=1), rungs, np.std(boot_k_rungs, axis=0, ddof=1))
        k_low, k_high = log_k - _t_half(se, n, level), log_k + _t_half(se, n, level)
        wall = np.full((3, where.size), np.nan)
        if throughput is not None:
            rung = _nearest_rung(arm.compute, where)
            rate_c, rate_a = throughput[0].rates(control.compute)[:, rung], throughput[1].rates(arm.compute)[:, rung]
            log_ratio = np.log(rate_a.mean(axis=0) / rate_c.mean(axis=0))
            boot_ratio = np.log(rate_a[picks].mean(axis=1) / rate_c[picks].mean(axis=1))  # [B, P]
            wall[0] = log_k + log_ratio
            # k's smoothing carried over: the bootstrap SD of log k + log ratio, scaled as k's own was
            sd_wall = np.std(boot_k + boot_ratio, axis=0, ddof=1) * se / np.std(boot_k, axis=0, ddof=1)
            wall[1], wall[2] = wall[0] - _t_half(sd_wall, n, level), wall[0] + _t_half(sd_wall, n, level)
    past = np.log10(where / float(arm.compute.max()))
    return Projection(compute=where, gap=gap, gap_low=gap_low, gap_high=gap_high, k=np.exp(log_k), k_low=np.exp(k_low),
                      k_high=np.exp(k_high), k_wall=np.exp(wall[0]), k_wall_low=np.exp(wall[1]),
                      k_wall_high=np.exp(wall[2]), decades_past=past, level=level, n_seeds=n, laws=(fit_c, fit_a),
                      losses=losses)


@dataclass(frozen=True)
class Backtest:
    """The projection of the ladder without its largest rung to that rung's compute, against what the full
    ladder says there: the gap (the seeds' mean paired delta at the rung) and k (the fit on every rung). The
    errors' intervals come from the same seed draws for both sides (a prediction check: the observed values
    are noisy too), and `covered` says whether they hold 0."""

    compute: float
    gap_projected: float
    gap_observed: float
    gap_error_low: float
    gap_error_high: float
    k_projected: float
    k_observed: float
    k_ratio_low: float  # projected over observed k
    k_ratio_high: float

    @property
    def gap_error(self) -> float:
        return self.gap_projected - self.gap_observed

    @property
    def k_ratio(self) -> float:
        """projected over observed k (1: exact)."""
        return self.k_projected / self.k_observed

    @property
    def gap_covered(self) -> bool:
        return bool(self.gap_error_low <= 0.0 <= self.gap_error_high)

    @property
    def k_covered(self) -> bool:
        return bool(self.k_ratio_low <= 1.0 <= self.k_ratio_high)


def backtest(control: Ladder, arm: Ladder, *, form: LawForm = LawForm(), level: float = 0.95,
             draws: int = DEFAULT_DRAWS, seed: int = 0) -> Backtest:
    """Fit without the largest rung, project to it, and compare (the module doc); the ladder needs one rung
    more than the law does."""
    n = _check(control, arm, form)
    last = int(np.argmax(arm.compute))
    keep = np.array([j for j in range(arm.compute.size) if j != last])
    if np.unique(arm.compute[keep]).size < form.min_rungs:
        raise ValueError(f"a backtest needs {form.min_rungs + 1} rungs (the law's {form.min_rungs} and one to "
                         f"predict), got {arm.compute.size}")
    less = Ladder(control.compute[keep], control.loss[:, keep]), Ladder(arm.compute[keep], arm.loss[:, keep])
    target = arm.compute[last:last + 1]
    picks = np.random.default_rng(seed).integers(0, n, size=(draws, n))
    laws = [(form.fit(c), form.fit(a)) for c, a in (less, (control, arm))]
    (gap, log_k), (_, log_k_full) = (_gap_and_log_k(_laws(c), _laws(a), target) for c, a in laws)
    (boot_gap, boot_k), (_, boot_k_full) = (
        _gap_and_log_k(_boot_laws(c, form, picks, fc), _boot_laws(a, form, picks, fa), target)
        for (c, a), (fc, fa) in zip((less, (control, arm)), laws, strict=True))
    delta = arm.loss[:, last] - control.loss[:, last]
    gap_error = gap[:, 0] - delta.mean()
    with np.errstate(invalid="ignore"):
        gap_low, gap_high = _t_interval(gap_error, boot_gap[:, :1] - delta[picks].mean(axis=1)[:, None], n, level)
        ratio_low, ratio_high = _t_interval(log_k[:, 0] - log_k_full[:, 0], boot_k[:, :1] - boot_k_full[:, :1], n,
                                            level)
    return Backtest(compute=float(target[0]), gap_projected=float(gap[0, 0]), gap_observed=float(delta.mean()),
                    gap_error_low=float(gap_low[0]), gap_error_high=float(gap_high[0]),
                    k_projected=float(np.exp(log_k[0, 0])), k_observed=float(np.exp(log_k_full[0, 0])),
                    k_ratio_low=float(np.exp(ratio_low[0])), k_ratio_high=float(np.exp(ratio_high[0])))
