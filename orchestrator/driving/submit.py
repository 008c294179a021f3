"""The driver: plan a study, dispatch its runs through a backend, track them, report.

`submit(study, runs, workspace, backend, tracker, options)` is the whole of `reslab run` minus
argument parsing, the power check (`check_power`), the preflight (`loop.preflight`) and the final
table. The study is a source of tasks for the one dispatch loop (`orchestrator.driving.loop`), which owns
concurrency, retries, held runs and signals; this module owns what is the study's own. A plain study
is a `StudySource`, which draws its runs lazily as slots free up (`LazyRuns`: from `expand.iter_runs`,
through `plan.plan_iter`, a bounded look-ahead of planned entries), so a study of 10^6 runs starts
dispatching without building them: the plan is counted (`plan.plan_counts`, from the run directories
that exist, the study's folder listed once), per-run state is kept only for the runs this submission
started, and the parent MLflow run gets the plan's counts per arm; a sequential study is a `SequentialSource`, which
plans one look's runs at a time (`orchestrator.driving.sequential.Looks`): while they are pending it answers
"nothing yet", once they have all ended it reads the test on their run directories' summaries and
releases the next look's runs, or finishes; the whole sequential study is one submission (one parent
run in MLflow). The submission

1. plans from the run directories (`orchestrator.driving.plan`): finished runs are skipped, so submitting
   a study twice runs nothing the second time; the backend (Ray) is not even started then. With run
   storage (`workspace.storage`, `orchestrator.durability.storage`) it first syncs the study with storage
   (`storage.sync_study`: the records storage has ahead are pulled, the finished runs storage lacks
   are pushed, and those pushed without their checkpoint are pushed again, whole, by the nodes that
   hold them, through the loop; an unreachable storage is waited out, `orchestrator.durability.outage`,
   one outage for the whole submission, which the study marker's heartbeat feeds), and after every
   completion it pulls that run's records (success or failure), so the workspace sees what every
   node did; without storage, or when a finished run's push failed, a successful run's record is
   mirrored from the worker's result (`_mirror`);
2. mirrors each skipped run into MLflow when MLflow lacks it, as the plan is drawn (`Tracker.sync`);
3. hands the planned runs to the loop in plan order, drawn as slots free up, and feeds worker events to the progress
   display (the loop keeps at most `max_concurrent` in flight and feeds the tracker);
4. records how each run ended: a retry the loop makes is shown; a deterministic failure
   (divergence, config error) is reported at once; a run another submission holds is "busy";
5. on Ctrl-C or SIGTERM the loop cancels the runs in flight, marks them `INTERRUPTED` in their run
   directories and `KILLED` in MLflow; the next submission resumes each from its checkpoint and
   reuses its MLflow child run;
6. has the study's result published on its parent run (the tracker's `publisher`) before it ends that
   run, so the parent is FINISHED only with its result on it; a submission with nothing to run
   publishes when the study's last whole publication was of other finished runs (`_result_key`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from reslab.common.io import write_atomic
from reslab.experiments.expand import RunSpec, expand, iter_runs
from reslab.experiments.spec import Study
from reslab.models.optim import hashed_config
from reslab.orchestrator.attempt.envinfo import submission_code
from reslab.orchestrator.dispatch import Backend
from reslab.orchestrator.driving.after import Drawn, around
from reslab.orchestrator.driving.gates import GateLooks
from reslab.orchestrator.driving.loop import DispatchLoop, ExecutionOptions, TaskMaker, new_submission
from reslab.orchestrator.driving.plan import PlanCounts, PlanEntry, plan, plan_iter, study_counts
from reslab.orchestrator.driving.progress import Progress
from reslab.orchestrator.driving.sequential import Looks
from reslab.orchestrator.durability.ledger import record_tries
from reslab.orchestrator.durability.outage import Outage
from reslab.orchestrator.durability.plans import record_version
from reslab.orchestrator.durability.storage import (
    StorageError,
    StudySync,
    hold_workspace_study,
    storage_outage,
    sync_study,
)
from reslab.orchestrator.durability.workspace import RunDir, Workspace, write_json
from reslab.orchestrator.tasks import (
    FAILED,
    INTERRUPTED,
    PRUNED,
    RUNNING,
    SUCCESS,
    Action,
    ClusterInfo,
    Completion,
    RunOutcome,
    RunState,
    RunTask,
    Word,
)
from reslab.orchestrator.tracking.protocol import DriverTracker, NullTracker
from reslab.results.power import check_confirmatory
from reslab.results.tries import ledger_records
from reslab.results.verdict import DEFAULT_ALPHA, analysis_of, plan_hash

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class LazyRuns:
    """Every run of a study as `submit` takes it at any size: drawn from `expand.iter_runs` as slots free up,
    never listed. `firsts` are its runs at its first seed (`expand(study, study.seeds[:1])`), one per (arm, grid
    point), which carry the device check; `counts` its plan counted before the submission (`plan.study_counts`),
    None to have `submit` count it."""

    firsts: list[RunSpec]
    counts: PlanCounts | None = None


@dataclass
class SubmitResult:
    submission: str
    # the plan counted, per arm and action: every run of a plain study, those a sequential study's looks reached
    planned: PlanCounts = field(default_factory=PlanCounts)
    # run_id -> what came of it, in the words the CLI prints (`tasks.WORDS`), for the runs this submission started
    states: dict[str, str] = field(default_factory=dict)
    # the other runs counted by word: those not run ("skipped", "busy elsewhere") and, after an interrupt, those
    # not started ("to run")
    tally: Counter[str] = field(default_factory=Counter)
    errors: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False
    cluster: ClusterInfo | None = None
    parent_run_id: str | None = None
    wall_s: float = 0.0
    # a sequential study: `results.sequential.sequential_table` after its last look read; a gates study: its
    # decisions so far (`results.gates.gate_rows`)
    sequential: pd.DataFrame | None = None
    # the finished runs the study's result is computed from (`_result_key`), for its publication
    result_key: str = ""
    # what the tracker's `publisher` published on the parent run, for the caller to print (`reslab run`: the readout)
    published: Any = None
    # evaluations (run, task) this submission did (`orchestrator.driving.evaluations`)
    evaluated: int = 0
    # interventions (run, request) this submission did (`orchestrator.driving.interventions`)
    intervened: int = 0
    # the runs planned, drawn again each call (the source's `planned_runs`)
    planned_runs: Callable[[], Iterable[RunSpec]] = field(default=lambda: (), repr=False)

    @property
    def runs(self) -> list[RunSpec]:
        """The runs this submission planned: every run of a plain study, those a sequential study's looks reached
        (built on demand: the readouts read them once the runs are done)."""
        return list(self.planned_runs())

    def count(self, word: str) -> int:
        return self.tally[word] + sum(1 for s in self.states.values() if s == word)

    def summary(self) -> str:
        text = ", ".join(f"{self.count(w.label)} {w.label}" for w in (SUCCESS, Action.SKIP, FAILED))
        text += f", {self.count(Action.BUSY.label)} busy elsewhere, {self.count(INTERRUPTED.label)} {INTERRUPTED.label}"
        text += f", {self.count(Action.RUN.label)} {Action.RUN.label}" if self.interrupted else ""
        text += f"; {self.evaluated} evaluation(s)" if self.evaluated else ""
        return text + (f"; {self.intervened} run(s) intervened on" if self.intervened else "")

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.errors


def check_power(study: Study, allow_underpowered: bool = False) -> None:
    """`results.power.UnderpoweredStudy` when a confirmatory comparison cannot reach alpha, unless
    `allow_underpowered`. A sequential study is not sized in advance: its test is anytime-valid (a gates study:
    its looks, `experiments.gates`). Each
    command that submits a study (`validate`, `run`, `submit`) calls it once, before it writes anything."""
    if not allow_underpowered and study.sequential is None and study.gates is None:
        check_confirmatory(study.comparisons, len(study.seeds), study.grid_sizes(), study=study.name)


def _mirror(rd: RunDir, run: RunSpec, outcome: RunOutcome) -> None:
    """A worker on another node without a shared workspace wrote its run directory there; keep
    the driver's copy complete so planning skips the run next time."""
    if rd.state() == SUCCESS and rd.complete():
        return
    rd.path.mkdir(parents=True, exist_ok=True)
    write_json(rd.spec_file, run.to_dict())
    write_json(rd.env_file, outcome.env)
    write_atomic(rd.metrics_file, "".join(json.dumps(r) + "\n" for r in outcome.metrics))
    write_json(rd.summary_file, {"summary": outcome.summary, "info": outcome.info})
    rd.set_status(SUCCESS, mirrored_from=outcome.host, host=outcome.host, node=outcome.node)


