"""The one dispatch loop: plan -> tasks -> dispatch -> completions -> retries -> signals.

A submission is a *source* of tasks driven by this loop, the shape of Ray Tune's `Searcher`
(`suggest`, then `on_trial_complete`): a study's plan (`orchestrator.driving.submit.StudySource`) hands
out its planned runs; a sequential study (`orchestrator.driving.submit.SequentialSource`) hands out a
look's runs, answers "nothing yet" (None) while they are pending, then decides and releases the
next look; a search (`orchestrator.driving.tune.SearchSource`) asks Optuna for a trial each time a slot
frees. A source's None with tasks in flight means "nothing yet" (the loop asks again once one
ends); with none in flight, the source is finished and the loop ends. The loop alone owns what
every source needs:

- **concurrency**: at most `limit` tasks in flight, GPU-aware (`concurrency`): the cluster's GPUs
  over each run's GPUs for GPU runs, its CPUs over each run's CPUs otherwise (runs on CPU ranks,
  `cpu_ranks`, ask for no GPU), or `max_concurrent`;
- **the device check**: runs that ask for CUDA get a GPU (`check_devices`); `preflight`, which the
  commands call before they write anything, checks the address or local devices, and budgets;
- **retries**: an attempt whose worker never returned, or that failed for a reason a retry can fix,
  runs again (up to `retries` more times), before any new task; a run whose worker died is
  marked FAILED (retryable) in its run directory first;
- **held runs**: a source may hold a run another driver's lease holds and have it submitted again
  after a wait (a search needs its value; a study reports it busy instead);
- **events**: every worker event goes to the tracker (the one MLflow writer) and to the source;
- **signals**: inside `StopOnSignal`, SIGINT and SIGTERM set a flag the loop checks between ticks,
  so an interrupt never lands inside an MLflow write or a Ray call; then the loop cancels what is in
  flight, gives the tracker the workers' last events, marks each cancelled run INTERRUPTED (or
  counts it finished, when it finished just before) and kills its MLflow child;
- **a driver that fails** (a bug, a broken backend) kills the in-flight MLflow children before
  the error propagates, so none stays RUNNING.

Work after training (evaluations, interventions) is a task like a run's, which a source wrapped around the
study's releases when its run finishes (`orchestrator.driving.after.AfterSource`, the shape of Ray Tune's
`ConcurrencyLimiter` wrapping a searcher); the task carries its function (`RunTask.work`). The loop does not
know it from a run's task: it runs under the same concurrency, is retried as a run is, Ctrl-C cancels it like
a run, and its completion goes to the source, which records it (a source, not the loop, tells the tracker of a
retry: `Source.on_retry`).

Run storage: after every completion, and for every cancelled run, the run's records are pulled
from storage first (`storage.pull_completed`), so the driver sees what the worker's node wrote.
While storage does not answer (`outage.Outage`), nothing is failed for it and nothing is trained
twice: a run that finished but whose push failed is finished ("not yet durable"; the source counts
it, the driver's copy holds its records), and once storage answers, before it ends, the loop has the
node that finished it push its copy, whole (a push task, `RunTask.push_from`: the checkpoint,
train.log and diagnostics, which the driver's copy lacks when the run trained in a node's scratch
directory); only when that node or its copy is gone does it push the driver's copy, and says what
storage then lacks. A run that could not start because storage did not answer is held and submitted
again after a backoff, spending no retry. Runs in flight train on. The outage's clock starts when
storage stopped answering, as the first failure anyone saw says (a worker's failed checkpoint push,
the study marker's heartbeat), and the loop checks it every tick: past `--outage-timeout` it stops
with one line (`storage.storage_outage`). The submission's sync before planning hands the loop the
finished runs whose checkpoint storage lacks, to be pushed from their nodes the same way.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from reslab.common.errors import ConfigError
from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import SHARDINGS, PipelineResources, StudyResources
from reslab.orchestrator.dispatch import Backend, BackendError
from reslab.orchestrator.durability.lease import HEARTBEAT_S
from reslab.orchestrator.durability.outage import DEFAULT_TIMEOUT_S, Outage, check_outage_timeout
from reslab.orchestrator.durability.storage import (
    StorageError,
    has_checkpoint,
    pull_completed,
    push_finished,
    storage_outage,
)
from reslab.orchestrator.durability.workspace import (
    DEFAULT_LEASE_TIMEOUT_S,
    RunDir,
    Workspace,
    check_lease_timeout,
)
from reslab.orchestrator.tasks import (
    COORDINATOR_CPUS,
    FAILED,
    INTERRUPTED,
    RUNNING,
    SUCCESS,
    Action,
    ClusterInfo,
    Completion,
    EvalJob,
    Node,
    Ranks,
    Resources,
    RunState,
    RunTask,
    on_cpu_ranks,
)
from reslab.orchestrator.tracking.protocol import DriverTracker


@dataclass(frozen=True, kw_only=True)
class ExecutionOptions:
    """How a submission's runs execute, for a study (`submit`) and a search (`tune`) alike; none of
    them enters a run id.

    Args:
        max_concurrent: runs in flight at once. Default (None): the cluster's GPUs / gpus per run
            for GPU runs, its CPUs / cpus per run otherwise.
        cpus_per_run: CPUs each run asks for, also its torch thread count. Default: 1.
        gpus_per_run: GPUs each run asks for. Default (None): 1 when the cluster has GPUs, else 0.
            N >= 2 (a whole number) trains each run on N ranks of one GPU each through Ray Train
            (`orchestrator.attempt.distributed_run`).
        sharding: how a run on N ranks holds its model: "ddp" (replicated) or "fsdp" (FSDP2,
            sharded). Default (None): "ddp".
        rank_restarts: how many times Ray Train starts a run's ranks again, from its last committed
            checkpoint, after one of them dies, before the attempt fails. Default: 2.
        retries: extra attempts for a run whose failure a retry can fix. Default: 1.
        rerun_failed: run runs that failed in an earlier submission. Default: False.
        lease_timeout_s: a `RUNNING` run whose heartbeat is older is taken over. Default: 120.
        poll_s: how long the driver waits for events per tick. Default: 0.5.
        outage_timeout_s: how long the driver waits out run storage that does not answer before it
            stops (`orchestrator.durability.outage`). Default: 1800.
        evaluate: a study's evaluations of its finished runs (`orchestrator.driving.evaluations`). Default
            (None): the study's `evals:`, if any; `reslab eval` sets one (`EvalJob.only`: nothing trains).
    """

    max_concurrent: int | None = None
    cpus_per_run: float = 1.0
    gpus_per_run: float | None = None
    retries: int = 1
    rerun_failed: bool = False
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    heartbeat_s: float = HEARTBEAT_S
    poll_s: float = 0.5
    outage_timeout_s: float = DEFAULT_TIMEOUT_S
    sharding: str | None = None
    rank_restarts: int = 2
    evaluate: EvalJob | None = None
    pipeline: PipelineResources = PipelineResources()  # the study's `resources.pipeline_*` (no flag)

    def __post_init__(self) -> None:
        check_lease_timeout(self.lease_timeout_s)
        check_outage_timeout(self.outage_timeout_s)
        for name, bad, allowed in (
            ("max_concurrent", self.max_concurrent is not None and self.max_concurrent < 1, "None or >= 1"),
            ("cpus_per_run", not self.cpus_per_run > 0, "> 0"),
            ("gpus_per_run", self.gpus_per_run is not None and not (
                self.gpus_per_run >= 0 and (self.gpus_per_run < 2 or float(self.gpus_per_run).is_integer())),
             "None, a number >= 0 below 2, or a whole number of GPUs (one per rank)"),
            ("sharding", self.sharding not in (None, *SHARDINGS), "None, " + " or ".join(SHARDINGS)),
            ("rank_restarts", self.rank_restarts < 0, ">= 0"),
            ("retries", self.retries < 0, ">= 0"),
            ("heartbeat_s", not self.heartbeat_s > 0, "> 0"),
            ("poll_s", not self.poll_s >= 0, ">= 0"),
        ):
            if bad:
                raise ConfigError(f"ExecutionOptions.{name}: {getattr(self, name)!r} is not allowed; "
                                  f"allowed: {allowed}")

    @property
    def ranks(self) -> Ranks:
        """How each run trains: on `gpus_per_run` ranks when that is 2 or more, each with an equal share
        of `cpus_per_run` (its torch threads: at least 1); else in one process."""
        gpus = self.gpus_per_run
        world = int(gpus) if gpus is not None and gpus >= 2 else 1
        share = self.cpus_per_run / world
        return Ranks(world=world, sharding=self.sharding or "ddp", cpus=share, threads=max(1, int(share)),
                     restarts=self.rank_restarts, **dataclasses.asdict(self.pipeline))

    def with_resources(self, resources: StudyResources) -> ExecutionOptions:
        """These options with a study's `resources:` filling in what the flags left unset (the flags win)."""
        gpus = self.gpus_per_run if self.gpus_per_run is not None else resources.gpus_per_run
        return dataclasses.replace(self, gpus_per_run=gpus, sharding=self.sharding or resources.sharding,
                                   pipeline=resources.pipeline)


