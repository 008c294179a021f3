"""Work after training, the driver's side: a source wrapped around the study's that releases, for each run that
finishes, its work after training as a task, and says what came of it.

"Work after training (an evaluation, an intervention) is a unit of work like a run": each kind
(`driving.evaluations.Evaluations`, `driving.interventions.Interventions`) says which runs have units pending
and what each unit done came to; `AfterWork` joins them. `AfterSource` wraps the study's source (the shape of
Ray Tune's `ConcurrencyLimiter` or `Repeater` wrapping a searcher): the study's source says which runs finished
(`Releasing.released`: a run finished before, when it is planned, or one whose training just finished), and
the wrapper hands out one task per such run that has any unit pending (`AfterWork.task`: the task carries its
work, `orchestrator.attempt.after.AfterTraining`, the kinds pending on it: the loop holds one task per run in
flight) before the study's next task. The loop dispatches it like a run's on the study's backend, with a run's
resources, so on the run's device, and retries it as it retries a run; its completions, retries and interrupts
come back to the wrapper, never to the study's source, so they never change the run's state or its MLflow
child's status. `completed` says per unit what was done, logs each kind's metrics and tables on the run's MLflow
child (the driver is the only MLflow writer) and keeps a task that failed as the submission's error, after
logging the units it did finish. A unit whose marker exists is skipped, by the driver (no task) and again by the
worker (under its lock); one interrupted left no marker and the next submission does it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.orchestrator.attempt.after import AfterTraining
from reslab.orchestrator.driving.evaluations import Evaluations
from reslab.orchestrator.driving.interventions import Interventions
from reslab.orchestrator.driving.loop import ExecutionOptions, Source, TaskMaker
from reslab.orchestrator.driving.progress import Progress
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import FAILED, INTERRUPTED, SUCCESS, Completion, EvalJob, InterventionJob, RunTask
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

    @property
    def noun(self) -> str:
        """What the progress display calls its units: "evaluations", "interventions" or both."""
        return " and ".join(k.noun for k in (self.evals, self.interventions) if k is not None)

    def task(self, run: RunSpec, maker: TaskMaker) -> RunTask | None:
        """The run's task of work after training, or None when the run has not finished or nothing is pending."""
        rd = self.workspace.run_dir(run.study, run.run_id)
        evals = self.evals is not None and self.evals.pending(run, rd)
        knock = self.interventions is not None and self.interventions.pending(run, rd)
        if not evals and not knock:
            return None
        after = AfterTraining(evals=self.evals.job if evals and self.evals else None,
                              interventions=self.interventions.job if knock and self.interventions else None)
        return dataclasses.replace(maker.task(run), work=after)

    def completed(self, c: Completion) -> str | None:
        """A task ended: a line per unit and its metrics and tables on MLflow; then why it failed, if it did."""
        self.log_units(c)
        if c.outcome is None or c.outcome.state != SUCCESS:
            self.say(f"  after training {c.task.run.label}: failed: {c.error_text}")
            return c.error_text
        return None

    def log_units(self, c: Completion) -> None:
        """The units an attempt finished (also one that failed later, or is retried): a line each, and their
        metrics and tables on MLflow (a retry finds them done and skips them)."""
        run, outcome = c.task.run, c.outcome
        metrics: dict[str, float] = {}
        tables: dict[str, list[dict[str, Any]]] = {}
        for unit in outcome.units if outcome is not None else []:
            m, t = self.kinds[unit["kind"]].logged(run, unit)
            metrics.update(m)
            tables.update(t)
        if metrics or tables:
            self.tracker.log_after(run, metrics, tables)

    def interrupted(self, task: RunTask) -> None:
        self.say(f"  after training {task.run.label}: interrupted; the next `reslab run` does what it left undone")


class Drawn(Source, Protocol):
    """A source that can say before the loop starts whether it has anything to run (`has_tasks`)."""

    def has_tasks(self) -> bool: ...


class Releasing(Drawn, Protocol):
    """A source whose finished runs a wrapping source takes (`StudySource`): each run that finished (before, or
    now) is appended to `released` once a wrapper set it (None: nobody takes them); `has_tasks` says whether a
    task or a released run is ready, drawing its plan until one is; `maker` builds a run's task; `train`
    False: it trains nothing (its runs that have not finished are left as they are); `progress` shows the
    wrapper's units beside its runs."""

    maker: TaskMaker | None
    released: deque[RunSpec] | None
    train: bool
    progress: Progress