def _not_stored(outcome: RunOutcome) -> str:
    return "; finished, not yet in run storage (pushed once it answers)" if outcome.not_stored else ""


class StudySource:
    """A study's planned runs as the loop's task source; records what became of each run. The runs are drawn
    lazily (`LazyRuns`) or from a list, planned one at a time as the loop asks for a task (`plan.plan_iter`:
    the study's folder listed once), so the queue holds at most the next task; only the runs handed to the loop
    are remembered (`started`), the rest counted. The runs that finish, or had finished when planned, are
    `released` to a source wrapped around this one (`after.AfterSource`: their work after training)."""

    resume_hint = "the next `reslab run` resumes it"

    def __init__(self, study: Study, runs: list[RunSpec] | LazyRuns, workspace: Workspace, tracker: DriverTracker,
                 options: ExecutionOptions, result: SubmitResult, progress: Progress, say: Any) -> None:
        self.study, self.workspace, self.tracker, self.options = study, workspace, tracker, options
        self.result, self.progress, self.say = result, progress, say
        self.runs = runs
        self.started: dict[str, RunSpec] = {}  # the runs handed to the loop: the events name them
        self.stream: Iterator[PlanEntry] = iter(())  # the plan entries not drawn yet
        self.queue: deque[RunTask] = deque()
        self.maker: TaskMaker | None = None  # once the submission's code is known (`_run_plan`)
        self.synced = self.unsaid = 0  # finished runs mirrored into MLflow; of those, the ones not said yet
        self.undrawn = 0  # the planned runs to run not drawn from `stream` yet
        self.train = True  # False (`reslab eval`): the runs that have not finished are left as they are
        # the runs finished (now, or when planned) not taken yet by the source wrapped around this one (which sets
        # it: `after.AfterSource`); None: none is
        self.released: deque[RunSpec] | None = None

    def planned_runs(self) -> Iterator[RunSpec]:
        """The runs this source plans, drawn again: the list, or every run of the study (`iter_runs`)."""
        return iter(self.runs) if isinstance(self.runs, list) else iter_runs(self.study)

    def sample(self) -> list[RunSpec]:
        """Runs that carry every check made per (arm, grid point): the list, or the study's first seed's runs."""
        return self.runs if isinstance(self.runs, list) else self.runs.firsts

    def first_plan(self, recount: bool = False) -> PlanCounts:
        """What the submission plans before anything runs: every run, counted (`recount`: the counts `LazyRuns`
        carries are stale, run storage having brought records); its entries drawn later, one at a time."""
        rerun, lease = self.options.rerun_failed, self.options.lease_timeout_s
        if isinstance(self.runs, list):
            counts = PlanCounts.of(plan_iter(self.runs, self.workspace, rerun_failed=rerun, lease_timeout_s=lease))
        elif self.runs.counts is None or recount:
            counts = study_counts(self.study, self.runs.firsts, self.workspace, rerun_failed=rerun,
                                  lease_timeout_s=lease)
        else:
            counts = self.runs.counts
        self.stream = plan_iter(self.planned_runs(), self.workspace, rerun_failed=rerun, lease_timeout_s=lease)
        self.undrawn = counts.actions[Action.RUN]
        return counts

    def lookup(self, run_ids: list[str]) -> list[RunSpec]:
        """The runs of `run_ids` among those planned, in plan order (one pass, none kept but these)."""
        wanted = set(run_ids)
        return [r for r in self.planned_runs() if r.run_id in wanted] if wanted else []

    def device_runs(self) -> list[RunSpec]:
        """The runs whose devices the loop checks: `sample`'s, of the arms with runs to run."""
        by_arm = self.result.planned.by_arm
        return [r for r in self.sample() if by_arm.get(r.arm, Counter())[Action.RUN]]

    def _draw(self) -> bool:
        """Plan the next run and take its entry (`_take`); False once every planned run was drawn."""
        entry = next(self.stream, None)
        if entry is None:
            if self.unsaid:  # once the plan (a sequential study: a look's) is drawn
                self.say(f"  mirrored {self.unsaid} finished run(s) from their run directories into MLflow")
                self.unsaid = 0
            return False
        self._take(entry)
        return True

    def _take(self, e: PlanEntry) -> None:
        """A planned run: its task queued when it runs, counted when not; its lines said; a finished run mirrored
        into MLflow when MLflow lacks it and released."""
        assert self.maker is not None
        run, name = e.run, self.study.name
        if e.action == Action.RUN:
            self.undrawn = max(0, self.undrawn - 1)
            if e.state == RUNNING:  # a crashed or stopped holder: say why it is taken over
                self.say(f"  taking over {run.label}: {e.reason}")
            elif e.state == SUCCESS:  # a damaged summary: repaired from the final checkpoint
                self.say(f"  repairing {run.label}: {e.reason}")
            if self.train:
                self.queue.append(self.maker.task(run))
            return
        self.result.tally[e.action.label] += 1
        self.progress.counted(e.action.label)
        if e.action == Action.BUSY:
            self.say(f"  busy {run.label}: {e.reason}")
            return
        rd = self.workspace.run_dir(name, run.run_id)
        if e.state == SUCCESS:
            if rd.state() != SUCCESS and rd.restore_complete(self.options.lease_timeout_s):
                self.say(f"  {run.label}: finished (summary.json) but its status was lost or stale; restored SUCCESS")
            self._synced(self.tracker.sync(run, rd))
            self._release(run)
        elif e.state == FAILED:
            self._synced(self.tracker.sync_failed(run, e.error or "failed"))

    def _synced(self, mirrored: bool) -> None:
        self.synced += mirrored
        self.unsaid += mirrored

    def _release(self, run: RunSpec) -> None:
        """A finished run, for the source wrapped around this one, if any."""
        if self.released is not None:
            self.released.append(run)

    def has_tasks(self) -> bool:
        """Whether a task or a released run is ready, drawing planned runs until one is or none is left."""
        while not self.queue and not self.released and self._draw():
            pass
        return bool(self.queue or self.released)

    def left_to_run(self) -> int:
        """Planned runs to run that no task of this submission started: queued, or not drawn yet."""
        return self.undrawn + sum(1 for t in self.queue if t.run_id not in self.started)

    def run_of(self, run_id: str) -> RunSpec | None:
        return self.started.get(run_id)

    def next_task(self) -> RunTask | None:
        if not self.has_tasks() or not self.queue:
            return None
        task = self.queue.popleft()
        if task.run_id not in self.started:
            self.progress.add(task.run_id, task.run.label, task.run.config.train.steps)
        self.started[task.run_id] = task.run
        return task

    def on_event(self, event: dict[str, Any]) -> None:
        self.progress.event(event)

    def tick(self) -> None:
        self.progress.render()

    def waiting(self, what: str | None) -> None:
        self.progress.waiting(what)

    def on_retry(self, c: Completion) -> None:
        self.tracker.fail(c.task.run, c.error_text, final=False)
        self.progress.retry(c.task.run_id, c.task.attempt + 1, c.error_text)

    def _record(self, run_id: str, word: Word, detail: str = "") -> None:
        self.result.states[run_id] = word.label
        self.progress.finished(run_id, word.label, detail)

    def on_complete(self, c: Completion) -> float | None:
        run, outcome, end = c.task.run, c.outcome, c.end
        if end in (SUCCESS, Action.SKIP):
            self._record_end(c)
            self._release(run)
            return None
        if end == Action.BUSY:
            self._record(run.run_id, Action.BUSY, (outcome.error or "") if outcome else "")
        elif end in (INTERRUPTED, PRUNED):
            self.tracker.kill(run)
            self._record(run.run_id, INTERRUPTED, (outcome.error or "") if outcome else "")
        else:
            self.tracker.fail(run, c.error_text, final=True)
            self.result.errors[run.run_id] = c.error_text
            self._record(run.run_id, FAILED, c.error_text)
        return None

    def _record_end(self, c: Completion) -> None:
        """A run that succeeded now, or had finished (SKIP): its record mirrored, MLflow told."""
        run, outcome, end = c.task.run, c.outcome, c.end
        rd = self.workspace.run_dir(self.study.name, run.run_id)
        if outcome is not None and end == SUCCESS:
            _mirror(rd, run, outcome)  # a no-op when the loop's pull brought SUCCESS
            # metrics and diagnostics whose events were lost on the way (a progress actor that restarted)
            self.tracker.finish(run, outcome.summary, metrics=outcome.metrics, env=outcome.env, info=outcome.info,
                                diagnostics=rd.diagnostics())
            s = outcome.summary
            self._record(run.run_id, SUCCESS, f"val {s.get('val_loss', float('nan')):.4f} "
                                              f"(tail {s.get('val_loss_tail', float('nan')):.4f})"
                                              + _not_stored(outcome))
        elif end == Action.SKIP:
            if outcome is not None and outcome.not_stored:
                _mirror(rd, run, outcome)  # the driver pushes its copy: it must be whole
            self.tracker.sync(run, rd)
            self._record(run.run_id, Action.SKIP,
                         "finished by another submission" + (_not_stored(outcome) if outcome else ""))

    def on_interrupted(self, task: RunTask, finished: bool) -> None:
        if finished:
            self.tracker.sync(task.run, self.workspace.run_dir(self.study.name, task.run_id))
            self._record(task.run_id, SUCCESS)
        else:
            self._record(task.run_id, INTERRUPTED)