def new_submission(prefix: str = "") -> str:
    """A submission id: when it started, and a random suffix."""
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


class StopOnSignal:
    """`with StopOnSignal() as stop:` SIGINT/SIGTERM set `stop.requested`; a second one raises
    KeyboardInterrupt at once. Enter it after the backend starts: `ray.init` installs its own
    SIGTERM handler (`sys.exit`). The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.requested = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous.clear()


def preflight(runs: list[RunSpec], address: str | None) -> None:
    """The checks every command that dispatches makes before it writes anything: the address answers
    (a dead one fails in seconds) or the local devices exist, and each run's token budget fits its
    prepared corpus. A study's command checks its power first, once (`submit.check_power`)."""
    from reslab.experiments.budget import check_budget, study_budget
    from reslab.orchestrator.dispatch.ray_backend import check_local_devices, probe_address

    if address is None:
        check_local_devices(runs)
    else:
        probe_address(address)
    check_budget(study_budget(runs, prepare_stdlib_corpus=True), require_prepared=True)


def check_devices(runs: list[RunSpec], gpus: float) -> None:
    wants_cuda = sorted({r.arm for r in runs if r.config.train.device.startswith("cuda")})
    if wants_cuda and gpus <= 0:
        raise BackendError(
            f"arms {wants_cuda} set train.device to cuda but runs get no GPU (--gpus-per-run 0 or a cluster "
            "without GPUs); use train.device: auto, or give each run a GPU"
        )


