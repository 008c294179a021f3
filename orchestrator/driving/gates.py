"""A gates study's looks (`gates:`, `experiments.gates`): gate by gate, treatments promoted up the ladder while
their compute-equivalent multiplier holds.

`GateLooks` is the study's side of `submit.GatesSource` (a `SequentialSource` over these looks), the task source
that runs a gates study through the one dispatch loop in one submission. At each gate, the control and every
treatment still read there train the gate's rungs on the first n seeds of a look (`gates.looks`); once those runs
have all ended, each such treatment's look is decided by `results.gates.decide_look` on the finished runs
(`Ladder`s of every rung: loss[seed, rung] from each run's summary, NaN where no run finished; compute per rung
from `experiments.budget`, the arm's FLOPs, as the ladder readout has them): a promoted treatment waits for the
next gate, a dropped one stops, one to continue gets the next look's seeds, and one undecided after the last look
stops undecided. When no treatment is left to read at a gate, the promoted ones go to the next gate. A run an
earlier gate (or look) trained is reused, never retrained: the next look releases only runs no look covered,
and the plan skips the finished ones.

Decisions are not written anywhere: they are a pure function of the plan and the finished runs. Each look reads
the first n seeds (seeds 0..n-1, `experiments.gates` holds a gates study's seeds to that) with the bootstrap seeded
by `results.gates.look_seed(gate, n)`, exactly as `results.gates.run_gates` replays a plan, so the readout rebuilds
the same decisions from the runs table (`run_gates(plan, control, arms)` on ladders of the gates' metric per seed
and rung, NaN where no run), and a driver killed at any point and run again replays the same looks on the finished
runs (skipped) and continues where the dead one stopped.

`where_gates_stand` replays the looks the same way without running anything, for `reslab plan` and `reslab status`:
each gate's decisions so far, the look in progress and the most runs the study can still run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from reslab.experiments.budget import budgets_by_point
from reslab.experiments.expand import RunSpec, grid_key_of
from reslab.experiments.gates import GatesSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.driving.sequential import LooksInProgress
from reslab.orchestrator.durability.workspace import Workspace
from reslab.results.gates import GATE_COLUMNS, GateLook, GateOutcome, decide_look, gate_rows, look_seed
from reslab.results.scaling import Ladder

__all__ = ["GateLooks", "GatesStatus", "rung_flops", "where_gates_stand"]


def rung_index(study: Study) -> dict[str, int]:
    """Grid key -> the ladder rung it is (a gates study has no grid axes)."""
    return {grid_key_of(rung): i for i, rung in enumerate(study.rungs())}


def rung_flops(study: Study, runs: Iterable[RunSpec]) -> dict[tuple[str, int], float]:
    """(arm, rung) -> one run's training FLOPs (`experiments.budget`, as the ladder readout prices a run)."""
    index = rung_index(study)
    return {(arm, index[key]): b.flops for (arm, key), (b, _) in budgets_by_point(list(runs)).items()}


