"""The driver's side of evaluations: check a study's tasks before anything trains, then hand out each finished
run's evaluation as a task of the dispatch loop and record what came of it.

An evaluation is a unit of work like a run (`orchestrator.attempt.evaluation`): `Evaluations.task` makes one
evaluation task per finished run that has evaluations pending (`RunTask.evals`), which the study's source
(`submit.StudySource`) queues once the run's training finished (or, for a run finished before, when it is
planned); the loop dispatches it on the study's backend (Ray; in-process in tests) with a run's resources, so
on the run's device. `Evaluations.completed` says per (run, task) what was done, logs the metrics on the run's
MLflow child (the driver is the only MLflow writer) and keeps an evaluation that failed as the submission's
error. A (run, task) whose marker exists is skipped, by the driver (no task) and again by the worker (under
the run's evaluation lock); one interrupted left no marker and the next submission evaluates it.

`reslab run` evaluates after each run trains; `reslab eval` is the same submission with nothing trained
(an `EvalJob` with `only` set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from reslab.experiments.evals import EvalSpec
from reslab.experiments.expand import RunSpec
from reslab.orchestrator.attempt.evaluation import pending
from reslab.orchestrator.driving.loop import TaskMaker
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import SUCCESS, Completion, EvalJob, RunTask
from reslab.orchestrator.tracking.protocol import DriverTracker


def check_evals(spec: EvalSpec) -> None:
    """The harness is installed and knows every task (the local next-line task is built from each run's corpus
    when it is evaluated, so its name alone is checked here); one line each, before anything trains."""
    from reslab.models.evals.harness import check_tasks
    from reslab.models.evals.next_line import TASK_NAME

    check_tasks([t for t in spec.tasks if t != TASK_NAME])


class Evaluations:
    """A submission's evaluations (module docstring): the tasks it hands out and what it says of each."""

    def __init__(self, job: EvalJob, workspace: Workspace, tracker: DriverTracker, say: Callable[[str], Any]) -> None:
        from reslab.models.evals.harness import harness_version

        self.job, self.workspace, self.tracker, self.say = job, workspace, tracker, say
        self.harness = harness_version()
        self.ran = 0       # evaluations (run, task) done by this submission
        self.skipped = 0   # found done (a worker that found the marker its driver had not seen)

    @property
    def spec(self) -> EvalSpec:
        spec: EvalSpec = self.job.spec
        return spec

    def task(self, run: RunSpec, maker: TaskMaker) -> RunTask | None:
        """The run's evaluation task, or None when the run has not finished or every evaluation of it is done."""
        rd = self.workspace.run_dir(run.study, run.run_id)
        if not pending(run, rd, self.spec, self.harness):
            return None
        return dataclasses.replace(maker.task(run), evals=self.job)

    def completed(self, c: Completion) -> str | None:
        """An evaluation task ended: a line per (run, task) and its metrics on MLflow; or why it failed."""
        run, outcome = c.task.run, c.outcome
        if outcome is None or outcome.state != SUCCESS:
            self.say(f"  eval {run.label}: failed: {c.error_text}")
            return c.error_text
        logged: dict[str, dict[str, float]] = {}
        for task, unit in sorted(outcome.evals.items()):
            metrics = unit.get("metrics")
            if metrics is None:
                self.skipped += 1
                self.say(f"  eval {run.label} {task}: skipped (done, {unit.get('eval_id')})")
                continue
            self.ran += 1
            logged[task] = metrics
            shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
            self.say(f"  eval {run.label} {task}: {shown or 'no metrics'} ({unit.get('eval_id')})")
        if logged:
            self.tracker.log_evals(run, logged)
        return None

    def interrupted(self, task: RunTask) -> None:
        self.say(f"  eval {task.run.label}: interrupted; the next `reslab run` or `reslab eval` evaluates it")


__all__ = ["Evaluations", "check_evals"]
