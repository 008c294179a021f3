"""Power before compute: what a study's comparisons can show with the pairs they will have.

One function, `attainable_p`, gives the smallest p a comparison row can reach after its family's
correction, from the number of complete, non-zero pairs, the family size and the test; the plan,
the refusal before a run (`check_confirmatory`) and `compare`'s flags all use it. `power_rows`
sizes seeds for a declared minimum effect with the test that decides the verdict: the exact sign
flip (`sign_flip_power`) or the sign-flip TOST (`sign_flip_tost_power`), Monte Carlo over normal
draws of the per-seed deltas with its standard error stated, next to the paired-t approximation
(noncentral t; TOST by integrating over the sample SD) and the sign-flip floor.

Sign-flip power. The deltas are drawn as independent N(effect, sd**2) (each pooled stratum with the
same SD); for every draw the exact sign-flip p is computed as `stats.sign_flip_p` and
`stats.pooled_summary` compute it (all 2**n patterns, counted by meet in the middle; pooled strata
scaled by their mean square), and the power is the share of draws with p <= the level. Common
random numbers: seed 0, and the draws for s seeds are a prefix of those for s + 1. Above
`EXACT_MAX_N` pairs the verdict's own p is Monte Carlo and the sign-flip figures are the paired-t
ones, marked approximate (at 20 pairs and levels 0.05-0.0025 the sign flip's power is 0.2-1.5
percentage points below the t's). This is the power of the sign flip alone: a verdict also needs the
1 - alpha CI to exclude 0 (the t TOST for equivalence), which for one stratum almost never binds
once the sign flip rejects at alpha / m; a pooled row's CI inverts the stratified sign flip itself
(`stats.stratified_flip_interval`), so it does not bind there either (the min-df t interval it
replaced did: at 4 strata x 2 seeds, effect 1.5 SD, 0.84 for the sign flip, 0.03 for both).

Downstream tasks (`task_power`): the task rows' test is a t on the variance components of a crossed
seeds x items design (`results.tasks.two_way`), so a task is sized in seeds and items together from the gain
to detect, a stated seed SD (how much a seed's paired accuracy delta moves on its own) and the items' variance
(for 0/1 accuracy from the accuracies and the share of it that is the items' own, `TaskVariance.of_accuracy`),
at alpha / the number of tasks (Holm's first step over a comparison's tasks). More items never shrink the
seeds' part of the variance: past some seed SD no item count reaches the power, and the row says so.

Planning level. With m rows in a family, the first Holm step (and Benjamini-Hochberg when only
one hypothesis is false) rejects at p <= alpha / m, so sizing uses alpha / m for both corrections;
the floor uses each correction's best case: Holm m * p_min (every row at p_min), BH p_min.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from reslab.common.errors import ConfigError
from reslab.results.comparison import Comparison

__all__ = [
    "EXACT_MAX_N",
    "MC_DRAWS",
    "POWER_DRAWS",
    "Attainable",
    "PowerRow",
    "TaskPowerRow",
    "TaskVariance",
    "UnderpoweredStudy",
    "attainable_p",
    "check_confirmatory",
    "family_sizes",
    "paired_t_power",
    "pilot_sd",
    "plan_attainable",
    "power_rows",
    "rows_per_treatment",
    "seeds_for_floor",
    "seeds_needed",
    "sign_flip_floor",
    "sign_flip_power",
    "sign_flip_tost_power",
    "task_power",
    "tost_power",
    "two_way_power",
]

# Up to 2**20 sign patterns are enumerated exactly; beyond that a seeded Monte-Carlo estimate.
EXACT_MAX_N = 20
MC_DRAWS = 200_000
# Monte-Carlo draws of the deltas for sign-flip power: SE <= 0.5 / sqrt(20,000) = 0.0035.
POWER_DRAWS = 20_000
_POWER_SEED = 0
_PERM_RTOL = 1e-12  # as stats.sign_flip_p: a pattern ties the observed one within 1e-12 of sum|v|
_CHUNK = 1 << 22  # subset sums held at once
_MAX_SEEDS = 10_000
Sided = Literal["two-sided", "one-sided"]


class UnderpoweredStudy(ConfigError):
    """A confirmatory comparison cannot reach alpha with the study's pairs, family and correction."""


