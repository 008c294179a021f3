"""Anytime-valid paired tests: an e-process and a confidence sequence over per-seed deltas.

A sequential study adds seeds in batches and looks at the deltas after every batch; a fixed-n test
looked at that way loses its error rate. An e-process keeps it: `E_n`, a nonnegative process whose
expectation is at most 1 under the null at every stopping time, so by Ville's inequality
``P(E_n >= 1/alpha for some n) <= alpha``, however often it is looked at and whenever the study stops.

Three tests (`seeds.sequential.test`). The default, "flip" (issue 51), needs what the fixed design's sign flip
needs: the paired deltas symmetric about 0 under the null, as exchangeable arms give. Its bet on delta i is
``tanh(theta x_i / s_i)``, s_i the RMS of x_1..x_i (the current delta included): given the earlier deltas, an odd
and increasing function of x_i (x / sqrt(a + x^2) is), so its mean is 0 for a delta symmetric about 0 and at most
0 for one symmetric about a mean below 0, and the wealth ``prod (1 + tanh(theta x_i / s_i))`` is a test
martingale under symmetry alone, its one-sided versions for their composite nulls (every bet clipped to +-0.98).
It is the
likelihood ratio of the signs given the sizes under a normal shift of d SDs (P(+ | |x|) = (1 + tanh(mu |x| /
sigma^2)) / 2) at theta = d sqrt(1 + d^2), the shift's scale in units of the RMS; the e-process mixes theta
uniformly over 0.7, 1 and 1.4 x its value at d^2 = `prior_scale` (g), for each sign (E+ bets on positive
deltas, E- on negative), and averages the two: ``E = (E+ + E-) / 2``. Its confidence sequence and equivalence
bounds are found as the sign test's (below). It uses the deltas' sizes, as the t e-process does, and keeps its
seed cost: over 2000 simulated studies of normal deltas (`bench/sim_sequential.py`, `power --sequential`'s design:
seeds 4, +1 per look, at most 16, level 0.025, g = d^2) at d = 1.5 it needs 8.9 seeds for superiority (the t
e-process 9.1, the sign test 12.0), deciding 94.8% of them (t 96.9%, sign 95.6%), and 9.1 for equivalence within
+-1.5 SD (t 8.3, sign 11.4; 92.9%, 95.9%, 96.9%); type-I error at the default looks (alpha 0.05, 2000 studies) is
at most alpha for every symmetric null (normal 2.4%, t3 2.1%, bimodal 3.4%, +-1 3.5%; t 1.1, 0.5, 4.0, 4.4%,
whose validity the last two lack: after every seed they reach 7%, below). Skewed deltas of mean 0 are outside all
three tests' assumption (lognormal sigma 0.5 / 1, exponential: flip 5.5 / 14.1 / 7.7%, sign 2.7 / 9.4 / 4.2%, t
3.9 / 14.5 / 7.1%).

"sign" is a betting e-process on the signs, with sizes only relative to the earlier deltas (Waudby-Smith and
Ramdas, "Estimating means of bounded random variables by betting", 2024; Shaer, Maman and Romano, "Model-X
sequential testing", 2023, for symmetric nulls): the bet on delta i (from the second) is
``lambda * tanh(c * d_i / s_i)`` with ``s_i`` the RMS of the EARLIER deltas (predictable) and c = 1.5; the
wealth ``prod (1 + lambda tanh(c d_i / s_i))`` is a test martingale under symmetry alone. The e-process mixes the
wealth uniformly over lambda in 0.5..0.98 (13 sizes), for each sign, and averages the two. Its confidence
sequence is the hull of the shifts m whose deltas - m it does not reject (a grid about the mean, bisection at
each edge); the equivalence bounds are E+'s and E-'s one-sided sequences at alpha each (each one-sided
e-process is valid for every delta symmetric about a mean on its null's side: a shift only lowers the odd
function's mean). Measured by simulation
(tests/results/test_sequential.py; looks at 4, 6, ..., 16 seeds, alpha 0.05): type-I error 0.5-1.9% for
symmetric nulls (t2, t3, Laplace, 10% outliers at 10 SD, one seed at +-10 SD, bimodal +-1), where the t
e-process gives 4.0% for the bimodal null and 4.6% for +-1 deltas, 7.2% and 7.6% looked at after every seed
(the sign test 2.1%); power 15/71/99% at 0.5/1/1.5 SD against the t e-process's 16/72/99%, at one to two
more seeds on average (10.5/12.3/11.0 against 10.3/11.2/9.0: it cannot reject before about 8 deltas, each
bet being below 1).

The "t" e-process is the safe t-test's (Grünwald, de Heide and Koolen, "Safe testing", 2024; Pérez-Ortiz,
Lardy, de Heide and Grünwald, "E-statistics, group invariance and anytime-valid testing", 2024): the
Bayes factor of the one-sample t-test whose alternative puts a normal prior of variance `g` on the
standardised effect delta / sigma and whose nuisance sigma gets the right Haar prior 1/sigma on both
sides, which makes it scale invariant and an e-process for the composite null "mean 0, any sigma"
(normal deltas). In closed form (Rouder et al. 2009, eq. 1 with g fixed), with ``t`` the t statistic
of n deltas and ``nu = n - 1``::

    E_n = (1 + n g)^(-1/2) * ((1 + t^2/nu) / (1 + t^2 / (nu (1 + n g))))^((nu + 1) / 2)

`g` (`prior_scale`, the squared standardised effect the test is tuned to) is a choice: the test is valid
for any g fixed before the data; a g near the true d_z^2 reaches 1/alpha soonest. Default 1.

The confidence sequence for the mean delta mu inverts the test: ``{mu : E_n(deltas - mu) < 1/alpha}``,
i.e. ``mean +- t*(n) sd / sqrt(n)`` where ``E_n`` at ``t*`` is ``1/alpha`` (E_n grows with |t|). It covers
mu at every n at once with probability >= 1 - alpha. Several rows (a comparison's treatments, grid
points) are family-wise controlled by Bonferroni over e-values: each row at alpha/m.

Equivalence is the two one-sided tests' (TOST's) claim, each side its own e-process: "mean >= m" is
rejected when the likelihood ratio of the t statistic of ``m - deltas`` between the standardised effect
``sqrt(g)`` and 0 (noncentral over central t density, the scale-invariant Bayes factor with a point prior,
a test martingale under the boundary mean m by the same group invariance) reaches 1/alpha, and
"mean <= -m" likewise. The ratio grows with t (the noncentral t has a monotone likelihood ratio), so a
mean beyond the boundary only lowers it path by path: each side is valid for its whole composite null.
Equivalence is wrong only when one side's null holds, so each side takes alpha (not alpha/2: the
intersection-union principle, as TOST's 1 - 2 alpha interval), and inverting them gives the equivalence
bounds ``mean +- c*(n) sd / sqrt(n)`` (`equivalence_bounds`). With superiority read from the two-sided
sequence at alpha, a row's claims together stay within alpha at every true mean: past +m both "better"
and "equivalent" need the upper one-sided bound below the truth. The same `g` tunes both; for an
equivalence row `power --sequential` sets it to (margin / SD)^2.

Decisions (`decide`) read these bounds by the fixed-n verdicts' rules: a superiority row is better/worse
when the sequence excludes 0 (tested against 0, not the MEI: `results.comparison`), an equivalence row
when it lies beyond its margin; either is equivalent when its equivalence bounds lie within +-margin
(+-MEI for a superiority row with one); futile, from half of `max_n` seeds on, when the bounds
`max_n` seeds would give (t* or c* at `max_n` times the current SD over sqrt(max_n)) could reach
neither verdict even if the mean drifted over the remaining seeds by its 97.5% quantile the right way
(conditional power under the current trend below 2.5%); else undecided (add a batch). Futility only
stops early, so it never raises the error rate; it costs power when the mean at half the seeds
understates the effect. The 2.5% was chosen by simulation (bench/RESULTS.md): giving up at the
point estimate's 50% cost up to a quarter of the power, and never giving up costs seeds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from reslab.common.errors import ConfigError

__all__ = ["TEST_WORDS", "DesignPower", "RowRule", "SequentialDesign", "SequentialState", "Tost", "confidence_sequence",
           "decide", "e_value", "equivalence_bounds", "look_bounds", "needed_arms", "parse_design", "sequential_path",
           "sequential_table", "sequential_text", "sign_e_value", "simulate_design"]

Decision = Literal["better", "worse", "equivalent", "futile", "undecided"]
DEFAULTS: dict[str, Any] = {"start": 4, "batch": 2, "max": 16, "prior_scale": 1.0, "test": "flip"}
# `seeds.sequential.test`: the sign-flip likelihood ratio by size (symmetry), the betting e-process on signs
# (symmetry) or the safe t-test (normality)
TESTS = ("flip", "sign", "t")
# what the terminal and the report say each test is and assumes
TEST_WORDS = {"flip": "the flip test, an e-process betting on each paired delta's sign by its size, valid when the "
                      "deltas are symmetric about 0 under the null, as exchangeable arms give",
              "sign": "the sign test, a betting e-process valid when the paired deltas are symmetric about 0 under "
                      "the null, as exchangeable arms give",
              "t": "the safe t-test's e-process, valid when the paired deltas are normal"}
DEFAULT_PRIOR_SCALE = DEFAULTS["prior_scale"]
DESIGN_KEYS = tuple(DEFAULTS)
# futility gives up below 2.5% conditional power under the trend (`sequential_path`; bench/RESULTS.md)
FUTILITY_Z = 1.96


@dataclass(frozen=True)
class SequentialDesign:
    """A study's `seeds: {sequential: {start, batch, max, prior_scale, test}}`: seeds 0..start-1 first, then
    `batch` more after each look, never more than `max`; the `test` ("flip", the default, and "sign": betting
    e-processes valid when the deltas are symmetric about 0 under the null; "t": the safe t-test's, valid for
    normal deltas) and the `prior_scale` (g, the module doc: the squared standardised effect the flip and t tests
    are tuned to; every test's futility rule reads it)."""

    start: int
    batch: int
    max: int
    prior_scale: float = DEFAULT_PRIOR_SCALE
    test: str = "flip"

    def looks(self) -> list[int]:
        """The seed counts after which the test is read: start, start + batch, ..., max."""
        return [*range(self.start, self.max, self.batch), self.max]


def parse_design(value: object, where: str = "seeds.sequential") -> SequentialDesign:
    """The design from its YAML mapping; a ConfigError naming the field and what is allowed otherwise."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping with {', '.join(DESIGN_KEYS)} (e.g. {{start: 4, batch: 2, "
                          f"max: 16}}), got {value!r}")
    unknown = sorted(set(value) - set(DESIGN_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(DESIGN_KEYS)}")
    got = {**DEFAULTS, **value}
    for key in ("start", "batch", "max"):
        v = got[key]
        low = 2 if key == "start" else 1
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ConfigError(f"{where}.{key}: expected an integer >= {low}, got {v!r}"
                              + (" (the test needs two pairs for a spread)" if key == "start" else ""))
    if got["max"] < got["start"]:
        raise ConfigError(f"{where}.max: {got['max']} is below start {got['start']}; allowed: max >= start")
    g = got["prior_scale"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and g > 0):
        raise ConfigError(f"{where}.prior_scale: expected a number > 0 (the squared standardised effect the "
                          f"test is tuned to), got {g!r}")
    if got["test"] not in TESTS:
        raise ConfigError(f"{where}.test: {got['test']!r} is not a sequential test; allowed: flip (the default, "
                          "betting on each delta's sign by its size), sign (betting on signs), both valid for deltas "
                          "symmetric about 0; t (the safe t-test, normal deltas)")
    return SequentialDesign(got["start"], got["batch"], got["max"], float(g), got["test"])


def _t_stat(deltas: np.ndarray) -> float:
    n = deltas.size
    sd = float(deltas.std(ddof=1))
    if sd == 0.0:
        return math.copysign(math.inf, float(deltas.mean())) if deltas.mean() != 0 else 0.0
    return float(deltas.mean()) / (sd / math.sqrt(n))


def _log_e(t: float | np.ndarray, n: int, g: float) -> float | np.ndarray:
    nu = n - 1
    t2 = np.square(t)
    return (-0.5 * math.log1p(n * g) + 0.5 * (nu + 1) * (np.log1p(t2 / nu) - np.log1p(t2 / (nu * (1 + n * g)))))


def e_value(deltas: np.ndarray | list[float], prior_scale: float = DEFAULT_PRIOR_SCALE, mu: float = 0.0) -> float:
    """The e-process at the last delta, for the null "mean delta = mu": 1 before two deltas (no evidence)."""
    d = np.asarray(deltas, dtype=float) - mu
    if d.size < 2:
        return 1.0
    t = _t_stat(d)
    if math.isinf(t):
        return math.inf
    return float(math.exp(_log_e(t, d.size, prior_scale)))


@functools.lru_cache(maxsize=4096)
def _t_star(n: int, level: float, g: float) -> float:
    """The |t| at which the e-process of n deltas reaches 1/level."""
    from scipy import optimize  # on first use: `reslab status` reads no statistics (issue 39)

    target = math.log(1.0 / level)
    if _log_e(0.0, n, g) >= target:
        return 0.0
    # E_n is bounded as |t| -> inf: (1 + n g)^(nu/2); below 1/level there, no t rejects
    if 0.5 * (n - 1) * math.log1p(n * g) <= target:
        return math.inf
    high = 1.0
    while _log_e(high, n, g) < target:
        high *= 2.0
    return float(optimize.brentq(lambda t: float(_log_e(t, n, g)) - target, 0.0, high, xtol=1e-10))


def confidence_sequence(deltas: np.ndarray | list[float], alpha: float,
                        prior_scale: float = DEFAULT_PRIOR_SCALE) -> tuple[float, float]:
    """(low, high) of the 1 - alpha confidence sequence for the mean delta after these deltas; (-inf, inf)
    while it is unbounded (fewer than the deltas the e-process needs to reach 1/alpha at all)."""
    if not 0 < alpha < 1:
        raise ConfigError(f"alpha {alpha!r} is not allowed; allowed: 0 < alpha < 1")
    return _band(deltas, lambda n: _t_star(n, alpha, prior_scale))


def _band(deltas: np.ndarray | list[float], critical: Callable[[int], float]) -> tuple[float, float]:
    """mean +- critical(n) sd / sqrt(n) of the deltas; (-inf, inf) before two deltas or while critical(n) is inf."""
    d = np.asarray(deltas, dtype=float)
    if d.size < 2:
        return -math.inf, math.inf
    c = critical(d.size)
    if math.isinf(c):
        return -math.inf, math.inf
    half = c * float(d.std(ddof=1)) / math.sqrt(d.size)
    return float(d.mean()) - half, float(d.mean()) + half


def _log_e_one_sided(t: float, n: int, g: float) -> float:
    """The one-sided e-process of n deltas at t statistic t: the likelihood ratio of t between the standardised
    effect sqrt(g) and 0 (noncentral over central t density, nu = n - 1)."""
    from scipy import stats  # on first use: `reslab status` reads no statistics (issue 39)

    return float(stats.nct.logpdf(t, n - 1, math.sqrt(n * g)) - stats.t.logpdf(t, n - 1))


@functools.lru_cache(maxsize=4096)
def _c_star(n: int, level: float, g: float) -> float:
    """The t at which the one-sided e-process of n deltas reaches 1/level (inf: it cannot at n)."""
    from scipy import optimize  # on first use: `reslab status` reads no statistics (issue 39)

    target = math.log(1.0 / level)
    if _log_e_one_sided(1e6, n, g) <= target:  # the ratio is bounded as t -> inf, like the two-sided one
        return math.inf
    high = 1.0
    while _log_e_one_sided(high, n, g) < target:
        high *= 2.0
    return float(optimize.brentq(lambda t: _log_e_one_sided(t, n, g) - target, -high, high, xtol=1e-10))


def equivalence_bounds(deltas: np.ndarray | list[float], alpha: float,
                       prior_scale: float = DEFAULT_PRIOR_SCALE) -> tuple[float, float]:
    """The lower and the upper one-sided 1 - alpha confidence sequences for the mean delta, each at alpha (the
    two one-sided tests of an equivalence claim: the claim "within +-m" is wrong only when one of them
    misses, so each takes alpha, as TOST's 1 - 2 alpha interval). (-inf, inf) while they are unbounded."""
    return _band(deltas, lambda n: _c_star(n, alpha, prior_scale))


# --------------------------------------------------------------------------- the sign test: a betting e-process
SIGN_C = 1.5  # the bet on delta i is tanh(SIGN_C * delta_i / s_i) times a bet size (module doc)
SIGN_BETS = np.linspace(0.5, 0.98, 13)  # the bet sizes lambda, mixed uniformly
_GRID = np.sinh(np.linspace(-12.0, 12.0, 97))  # the shifts tried, in SEs about the mean: fine near it, far far
_BISECT = 32  # halvings of a grid cell at each edge of a sign-test bound
_CHUNK = 256  # rows of deltas evaluated on the grid at once


def _sign_log_e(d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Deltas [R, n] and shifts [R, K] -> (log E+, log E-) [R, K]: the mixtures over `SIGN_BETS` of the bets that
    d - m is positive (E+) and negative (E-). The bet on delta i (from the second) is lambda tanh(c x_i / s_i),
    x = d - m, s_i the RMS of the earlier x (no bet while it is 0): predictable, bounded by lambda < 1, and of mean
    0 whenever x_i is symmetric about 0 given the past, so each wealth is a test martingale under that null."""
    x = d[:, None, :] - m[:, :, None]
    n = x.shape[-1]
    if n < 2:
        zero = np.zeros(m.shape)
        return zero, zero.copy()
    s = np.sqrt(np.cumsum(x[..., :-1] ** 2, axis=-1) / np.arange(1, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(s > 0, np.tanh(SIGN_C * x[..., 1:] / np.where(s > 0, s, 1.0)), 0.0)
    bets = z[..., None] * SIGN_BETS  # [R, K, n - 1, L]
    log_l = math.log(SIGN_BETS.size)
    # each wealth as the log of its product of (1 +- bet), not the sum of log1p: equal to rounding (n ulps) and
    # one log a wealth instead of one a bet, the simulations' hot spot (`simulate_design`); every factor lies in
    # [0.02, 1.98], so the product of up to 150 factors neither underflows nor overflows; past that, in chunks
    return _log_sum_exp(_log_prod(1.0 + bets)) - log_l, _log_sum_exp(_log_prod(1.0 - bets)) - log_l


def _log_sum_exp(a: np.ndarray) -> np.ndarray:
    """log(sum(exp(a), axis=-1)) for finite a, by the largest term (scipy's `logsumexp` to rounding, without its
    array-API checks: a tenth of a simulation's time)."""
    top = a.max(axis=-1)
    return np.log(np.exp(a - top[..., None]).sum(axis=-1)) + top


_PROD_RUN = 150  # factors in [0.02, 1.98] multiplied before a log: 0.02**150 = 1e-255, 1.98**150 = 1e44


def _log_prod(factors: np.ndarray) -> np.ndarray:
    """sum(log(factors), axis=-2), as sums of the logs of products of runs of `_PROD_RUN` factors."""
    n = factors.shape[-2]
    total = np.log(factors[..., :_PROD_RUN, :].prod(axis=-2))
    for start in range(_PROD_RUN, n, _PROD_RUN):
        total += np.log(factors[..., start:start + _PROD_RUN, :].prod(axis=-2))
    return total


def _sign_stats(d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[R, K] shifts -> [3, R, K]: log of the two-sided mixture (E+ + E-) / 2, of E+ and of E-."""
    up, down = _sign_log_e(d, m)
    return np.stack([np.logaddexp(up, down) - math.log(2.0), up, down])


# ----------------------------------------------------------- the flip test: the sign-flip likelihood ratio by size
FLIP_THETAS = np.array([0.7, 1.0, 1.4])  # the mixed bet scales, in units of the tuned one (module doc)
_FLIP_CAP = 0.98  # |bet| at most this: every factor in [0.02, 1.98] (`_log_prod`)


def flip_theta(g: float) -> float:
    """The tuned scale of the flip test's bets: d sqrt(1 + d^2) at d^2 = g, where the sign-flip likelihood ratio
    of a normal shift d (in SDs) given the deltas' sizes bets tanh(theta delta / s), s their RMS (module doc)."""
    return math.sqrt(g * (1.0 + g))


def _flip_log_e(d: np.ndarray, m: np.ndarray, g: float) -> tuple[np.ndarray, np.ndarray]:
    """Deltas [R, n] and shifts [R, K] -> (log E+, log E-) [R, K] of the flip test: the mixtures over
    `FLIP_THETAS` x `flip_theta(g)` of the bets tanh(theta x_i / s_i), x = d - m, s_i the RMS of x_1..x_i
    (the current one included: an odd, increasing function of x_i given the earlier deltas, so each bet has mean
    0 under symmetry and each wealth is a test martingale)."""
    x = d[:, None, :] - m[:, :, None]
    n = x.shape[-1]
    s = np.sqrt(np.cumsum(x ** 2, axis=-1) / np.arange(1, n + 1))
    with np.errstate(invalid="ignore", divide="ignore"):
        z = np.where(s > 0, x / np.where(s > 0, s, 1.0), 0.0)
    bets = np.clip(np.tanh(z[..., None] * (FLIP_THETAS * flip_theta(g))), -_FLIP_CAP, _FLIP_CAP)  # [R, K, n, L]
    log_l = math.log(FLIP_THETAS.size)
    return _log_sum_exp(_log_prod(1.0 + bets)) - log_l, _log_sum_exp(_log_prod(1.0 - bets)) - log_l


def _flip_stats(d: np.ndarray, m: np.ndarray, g: float) -> np.ndarray:
    """[R, K] shifts -> [3, R, K]: log of the two-sided mixture (E+ + E-) / 2, of E+ and of E-."""
    up, down = _flip_log_e(d, m, g)
    return np.stack([np.logaddexp(up, down) - math.log(2.0), up, down])


def flip_e_value(deltas: np.ndarray | list[float], prior_scale: float = DEFAULT_PRIOR_SCALE, mu: float = 0.0) -> float:
    """The flip test's two-sided e-process at the last delta, for the null "deltas symmetric about mu" (module
    doc); 1 before any delta."""
    d = np.asarray(deltas, dtype=float)[None, :]
    if d.size == 0:
        return 1.0
    return float(np.exp(_flip_stats(d, np.full((1, 1), mu), prior_scale)[0, 0, 0]))


def sign_e_value(deltas: np.ndarray | list[float], mu: float = 0.0) -> float:
    """The sign test's two-sided e-process at the last delta, for the null "deltas symmetric about mu": the average
    of the two one-sided betting mixtures (module doc); 1 before two deltas."""
    d = np.asarray(deltas, dtype=float)[None, :]
    return float(np.exp(_sign_stats(d, np.full((1, 1), mu))[0, 0, 0]))


def _sign_edges(d: np.ndarray, level: float,
                stats_of: Callable[[np.ndarray, np.ndarray], np.ndarray] = _sign_stats) -> np.ndarray:
    """Deltas [R, n] -> [R, 4]: the two-sided 1 - level confidence sequence (low, high) and the one-sided bounds
    (low from E+, high from E-, each at level) of the sign test (or of the betting test `stats_of`: the flip
    test's): the hull of the shifts m it does not reject, from a grid about the mean refined by bisection at each
    edge (+-inf where the grid's last shift is kept)."""
    r, n = d.shape
    target = math.log(1.0 / level)
    mean = d.mean(axis=1)
    se = d.std(axis=1, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(r)
    se = np.where(se > 0, se, np.maximum(np.abs(mean), 1.0) * 1e-9)
    grid = mean[:, None] + se[:, None] * _GRID
    stats_ = np.concatenate([stats_of(d[i:i + _CHUNK], grid[i:i + _CHUNK]) for i in range(0, r, _CHUNK)], axis=1)
    kept = stats_ < target  # [3, R, G]
    rows = np.arange(r)
    last = _GRID.size - 1
    inside, outside, out = np.zeros((r, 4)), np.zeros((r, 4)), np.zeros((r, 4))
    # columns: two-sided low, two-sided high, E+'s low, E-'s high
    for col, (which, low_side) in enumerate(((0, True), (0, False), (1, True), (2, False))):
        k = kept[which]
        anything = k.any(axis=1)
        i = np.where(low_side, np.argmax(k, axis=1), last - np.argmax(k[:, ::-1], axis=1))
        step = -1 if low_side else 1
        j = np.clip(i + step, 0, last)
        inside[:, col], outside[:, col] = grid[rows, i], grid[rows, j]
        at_end = i == (0 if low_side else last)
        out[:, col] = np.where(at_end, -math.inf if low_side else math.inf, math.nan)
        # nothing kept (rare): the shift of least evidence, a point
        least = grid[rows, np.argmin(stats_[which], axis=1)]
        out[:, col] = np.where(anything, out[:, col], least)
    todo = np.isnan(out)
    live = np.flatnonzero(todo.any(axis=1))  # rows with an edge to refine (each row's stats are its own)
    if not live.size:
        return out
    d, inside, outside = d[live], inside[live], outside[live]
    for _ in range(_BISECT):
        mid = (inside + outside) / 2.0
        s = stats_of(d, mid)
        keep = np.stack([s[0, :, 0], s[0, :, 1], s[1, :, 2], s[2, :, 3]], axis=1) < target
        inside, outside = np.where(keep, mid, inside), np.where(keep, outside, mid)
    out[live] = np.where(todo[live], outside, out[live])
    return out


def _t_edges(d: np.ndarray, level: float, g: float) -> np.ndarray:
    """Deltas [R, n] -> [R, 4]: the t e-process's confidence sequence and equivalence bounds (`_band`)."""
    r, n = d.shape
    if n < 2:
        return np.tile([-math.inf, math.inf, -math.inf, math.inf], (r, 1))
    mean, se = d.mean(axis=1), d.std(axis=1, ddof=1) / math.sqrt(n)
    out = np.empty((r, 4))
    for col, c in enumerate((_t_star(n, level, g), _c_star(n, level, g))):
        half = np.where(se > 0, c * se, 0.0) if math.isfinite(c) else np.full(r, math.inf)
        out[:, 2 * col], out[:, 2 * col + 1] = mean - half, mean + half
    return out


def look_bounds(deltas: np.ndarray, level: float, test: str = "flip",
                prior_scale: float = DEFAULT_PRIOR_SCALE) -> np.ndarray:
    """Rows of deltas [R, n] (or one row [n]) -> [R, 4] (or [4]): the 1 - level confidence sequence (low, high)
    and the equivalence bounds (the two one-sided sequences, each at level) of `test` after those deltas."""
    d = np.asarray(deltas, dtype=float)
    one = d.ndim == 1
    d2 = d[None, :] if one else d
    if test == "flip":
        out = _sign_edges(d2, level, functools.partial(_flip_stats, g=prior_scale))
    else:
        out = _sign_edges(d2, level) if test == "sign" else _t_edges(d2, level, prior_scale)
    return out[0] if one else out


def _e(deltas: np.ndarray, test: str, prior_scale: float) -> float:
    if test == "flip":
        return flip_e_value(deltas, prior_scale)
    return sign_e_value(deltas) if test == "sign" else e_value(deltas, prior_scale)


@dataclass(frozen=True)
class SequentialState:
    """One row's sequential test after n seeds."""

    n: int
    mean: float
    cs_low: float
    cs_high: float
    e_value: float  # against mean 0
    decision: Decision
    tost_low: float = -math.inf  # the equivalence bounds (`equivalence_bounds`)
    tost_high: float = math.inf


@dataclass(frozen=True)
class RowRule:
    """How a row is decided: `direction` (`minimize`: a negative delta is better); `bound`, the margin of an
    equivalence row or the MEI of a superiority row (None: no equivalence verdict); `superiority` (False:
    an equivalence row, which differs only beyond its margin)."""

    direction: str = "minimize"
    bound: float | None = None
    superiority: bool = True

    @classmethod
    def of(cls, comp: Any) -> RowRule:
        """The rule of a comparison's rows (`results.comparison.Comparison`)."""
        superiority = comp.kind == "superiority"
        return cls(comp.direction, comp.mei if superiority else comp.margin, superiority)


@dataclass(frozen=True)
class Tost:
    """A row's equivalence bounds at a look (`equivalence_bounds`) and the half-width `max_n` seeds would give
    them at the current spread (`reachable`), for futility."""

    low: float
    high: float
    reachable: float | None = None


def decide(low: float, high: float, n: int, max_n: int, rule: RowRule = RowRule(),
           reachable: float | None = None, tost: Tost | None = None, center: float | None = None) -> Decision:
    """The decision the confidence sequence [low, high] allows after n of at most max_n seeds (module doc).

    A superiority row is better/worse once the sequence excludes 0 (as the fixed-n verdict, tested against
    0), an equivalence row once it lies beyond its margin; either is equivalent once its equivalence bounds
    (`tost`; default: the sequence itself) lie within +-`rule.bound`. `reachable`: the half-width max_n seeds
    would give at the current spread (default: the current half-width shrunk by sqrt(n / max_n), which
    ignores that t* shrinks too). `center`: the mean delta futility reads (default the sequence's midpoint, the
    mean for the t e-process's; the sign test's sequence need not be symmetric about the mean)."""
    bound = rule.bound
    edge = 0.0 if rule.superiority else (bound or 0.0)
    if high < -edge or low > edge:
        better = high < -edge if rule.direction == "minimize" else low > edge
        return "better" if better else "worse"
    mean, half = (low + high) / 2.0, (high - low) / 2.0
    mean = mean if center is None else center
    if reachable is None:
        reachable = half * math.sqrt(n / max_n)
    if tost is None:
        tost = Tost(low, high, reachable)
    if bound is not None and -bound < tost.low and tost.high < bound:
        return "equivalent"
    if n >= max_n:
        return "futile"
    if not (math.isfinite(low) and math.isfinite(high)) or 2 * n < max_n:
        return "undecided"  # futility is judged from half the seeds on: an early mean is too noisy to give up on
    can_differ = abs(mean) - edge > reachable
    reach_eq = tost.reachable if tost.reachable is not None else reachable
    can_match = bound is not None and abs(mean) + reach_eq < bound
    return "undecided" if can_differ or can_match else "futile"


def _decision(d: np.ndarray, bounds: np.ndarray, max_n: int, level: float, rule: RowRule, g: float) -> Decision:
    """A row's decision at a look from its bounds (`look_bounds`): `decide`, with the half-widths max_n seeds
    would give at this spread (the t e-process's t* and c* at max_n, not at n; for the sign test too, whose
    widths at normal deltas are close to them: a futility rule only stops early), less how far the mean may
    still drift in the seeds to come (its 97.5% quantile): futility waits while a verdict keeps a 2.5% chance
    under the current trend."""
    return _decide_at(float(d.std(ddof=1)), float(d.mean()), d.size, bounds, max_n, level, rule, g)


def _decide_at(sd: float, mean: float, n: int, bounds: np.ndarray, max_n: int, level: float, rule: RowRule,
               g: float) -> Decision:
    """`_decision` from the row's SD and mean after n deltas (`simulate_design` takes them for all rows at once)."""
    spread, drift = sd / math.sqrt(max_n), FUTILITY_Z * sd * math.sqrt(max_n - n) / max_n
    tost = Tost(float(bounds[2]), float(bounds[3]), _c_star(max_n, level, g) * spread - drift)
    return decide(float(bounds[0]), float(bounds[1]), n, max_n, rule, _t_star(max_n, level, g) * spread - drift,
                  tost, mean)


def sequential_path(deltas: np.ndarray | list[float], looks: list[int], alpha: float, max_n: int, *,
                    rows: int = 1, rule: RowRule = RowRule(), prior_scale: float = DEFAULT_PRIOR_SCALE,
                    test: str = "flip") -> list[SequentialState]:
    """The row's state at each look (seed counts, ascending), each at level alpha / rows (Bonferroni over
    the family's rows), stopping at the first decision, by `test` ("flip", "sign" or "t"). A function of the deltas in
    seed order only: a driver that restarts recomputes the same path."""
    d = np.asarray(deltas, dtype=float)
    level = alpha / rows
    path = []
    for n in looks:
        if n > d.size:
            break
        bounds = look_bounds(d[:n], level, test, prior_scale)
        decision = _decision(d[:n], bounds, max_n, level, rule, prior_scale)
        path.append(SequentialState(n, float(d[:n].mean()), float(bounds[0]), float(bounds[1]),
                                    _e(d[:n], test, prior_scale), decision, float(bounds[2]), float(bounds[3])))
        if decision != "undecided":
            break
    return path


SEQUENTIAL_COLUMNS = ("comparison", "grid_key", "control", "treatment", "metric", "direction", "rows", "n", "looks",
                      "mean_delta", "cs_low", "cs_high", "tost_low", "tost_high", "e_value", "decision", "bound",
                      "path", "by_seed")


def _row_deltas(pairs: pd.DataFrame, seeds: tuple[int, ...]) -> np.ndarray:
    """A row's deltas in the study's seed order, up to the first seed without both arms finished: the
    sequence is read in a fixed order, so a gap ends it (the seeds after it wait for the gap's rerun)."""
    by_seed = dict(zip(pairs["seed"], pairs["delta"], strict=True))
    out = []
    for seed in seeds:
        value = by_seed.get(seed, math.nan)
        if not math.isfinite(value):
            break
        out.append(value)
    return np.array(out, dtype=float)


def _gap(pairs: pd.DataFrame, seeds: tuple[int, ...], read: int) -> int | None:
    """The seed a row's sequence stops at (`_row_deltas` read `read` of them) while a later seed has both arms
    finished: the row waits for that seed's rerun, not for the next look; None when there is no such gap."""
    if read >= len(seeds):
        return None
    later = set(seeds[read + 1:])
    finished = {s for s, d in zip(pairs["seed"], pairs["delta"], strict=True) if math.isfinite(d)}
    return seeds[read] if later & finished else None


def sequential_table(pairs: pd.DataFrame, comparisons: Iterable[Any], design: SequentialDesign,
                     seeds: tuple[int, ...], alpha: float = 0.05) -> pd.DataFrame:
    """Per comparison, grid point and treatment: its path through the design's looks (`sequential_path`)
    on the per-seed deltas (`results.collect.pairs_table`), each row at alpha / (the rows of its family: every
    comparison with the same `family`, as the fixed design's correction),
    and where it stands: the last look's n, mean delta, confidence sequence, e-value against 0 and
    decision ("undecided": it needs the next batch). A pure function of the finished runs."""
    out = []
    comparisons = list(comparisons)
    grouped = {comp.name: list(pairs[pairs["comparison"] == comp.name].groupby(["grid_key", "treatment"],
                                                                              sort=False))
               for comp in comparisons}
    family: dict[str, int] = {}  # Bonferroni over the family's rows, as the fixed design's Holm/BH (issue 35)
    for comp in comparisons:
        family[comp.family] = family.get(comp.family, 0) + len(grouped[comp.name])
    table_waits: dict[tuple[str, str, str], int] = {}  # undecided rows waiting for a seed's rerun (`_gap`)
    for comp in comparisons:
        rows = family[comp.family]
        for (grid_key, treatment), group in grouped[comp.name]:
            rule = RowRule.of(comp)
            deltas = _row_deltas(group, seeds)
            path = sequential_path(deltas, design.looks(), alpha, design.max, rows=rows, rule=rule,
                                   prior_scale=design.prior_scale, test=design.test)
            shown = deltas[:path[-1].n] if path else deltas[:0]  # the sequence seed by seed, up to the last look
            by_seed = [(n, float(shown[:n].mean()),
                        *map(float, look_bounds(shown[:n], alpha / rows, design.test, design.prior_scale)[:2]))
                       for n in range(2, shown.size + 1)]
            last = path[-1] if path else SequentialState(0, math.nan, -math.inf, math.inf, 1.0, "undecided")
            gap = _gap(group, seeds, deltas.size)
            if gap is not None and last.decision == "undecided":
                table_waits[comp.name, grid_key, treatment] = gap
            out.append({"comparison": comp.name, "grid_key": grid_key, "control": comp.control,
                        "treatment": treatment, "metric": comp.metric, "direction": comp.direction,
                        "rows": rows, "n": last.n, "looks": [s.n for s in path], "mean_delta": last.mean,
                        "cs_low": last.cs_low, "cs_high": last.cs_high, "tost_low": last.tost_low,
                        "tost_high": last.tost_high, "e_value": last.e_value,
                        "decision": last.decision, "bound": rule.bound,
                        "path": [(s.n, s.mean, s.cs_low, s.cs_high) for s in path], "by_seed": by_seed})
    table = pd.DataFrame(out, columns=list(SEQUENTIAL_COLUMNS))
    table.attrs["alpha"] = alpha
    table.attrs["test"] = design.test
    table.attrs["waits"] = table_waits
    return table


def sequential_text(table: pd.DataFrame, design: SequentialDesign) -> str:
    """The sequential table as the terminal prints it: the primary result of a sequential study."""
    alpha = float(table.attrs.get("alpha", 0.05))
    level = f"{100 * (1 - alpha):g}%"
    lines = [f"sequential test (anytime-valid; {TEST_WORDS[design.test]}; seeds {design.start} then +{design.batch} "
             f"per look, at most {design.max}; each row at alpha / its family's rows): delta = treatment - control, "
             f"{level} confidence sequence; equivalence bounds: the two one-sided sequences, each at that level (TOST)"]
    for r in table.to_dict("records"):
        where = f" [{r['grid_key']}]" if r["grid_key"] else ""
        cs = "unbounded" if not math.isfinite(r["cs_low"]) else f"[{r['cs_low']:.4g}, {r['cs_high']:.4g}]"
        tost = "" if r["bound"] is None or not math.isfinite(r["tost_low"]) else (
            f", equivalence bounds [{r['tost_low']:.4g}, {r['tost_high']:.4g}] against +-{r['bound']:.4g}")
        if tost and r["decision"] in ("better", "worse"):  # bounds of another width than the CS that decided
            tost += " (the one-sided pair, for reference: the CS decided this row)"
        head = f"  {r['comparison']}{where}: {r['treatment']} vs {r['control']} on {r['metric']}: "
        gap = table.attrs.get("waits", {}).get((r["comparison"], r["grid_key"], r["treatment"]))
        waits = "" if gap is None else (f"waits for seed {gap}: a run of it did not finish and the sequence reads "
                                        "seeds in order (`reslab run` reruns it)")
        if gap is not None and not r["looks"]:
            lines.append(f"{head}undecided, {waits}; later seeds finished")
            continue
        lines.append(f"{head}{r['decision']} after {r['n']} seeds (looks {r['looks']}); mean delta "
                     f"{r['mean_delta']:.4g}, CS {cs}{tost}, e-value {r['e_value']:.3g}"
                     + (f"; {waits}" if waits else ""))
    return "\n".join(lines) + "\n"


def needed_arms(table: pd.DataFrame) -> set[str]:
    """The arms the undecided rows still need (their controls and treatments)."""
    open_rows = table[table["decision"] == "undecided"]
    return set(open_rows["control"]) | set(open_rows["treatment"])


@dataclass(frozen=True)
class DesignPower:
    """What a sequential design does at a true effect, by simulation (`simulate_design`)."""

    reps: int
    mean_seeds: float  # seeds run until the row stopped (or max)
    mean_seeds_se: float  # its Monte Carlo standard error
    decided: dict[str, float]  # decision -> share of replicates
    fixed_seeds: int | None  # the fixed design's seeds for the same power, for comparison (None: not given)


def simulate_design(design: SequentialDesign, effect: float, sd: float, *, alpha: float = 0.05,
                    rule: RowRule = RowRule(), reps: int = 2000, seed: int = 0,
                    noise: Callable[[np.random.Generator, tuple[int, int]], np.ndarray] | None = None) -> DesignPower:
    """Deltas ``effect + sd * noise`` (default: standard normal noise; `noise(rng, (reps, max))` draws another)
    through the design's looks and its test at the row's level `alpha` (a family of m rows: alpha / m), `reps`
    times: the expected seeds to a decision (with its Monte Carlo SE) and how often each decision is reached.
    The replicates still open at a look are read together."""
    rng = np.random.default_rng(seed)
    shape = (reps, design.max)
    d = effect + sd * (rng.standard_normal(shape) if noise is None else np.asarray(noise(rng, shape), dtype=float))
    level = alpha
    stops = np.full(reps, float(design.max))
    decided = np.full(reps, "undecided", dtype=object)
    for n in design.looks():
        idx = np.flatnonzero(decided == "undecided")
        if not idx.size:
            break
        rows = d[idx, :n]
        bounds = look_bounds(rows, level, design.test, design.prior_scale)
        sds, means = rows.std(axis=1, ddof=1), rows.mean(axis=1)  # each row's as `_decision` takes them, at once
        for j, i in enumerate(idx):
            decision = _decide_at(float(sds[j]), float(means[j]), n, bounds[j], design.max, level, rule,
                                  design.prior_scale)
            if decision != "undecided":
                stops[i], decided[i] = n, decision
    counts = dict(zip(*np.unique(decided.astype(str), return_counts=True), strict=True))
    return DesignPower(reps, float(stops.mean()), float(stops.std(ddof=1) / math.sqrt(reps)),
                       {str(k): int(v) / reps for k, v in sorted(counts.items())}, None)
