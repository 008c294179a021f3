"""Work after training, the driver's side: one task per finished run with work pending, and what came of it.

"Work after training (an evaluation, an intervention) is a unit of work like a run": each kind
(`driving.evaluations.Evaluations`, `driving.interventions.Interventions`) says which runs have units pending
and what each unit done came to; `AfterWork` joins them. `task` makes one task per finished run that has any
unit pending (`RunTask.after`, carrying the kinds pending on it: the loop holds one task per run in flight),
which the study's source (`submit.StudySource`) queues once the run's training finished (or, for a run finished
before, when it is planned); the loop dispatches it on the study's backend with a run's resources, so on the
run's device (`orchestrator.attempt.after`). `completed` says per unit what was done, logs each kind's metrics
and tables on the run's MLflow child (the driver is the only MLflow writer) and keeps a task that failed as the
submission's error, after logging the units it did finish. A unit whose marker exists is skipped, by the
driver (no task) and again by the worker (under its lock); one interrupted left no marker and the next
submission does it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from reslab.experiments.expand import RunSpec
from reslab.orchestrator.driving.evaluations import Evaluations
from reslab.orchestrator.driving.interventions import Interventions
from reslab.orchestrator.driving.loop import TaskMaker
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import SUCCESS, AfterTraining, Completion, EvalJob, InterventionJob, RunTask
from reslab.orchestrator.tracking.protocol import DriverTracker


class AfterWork:
    """A submission's work after training (module docstring): the tasks it hands out and what it says of each."""

    def __init__(self, workspace: Workspace, tracker: DriverTracker, say: Callable[[str], Any], *,
                 evals: EvalJob | None = None, interventions: InterventionJob | None = None) -> None:
        self.workspace, self.tracker, self.say = workspace, tracker, say
        self.evals = Evaluations(evals, say) if evals is not None else None
        self.interventions = Interventions(interventions, say) if interventions is not None else None

    @property
    def kinds(self) -> dict[str, Evaluations | Interventions]:
        return {k.kind: k for k in (self.evals, self.interventions) if k is not None}

    def task(self, run: RunSpec, maker: TaskMaker) -> RunTask | None:
        """The run's task of work after training, or None when the run has not finished or nothing is pending."""
        rd = self.workspace.run_dir(run.study, run.run_id)
        evals = self.evals is not None and self.evals.pending(run, rd)
        knock = self.interventions is not None and self.interventions.pending(run, rd)
        if not evals and not knock:
            return None
        after = AfterTraining(evals=self.evals.job if evals and self.evals else None,
                              interventions=self.interventions.job if knock and self.interventions else None)
        return dataclasses.replace(maker.task(run), after=after)

    def completed(self, c: Completion) -> str | None:
        """A task ended: a line per unit and its metrics and tables on MLflow; then why it failed, if it did."""
        run, outcome = c.task.run, c.outcome
        metrics: dict[str, float] = {}
        tables: dict[str, list[dict[str, Any]]] = {}
        for unit in outcome.units if outcome is not None else []:
            m, t = self.kinds[unit["kind"]].logged(run, unit)
            metrics.update(m)
            tables.update(t)
        if metrics or tables:
            self.tracker.log_after(run, metrics, tables)
        if outcome is None or outcome.state != SUCCESS:
            self.say(f"  after training {run.label}: failed: {c.error_text}")
            return c.error_text
        return None

    def interrupted(self, task: RunTask) -> None:
        self.say(f"  after training {task.run.label}: interrupted; the next `reslab run` does what it left undone")


__all__ = ["AfterWork"]