def sign_flip_floor(n_nonzero: int, sided: Sided = "two-sided") -> float:
    """Smallest sign-flip p with ``n_nonzero`` non-zero deltas (a zero delta flips to itself).

    Exact: 2 / 2**n two-sided (the observed pattern and its mirror), 1 / 2**n one-sided; Monte
    Carlo (n > 20) cannot go below 1 / (draws + 1). No pairs: 1.
    """
    if n_nonzero <= 0:
        return 1.0
    exact = (2.0 if sided == "two-sided" else 1.0) / 2.0**n_nonzero
    return exact if n_nonzero <= EXACT_MAX_N else max(exact, 1.0 / (MC_DRAWS + 1))


def attainable_p(n_nonzero: int, family_size: int, correction: str = "holm", kind: str = "superiority") -> float:
    """Smallest p a row can reach after its family's correction: Holm ``m * p_min``, BH ``p_min``.

    ``p_min`` is the two-sided sign-flip floor for superiority and the one-sided one for
    equivalence (TOST's p is the larger of two one-sided p).
    """
    if family_size < 1:
        raise ValueError(f"family_size must be >= 1, got {family_size}")
    if correction not in ("holm", "bh"):
        raise ValueError(f"correction {correction!r} is not one of ['holm', 'bh']")
    p_min = sign_flip_floor(n_nonzero, "one-sided" if kind == "equivalence" else "two-sided")
    return min(1.0, family_size * p_min) if correction == "holm" else p_min


def rows_per_treatment(comparison: Comparison, grid_axes: Mapping[str, int]) -> tuple[int, int]:
    """(rows that enter the family, pairs per such row per seed) for one treatment of a comparison.

    Without pooling every grid point is a row with one pair per seed; pooling over some axes makes
    one pooled row per point of the other axes, with one pair per seed and pooled grid point.
    """
    unknown = [a for a in comparison.pool if a not in grid_axes]
    if unknown:
        raise ConfigError(f"comparison {comparison.name!r}: pool axes {unknown} are not grid axes; "
                          f"grid axes: {', '.join(grid_axes) or '(none)'}")
    pooled = math.prod(grid_axes[a] for a in comparison.pool)
    return math.prod(grid_axes.values()) // pooled, pooled


def family_sizes(comparisons: Iterable[Comparison], grid_axes: Mapping[str, int]) -> dict[str, int]:
    """Rows that each family's correction spans (per-stratum rows of a pooled comparison do not count)."""
    sizes: dict[str, int] = {}
    for c in comparisons:
        sizes[c.family] = sizes.get(c.family, 0) + len(c.treatments) * rows_per_treatment(c, grid_axes)[0]
    return sizes


@dataclass(frozen=True)
class Attainable:
    """What one comparison can show: each of its rows has ``n_pairs`` pairs in a family of ``family_size``."""

    comparison: Comparison
    family_size: int
    n_pairs: int
    p: float
    alpha: float

    @property
    def reachable(self) -> bool:
        return self.p <= self.alpha

    def line(self) -> str:
        c = self.comparison
        status = "exploratory" if c.exploratory else "confirmatory"
        verdict = "can reach" if self.reachable else "CANNOT reach"
        return (f"{c.name} ({status}, {c.kind}): {self.n_pairs} pairs per row, family {c.family!r} of "
                f"{self.family_size} ({c.correction}): smallest attainable p {self.p:.3g} {verdict} "
                f"alpha={self.alpha:g}")


def plan_attainable(comparisons: Iterable[Comparison], n_seeds: int, grid_axes: Mapping[str, int],
                    alpha: float = 0.05) -> list[Attainable]:
    """The attainable p of every comparison when every run finishes with a non-zero delta."""
    comparisons = list(comparisons)
    sizes = family_sizes(comparisons, grid_axes)
    out = []
    for c in comparisons:
        n = n_seeds * rows_per_treatment(c, grid_axes)[1]
        m = sizes[c.family]
        out.append(Attainable(c, m, n, attainable_p(n, m, c.correction, c.kind), alpha))
    return out