class SequentialSource(StudySource):
    """A sequential study's looks as the loop's task source (module docstring): a look's runs, "nothing yet"
    while they are pending, then the test's decision and the next look's runs, or the end. A look's runs are
    planned together (the test reads them all) and drawn like a plain study's. A gates study's looks
    (`orchestrator.driving.gates.GateLooks`) are the same to it."""

    def __init__(self, study: Study, runs: list[RunSpec] | LazyRuns, workspace: Workspace, tracker: DriverTracker,
                 options: ExecutionOptions, result: SubmitResult, progress: Progress, say: Any) -> None:
        super().__init__(study, runs, workspace, tracker, options, result, progress, say)
        # the looks pick their runs from the design's whole list: a sequential study is bounded by its `max` seeds,
        # a gates study by its last look
        every = runs if isinstance(runs, list) else expand(study)
        self.looks: Looks | GateLooks = Looks(study, every, workspace) if study.gates is None \
            else GateLooks(study, every, workspace)
        self.pending: set[str] = set()  # run ids of the looks so far that have not ended

    def planned_runs(self) -> Iterator[RunSpec]:
        return iter(list(self.looks.covered.values()))

    def sample(self) -> list[RunSpec]:
        return self.looks.runs

    def lookup(self, run_ids: list[str]) -> list[RunSpec]:
        wanted = set(run_ids)
        return [r for r in self.looks.runs if r.run_id in wanted]

    def first_plan(self, recount: bool = False) -> PlanCounts:
        return self._plan_look() or PlanCounts()

    def _plan_look(self) -> PlanCounts | None:
        """Read the test on the looks so far and plan the next look's runs (drawn from `stream`), counted; None
        when the study is done."""
        seeds = self.looks.seeds
        batch = self.looks.next()
        self.result.sequential = self.looks.table
        for line in self.looks.news(seeds, batch):
            self.say(f"{self.study.name}: {line}")
        if batch is None:
            return None
        entries = plan(batch, self.workspace, rerun_failed=self.options.rerun_failed,
                       lease_timeout_s=self.options.lease_timeout_s)
        self.pending.update(e.run.run_id for e in entries if e.action == Action.RUN)
        self.stream = iter(entries)
        counts = PlanCounts.of(entries)
        self.undrawn = counts.actions[Action.RUN]
        return counts

    def has_tasks(self) -> bool:
        """Once a look's runs have all ended (and none failed), release the next look's until one has a run to
        run or the study is done."""
        while not super().has_tasks():
            if self.pending or self.result.errors:
                return False
            counts = self._plan_look()
            if counts is None:
                return False
            self.result.planned.merge(counts)
            _announce(self, counts)
        return True

    def on_complete(self, c: Completion) -> float | None:
        self.pending.discard(c.task.run_id)
        return super().on_complete(c)


