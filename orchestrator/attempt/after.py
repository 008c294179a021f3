"""Work after training, in the worker: a finished run's pending evaluations (`orchestrator.attempt.evaluation`)
and interventions (`orchestrator.attempt.intervention`), one task per run (`AfterTraining`, the task's `RunTask.work`:
the worker runs its `run`, a backend places it by its `asks`).

Each kind is a unit of work like a run: a content id, its records whole in the run directory under a marker
written last, a lock held while it is done, so a unit is done once and a unit done before is skipped. The task
runs in the run's copy on this node, pulled first when run storage is ahead (the checkpoint included), on the
backend and resources its training had, and pushes the files of each kind storage lacks once that kind is done
(`StoredRun.push_after`), so a fresh machine sees them. Its outcome carries each unit (`RunOutcome.units`: the
metrics, an intervention's rows; None for a unit done before), also the units done before a later kind failed;
the driver logs them on the run's MLflow child (it is the only MLflow writer).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reslab.common.errors import ReslabError
from reslab.orchestrator.attempt.evaluation import evaluate
from reslab.orchestrator.attempt.intervention import intervene, metrics_of
from reslab.orchestrator.attempt.threads import set_threads
from reslab.orchestrator.attempt.worker import scratch_dir
from reslab.orchestrator.durability.storage import StoredRun, pull_if_ahead
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import FAILED, SUCCESS, EvalJob, InterventionJob, Resources, RunOutcome, RunTask


@dataclass(frozen=True)
class AfterTraining:
    """Work after training that one task does on one finished run (`tasks.Work`): its pending evaluations and its
    pending interventions, whichever is set. One task per run at a time carries both, so the loop has one task in
    flight per run."""

    evals: EvalJob | None = None
    interventions: InterventionJob | None = None

    @property
    def name(self) -> str:
        return "after"

    def asks(self, task: RunTask, resources: Resources) -> tuple[float, float]:
        """A run's resources; one rank's share (its CPUs and one GPU) for a run on N ranks: the work runs in one
        process."""
        if task.ranks.world > 1:
            return task.ranks.cpus, min(resources.gpus, 1.0)
        return resources.cpus, resources.gpus

    def run(self, task: RunTask, host: str) -> RunOutcome:
        """In the run's copy on this node (pulled from run storage when storage is ahead), with `task.threads`
        torch threads."""
        rd = RunDir(scratch_dir(task) if task.storage else Path(task.run_dir))
        previous = set_threads(task.threads)
        try:
            return after_task(task, rd, StoredRun.at(task.storage) if task.storage else None, host)
        finally:
            set_threads(previous)


def _work(task: RunTask, rd: RunDir, stored: StoredRun | None, units: list[dict[str, Any]]) -> None:
    """Each kind the task carries, in turn, its units appended to `units` as they are done."""
    job = task.work
    assert isinstance(job, AfterTraining)
    if job.evals is not None:
        done = evaluate(task.run, rd, job.evals.spec, device=job.evals.device, batch_size=job.evals.batch_size)
        units += [{"kind": "eval", "name": u.task, "id": u.eval_id, "metrics": metrics} for u, metrics in done]
        if stored is not None:
            stored.push_after(rd)
    if job.interventions is not None:
        unit, rows = intervene(task.run, rd, job.interventions.spec, device=job.interventions.device)
        units.append({"kind": "intervention", "name": "interventions", "id": unit.intervention_id,
                      "metrics": None if rows is None else metrics_of(rows), "rows": rows})
        if stored is not None:
            stored.push_after(rd)


def after_task(task: RunTask, rd: RunDir, stored: StoredRun | None, host: str) -> RunOutcome:
    """A task of work after training in the worker (module docstring): SUCCESS with each unit, or FAILED with
    the error and the units done before it; a bad input (`ReslabError`) is not retried, anything else may be."""
    outcome = RunOutcome(run_id=task.run_id, state=SUCCESS, host=host)
    units: list[dict[str, Any]] = []
    try:
        if stored is not None:
            pull_if_ahead(stored, rd)
        if not rd.complete():
            outcome.state = FAILED
            outcome.error = f"after training: run {task.run_id} has not finished training in {rd.path}"
            return outcome
        _work(task, rd, stored, units)
    except ReslabError as exc:
        outcome.state, outcome.error = FAILED, f"{type(exc).__name__}: {exc} (after training, on {host})"
    except Exception as exc:
        outcome.state, outcome.retryable = FAILED, True
        outcome.error, outcome.traceback = f"{type(exc).__name__}: {exc} (after training, on {host})", \
            traceback.format_exc()
    outcome.units = units
    return outcome