class GateLooks:
    """The looks of one gates study (module docstring): which runs each releases, and every decision so far."""

    def __init__(self, study: Study, runs: list[RunSpec], workspace: Workspace) -> None:
        if study.gates is None:
            raise ValueError(f"study {study.name!r} has no gates")
        self.study, self.runs, self.workspace = study, runs, workspace
        self.spec: GatesSpec = study.gates
        self.plan = self.spec.plan
        self.index = rung_index(study)
        flops = rung_flops(study, [r for r in runs if r.seed == study.seeds[0]])
        self.compute = {a: np.array([flops[a, i] for i in range(len(self.index))]) for a in self.spec.arms}
        self.covered: dict[str, RunSpec] = {}  # run id -> run, every look so far
        self.losses: dict[str, float] = {}  # run id -> its metric, once finished
        self.gate, self.look = 0, -1  # the gate read now, and its look released last (-1: none yet)
        self.reading = list(self.spec.treatments)  # treatments read at this gate's next look
        self.promoted: list[str] = []  # promoted at this gate so far
        self.outcomes: list[GateOutcome] = []  # each (gate, treatment) decided, in order
        self.history: dict[str, list[GateLook]] = {}  # treatment -> its looks at the current gate
        self.trained = {a: np.zeros(len(self.index)) for a in self.spec.arms}  # seeds each rung was read at
        self.said: list[str] = []  # decisions read since `news` last said them
        self.seeds = 0  # the seed count of the last look released
        self.stopped = ""  # why the gates stopped before the plan's end (a run without a value), or ""
        self.done = False

    @property
    def arms(self) -> set[str]:
        """The arms the look in progress trains."""
        return {self.spec.control, *self.reading}

    @property
    def table(self) -> pd.DataFrame:
        """Every decision so far (`results.gates.gate_rows`, one row per gate, treatment and point)."""
        return pd.DataFrame(gate_rows(self.plan, self.outcomes), columns=list(GATE_COLUMNS))

    def undecided(self) -> int:
        return len(self.reading)

    def next(self) -> list[RunSpec] | None:
        """The runs the next look adds (those no earlier look covered), after deciding the look released last;
        None when every treatment is decided, dropped or through the last gate."""
        if self.done:
            return None
        if self.look >= 0:
            self._read()
        while not self.reading or self.stopped:
            if self.stopped or self.gate + 1 >= len(self.plan.gates) or not self.promoted:
                self.done = True
                return None
            self.gate, self.look, self.reading, self.promoted = self.gate + 1, -1, self.promoted, []
            self.history = {}
        self.look += 1
        self.seeds = self.plan.looks[self.look]
        rungs, seeds = set(self.plan.gates[self.gate].rungs), set(self.study.seeds[:self.seeds])
        batch = [r for r in self.runs if r.arm in self.arms and self.index[r.grid_key] in rungs and r.seed in seeds
                 and r.run_id not in self.covered]
        self.covered.update((r.run_id, r) for r in batch)
        return batch

    def ladders(self) -> dict[str, Ladder]:
        """Each arm's ladder over every rung and the plan's most seeds: loss[seed, rung] of its finished runs."""
        n = self.plan.looks[-1]
        loss = {a: np.full((n, len(self.index)), math.nan) for a in self.spec.arms}
        row = {seed: i for i, seed in enumerate(self.study.seeds)}  # a replicate's seeds are not 0..n-1
        for run in self.covered.values():
            value = self._loss(run)
            if value is not None and row[run.seed] < n:
                loss[run.arm][row[run.seed], self.index[run.grid_key]] = value
        return {a: Ladder(self.compute[a], loss[a]) for a in self.spec.arms}

    def _loss(self, run: RunSpec) -> float | None:
        if run.run_id not in self.losses:
            rd = self.workspace.run_dir(self.study.name, run.run_id)
            if not rd.complete():
                return None
            value = ((rd.summary() or {}).get("summary") or {}).get(self.spec.metric)
            if not isinstance(value, int | float) or not math.isfinite(value):
                return None
            self.losses[run.run_id] = float(value)
        return self.losses[run.run_id]

    def _read(self) -> None:
        """Decide the look released last for every treatment read at it."""
        gi, n, gate = self.gate, self.seeds, self.plan.gates[self.gate]
        ladders = self.ladders()
        first = {a: Ladder(lad.compute, lad.loss[:n]) for a, lad in ladders.items()}
        cols = list(gate.rungs)
        missing = [a for a in self.arms if np.isnan(first[a].loss[:, cols]).any()]
        if missing:
            self.stopped = (f"{gate.name}: the look at {n} seeds lacks a finished {self.spec.metric} of "
                            f"{', '.join(sorted(missing))}; the gates stop here (rerun to train it and go on)")
            return
        for a in self.arms:
            self.trained[a][cols] = np.maximum(self.trained[a][cols], n)
        still = []
        for t in self.reading:
            try:
                look = decide_look(self.plan, gi, first[self.spec.control], first[t], seed=look_seed(gi, n))
            except ValueError as exc:  # a fixed floor above some loss
                self.stopped = f"{gate.name}: {t}: {exc}"
                return
            self.history.setdefault(t, []).append(look)
            if look.decision == "continue":
                still.append(t)
                continue
            self.outcomes.append(GateOutcome(gi, t, look.decision, n, float(self.trained[t] @ self.compute[t]), look,
                                             tuple(self.history[t])))
            self.said.append(self.decision_line(self.outcomes[-1]))
            if look.decision == "promote":
                self.promoted.append(t)
        self.reading = still

    def decision_line(self, o: GateOutcome) -> str:
        """`gate1: attnres promote after 3 seeds: k 1.31 [1.12, 1.52] at 1.2e+12 FLOPs, ... (threshold 1)`."""
        gate = self.plan.gates[o.gate]
        at = ", ".join(f"{k:.3g} [{lo:.3g}, {hi:.3g}] at {p:.3g}" for k, lo, hi, p in
                       zip(o.last.k, o.last.low, o.last.high, o.last.points, strict=True))
        return (f"{gate.name}: {o.treatment} {o.decision} after {o.seeds} seeds: k {at} FLOPs (threshold "
                f"{gate.threshold:g})")

    def news(self, before: int, batch: list[RunSpec] | None) -> list[str]:
        """What the driver says after a look is read (`before`: its seeds, 0 before the first) and the next is
        released (`batch`; None: the gates are done)."""
        out, self.said = self.said, []
        if self.stopped:
            out.append(self.stopped)
        if batch is not None:
            gate = self.plan.gates[self.gate]
            out.append(f"{gate.name}: look at {self.seeds} seeds on rungs {', '.join(map(str, gate.rungs))} "
                       f"({len(batch)} new runs of {', '.join(sorted(self.arms))})")
        return out