def submit(study: Study, runs: list[RunSpec] | LazyRuns, workspace: Workspace, backend: Backend,
           tracker: DriverTracker | None, options: ExecutionOptions | None = None, *, stream: TextIO | None = None,
           say: Any = print) -> SubmitResult:
    """Run every run of `runs` that is not finished (a sequential study: of the looks it needs); see the
    module docstring. `runs` is a list, or `LazyRuns`: every run of the study, drawn as slots free up (what
    `reslab run` passes). The caller checks the study's power first (`check_power`).

    Each finished run is then evaluated on `options.evaluate`'s tasks (default: the study's `evals:`), each
    (run, task) once (`orchestrator.driving.evaluations`), and intervened on as the study's `interventions:`
    asks, each (run, request) once (`orchestrator.driving.interventions`): work after training
    (`orchestrator.driving.after`). An `EvalJob.only` trains nothing and only evaluates the runs finished before
    (`reslab eval`).

    The tracker's `publisher` (`reslab run` sets it: `gathering.gather.publish_result`, with
    `SubmitResult.result_key`) puts the study's result on the submission's parent run. It is called once the
    runs are done (not after an interrupt) and before the parent run ends, so a parent is FINISHED only with
    its result on it; and a submission with nothing to run keeps its parent and calls it when the study's
    last whole publication was of other runs (`DriverTracker.published_key`): a driver killed before its
    publication was whole, a study that finished elsewhere. Publishing is idempotent, so any later
    submission completes it."""
    options = options or ExecutionOptions()
    t0 = time.time()
    submission = new_submission()
    # run storage has no per-node leases: one driver per study at a time, held by a marker there
    storage = workspace.run_storage()
    outage = storage_outage(storage, options.outage_timeout_s, say, "nothing is planned until it answers") \
        if storage else None
    if storage and outage:
        outage.wait_out(storage.probe, (StorageError,))  # one cheap call; the study is listed once, in the sync
    synced = StudySync([], [], [])
    result = SubmitResult(submission=submission)
    progress = Progress(study.name, stream=stream) if stream is not None else Progress(study.name)
    kind = StudySource if study.sequential is None and study.gates is None else SequentialSource
    source = kind(study, runs, workspace, tracker or NullTracker(), options, result, progress, say)
    record_study_tries(study, workspace, source.sample())
    result.planned_runs = source.planned_runs
    with hold_workspace_study(workspace, study.name, submission, options.lease_timeout_s, options.heartbeat_s,
                              outage):
        if storage and outage:
            # a sequential or gates study's design
            every = source.planned_runs if study.sequential is None and study.gates is None else source.sample
            synced = outage.wait_out(lambda: sync_study(workspace, study.name, (r.run_id for r in every())),
                                     (StorageError,))
            say(f"{study.name}: run storage {storage}: pulled the records of {len(synced.pulled)} run(s)"
                + (f"; pushed {len(synced.pushed)} finished run(s) it lacked" if synced.pushed else "")
                + (f" ({len(synced.without_checkpoint)} without their checkpoint: their nodes push it)"
                   if synced.without_checkpoint else ""))
            outage.doing = "runs in flight train on"
        # the study's work after training, wrapped around its source (`after.around`)
        driven, after_done = around(source, study, options, workspace, source.tracker, say, result.errors)
        result.planned = source.first_plan(recount=bool(synced.pulled or synced.pushed))
        try:
            _run_plan(source, driven, backend, options, outage, synced.without_checkpoint)
        finally:
            progress.close()
    result.wall_s = time.time() - t0
    result.evaluated, result.intervened = after_done()
    return result


