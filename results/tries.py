"""Tries of a comparison: what makes two tests the same comparison, what makes them two tries, and the level
the k-th try is tested at when the verdict corrects over them (issue 55 item 4).

A comparison is its content, not its names: the control's and the treatment's resolved run configs without the
seed (the grid point enters through the fields it sets) and the metric (`comparison_key`). The same comparison
submitted under another study name, or with its arms renamed, has the same key; read in the other direction it
is the same comparison too (flipping `direction` is one more way to shop). A pooled row's key is over its strata.

A try is one distinct set of seeds of a key (`try_id`: the seeds, and the sequential design that reads them):
the seeds come from the study's design (`seeds: N`, `{count: N, replicate: R}`, a sequential design), so a
re-submitted or resumed study is the same try, and a new replicate, or another count, is a new one. The
workspace's ledger (`orchestrator.durability.ledger`) records them; `spent_alpha` is the level of the k-th.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from reslab.results.comparison import Comparison
from reslab.results.sequential import SequentialDesign
from reslab.results.stats import grid_parts

__all__ = ["comparison_key", "design_words", "ledger_records", "row_keys", "seedless", "spent_alpha", "study_try",
           "try_id"]


def spent_alpha(alpha: float, k: int) -> float:
    """The level of a key's k-th try (k >= 1): alpha_k = alpha * 6 / (pi^2 k^2).

    The bound. Let H0 hold for the comparison (both arms' metric has the same distribution) and let try k be a
    test of level alpha_k: P(try k says "better" or "worse") <= alpha_k under H0, whatever happened in tries
    1..k-1 (each try reads fresh seeds; the ledger fixes k before the try's result exists). A loop that re-submits
    the comparison and stops at its first win makes a false claim only if some try k it ran rejected at alpha_k,
    so by the union bound, however the loop chooses to go on or stop and however dependent the tries are,

        P(false claim) <= sum_{k >= 1} alpha_k = alpha * (6 / pi^2) * sum_{k >= 1} 1 / k^2 = alpha * (6 / pi^2)
                          * (pi^2 / 6) = alpha,

    by Euler's sum of 1 / k^2 = pi^2 / 6 (the Basel problem). The family-wise error over every try ever made is
    at most alpha, with no bound on the number of tries; the price is the k-th try's level, alpha / 1.64 for the
    first and alpha / (1.64 k^2) after. `tests/results/test_seed_shopping.py` simulates the loop."""
    if k < 1:
        raise ValueError(f"k: a try's number starts at 1, got {k}")
    return alpha * 6.0 / (math.pi ** 2 * k * k)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()).hexdigest()


def seedless(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved run config (`to_dict`'s form, as the run id hashes it) without `train.seed`."""
    out = dict(config)
    out["train"] = {k: v for k, v in dict(config.get("train") or {}).items() if k != "seed"}
    return out


def comparison_key(control: Mapping[str, Any], treatment: Mapping[str, Any], metric: str) -> str:
    """The ledger's key of one comparison (module doc): sha256 over both arms' seedless configs and the metric."""
    return _digest({"control": seedless(control), "treatment": seedless(treatment), "metric": metric})


def try_id(seeds: Iterable[int], sequential: Mapping[str, Any] | None = None) -> str:
    """One try of a key: its seeds in the design's order and, for a sequential design, the design."""
    return _digest({"seeds": [int(s) for s in seeds], "sequential": dict(sequential) if sequential else None})


def _row_key(grid_key: str, pool: tuple[str, ...]) -> str:
    return ",".join(f"{a}={'*' if a in pool else v}" for a, v in grid_parts(grid_key))


def row_keys(comparisons: Iterable[Comparison], configs: Mapping[tuple[str, str], Mapping[str, Any]]
             ) -> dict[tuple[str, str, str], str]:
    """(comparison, treatment, grid key of its row) -> the row's key, from `configs`: (arm, grid key) -> that arm's
    resolved config at that point (any seed). A pooled comparison's row (its pooled axes `*`, as the paired table
    writes them) is keyed over its strata's keys, sorted."""
    points = sorted({g for _, g in configs})
    out: dict[tuple[str, str, str], str] = {}
    for comp in comparisons:
        for treatment in comp.treatments:
            strata: dict[str, list[str]] = {}
            for g in points:
                if (comp.control, g) in configs and (treatment, g) in configs:
                    strata.setdefault(_row_key(g, tuple(comp.pool)), []).append(
                        comparison_key(configs[(comp.control, g)], configs[(treatment, g)], comp.metric))
            for row, keys in strata.items():
                out[(comp.name, treatment, row)] = keys[0] if not comp.pool else _digest(sorted(keys))
    return out


def design_words(seeds: int, replicate: int, sequential: SequentialDesign | None = None) -> str:
    """A try's design in words: `3 seeds, replicate 0`, `sequential (start 4, batch 2, max 16), replicate 1`."""
    head = (f"sequential (start {sequential.start}, batch {sequential.batch}, max {sequential.max})"
            if sequential is not None else f"{seeds} seeds")
    return f"{head}, replicate {replicate}"


def study_try(seeds: Iterable[int], sequential: SequentialDesign | None = None) -> str:
    """The try a study's seeds make (`try_id`), its sequential design as its fields."""
    return try_id(seeds, dataclasses.asdict(sequential) if sequential is not None else None)


def ledger_records(study: str, comparisons: Iterable[Comparison], configs: Mapping[tuple[str, str], Mapping[str, Any]],
                   seeds: tuple[int, ...], replicate: int, sequential: SequentialDesign | None = None
                   ) -> list[dict[str, Any]]:
    """What a submission of the study records in the ledger (`orchestrator.durability.ledger`): one record per row
    of its comparisons (`row_keys`), all of its one try."""
    comparisons = list(comparisons)
    metric = {c.name: c.metric for c in comparisons}
    tried, words = study_try(seeds, sequential), design_words(len(seeds), replicate, sequential)
    return [{"key": key, "try": tried, "study": study, "comparison": comp, "treatment": treatment, "point": row,
             "metric": metric[comp], "design": words, "replicate": replicate}
            for (comp, treatment, row), key in row_keys(comparisons, configs).items()]