@dataclass(frozen=True)
class GatesStatus(LooksInProgress):
    """Where a gates study stands on its finished runs (`where_gates_stand`)."""

    gates: GateLooks  # replayed up to the look in progress
    current: str | None  # "gate1 at 3 seeds": the look in progress; None once the gates are done
    pending: frozenset[str]  # run ids of the look in progress that have not finished
    later: frozenset[str]  # run ids later looks or gates may run

    def budget_note(self) -> str:
        return (f"(a gates study: the budget counts every arm at every rung at {self.gates.plan.looks[-1]} seeds, "
                "its worst case; a treatment dropped or undecided trains no later gate)")

    def lines(self) -> list[str]:
        """Each gate's decisions so far, the look in progress and the most that can still run."""
        g = self.gates
        out = [f"gates: {', '.join(x.name for x in g.plan.gates)}, looks at {list(g.plan.looks)} seeds"]
        out += [f"  {g.decision_line(o)}" for o in g.outcomes]
        if g.stopped:
            out.append(f"  stopped: {g.stopped}")
        if self.current is None:
            through = [o.treatment for o in g.outcomes if o.gate == len(g.plan.gates) - 1 and o.decision == "promote"]
            out.append(f"  done: {', '.join(through) or 'no treatment'} through every gate; no run is left to run")
        else:
            out.append(f"  now: {self.current} ({', '.join(sorted(g.arms))}), {len(self.pending)} of its runs not "
                       f"finished; at most {self.most} run(s) can still run ({len(self.later)} in later looks or "
                       "gates, only if the treatments needing them get there)")
        return out


def where_gates_stand(study: Study, runs: list[RunSpec], workspace: Workspace) -> GatesStatus:
    """Replay the study's looks on its finished runs, as the driver would, and stop at the first look that has a
    run not finished (module docstring); nothing is run or written."""
    g = GateLooks(study, runs, workspace)

    def finished(run: RunSpec) -> bool:
        return workspace.run_dir(study.name, run.run_id).complete()

    batch = g.next()
    while batch is not None and all(finished(r) for r in g.covered.values()):
        batch = g.next()
    if batch is None:
        return GatesStatus(g, None, frozenset(), frozenset())
    pending = frozenset(r.run_id for r in g.covered.values() if not finished(r))
    alive = g.arms | set(g.promoted)
    rungs = {r for gate in g.plan.gates[g.gate:] for r in gate.rungs}
    later = frozenset(r.run_id for r in runs if r.arm in alive and g.index[r.grid_key] in rungs
                      and r.run_id not in g.covered and not finished(r))
    return GatesStatus(g, f"{g.plan.gates[g.gate].name} at {g.seeds} seeds", pending, later)