def _announce(source: StudySource, counts: PlanCounts) -> None:
    """The plan's line (its counts), and on the progress display the runs not started yet, counted."""
    study, result = source.study, source.result
    source.say(f"{study.name}: {counts.summary()} (submission {result.submission})")
    steps = _mean_steps(source.sample())
    source.progress.expect(sum(n[Action.RUN] * steps.get(arm, 0.0) for arm, n in counts.by_arm.items()),
                           counts.actions[Action.RUN])


def _mean_steps(runs: list[RunSpec]) -> dict[str, float]:
    """Each arm's mean training steps over `runs` (one per grid point: the ETA's estimate for the runs not drawn)."""
    total: Counter[str] = Counter()
    n: Counter[str] = Counter()
    for r in runs:
        total[r.arm] += r.config.train.steps
        n[r.arm] += 1
    return {arm: total[arm] / n[arm] for arm in n}


def _begin_tracking(source: StudySource, options: ExecutionOptions, code: dict[str, Any]) -> None:
    """The submission's parent run, with the plan counted per arm (O(arms), whatever the study's size); the
    finished runs MLflow lacks are mirrored into it as the plan is drawn (`StudySource._take`)."""
    study, result, tracker = source.study, source.result, source.tracker
    result.parent_run_id = tracker.begin(
        study.name, submission=result.submission, code=code, study_file=study.path,
        plan=result.planned.to_dict(), analysis=_freeze_analysis(source),
        settings={"retries": options.retries, "rerun_failed": options.rerun_failed,
                  "cpus_per_run": options.cpus_per_run, "gpus_per_run": options.gpus_per_run,
                  "sharding": options.ranks.sharding if options.ranks.world > 1 else None,
                  "max_concurrent": options.max_concurrent},
    )


