"""The driver's side of evaluations: check a study's tasks before anything trains, then say and log what each
finished run's evaluation came to. One kind of work after training (`orchestrator.driving.after`).

An evaluation is a unit of work like a run (`orchestrator.attempt.evaluation`): `AfterWork.task` makes one task
per finished run with work pending (its `RunTask.work`), which the source wrapped around the study's
(`after.AfterSource`) releases once the run's training finished (or, for a run finished before, when it is
planned); the loop dispatches it on the
study's backend (Ray; in-process in tests) with a run's resources, so on the run's device. `Evaluations.logged`
says per (run, task) what was done and hands back the metrics the driver logs on the run's MLflow child (the
driver is the only MLflow writer). A (run, task) whose marker exists is skipped, by the driver (no task) and
again by the worker (under the run's evaluation lock); one interrupted left no marker and the next submission
evaluates it.

`reslab run` evaluates after each run trains; `reslab eval` is the same submission with nothing trained
(an `EvalJob` with `only` set).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reslab.experiments.evals import EvalSpec
from reslab.experiments.expand import RunSpec
from reslab.orchestrator.attempt.evaluation import pending
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import EvalJob
from reslab.orchestrator.tracking.layout import EVAL_PREFIX


def check_evals(spec: EvalSpec) -> None:
    """The harness is installed and knows every task (the local next-line task is built from each run's corpus
    when it is evaluated, so its name alone is checked here); one line each, before anything trains."""
    from reslab.models.evals.harness import check_tasks
    from reslab.models.evals.next_line import TASK_NAME

    check_tasks([t for t in spec.tasks if t != TASK_NAME])


class Evaluations:
    """A submission's evaluations (module docstring): which runs have some pending, and what it says of each."""

    kind = "eval"
    noun = "evaluations"  # what the progress display calls its units

    def __init__(self, job: EvalJob, say: Callable[[str], Any]) -> None:
        from reslab.models.evals.harness import harness_version

        self.job, self.say = job, say
        self.harness = harness_version()
        self.ran = 0       # evaluations (run, task) done by this submission
        self.skipped = 0   # found done (a worker that found the marker its driver had not seen)

    @property
    def spec(self) -> EvalSpec:
        spec: EvalSpec = self.job.spec
        return spec

    def pending(self, run: RunSpec, rd: RunDir) -> bool:
        return bool(pending(run, rd, self.spec, self.harness))

    def logged(self, run: RunSpec, unit: dict[str, Any]) -> tuple[dict[str, float], dict[str, list[dict[str, Any]]]]:
        """One (run, task) done: its line, and its metrics as MLflow keys `eval/<task>/<metric>` (none: skipped)."""
        metrics = unit.get("metrics")
        if metrics is None:
            self.skipped += 1
            self.say(f"  eval {run.label} {unit['name']}: skipped (done, {unit.get('id')})")
            return {}, {}
        self.ran += 1
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        self.say(f"  eval {run.label} {unit['name']}: {shown or 'no metrics'} ({unit.get('id')})")
        return {f"{EVAL_PREFIX}{unit['name']}/{k}": v for k, v in metrics.items()}, {}


__all__ = ["Evaluations", "check_evals"]