def cpu_ranks(cluster: ClusterInfo, options: ExecutionOptions, runs: list[RunSpec]) -> bool:
    """Whether the submission's runs on N >= 2 ranks train on CPU ranks (`tasks.on_cpu_ranks`: the cluster has
    no GPU, or every run sets `train.device: cpu`); False for runs in one process."""
    return options.ranks.world > 1 and on_cpu_ranks(cluster.gpus, [r.config.train.device for r in runs])


def run_resources(cluster: ClusterInfo, options: ExecutionOptions, on_cpus: bool = False) -> Resources:
    """What each run asks for: `cpus_per_run`, and `gpus_per_run` GPUs (default: 1 when the cluster has GPUs);
    none when its ranks are CPU ranks (`on_cpus`)."""
    gpus = options.gpus_per_run if options.gpus_per_run is not None else (1.0 if cluster.gpus > 0 else 0.0)
    return Resources(cpus=options.cpus_per_run, gpus=0.0 if on_cpus else gpus, ranks=options.ranks.world)


def concurrency(cluster: ClusterInfo, resources: Resources, options: ExecutionOptions) -> int:
    """Tasks in flight at once: `max_concurrent`, else what the cluster can place whole (a run on CPU ranks: its
    ranks' CPUs and its coordinating task's)."""
    if options.max_concurrent:
        return options.max_concurrent
    if resources.gpus > 0:
        return max(1, int(cluster.gpus // resources.gpus))
    coordinator = COORDINATOR_CPUS if options.ranks.world > 1 else 0.0
    return max(1, int(cluster.cpus // max(resources.cpus + coordinator, 1e-9)))


def placement(cluster: ClusterInfo, resources: Resources, ranks: Ranks, on_cpus: bool, limit: int) -> str:
    """The line that says where the runs go: "... each run 2 CPU on 2 CPU ranks (gloo, pipeline 2 stages), ..."."""
    if ranks.world < 2:
        each = f"{resources.cpus:g} CPU + {resources.gpus:g} GPU"
    elif on_cpus:
        each = f"{resources.cpus:g} CPU on {ranks.world} CPU ranks (gloo, {ranks.layout})"
    else:
        each = f"{resources.cpus:g} CPU + {resources.gpus:g} GPU on {ranks.world} ranks ({ranks.layout})"
    return (f"  cluster {cluster.address}: {cluster.nodes} node(s), {cluster.cpus:g} CPU, {cluster.gpus:g} GPU; "
            f"each run {each}, up to {limit} at once")


def mark_interrupted(rd: RunDir, submission: str, why: str) -> None:
    status = rd.status() or {}
    lease = rd.lease() or {}
    if status.get("state") in (RUNNING, None) and lease.get("submission") in (submission, None):
        if rd.path.exists():
            rd.set_status(INTERRUPTED, submission=submission, error=why)
        rd.release(submission)


@dataclass(frozen=True)
class TaskMaker:
    """Builds a run's task for one submission: where it trains, its code, its lease settings."""

    workspace: Workspace
    submission: str
    code: dict[str, Any]
    options: ExecutionOptions

    def task(self, run: RunSpec, trial: Any = None) -> RunTask:
        storage = self.workspace.run_storage()
        return RunTask(run=run, run_dir=str(self.workspace.run_dir(run.study, run.run_id).path),
                       submission=self.submission, threads=max(1, int(self.options.cpus_per_run)), code=self.code,
                       lease_timeout_s=self.options.lease_timeout_s, heartbeat_s=self.options.heartbeat_s,
                       trial=trial, storage=storage.run_uri(run.study, run.run_id) if storage else None,
                       ranks=self.options.ranks)


class Source(Protocol):
    """A source of tasks for the loop (a study's plan, a sequential study's looks, a search)."""

    # the end of "interrupted (Ctrl-C); ..." written into a cancelled run's status
    resume_hint: str

    def run_of(self, run_id: str) -> RunSpec | None:
        """The run an event names, if it is one of this source's."""
    def next_task(self) -> RunTask | None:
        """The next task to start now, or None: nothing yet while tasks are in flight (asked again after
        each completion), finished when none is."""
    def on_event(self, event: dict[str, Any]) -> None: ...
    def on_retry(self, c: Completion) -> None:
        """An attempt failed and runs again (the loop resubmits it); the source tells the tracker, if it should."""
    def on_complete(self, c: Completion) -> float | None:
        """An attempt ended for good; a number of seconds asks the loop to submit it again after
        that wait (its run is held by another driver's lease)."""
    def on_interrupted(self, task: RunTask, finished: bool) -> None:
        """A task cancelled by an interrupt; `finished` when its run had finished just before."""
    def tick(self) -> None:
        """After each poll (a progress display redraws)."""
    def waiting(self, what: str | None) -> None:
        """What the loop waits for while nothing runs yet ("Ray to start", "workers"), for a progress display."""


@dataclass
class LoopResult:
    status: RunState = FAILED  # until the loop completes: a backend that cannot start fails the submission
    interrupted: bool = False
    cluster: ClusterInfo | None = None


class DispatchLoop:
    """Drives one source to the end on one backend; see the module docstring."""

    def __init__(self, source: Source, backend: Backend, tracker: DriverTracker, workspace: Workspace,
                 options: ExecutionOptions, say: Any = print, outage: Outage | None = None) -> None:
        """`outage`: the submission's outage of run storage (its clock may have started before the loop, and
        the study marker's heartbeat feeds it); by default one of the loop's own."""
        self.source, self.backend, self.tracker, self.workspace = source, backend, tracker, workspace
        self.options, self.say = options, say
        self.inflight: dict[str, RunTask] = {}
        self.retries: deque[RunTask] = deque()
        self.held: list[tuple[float, RunTask]] = []  # (not before, task): runs another driver's lease holds
        self.result = LoopResult()
        self.storage = workspace.run_storage()
        if self.storage is not None and outage is None:
            outage = storage_outage(self.storage, options.outage_timeout_s, say, "runs in flight train on")
        self.outage = outage if self.storage is not None else None
        # finished runs whose copy run storage lacks, and the node that holds it (None: push the driver's copy)
        self.unstored: dict[str, tuple[RunTask, Node | None]] = {}
        self.pushing: dict[str, RunTask] = {}  # push tasks in flight (`RunTask.push_from`)

    def run(self, device_runs: list[RunSpec], submission: str) -> LoopResult:
        """Start the backend, check `device_runs` against the runs' resources, and drive the source."""
        try:
            self.source.waiting(f"{getattr(self.backend, 'name', 'the backend')} to start")
            cluster = self.result.cluster = self.backend.start()
            on_cpus = cpu_ranks(cluster, self.options, device_runs)
            resources = run_resources(cluster, self.options, on_cpus)
            check_devices(device_runs, resources.gpus)
            self.backend.resources(resources)
            limit = concurrency(cluster, resources, self.options)
            self.say(placement(cluster, resources, self.options.ranks, on_cpus, limit))
            self.source.waiting("workers")
            with StopOnSignal() as stop:
                self._drive(resources, limit, stop)
            self.result.status = SUCCESS
        except KeyboardInterrupt:
            self.result.status, self.result.interrupted = INTERRUPTED, True
            self._cancel(submission)
        except Exception:
            for task in self.inflight.values():  # no MLflow child may stay RUNNING
                try:
                    self.tracker.kill(task.run)
                except Exception:  # a broken tracker must not hide the driver's own error
                    continue
            raise
        finally:
            self.backend.shutdown()
        return self.result

    def push_from_nodes(self, tasks: list[RunTask]) -> None:
        """Have the nodes that hold these finished runs push their copies once storage answers (the runs the
        sync before planning pushed without their checkpoint); each node is the one its status names."""
        for task in tasks:
            status = RunDir(Path(task.run_dir)).status() or {}
            self.unstored[task.run_id] = (task, Node(status.get("node"), status.get("host")))

    def _drive(self, resources: Resources, limit: int, stop: StopOnSignal) -> None:
        while True:
            if stop.requested:
                raise KeyboardInterrupt
            self._release_held(resources)
            while len(self.inflight) < limit:
                task = self.retries.popleft() if self.retries else self.source.next_task()
                if task is None:
                    break
                self.backend.submit(task, resources)
                self.inflight[task.run_id] = task
            self._storage_tick(resources)
            if not self.inflight and not self.pushing:
                if not self.unstored:
                    return
                time.sleep(max(self.options.poll_s, 0.2))  # the study's runs are done; their pushes are not
                continue
            if not self.pushing and len(self.held) == len(self.inflight):  # only runs waiting for a lease or storage
                time.sleep(max(self.options.poll_s, 0.2))
                continue
            events, done = self.backend.poll(self.options.poll_s)
            self._events(events)
            for completion in done:
                self._complete(completion)
            self.source.tick()

    def _release_held(self, resources: Resources) -> None:
        now = time.time()
        for when, task in [h for h in self.held if h[0] <= now]:
            self.held.remove((when, task))
            self.backend.submit(task, resources)

    def _events(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            rid = event.get("run_id")
            run = self.source.run_of(rid) if isinstance(rid, str) else None
            if run is None:
                continue
            self.tracker.on_event(run, event)
            self.source.on_event(event)
        self.tracker.flush()

    def _storage_tick(self, resources: Resources) -> None:
        """While storage is down or finished runs wait for their push, storage is asked again when the next
        try is due; once it answers the outage is over, and each finished run it lacks is pushed by the node
        that holds its copy (a push task), or from the driver's copy when that node is gone. The outage's
        clock is checked every tick, so its timeout holds while nothing of the driver's own fails."""
        if self.outage is None or self.storage is None:
            return
        if (self.unstored or self.outage.down) and self.outage.due():
            self._push_unstored(resources)
        self.outage.check()

    def _push_unstored(self, resources: Resources) -> None:
        assert self.outage is not None and self.storage is not None
        try:
            self.storage.probe()
            for run_id, (task, node) in list(self.unstored.items()):
                if node is None:
                    push_finished(self.storage.run(task.run.study, run_id),
                                  self.workspace.run_dir(task.run.study, run_id))
                else:
                    push = dataclasses.replace(task, push_from=node)
                    self.backend.submit(push, resources)
                    self.pushing[run_id] = push
                del self.unstored[run_id]
        except StorageError as exc:
            waiting = f"{len(self.unstored)} finished run(s) wait for their push; " if self.unstored else ""
            self.outage.failed(f"{waiting}{exc}")
            return
        self.outage.ok()

    def _pushed(self, c: Completion) -> None:
        """A push task ended: the run's copy is in storage, or storage failed again (it waits for the next
        try), or the node or its copy is gone (the driver's copy is pushed instead, and what it lacks said)."""
        task, outcome = c.task, c.outcome
        self.pushing.pop(task.run_id, None)
        if outcome is not None and outcome.not_stored and self.outage is not None:
            self.unstored[task.run_id] = (task, task.push_from)
            self.outage.failed(outcome.not_stored, since=outcome.storage_down_since)
        elif outcome is not None and outcome.state == Action.SKIP:
            pull_completed(self.workspace, task.run.study, task.run_id, self.outage)  # the node's records, here too
        else:
            rd = RunDir(Path(task.run_dir))
            lacks = [n for n in ("train.log", "diagnostics.jsonl") if not (rd.path / n).is_file()]
            lacks += [] if has_checkpoint(rd.path) else ["checkpoint"]
            where = (task.push_from.host if task.push_from else None) or "its node"
            self.say(f"  {task.run.label}: its copy on {where} was not pushed ({c.error_or('no copy there')}); run "
                     "storage gets this workspace's copy instead" + (f", without its {', '.join(lacks)}" if lacks
                                                                     else ""))
            self.unstored[task.run_id] = (task, None)

    def _storage_wait(self, c: Completion) -> bool:
        """Run storage's part of a completion; True when the task is held until storage answers (no retry spent)."""
        outcome = c.outcome
        if self.outage is None or outcome is None:
            return False
        if outcome.storage_unreachable:
            self.outage.failed(c.error_text, since=outcome.storage_down_since)
            self.held.append((self.outage.next_try, c.task))
            return True
        if outcome.not_stored:
            self.unstored[c.task.run_id] = (c.task, outcome.where)
            self.outage.failed(outcome.not_stored, since=outcome.storage_down_since)
        elif outcome.storage_down_since is not None:  # it failed and did not recover, e.g. a failed run's push
            self.outage.note(c.error_text, outcome.storage_down_since)
        elif outcome.state in (SUCCESS, Action.SKIP) and not self.unstored:
            self.outage.ok()
        return False

    def _complete(self, c: Completion) -> None:
        task = c.task
        if task.push_from is not None:
            self._pushed(c)
            return
        if c.outcome is None or not (c.outcome.not_stored or c.outcome.storage_unreachable):  # else storage just failed
            pull_completed(self.workspace, task.run.study, task.run_id, self.outage)
        if self._storage_wait(c):
            return
        if c.outcome is None:
            # the worker never returned (its process died): its run directory still says RUNNING
            rd = RunDir(Path(task.run_dir))
            status = rd.status() or {}
            if status.get("state") in (RUNNING, None) and rd.path.exists():
                rd.set_status(FAILED, attempt=task.attempt, submission=task.submission, error=c.error_text,
                              retryable=True)
                rd.release(task.submission)
        if c.retryable and task.attempt <= self.options.retries:
            self.source.on_retry(c)
            self.inflight.pop(task.run_id)
            self.retries.append(dataclasses.replace(task, attempt=task.attempt + 1))
            return
        wait = self.source.on_complete(c)
        if wait is None:
            self.inflight.pop(task.run_id, None)
        else:
            self.held.append((time.time() + wait, task))

    def _cancel(self, submission: str) -> None:
        """After an interrupt: stop what is in flight and record each run's end (module docstring)."""
        stopped = self.backend.cancel()
        try:  # events the workers sent before they stopped: MLflow should have them too
            late, _ = self.backend.poll(0)
        except (Exception, KeyboardInterrupt):  # a broken backend or a second Ctrl-C must not stop the cleanup
            late = []
        for event in late:
            run = self.source.run_of(event.get("run_id", ""))
            if run is not None:
                self.tracker.on_event(run, event)
        for task in stopped:
            if task.push_from is not None:  # a push task: its run had finished; the next sync pushes it
                continue
            rd = RunDir(Path(task.run_dir))
            pull_completed(self.workspace, task.run.study, task.run_id)
            if rd.state() == SUCCESS:  # it finished just before the interrupt reached it
                self.source.on_interrupted(task, finished=True)
                continue
            mark_interrupted(rd, submission, f"interrupted (Ctrl-C); {self.source.resume_hint}")
            self.tracker.kill(task.run)
            self.source.on_interrupted(task, finished=False)


__all__ = ["DispatchLoop", "LoopResult", "Source", "StopOnSignal", "ExecutionOptions", "TaskMaker",
           "check_devices", "concurrency", "cpu_ranks", "mark_interrupted", "new_submission", "placement", "preflight",
           "run_resources"]