def _freeze_analysis(source: StudySource) -> dict[str, Any]:
    """The study's analysis plan (`results.verdict.analysis_of`, at the level its sequential looks read) recorded in
    the workspace (`durability.plans`): frozen at its first submission, a changed one appended with the finished runs
    the plan skips. Returns the parent run's record of it: this submission's hash and every version."""
    study = source.study
    analysis = analysis_of(study.comparisons, alpha=DEFAULT_ALPHA, sequential=study.sequential,
                           contrasts=study.contrasts)
    digest = plan_hash(analysis)
    skipped = {arm: c[Action.SKIP] for arm, c in source.result.planned.by_arm.items() if c[Action.SKIP]}
    versions = record_version(source.workspace.root, study.name, analysis, digest, skipped, first=True)
    return {"hash": digest, "versions": versions}


def _result_key(source: StudySource) -> str:
    """What the study's result is computed from: the finished runs among those planned, by run id (a content
    id). A whole publication carries it (`DriverTracker.mark_published`). The study's folder is listed once; only
    a run listed there is read."""
    study, workspace = source.study.name, source.workspace
    present = workspace.recorded_ids(study)
    done = sorted(r.run_id for r in source.planned_runs()
                  if r.run_id in present and workspace.run_dir(study, r.run_id).complete())
    return hashlib.sha256("\n".join(done).encode()).hexdigest()[:16]