class AfterSource:
    """The study's source with its work after training wrapped around it (module docstring): the loop's source."""

    def __init__(self, inner: Releasing, work: AfterWork, errors: dict[str, str]) -> None:
        """`errors`: the submission's (`SubmitResult.errors`), where a task that failed is kept."""
        self.inner, self.work, self.errors = inner, work, errors
        self.resume_hint = inner.resume_hint
        inner.released = deque()
        self.progress = inner.progress
        self.progress.after_noun = work.noun
        self.queue: deque[RunTask] = deque()  # the released runs' tasks not handed out yet
        self.inflight: dict[str, RunSpec] = {}  # run id -> run, of this wrapper's tasks handed out

    def _release(self) -> None:
        """The released runs' tasks queued, those with work pending."""
        released, maker = self.inner.released, self.inner.maker
        assert released is not None and maker is not None
        while released:
            task = self.work.task(released.popleft(), maker)
            if task is not None:
                self.queue.append(task)
                self.progress.after_queued()

    def has_tasks(self) -> bool:
        """Whether a task is ready: a released run's work, else the study's next task; the study's plan is drawn
        until one is or none is left."""
        while True:
            self._release()
            if self.queue:
                return True
            if not self.inner.has_tasks():
                return False
            if not self.inner.released:
                return True

    def next_task(self) -> RunTask | None:
        if not self.has_tasks():
            return None
        if not self.queue:
            return self.inner.next_task()
        task = self.queue.popleft()
        self.inflight[task.run_id] = task.run
        self.progress.after_started()
        return task

    def run_of(self, run_id: str) -> RunSpec | None:
        return self.inner.run_of(run_id) or self.inflight.get(run_id)

    def on_event(self, event: dict[str, Any]) -> None:
        self.inner.on_event(event)

    def tick(self) -> None:
        self.inner.tick()

    def waiting(self, what: str | None) -> None:
        self.inner.waiting(what)

    def on_retry(self, c: Completion) -> None:
        if c.task.run_id not in self.inflight:
            self.inner.on_retry(c)
            return
        self.work.log_units(c)
        self.progress.after_retry(c.task.run.label, c.task.attempt + 1, c.error_text)

    def on_complete(self, c: Completion) -> float | None:
        run = self.inflight.pop(c.task.run_id, None)
        if run is None:
            return self.inner.on_complete(c)
        error = self.work.completed(c)
        self.progress.after_ended(SUCCESS.label if error is None else FAILED.label)
        if error is not None:
            self.errors[f"{run.run_id} (after training)"] = error
        return None

    def on_interrupted(self, task: RunTask, finished: bool) -> None:
        if self.inflight.pop(task.run_id, None) is None:
            self.inner.on_interrupted(task, finished)
        else:
            self.work.interrupted(task)
            self.progress.after_ended(INTERRUPTED.label)


def around(source: Releasing, study: Study, options: ExecutionOptions, workspace: Workspace, tracker: DriverTracker,
           say: Callable[[str], Any], errors: dict[str, str]) -> tuple[Drawn, Callable[[], tuple[int, int]]]:
    """The source a submission's loop drives: `source` with the study's work after training wrapped around it, or
    `source` itself when there is none; and what the work did, (evaluations, interventions), to ask at the end.
    The work is `options.evaluate` (default: the study's `evals:`) and the study's `interventions:`; an
    `EvalJob.only` (`reslab eval`) trains nothing and does no intervention."""
    evaluate = options.evaluate
    if evaluate is None and study.evals is not None:
        evaluate = EvalJob(study.evals)
    only = evaluate is not None and evaluate.only
    source.train = not only
    knock = None if study.interventions is None or only else InterventionJob(study.interventions)
    if evaluate is None and knock is None:
        return source, lambda: (0, 0)
    work = AfterWork(workspace, tracker, say, evals=evaluate, interventions=knock)
    return AfterSource(source, work, errors), lambda: (work.evals.ran if work.evals else 0,
                                                       work.interventions.ran if work.interventions else 0)


__all__ = ["AfterSource", "AfterWork", "Drawn", "Releasing", "around"]
