"""Seed shopping (issue 55 item 5): a loop re-submits a null comparison under new study names, each time with a new
replicate's seeds, until its verdict says "better" or it gives up after K tries. With the ledger's correction
(`results.tries.spent_alpha` at the try's number in the workspace's ledger) its false-positive rate stays at or
under alpha; without it the test shows how high it goes (near 1 - (1 - alpha)^K for K independent tries).

No training: 2000 loops of up to 10 studies each would be 20,000 trained studies; what the ledger changes is the
decision path, which this runs for real. Each try's per-seed metric values are drawn from one distribution for
both arms (a seed SD of 0.03, senpai's baseline re-runs); the decision is the paired table's own rule for a
superiority row (`results.stats.sign_flip_p`, `t_intervals` and the row verdict `_verdict`, mapped to the
verdict's words by `results.verdict.FIXED_WORDS`, as `fixed_verdicts` reads it); the try's number comes from the
real ledger (`orchestrator.durability.ledger`) in a temporary workspace, each loop's comparison under its own
content key (`results.tries.comparison_key`), each try's seeds the replicate's (`experiments.spec.replicate_seeds`).
The false-positive bound is checked with scipy's exact binomial test (`scipy.stats.binomtest`): the observed
count must not reject "rate <= alpha" at one-sided level 0.001.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from scipy import stats as sps

from reslab.experiments.spec import replicate_seeds
from reslab.orchestrator.durability.ledger import record_tries, tries_of
from reslab.results.stats import _verdict, sign_flip_p, t_intervals
from reslab.results.tries import comparison_key, spent_alpha, try_id
from reslab.results.verdict import FIXED_WORDS

SEED_SD = 0.03  # senpai's seed SD (0.025-0.032)
SEEDS = 10  # per study: the exact sign flip's floor 2 / 2^10 leaves the first tries' corrected levels reachable
CONTROL = {"model": {"preset": "tiny"}, "residual": {"name": "prenorm"}, "train": {"steps": 100, "seed": 0}}


def decide(deltas: np.ndarray, level: float) -> list[str]:
    """The verdict of each row of `deltas` (tries x seeds, treatment - control, to minimize) at `level`: the paired
    table's rule for a one-treatment superiority comparison (its family of one: the adjusted p is the raw p)."""
    n = deltas.shape[1]
    mean, se = deltas.mean(axis=1), deltas.std(axis=1, ddof=1) / math.sqrt(n)
    t = t_intervals(mean, se, np.full(len(deltas), n - 1.0), level)
    out = []
    for i, d in enumerate(deltas):
        p, _ = sign_flip_p(d)
        row = {"threshold": 0.0, "role": "row", "kind": "superiority", "direction": "minimize", "p_adj": p,
               "tost_perm_p_adj": math.nan, "tost_p": math.nan, "tost_ci_low": math.nan, "tost_ci_high": math.nan,
               "ci_low": float(t["ci_low"][i]), "ci_high": float(t["ci_high"][i])}
        out.append(FIXED_WORDS[_verdict(row, level)])
    return out


def shop(root: Path, loops: int, tries: int, alpha: float, corrected: bool, seed: int = 0) -> tuple[int, float]:
    """`loops` loops, each re-submitting its null comparison (its own treatment config, so its own ledger key)
    under a new study name and the next replicate until a verdict says "better" or `tries` were made; every try
    recorded in the ledger at `root` before it is decided. Returns (loops that claimed "better", mean tries)."""
    rng = np.random.default_rng(seed)
    keys = [comparison_key(CONTROL, {**CONTROL, "residual": {"name": "attnres", "loop": i}}, "val_loss_tail")
            for i in range(loops)]
    active, made = list(range(loops)), 0
    won = 0
    for replicate in range(tries):
        seeds = replicate_seeds(SEEDS, replicate)
        record_tries(root, [{"key": keys[i], "try": try_id(seeds), "study": f"shop-{i}-try{replicate}",
                             "comparison": "main", "treatment": "attnres", "point": "", "metric": "val_loss_tail",
                             "design": f"{SEEDS} seeds, replicate {replicate}", "replicate": replicate}
                            for i in active])
        ledger = tries_of(root, [keys[i] for i in active])
        control = rng.normal(3.3, SEED_SD, (len(active), SEEDS))
        treatment = rng.normal(3.3, SEED_SD, (len(active), SEEDS))  # the null: the same distribution
        deltas = treatment - control
        number = [next(t.number for t in ledger[keys[i]] if t.id == try_id(seeds)) for i in active]
        assert number == [replicate + 1] * len(active)  # each new replicate is one more try of the key
        levels = sorted(set(number))
        words: list[str] = [""] * len(active)
        for level_k in levels:
            rows = [j for j, k in enumerate(number) if k == level_k]
            level = spent_alpha(alpha, level_k) if corrected else alpha
            for j, word in zip(rows, decide(deltas[rows], level), strict=True):
                words[j] = word
        made += len(active)
        won += sum(w == "better" for w in words)
        active = [i for i, w in zip(active, words, strict=True) if w != "better"]
    return won, made / loops


LOOPS, TRIES, ALPHA = 2000, 10, 0.05


def test_shopping_seeds_with_the_ledger_s_correction_keeps_the_false_positive_rate_under_alpha(tmp_path):
    won, mean_tries = shop(tmp_path / "with", LOOPS, TRIES, ALPHA, corrected=True)
    rate = won / LOOPS
    # exact binomial (scipy): the count must not be evidence that the rate exceeds alpha (one-sided, 0.001)
    p = sps.binomtest(won, LOOPS, ALPHA, alternative="greater").pvalue
    print(f"with the ledger's correction: {won}/{LOOPS} loops claimed 'better' ({rate:.3f}), "
          f"{mean_tries:.2f} tries each; binomtest p (rate > {ALPHA}) = {p:.3g}")
    assert p > 0.001 and rate <= ALPHA + 3 * math.sqrt(ALPHA * (1 - ALPHA) / LOOPS)
    assert mean_tries > 9  # nearly every loop tried all 10 times and still won in few


def test_without_the_correction_the_loop_wins_far_more_often_than_alpha(tmp_path):
    won, mean_tries = shop(tmp_path / "without", LOOPS, TRIES, ALPHA, corrected=False)
    rate = won / LOOPS
    one = sum(w == "better" for w in decide(np.random.default_rng(1).normal(0, SEED_SD * math.sqrt(2),
                                                                               (4000, SEEDS)), ALPHA)) / 4000
    bound = 1 - (1 - one) ** TRIES  # independent tries at the one-try rate of claiming "better"
    print(f"without: {won}/{LOOPS} loops claimed 'better' ({rate:.3f}, {mean_tries:.2f} tries each); one try "
          f"claims it at {one:.4f}, so 1 - (1 - {one:.4f})^{TRIES} = {bound:.3f} (1 - (1 - alpha)^K = "
          f"{1 - (1 - ALPHA) ** TRIES:.3f} counts both directions)")
    assert rate > 4 * ALPHA
    se = math.sqrt(bound * (1 - bound) / LOOPS)
    assert abs(rate - bound) < 4 * se + 0.01