def _run_plan(source: StudySource, driven: Drawn, backend: Backend, options: ExecutionOptions,
              outage: Outage | None, without_checkpoint: list[str]) -> None:
    """The study's plan driven by the loop, through `driven` (the study's source, or a source wrapped around it)."""
    result, tracker = source.result, source.tracker
    _announce(source, result.planned)
    code = submission_code()  # the git version and the fingerprint every worker checks its code against
    _begin_tracking(source, options, code)
    maker = source.maker = TaskMaker(source.workspace, result.submission, code, options)
    # the runs storage got from the workspace without their checkpoint: their nodes push their copies
    pushes = [maker.task(r) for r in source.lookup(without_checkpoint)]
    source.started.update((t.run_id, t.run) for t in pushes)
    ran = driven.has_tasks()  # draws the plan up to its first task: all of it when nothing is to run
    if not ran and not pushes:
        _end(source, SUCCESS, _counts(result), ran=False)
        return
    loop = DispatchLoop(driven, backend, tracker, source.workspace, options, source.say, outage)
    loop.push_from_nodes(pushes)
    try:
        outcome = loop.run(source.device_runs(), result.submission)
    except BaseException:
        tracker.end(loop.result.status, _counts(result))
        raise
    result.cluster, result.interrupted = outcome.cluster, outcome.interrupted
    status = FAILED if outcome.status == SUCCESS and result.errors else outcome.status
    _end(source, status, _counts(result), ran=ran)
    if outcome.interrupted:
        _say_interrupted(source)