def check_confirmatory(comparisons: Iterable[Comparison], n_seeds: int, grid_axes: Mapping[str, int],
                       alpha: float = 0.05, *, study: str = "study") -> list[Attainable]:
    """Refuse (`UnderpoweredStudy`) when a confirmatory comparison cannot reach ``alpha``.

    Returns the plan when every confirmatory comparison can; exploratory ones never refuse.
    """
    plan = plan_attainable(comparisons, n_seeds, grid_axes, alpha)
    short = [a for a in plan if not a.comparison.exploratory and not a.reachable]
    if short:
        parts = []
        for a in short:
            need = seeds_for_floor(a.family_size, a.comparison.correction, a.comparison.kind, alpha,
                                   a.n_pairs // n_seeds)
            parts.append(f"{a.comparison.name} (smallest attainable p {a.p:.3g} with {n_seeds} seeds, family of "
                         f"{a.family_size}; needs {need} seeds)")
        raise UnderpoweredStudy(
            f"{study}: comparisons cannot reach alpha={alpha:g}: " + "; ".join(parts)
            + ". Add seeds (see `reslab power`), declare the comparison `exploratory: true`, "
            "or pass --allow-underpowered"
        )
    return plan


def seeds_for_floor(family_size: int, correction: str, kind: str, alpha: float, pairs_per_seed: int = 1) -> int:
    """Fewest seeds whose sign-flip floor after correction is at most ``alpha``."""
    for seeds in range(1, _MAX_SEEDS):
        if attainable_p(seeds * pairs_per_seed, family_size, correction, kind) <= alpha:
            return seeds
    raise ValueError(f"no seed count up to {_MAX_SEEDS} reaches alpha={alpha}")


def paired_t_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t test (both rejection tails) for a true mean delta ``effect``.

    The statistic is noncentral t with n - 1 df and noncentrality effect / sd * sqrt(n).
    """
    if n < 2:
        return math.nan
    from scipy import stats as sps  # here, not at the top: a submission's preflight needs no scipy

    df = n - 1
    crit = float(sps.t.ppf(1.0 - alpha / 2.0, df))
    nc = effect / sd * math.sqrt(n)
    power = float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))
    if math.isfinite(power):
        return power
    # scipy's nct returns NaN far in the tail (large nc); there the t statistic is normal to many digits
    return float(sps.norm.sf(crit - nc) + sps.norm.cdf(-crit - nc))


def tost_power(true_delta: float, sd: float, n: int, margin: float, alpha: float) -> float:
    """Power of paired TOST at level ``alpha`` with margin ``margin`` when the true mean delta is ``true_delta``.

    TOST passes when mean -/+ t(1-alpha, n-1) * s / sqrt(n) lies inside (-margin, margin). Given the
    sample SD s the mean is normal, so the power is an integral over (n - 1) s^2 / sd^2 ~ chi2(n - 1).
    """
    if n < 2:
        return math.nan
    from scipy import integrate
    from scipy import stats as sps

    df = n - 1
    crit = float(sps.t.ppf(1.0 - alpha, df))
    se_true = sd / math.sqrt(n)

    def given_v(v: float) -> float:
        half = crit * sd * math.sqrt(v / df) / math.sqrt(n)
        if half >= margin:
            return 0.0
        hi = sps.norm.cdf((margin - half - true_delta) / se_true)
        lo = sps.norm.cdf((-margin + half - true_delta) / se_true)
        return float(hi - lo) * float(sps.chi2.pdf(v, df))

    # Past v_max the interval is wider than the margin and the integrand is 0.
    v_max = df * (margin * math.sqrt(n) / (crit * sd)) ** 2
    value, _ = integrate.quad(given_v, 0.0, v_max, limit=200)
    return float(min(1.0, max(0.0, value)))


def _subset_sums(v: np.ndarray) -> np.ndarray:
    """[R, k] -> [R, 2**k]: each row's sums over all subsets of its k values."""
    sums = np.zeros((v.shape[0], 1))
    for j in range(v.shape[1]):
        sums = np.concatenate([sums, sums + v[:, j : j + 1]], axis=1)
    return sums


def _subsets_at_most(v: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Per row of ``v`` [R, n]: how many of its 2**n subsets sum to at most ``t[row]`` (meet in the middle)."""
    h = v.shape[1] // 2
    low = t[:, None] - _subset_sums(v[:, :h])  # a subset of the first h joins those of the rest summing <= this
    high = _subset_sums(v[:, h:])
    if v.shape[1] <= 10:
        return (high[:, None, :] <= low[:, :, None]).sum(axis=(1, 2))
    high.sort(axis=1)
    low.sort(axis=1)
    return np.array([np.searchsorted(hi, lo, side="right").sum() for hi, lo in zip(high, low, strict=True)])


def _flip_p(values: np.ndarray, alternative: str) -> np.ndarray:
    """Exact sign-flip p of each row's sum, for rows of ``values`` [R, n] without zeros.

    Flipping the signs of a subset F lowers the sum by 2 sum_F: "greater" counts the F with
    sum_F <= 0; two-sided, |sum| is reached by the F of magnitudes summing to at most the observed
    minority's, and by their complements.
    """
    n = values.shape[1]
    tol = _PERM_RTOL * np.abs(values).sum(axis=1)
    if alternative == "greater":
        return _subsets_at_most(values, tol / 2.0) / 2.0**n
    if alternative == "less":
        return _subsets_at_most(-values, tol / 2.0) / 2.0**n
    mags = np.abs(values)
    minority = (mags.sum(axis=1) - np.abs(values.sum(axis=1))) / 2.0
    return np.minimum(1.0, 2.0 * _subsets_at_most(mags, minority + tol / 2.0) / 2.0**n)


def _scaled(d: np.ndarray) -> np.ndarray:
    """[R, seeds, strata] -> [R, seeds * strata]: each stratum over its mean square, as the stratified flip."""
    return (d / np.mean(d**2, axis=1, keepdims=True)).reshape(d.shape[0], -1)


def _rejections(mean: float, sd: float, seeds: int, strata: int, test: Callable[[np.ndarray], np.ndarray],
                draws: int) -> tuple[float, float]:
    """Share of ``draws`` normal draws [seeds, strata] that ``test`` rejects, and its Monte-Carlo SE."""
    n = seeds * strata
    if n > EXACT_MAX_N:
        raise ValueError(f"{n} pairs: sign-flip power is computed exactly per draw for at most {EXACT_MAX_N}")
    z = np.random.default_rng(_POWER_SEED).standard_normal((seeds, strata, draws))  # prefix in seeds
    d = mean + sd * np.moveaxis(z, -1, 0)
    chunk = max(1, _CHUNK >> (n if n <= 10 else n // 2 + 1))  # _subsets_at_most's working set per row
    hits = sum(int(test(d[i : i + chunk]).sum()) for i in range(0, draws, chunk))
    power = hits / draws
    return power, math.sqrt(power * (1.0 - power) / draws)


def _at_level(p: np.ndarray, level: float) -> np.ndarray:
    return p <= level * (1.0 + 1e-12)  # the adjusted p is m * p: rounding must not flip a p at the level


def sign_flip_power(effect: float, sd: float, seeds: int, level: float, *, strata: int = 1,
                    draws: int = POWER_DRAWS) -> tuple[float, float]:
    """(power, Monte-Carlo SE) of the two-sided exact sign flip at ``level``: deltas N(effect, sd**2).

    ``strata`` > 1: the stratified sign flip of a pooled row (``seeds`` pairs in each stratum, all with
    SD ``sd``). Exactly 0 (SE 0) when the floor 2 / 2**n exceeds ``level``. At most `EXACT_MAX_N` pairs.
    """
    if sign_flip_floor(seeds * strata) > level:
        return 0.0, 0.0
    return _rejections(effect, sd, seeds, strata, lambda d: _at_level(_flip_p(_scaled(d), "two-sided"), level),
                       draws)


def sign_flip_tost_power(true_delta: float, sd: float, seeds: int, margin: float, level: float, *,
                         strata: int = 1, draws: int = POWER_DRAWS) -> tuple[float, float]:
    """(power, Monte-Carlo SE) of the sign-flip TOST within +-``margin`` at ``level``: N(true_delta, sd**2).

    Both one-sided exact sign flips (``d + margin`` greater, ``d - margin`` less, each stratum scaled by
    its own mean square) must reach ``level``. Exactly 0 when the floor 1 / 2**n exceeds ``level``.
    """
    if sign_flip_floor(seeds * strata, "one-sided") > level:
        return 0.0, 0.0

    def passes(d: np.ndarray) -> np.ndarray:
        low = _flip_p(_scaled(d + margin), "greater")
        return _at_level(np.maximum(low, _flip_p(_scaled(d - margin), "less")), level)

    return _rejections(true_delta, sd, seeds, strata, passes, draws)


def seeds_needed(target: float, power_at: Callable[[int], float], pairs_per_seed: int = 1) -> int | None:
    """Fewest seeds (>= 2) whose power reaches ``target``; None when even 10,000 seeds do not.

    Doubling then bisection: power grows with n, and the noncentral t is only evaluated near the answer
    (far past it scipy's nct can return NaN).
    """
    hi = 2
    while not power_at(hi * pairs_per_seed) >= target:
        if hi >= _MAX_SEEDS:
            return None
        hi = min(2 * hi, _MAX_SEEDS)
    lo = max(2, hi // 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if power_at(mid * pairs_per_seed) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _t_power_at(effect: float, sd: float, level: float, n: int) -> float:
    return paired_t_power(effect, sd, n, level)


def _tost_power_at(true_delta: float, sd: float, margin: float, level: float, n: int) -> float:
    return tost_power(true_delta, sd, n, margin, level)


@dataclass(frozen=True)
class PowerRow:
    """Seeds a comparison needs for 80% and 90% power, by the test that decides its verdict, and for the floor.

    ``power_now``, ``seeds_80``, ``seeds_90``: the exact sign flip (the sign-flip TOST for equivalence),
    Monte Carlo over ``draws`` normal draws of the deltas (``power_now_se`` its SE); ``t_power_now``,
    ``t_seeds_80``, ``t_seeds_90``: the paired-t approximation (noncentral t; TOST by integration).
    ``approximate`` names the sign-flip figures that need more than `EXACT_MAX_N` pairs and so are the
    paired-t ones (``"power now"``, ``"80%"``, ``"90%"``).
    """

    comparison: str
    kind: str
    family: str
    family_size: int
    correction: str
    effect: float | None
    sd: float
    true_delta: float
    level: float
    seeds_now: int
    power_now: float
    power_now_se: float
    seeds_80: int | None
    seeds_90: int | None
    seeds_floor: int
    t_power_now: float
    t_seeds_80: int | None
    t_seeds_90: int | None
    approximate: tuple[str, ...] = ()
    draws: int = POWER_DRAWS

    @property
    def seeds_recommended(self) -> int | None:
        """The sign-flip seeds for 80% power, and at least the seeds of the floor after the family's correction."""
        return None if self.seeds_80 is None else max(self.seeds_80, self.seeds_floor)


def _scan(target: float, power: Callable[[int], float], start: int, last: int,
          t_seeds: int | None) -> tuple[int | None, bool]:
    """(fewest seeds from ``start`` to ``last`` whose ``power`` reaches ``target``, False); past ``last``
    the sign flip is not computed and the paired-t answer ``t_seeds`` stands in: (it, True)."""
    for seeds in range(start, last + 1):
        if power(seeds) >= target:
            return seeds, False
    return (None if t_seeds is None else max(t_seeds, last + 1, start)), True


def _sized(kind: str, effect: float, sd: float, level: float, per_seed: int, n_seeds: int,
           true_delta: float) -> dict:
    """The power fields of a `PowerRow`: sign flip (or sign-flip TOST) beside the paired t (or TOST)."""
    cache: dict[int, tuple[float, float]] = {}
    if kind == "equivalence":
        t_at = partial(_tost_power_at, true_delta, sd, effect, level)
        run = partial(sign_flip_tost_power, true_delta, sd, margin=effect, level=level, strata=per_seed)
    else:
        t_at = partial(_t_power_at, effect, sd, level)
        run = partial(sign_flip_power, effect, sd, level=level, strata=per_seed)

    def flip(seeds: int) -> float:
        if seeds not in cache:
            cache[seeds] = run(seeds)
        return cache[seeds][0]

    sided: Sided = "one-sided" if kind == "equivalence" else "two-sided"
    start = next((k for k in range(1, _MAX_SEEDS) if sign_flip_floor(k * per_seed, sided) <= level), _MAX_SEEDS)
    last = EXACT_MAX_N // per_seed
    out: dict = {"t_power_now": t_at(n_seeds * per_seed)}
    approximate = []
    for target, key in ((0.8, "80"), (0.9, "90")):
        t_seeds = seeds_needed(target, t_at, per_seed)
        # The paired t is the most powerful scale- and sign-invariant test of normal deltas, and the sign
        # flip is one such test: it needs at least the t's seeds. No such bound holds for the TOSTs.
        lower = start if kind == "equivalence" or t_seeds is None else max(start, t_seeds)
        out[f"seeds_{key}"], approx = _scan(target, flip, lower, last, t_seeds)
        out[f"t_seeds_{key}"] = t_seeds
        if approx:
            approximate.append(f"{key}%")
    if n_seeds <= last:
        flip(n_seeds)
        out["power_now"], out["power_now_se"] = cache[n_seeds]
    else:
        out["power_now"], out["power_now_se"] = out["t_power_now"], math.nan
        approximate.insert(0, "power now")
    return out | {"approximate": tuple(approximate)}


def power_rows(comparisons: Iterable[Comparison], n_seeds: int, grid_axes: Mapping[str, int],
               sd: float | Mapping[str, float], alpha: float = 0.05, *, true_delta: float = 0.0,
               mei: float | None = None) -> list[PowerRow]:
    """Seeds needed per comparison for its declared ``mei`` (superiority) or ``margin`` (equivalence).

    Args:
        sd: the paired SD (SD of treatment - control across seeds) in the metric's units, one for
            all comparisons or one per comparison name.
        true_delta: the true mean delta assumed for equivalence power (0: the arms are identical).
        mei: used for a superiority comparison that declares none.
    The power is the sign flip's (sign-flip TOST's) at level alpha / m (module docstring), beside the
    paired t's; pooled rows count pairs over their pooled grid points, and their sign flip is the
    stratified one. ``seeds_80``/``seeds_90`` and `PowerRow.seeds_recommended` are the sign flip's.
    """
    if not 0.0 < alpha < 1.0:
        raise ConfigError(f"alpha {alpha!r} is not allowed; give a number in (0, 1)")
    comparisons = list(comparisons)
    sizes = family_sizes(comparisons, grid_axes)
    out = []
    for c in comparisons:
        s = sd[c.name] if isinstance(sd, Mapping) else sd
        if not (isinstance(s, int | float) and math.isfinite(s) and s > 0):
            raise ConfigError(f"comparison {c.name!r}: paired SD {s!r} is not allowed; give a positive number")
        m = sizes[c.family]
        level = alpha / m
        per_seed = rows_per_treatment(c, grid_axes)[1]
        effect = c.margin if c.kind == "equivalence" else (c.mei if c.mei is not None else mei)
        nan = math.nan
        powers = (_sized(c.kind, effect, float(s), level, per_seed, n_seeds, true_delta) if effect is not None
                  else {"power_now": nan, "power_now_se": nan, "seeds_80": None, "seeds_90": None,
                        "t_power_now": nan, "t_seeds_80": None, "t_seeds_90": None})
        out.append(PowerRow(
            comparison=c.name, kind=c.kind, family=c.family, family_size=m, correction=c.correction,
            effect=effect, sd=float(s), true_delta=true_delta if c.kind == "equivalence" else nan,
            level=level, seeds_now=n_seeds, seeds_floor=seeds_for_floor(m, c.correction, c.kind, alpha, per_seed),
            **powers,
        ))
    return out


def pilot_sd(deltas: Iterable[np.ndarray]) -> float:
    """Pooled paired SD from a pilot's per-row deltas: sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1))."""
    ss, df = 0.0, 0
    for d in deltas:
        d = np.asarray(d, dtype=np.float64)
        if d.size >= 2:
            ss += float(((d - d.mean()) ** 2).sum())
            df += d.size - 1
    if df == 0:
        raise ConfigError("the pilot has no row with two or more complete pairs; cannot estimate a paired SD")
    return math.sqrt(ss / df)


# ----------------------------------------------------------------------------- downstream tasks: seeds x items
_MAX_ITEMS = 10_000_000


@dataclass(frozen=True)
class TaskVariance:
    """The paired difference d[s, i] = treatment - control of seed s on item i as a crossed design
    (`results.tasks`): d = gain + a_s + b_i + e_si, with SDs `seed_sd` (a seed's own shift), `item_sd` (an
    item's, the same in every seed) and `interaction_sd` (seed x item)."""

    seed_sd: float
    item_sd: float
    interaction_sd: float

    @classmethod
    def of_accuracy(cls, gain: float, seed_sd: float, accuracy: float, item_share: float) -> TaskVariance:
        """For 0/1 accuracy: one seed pair's per-item variance of d is its discordance less gain^2, the
        discordance that of errors independent between the arms at `accuracy` (control) and `accuracy + gain`
        (treatment), the most items can disagree; `item_share` of it is the items' own, the rest the
        interaction (a pilot's task row gives the shares)."""
        treated = accuracy + gain
        if not (0 < accuracy < 1 and 0 < treated < 1 and 0 <= item_share <= 1 and seed_sd >= 0):
            raise ConfigError(f"task power: accuracy {accuracy:g} + gain {gain:g}, item share {item_share:g}, seed SD "
                              f"{seed_sd:g} are not allowed; allowed: both accuracies in (0, 1), a share in [0, 1], "
                              "an SD >= 0")
        per_item = accuracy * (1 - treated) + treated * (1 - accuracy) - gain**2
        return cls(seed_sd, math.sqrt(item_share * per_item), math.sqrt((1 - item_share) * per_item))

    def parts(self, seeds: int, items: int) -> tuple[float, float, float]:
        """The expectations of `results.tasks.two_way`'s V_seed, V_item and V_res at `seeds` x `items`."""
        inter = self.interaction_sd**2 / (seeds * items)
        return self.seed_sd**2 / seeds + inter, self.item_sd**2 / items + inter, inter


def two_way_power(gain: float, variance: TaskVariance, seeds: int, items: int, level: float) -> float:
    """Power of the task rows' test (`results.tasks.two_way`: the two-sided t on V = V_seed + V_item - V_res
    with Satterthwaite's df) for a true gain, at the expected variance parts: a noncentral t on the df those
    parts give. `tests/results/test_task_power.py` checks it against simulated studies."""
    from scipy import stats as sps

    if seeds < 2 or items < 2:
        return math.nan
    v_seed, v_item, v_res = variance.parts(seeds, items)
    var = v_seed + v_item - v_res
    if var <= 0:
        return 1.0 if gain else level
    df = var**2 / (v_seed**2 / (seeds - 1) + v_item**2 / (items - 1) + v_res**2 / ((seeds - 1) * (items - 1)))
    crit = float(sps.t.ppf(1.0 - level / 2.0, df))
    nc = gain / math.sqrt(var)
    power = float(sps.nct.sf(crit, df, nc) + sps.nct.cdf(-crit, df, nc))
    return power if math.isfinite(power) else float(sps.norm.sf(crit - nc) + sps.norm.cdf(-crit - nc))


def _fewest(target: float, power_at: Callable[[int], float], least: int, most: int) -> int | None:
    """Fewest n in [least, most] whose power reaches `target` (power grows with n); None when `most` does not."""
    if not power_at(most) >= target:
        return None
    lo, hi = least, most
    while lo < hi:
        mid = (lo + hi) // 2
        if power_at(mid) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass(frozen=True)
class TaskPowerRow:
    """A task's sizing (`task_power`): power at the study's seeds x items, the seeds each power needs at its
    items and the items each needs at its seeds (None: unreachable, e.g. the seeds' variance alone keeps the
    interval too wide whatever the items)."""

    task: str
    gain: float
    level: float
    seeds_now: int
    items_now: int
    power_now: float
    seeds_80: int | None
    seeds_90: int | None
    items_80: int | None
    items_90: int | None


def task_power(task: str, gain: float, variance: TaskVariance, seeds: int, items: int, level: float) -> TaskPowerRow:
    """Seeds and items a task needs for 80% and 90% power to detect `gain` at `level` (module section above)."""
    by_seeds = partial(lambda n, s: two_way_power(gain, variance, s, n, level), items)
    by_items = partial(lambda s, n: two_way_power(gain, variance, s, n, level), seeds)
    return TaskPowerRow(
        task=task, gain=gain, level=level, seeds_now=seeds, items_now=items,
        power_now=two_way_power(gain, variance, seeds, items, level),
        seeds_80=_fewest(0.8, by_seeds, 2, _MAX_SEEDS), seeds_90=_fewest(0.9, by_seeds, 2, _MAX_SEEDS),
        items_80=_fewest(0.8, by_items, 2, _MAX_ITEMS), items_90=_fewest(0.9, by_items, 2, _MAX_ITEMS))
