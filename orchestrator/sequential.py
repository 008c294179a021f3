"""A sequential study (`seeds: {sequential: {start, batch, max}}`): seeds in batches until it is decided.

`run_sequential` drives the looks of the study's design (`results.sequential.SequentialDesign`): it
submits the runs of the first `start` seeds (`submit`, the same driver as any study: finished runs
are skipped, failures retried), reads the anytime-valid test of every comparison row on the finished
runs (`results.sequential.sequential_table`), and, while some row is undecided, submits the next
`batch` seeds of the arms the undecided rows need, up to `max`. A row's state is a function of the
finished runs alone, in seed order, so a driver killed at any point and run again replays the same
looks: the finished batches are skipped, the test reads the same deltas, and it continues where the
dead one stopped, with no seed run twice or skipped. Each look is one submission (one parent run in
MLflow).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.results.sequential import needed_arms, sequential_table


@dataclass
class SequentialRun:
    """What the looks did: every submission's result, the runs they covered, the last table."""

    results: list[Any] = field(default_factory=list)  # orchestrator.submit.SubmitResult per look
    runs: list[RunSpec] = field(default_factory=list)
    table: pd.DataFrame | None = None

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)


def look_runs(study: Study, runs: list[RunSpec], look: int, arms: set[str]) -> list[RunSpec]:
    """The runs of the study's first `look` seeds for `arms`."""
    seeds = set(study.seeds[:look])
    return [r for r in runs if r.seed in seeds and r.arm in arms]


def run_sequential(study: Study, runs: list[RunSpec], submit_look: Callable[[list[RunSpec]], Any],
                   read_pairs: Callable[[list[RunSpec]], pd.DataFrame], say: Callable[[str], Any],
                   alpha: float = 0.05) -> SequentialRun:
    """Submit look after look until every row is decided or the design's maximum is run (module doc).
    `submit_look(runs)` submits one look's runs; `read_pairs(runs)` is the per-seed pairs table of the
    runs so far (`results.collect.pairs_table`)."""
    if study.sequential is None:
        raise ValueError(f"study {study.name!r} is not sequential")
    out = SequentialRun()
    arms = {a.name for a in study.arms}
    covered: dict[str, RunSpec] = {}
    for look in study.sequential.looks():
        batch = look_runs(study, runs, look, arms)
        covered.update((r.run_id, r) for r in batch)
        say(f"{study.name}: look at {look} seeds ({len(batch)} runs of {', '.join(sorted(arms))})")
        result = submit_look(batch)
        out.results.append(result)
        if not result.ok:
            break
        out.table = sequential_table(read_pairs(list(covered.values())), study.comparisons, study.sequential,
                                     study.seeds, alpha)
        arms = needed_arms(out.table)
        if not arms:
            break
        undecided = out.table[out.table["decision"] == "undecided"]
        say(f"{study.name}: {len(undecided)} row(s) undecided after {look} seeds: the next look adds seeds")
    out.runs = list(covered.values())
    return out