def _counts(result: SubmitResult) -> dict[str, int]:
    return {"planned": result.planned.runs, **{w.label: result.count(w.label) for w in (SUCCESS, FAILED, Action.SKIP)}}


def _end(source: StudySource, status: RunState, counts: dict[str, int], *, ran: bool) -> None:
    """The submission's parent run ended in `status`, the study's result published on it first (the tracker's
    `publisher`; a publication that fails ends it FAILED) unless the runs were interrupted: when runs ran, or
    when the study's last whole publication was of other finished runs. A submission that ran, mirrored and
    published nothing leaves no parent run (one empty parent per no-op `reslab run` otherwise)."""
    result, tracker = source.result, source.tracker
    publish = tracker.publisher if result.parent_run_id is not None and status != INTERRUPTED else None
    if publish is not None and (ran or tracker.published_key() != _result_key(source)):
        result.result_key = _result_key(source)
        try:
            publish(result)
        except BaseException:
            tracker.end(FAILED, counts)
            raise
    elif not ran and not source.synced:
        tracker.discard_parent()
        result.parent_run_id = None
        return
    tracker.end(status, counts)


def _say_interrupted(source: StudySource) -> None:
    study, result, say = source.study, source.result, source.say
    result.tally[Action.RUN.label] += source.left_to_run()
    stopped = result.count(INTERRUPTED.label)
    if stopped:
        say(f"\n{study.name}: interrupted; {stopped} run(s) stopped. Run the same "
            "command again to resume them from their checkpoints.")
    else:
        say(f"\n{study.name}: interrupted before any run started; nothing to resume (the same command starts "
            "them).")


__all__ = ["ExecutionOptions", "LazyRuns", "SequentialSource", "StudySource", "SubmitResult", "check_power", "submit"]


def record_study_tries(study: Study, workspace: Workspace, runs: Iterable[RunSpec] | None = None) -> int:
    """The study's comparisons, one try of its seeds each, in the workspace's ledger (`durability.ledger`; issue 55
    item 4): keyed by content (both arms' configs at each grid point, read off `runs` at the first seed; default:
    `expand`'s), so a re-submission records nothing new and the same comparison under another name is one more
    study of its try or a new try."""
    if not study.comparisons:
        return 0
    runs = expand(study, study.seeds[:1]) if runs is None else runs
    configs = {(r.arm, r.grid_key): hashed_config(r.config) for r in runs if r.seed == study.seeds[0]}
    return record_tries(workspace.root, ledger_records(study.name, study.comparisons, configs, study.seeds,
                                                       study.replicate, study.sequential))
