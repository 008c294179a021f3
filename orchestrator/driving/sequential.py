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

`where_it_stands` replays the looks the same way without running anything, for `reslab plan` and `reslab
status`: the looks read so far, what they decided, the look in progress and the most runs the study can still
run (the look's unfinished runs, then every later look's runs of the arms the undecided rows need).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.collect import FINISHED, MISSING, pairs_table
from reslab.results.sequential import needed_arms, sequential_table

__all__ = ["LATER", "UNNEEDED", "Looks", "SequentialStatus", "finished_pairs", "look_runs", "where_it_stands"]

# how `status` and `plan` show a run the look in progress does not need
LATER, UNNEEDED = "later look", "not needed"


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

    def news(self, before: int, batch: list[RunSpec] | None) -> list[str]:
        """What the driver says after a look is read (`before`: its seeds, 0 before the first) and the next is
        released (`batch`; None: the study is done)."""
        if batch is None:
            return []
        undecided = [f"{self.undecided()} row(s) undecided after {before} seeds: the next look adds seeds"] \
            if before else []
        return [*undecided, f"look at {self.seeds} seeds ({len(batch)} new runs of {', '.join(sorted(self.arms))})"]

    def undecided(self) -> int:
        """Rows the last read left undecided."""
        return 0 if self.table is None else int((self.table["decision"] == "undecided").sum())


class LooksInProgress:
    """What a study read at looks (sequential, gates) says of its runs that have not finished, from its `pending`
    (run ids the look in progress needs) and `later` (run ids later looks may run)."""

    pending: frozenset[str]
    later: frozenset[str]

    def word(self, run_id: str) -> str | None:
        """How a run that has not finished stands: None when the look in progress needs it, `LATER` when a later
        look may, `UNNEEDED` when no look will."""
        return None if run_id in self.pending else LATER if run_id in self.later else UNNEEDED

    @property
    def most(self) -> int:
        """The most runs the study can still run."""
        return len(self.pending) + len(self.later)


@dataclass(frozen=True)
class SequentialStatus(LooksInProgress):
    """Where a sequential study stands on its finished runs (`where_it_stands`)."""

    looks: list[int]  # the design's looks, in seeds
    read: list[int]  # the looks whose runs all finished, in order; the test was read after each
    current: int | None  # the look in progress (seeds); None once the study is decided or at its maximum
    table: pd.DataFrame | None  # the test after the last look read
    pending: frozenset[str]  # run ids of the look in progress that have not finished
    later: frozenset[str]  # run ids of later looks that run if the rows needing them stay undecided

    def budget_note(self) -> str:
        return (f"(a sequential study: the budget counts its maximum, {self.looks[-1]} seeds; it stops at the first "
                "look that decides every row)")

    def lines(self) -> list[str]:
        """The looks, what is decided and the most that can still run, as `plan` and `status` print them."""
        shown = ", ".join(f"[{n}]" if n == self.current else f"{n} (read)" if n in self.read else str(n)
                          for n in self.looks)
        out = [f"sequential: looks at {shown} seeds"]
        for r in [] if self.table is None else self.table.to_dict("records"):
            where = f" [{r['grid_key']}]" if r["grid_key"] else ""
            mean = "" if not math.isfinite(r["mean_delta"]) else f", mean delta {r['mean_delta']:.4g}"
            out.append(f"  {r['comparison']}{where}: {r['treatment']} vs {r['control']}: {r['decision']} after "
                       f"{r['n']} seeds{mean}")
        if self.current is None:
            decided = "every row decided" if self.table is not None and not (
                self.table["decision"] == "undecided").any() else f"its maximum of {self.looks[-1]} seeds reached"
            out.append(f"  done: {decided}; no run is left to run")
        else:
            now = "the first look" if not self.read else f"the look at {self.current} seeds"
            out.append(f"  now: {now}, {len(self.pending)} of its runs not finished; at most {self.most} run(s) can "
                       f"still run ({len(self.later)} in later looks, only if the rows needing them stay undecided)")
        return out


def where_it_stands(study: Study, runs: list[RunSpec], workspace: Workspace) -> SequentialStatus:
    """Replay the study's looks on its finished runs, as the driver would, and stop at the first look that has a
    run not finished (module docstring); nothing is run or written."""
    looks = Looks(study, runs, workspace)
    read: list[int] = []

    def finished(run: RunSpec) -> bool:
        return workspace.run_dir(study.name, run.run_id).complete()

    batch = looks.next()
    while batch is not None and all(finished(r) for r in looks.covered.values()):
        read.append(looks.seeds)
        batch = looks.next()
    design = looks.design
    if batch is None:
        return SequentialStatus(design.looks(), read, None, looks.table, frozenset(), frozenset())
    pending = frozenset(r.run_id for r in looks.covered.values() if not finished(r))
    later = frozenset(r.run_id for r in look_runs(study, runs, design.max, looks.arms)
                      if r.run_id not in looks.covered and not finished(r))
    return SequentialStatus(design.looks(), read, looks.seeds, looks.table, pending, later)
