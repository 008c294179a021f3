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
from dataclasses import dataclass

from reslab.experiments.expand import RunSpec
from reslab.orchestrator.durability.lease import lease_state
from reslab.orchestrator.durability.workspace import DEFAULT_LEASE_TIMEOUT_S, Workspace, check_lease_timeout
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


def plan_table(entries: list[PlanEntry]) -> list[str]:
    """The header and one line per entry, the run id and label columns as wide as their widest cell (a
    ladder's grid keys run past any fixed width), so `why` starts at the same column in every line."""
    id_width = max([28, *(len(e.run.run_id) for e in entries)])
    label_width = max([36, *(len(e.run.label) for e in entries)])
    return [f"{'':<4}  {'run id':<{id_width}} {'arm/grid point/seed':<{label_width}} why",
            *(e.line(id_width, label_width) for e in entries)]


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
            return PlanEntry(run, BUSY, f"running elsewhere ({why})", state, ckpt)
        return PlanEntry(run, RUN, f"stale lease ({why}); {_resume(status)}", state, ckpt)
    return PlanEntry(run, RUN, f"unreadable status {state!r}; starts over", state, ckpt)


def plan(runs: list[RunSpec], workspace: Workspace, *, rerun_failed: bool = False,
         lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> list[PlanEntry]:
    check_lease_timeout(lease_timeout_s)
    return [plan_run(r, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s) for r in runs]


def summarize(entries: list[PlanEntry]) -> str:
    counts = Counter(e.action for e in entries)
    return f"{len(entries)} runs: {counts[RUN]} {RUN.label}, {counts[SKIP]} to skip, {counts[BUSY]} busy elsewhere"
