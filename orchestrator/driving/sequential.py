"""A sequential study's looks (`seeds: {sequential: {start, batch, max}}`): seeds in batches until it is decided.

`Looks` is the design's side of `submit.SequentialSource`, the task source that runs a sequential
study through the one dispatch loop in one submission: `next()` gives the runs of the first `start`
seeds; called again once they have all ended, it reads the anytime-valid test of every comparison row
on the finished runs (`results.sequential.sequential_table`) and, while some row is undecided, gives
the runs of the next `batch` seeds of the arms the undecided rows need (`needed_arms`), up to `max`;
None once every row is decided or the maximum is run.

The values the test reads are the finished runs' summaries in their run directories (`finished_pairs`),
never MLflow's, so a tracking outage does not stop a look. A row's state is a function of the finished
runs alone, in seed order, so a driver killed at any point and run again replays the same looks: the
finished runs are skipped, the test reads the same deltas, and it continues where the dead one
stopped, with no seed run twice or skipped.
"""

from __future__ import annotations

import pandas as pd

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.collect import FINISHED, MISSING, pairs_table
from reslab.results.sequential import needed_arms, sequential_table

__all__ = ["Looks", "finished_pairs", "look_runs"]


def look_runs(study: Study, runs: list[RunSpec], look: int, arms: set[str]) -> list[RunSpec]:
    """The runs of the study's first `look` seeds for `arms`."""
    seeds = set(study.seeds[:look])
    return [r for r in runs if r.seed in seeds and r.arm in arms]


def finished_pairs(study: Study, runs: list[RunSpec], workspace: Workspace) -> pd.DataFrame:
    """The per-seed pairs table (`results.collect.pairs_table`) of `runs`, each value from the run's own
    summary: a run without a complete `summary.json` has none."""
    rows = []
    for run in runs:
        rd = workspace.run_dir(study.name, run.run_id)
        finished = rd.complete()
        summary = (rd.summary() or {}).get("summary", {}) if finished else {}
        rows.append({**summary, "run_id": run.run_id, "arm": run.arm, "grid_key": run.grid_key, "seed": run.seed,
                     "status": FINISHED if finished else MISSING})
    return pairs_table(pd.DataFrame(rows), study.comparisons)


class Looks:
    """The looks of one sequential study (module docstring): which runs each releases, and the test's table
    after the last one read."""

    def __init__(self, study: Study, runs: list[RunSpec], workspace: Workspace, alpha: float = 0.05) -> None:
        if study.sequential is None:
            raise ValueError(f"study {study.name!r} is not sequential")
        self.study, self.runs, self.workspace, self.alpha = study, runs, workspace, alpha
        self.design = study.sequential
        self.todo = list(self.design.looks())
        self.arms = {a.name for a in study.arms}
        self.covered: dict[str, RunSpec] = {}  # run id -> run, every look so far
        self.seeds = 0  # the seed count of the last look released
        self.table: pd.DataFrame | None = None  # results.sequential.sequential_table after the last look read
        self.done = False

    def next(self) -> list[RunSpec] | None:
        """The runs the next look adds (those no earlier look covered), after reading the test on the runs so
        far when a look was released; None when the study is decided or at its maximum."""
        if self.done:
            return None
        if self.seeds:
            self.table = sequential_table(finished_pairs(self.study, list(self.covered.values()), self.workspace),
                                          self.study.comparisons, self.design, self.study.seeds, self.alpha)
            self.arms = needed_arms(self.table)
        if not self.arms or not self.todo:
            self.done = True
            return None
        self.seeds = self.todo.pop(0)
        batch = [r for r in look_runs(self.study, self.runs, self.seeds, self.arms) if r.run_id not in self.covered]
        self.covered.update((r.run_id, r) for r in batch)
        return batch

    def undecided(self) -> int:
        """Rows the last read left undecided."""
        return 0 if self.table is None else int((self.table["decision"] == "undecided").sum())
