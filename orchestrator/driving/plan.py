"""Planning: what `reslab run` would do with each run of a study, and why.

The decision reads only the run directories (the local source of truth; MLflow is a view):

| run directory                          | action | reason                                          |
|----------------------------------------|--------|-------------------------------------------------|
| no `status`                            | run    | new                                             |
| not `SUCCESS`, but `summary.json`      | skip   | succeeded (training had finished; status lost)  |
| `SUCCESS`                              | skip   | succeeded                                       |
| `SUCCESS`, summary missing or damaged  | run    | resumes from its final checkpoint, which holds  |
|                                        |        | the result (`RunDir.complete`)                  |
| `FAILED`                               | skip   | failed: <error>; `--rerun-failed` reruns it      |
| `FAILED` with `--rerun-failed`         | run    | failed, forced                                  |
| `INTERRUPTED`                          | run    | interrupted; resumes from its checkpoint        |
| `RUNNING`, lease live                  | busy   | another submission is running it                |
| `RUNNING`, lease stale                 | run    | its worker is gone; resumes from its checkpoint |

"Resumes from step N" quotes the last checkpoint the worker reported; `train()` finds it.

With run storage (`orchestrator.durability.storage`) the driver pulls the study's records into the workspace
before planning, so the table applies to what every node recorded. Leases are per node and never
stored: a `RUNNING` run pulled from storage has no lease here and is run (resumed from its last
pushed checkpoint); with one driver per study at a time, its earlier driver is gone.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from reslab.experiments.expand import RunSpec, SeedIds, count_runs, iter_runs, with_seed
from reslab.experiments.spec import Study
from reslab.orchestrator.durability.lease import lease_state
from reslab.orchestrator.durability.workspace import (
    DEFAULT_LEASE_TIMEOUT_S,
    Workspace,
    check_lease_timeout,
    read_runs_in_order,
)
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, RUNNING, SUCCESS, Action

RUN, SKIP, BUSY = Action.RUN, Action.SKIP, Action.BUSY


@dataclass(frozen=True)
class PlanEntry:
    run: RunSpec
    action: Action
    reason: str
    state: str | None     # the run directory's state, None when it has none
    checkpoint_step: int | None = None
    error: str | None = None

    def line(self, id_width: int = 28, label_width: int = 36) -> str:
        return f"{self.action:<4}  {self.run.run_id:<{id_width}} {self.run.label:<{label_width}} {self.reason}"


def _resume(status: dict) -> str:
    step = status.get("checkpoint_step")
    return f"resumes from step {step}" if step else "no checkpoint yet: starts over"


def plan_run(run: RunSpec, workspace: Workspace, *, rerun_failed: bool = False,
             lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> PlanEntry:
    rd = workspace.run_dir(run.study, run.run_id)
    status = rd.status()
    if (status or {}).get("state") != SUCCESS and rd.complete():
        # a worker killed between summary.json and SUCCESS, or a lost status file: never retrain
        return PlanEntry(run, SKIP, "succeeded (summary.json; the status file said otherwise or was lost)", SUCCESS,
                         (status or {}).get("checkpoint_step"))
    if status is None:
        return PlanEntry(run, RUN, "new", None)
    state = status.get("state")
    ckpt = status.get("checkpoint_step")
    error = status.get("error")
    if state == SUCCESS and rd.complete():
        return PlanEntry(run, SKIP, "succeeded", state, ckpt)
    if state == SUCCESS:
        return PlanEntry(run, RUN, f"said SUCCESS, but its summary.json is missing or damaged; {_resume(status)} "
                         "(a final checkpoint holds the result: nothing is trained again)", state, ckpt)
    if state == FAILED:
        first = (error or "unknown error").splitlines()[0][:160]
        if rerun_failed:
            return PlanEntry(run, RUN, f"failed before, forced by --rerun-failed ({first}); {_resume(status)}",
                             state, ckpt, error)
        return PlanEntry(run, SKIP, f"failed: {first} (use --rerun-failed)", state, ckpt, error)
    if state == INTERRUPTED:
        return PlanEntry(run, RUN, f"interrupted; {_resume(status)}", state, ckpt)
    if state == RUNNING:
        lease = rd.lease()
        if lease is None and workspace.storage:
            return PlanEntry(run, RUN, f"RUNNING in run storage, which keeps no leases: training under its "
                             f"driver, or left by one that stopped; {_resume(status)}", state, ckpt)
        live, why = lease_state(lease, lease_timeout_s)
        if live:
            # not "elsewhere": `status` reads it while the user's own driver runs it (issue 52, item 16)
            sub = lease.get("submission") if isinstance(lease, dict) else None
            return PlanEntry(run, BUSY, f"running, leased by {why}" + (f", submission {sub}" if sub else ""),
                             state, ckpt)
        return PlanEntry(run, RUN, f"stale lease ({why}); {_resume(status)}", state, ckpt)
    return PlanEntry(run, RUN, f"unreadable status {state!r}; starts over", state, ckpt)


def plan_iter(runs: Iterable[RunSpec], workspace: Workspace, *, rerun_failed: bool = False,
              lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> Iterator[PlanEntry]:
    """`plan`'s entries one at a time, as `runs` yields them: the study's folder is listed once, when the first
    run is planned, and only a run listed there has its run directory read."""
    check_lease_timeout(lease_timeout_s)
    listed: dict[str, frozenset[str]] = {}
    for run in runs:
        present = listed.get(run.study)
        if present is None:
            present = listed[run.study] = workspace.recorded_ids(run.study)
        if run.run_id in present:
            yield plan_run(run, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s)
        else:
            yield PlanEntry(run, RUN, "new", None)


def plan(runs: Iterable[RunSpec], workspace: Workspace, *, rerun_failed: bool = False,
         lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> list[PlanEntry]:
    return list(plan_iter(runs, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s))


def summarize(entries: Iterable[PlanEntry]) -> str:
    return PlanCounts.of(entries).summary()


@dataclass
class PlanCounts:
    """A plan counted, not listed: runs per action, per arm and action."""

    runs: int = 0
    actions: Counter[Action] = field(default_factory=Counter)
    by_arm: dict[str, Counter[Action]] = field(default_factory=dict)

    @classmethod
    def of(cls, entries: Iterable[PlanEntry]) -> PlanCounts:
        counts = cls()
        for e in entries:
            counts.add(e.run.arm, e.action)
        return counts

    def add(self, arm: str, action: Action, n: int = 1) -> None:
        self.runs += n
        self.actions[action] += n
        self.by_arm.setdefault(arm, Counter())[action] += n

    def merge(self, other: PlanCounts) -> None:
        """Add `other`'s counts (a sequential study's next look)."""
        for arm, c in other.by_arm.items():
            for action, n in c.items():
                self.add(arm, action, n)

    def to_dict(self) -> dict[str, Any]:
        """The counts as JSON: runs, per action and per arm and action, by the words of `tasks.WORDS`."""
        return {"runs": self.runs, "actions": {a.label: self.actions[a] for a in (RUN, SKIP, BUSY)},
                "by_arm": {arm: {a.label: c[a] for a in (RUN, SKIP, BUSY)} for arm, c in self.by_arm.items()}}

    def summary(self) -> str:
        c = self.actions
        return f"{self.runs} runs: {c[RUN]} {RUN.label}, {c[SKIP]} to skip, {c[BUSY]} busy elsewhere"

    def arm_lines(self) -> list[str]:
        """One line per arm: its runs and how many of them run, are skipped, are busy."""
        width = max([3, *(len(a) for a in self.by_arm)])
        lines = [f"{'arm':<{width}} {'runs':>9} {RUN.label:>9} {'skip':>9} {'busy':>9}"]
        for arm, c in self.by_arm.items():
            lines.append(f"{arm:<{width}} {c.total():>9} {c[RUN]:>9} {c[SKIP]:>9} {c[BUSY]:>9}")
        return lines


def plan_counts(study: Study, firsts: list[RunSpec], workspace: Workspace, *, rerun_failed: bool = False,
                lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> PlanCounts | None:
    """The plan of every run of `study`, counted from its run directories alone: time in the runs that have one,
    whatever the study's size. `firsts` are its runs at its first seed (`expand(study, study.seeds[:1])`). A
    run directory is the study's when its `spec.json` names an arm, grid point and seed of the study and its id
    is theirs (`SeedIds`); one of another results version or `--set` is not. None when a run directory has no
    readable `spec.json` (a run claimed a moment ago): then count `plan_iter`'s entries."""
    check_lease_timeout(lease_timeout_s)
    by_key = {(r.arm, r.grid_key): (r, SeedIds(r.config)) for r in firsts}
    seeds = set(study.seeds)
    counts = PlanCounts()
    for arm in study.arms:
        counts.add(arm.name, RUN, 0)  # every arm in the study's order
    recorded: Counter[str] = Counter()

    def place(run_id: str) -> PlanEntry | None | bool:
        """The record's plan entry; None when it is not one of the study's runs; False when it has no spec."""
        spec = workspace.run_dir(study.name, run_id).spec()
        if not isinstance(spec, dict):
            return False
        first, seed = by_key.get((str(spec.get("arm")), str(spec.get("grid_key")))), spec.get("seed")
        if first is None or not isinstance(seed, int) or seed not in seeds or first[1](seed) != run_id:
            return None
        run = replace(first[0], seed=seed, config=with_seed(first[0].config, seed), run_id=run_id)
        return plan_run(run, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s)

    ids = sorted(workspace.recorded_ids(study.name))
    for entry in read_runs_in_order(workspace.study_dir(study.name), ids, ("spec.json", "status", "summary.json"),
                                    lambda i: place(ids[i])):
        if entry is False:
            return None
        if isinstance(entry, PlanEntry):
            counts.add(entry.run.arm, entry.action)
            recorded[entry.run.arm] += 1
    per_arm = count_runs(study) // len(study.arms)
    for arm in study.arms:
        counts.add(arm.name, RUN, per_arm - recorded[arm.name])
    return counts


def study_counts(study: Study, firsts: list[RunSpec], workspace: Workspace, *, rerun_failed: bool = False,
                 lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> PlanCounts:
    """`plan_counts`, or where it cannot tell (a run directory without a readable `spec.json`) the study's plan
    entries counted as `plan_iter` yields them: time in the study's runs then, memory never."""
    counts = plan_counts(study, firsts, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s)
    return counts or PlanCounts.of(plan_iter(iter_runs(study), workspace, rerun_failed=rerun_failed,
                                             lease_timeout_s=lease_timeout_s))
