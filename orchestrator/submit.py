"""The driver: plan a study, dispatch its runs through a backend, track them, report.

`submit(study, runs, workspace, backend, tracker, options)` is the whole of `reslab run` minus
argument parsing and the final table. It

1. plans from the run directories (`orchestrator.plan`): finished runs are skipped, so submitting
   a study twice runs nothing the second time; the backend (Ray) is not even started then. With run
   storage (`workspace.storage`, `orchestrator.storage`) it first pulls the study's records from
   storage, and after every completion that run's records (success or failure), so the workspace
   sees what every node did; without it, a successful run's record is mirrored from the worker's
   result (`_mirror`);
2. mirrors the skipped runs into MLflow when MLflow lacks them (`Tracker.sync`);
3. keeps at most `max_concurrent` runs in flight, feeding worker events to the tracker and the
   progress display;
4. retries an attempt that failed for a reason a retry can fix (a crash, a lost worker) up to
   `retries` times; a deterministic failure (divergence, config error) is reported at once;
5. on Ctrl-C or SIGTERM, cancels the runs in flight, marks them `INTERRUPTED` in their run
   directories and `KILLED` in MLflow, and returns. The next submission resumes each from its
   checkpoint and reuses its MLflow child run.

Signals. While runs are in flight, SIGINT and SIGTERM only set a flag that the loop checks between
ticks (at most `poll_s` later), so an interrupt never lands in the middle of an MLflow write or a
Ray call and the cleanup starts from a consistent state; a second signal stops at once. The
handlers are installed after the backend starts because `ray.init` installs its own SIGTERM
handler (`sys.exit`), and the previous handlers are restored at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.common.errors import ConfigError
from reslab.common.io import write_atomic
from reslab.orchestrator.dispatch import Backend, BackendError, ClusterInfo, Completion, Resources
from reslab.orchestrator.envinfo import submission_code
from reslab.orchestrator.plan import BUSY, RUN, SKIP, PlanEntry, plan, summarize
from reslab.orchestrator.progress import Progress
from reslab.orchestrator.storage import hold_workspace_study, pull_completed, pull_study
from reslab.orchestrator.worker import RunOutcome, RunTask
from reslab.orchestrator.workspace import (
    DEFAULT_LEASE_TIMEOUT_S,
    FAILED,
    HEARTBEAT_S,
    INTERRUPTED,
    RUNNING,
    SUCCESS,
    TO_RUN,
    RunDir,
    Workspace,
    check_lease_timeout,
    write_json,
)
from reslab.results.power import check_confirmatory


@dataclass(frozen=True, kw_only=True)
class SubmitOptions:
    """Execution settings; none of them enters a run id.

    Args:
        max_concurrent: runs in flight at once. Default (None): the cluster's GPUs / gpus per run
            for GPU runs, its CPUs / cpus per run otherwise.
        cpus_per_run: CPUs each run asks for, also its torch thread count. Default: 1.
        gpus_per_run: GPUs each run asks for. Default (None): 1 when the cluster has GPUs, else 0.
        retries: extra attempts for a run whose failure a retry can fix. Default: 1.
        rerun_failed: run runs that failed in an earlier submission. Default: False.
        lease_timeout_s: a `RUNNING` run whose heartbeat is older is taken over. Default: 120.
        poll_s: how long the driver waits for events per tick. Default: 0.5.
        allow_underpowered: submit even when a confirmatory comparison cannot reach alpha
            (`results.power.check_confirmatory`). Default: False.
    """

    max_concurrent: int | None = None
    cpus_per_run: float = 1.0
    gpus_per_run: float | None = None
    retries: int = 1
    rerun_failed: bool = False
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    heartbeat_s: float = HEARTBEAT_S
    poll_s: float = 0.5
    allow_underpowered: bool = False

    def __post_init__(self) -> None:
        check_lease_timeout(self.lease_timeout_s)
        for name, bad, allowed in (
            ("max_concurrent", self.max_concurrent is not None and self.max_concurrent < 1, "None or >= 1"),
            ("cpus_per_run", not self.cpus_per_run > 0, "> 0"),
            ("gpus_per_run", self.gpus_per_run is not None and not self.gpus_per_run >= 0, "None or >= 0"),
            ("retries", self.retries < 0, ">= 0"),
            ("heartbeat_s", not self.heartbeat_s > 0, "> 0"),
            ("poll_s", not self.poll_s >= 0, ">= 0"),
        ):
            if bad:
                raise ConfigError(f"SubmitOptions.{name}: {getattr(self, name)!r} is not allowed; allowed: {allowed}")


@dataclass
class SubmitResult:
    submission: str
    entries: list[PlanEntry]
    # run_id -> what this submission did with it: a RunState label (succeeded, failed, interrupted),
    # skipped, busy (held by another submission) or to run (not started before an interrupt)
    states: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    interrupted: bool = False
    cluster: ClusterInfo | None = None
    parent_run_id: str | None = None
    wall_s: float = 0.0

    def count(self, state: str) -> int:
        return sum(1 for s in self.states.values() if s == state)

    def summary(self) -> str:
        text = (f"{self.count('succeeded')} succeeded, {self.count('skipped')} skipped, {self.count('failed')} failed, "
                f"{self.count('busy')} busy elsewhere, {self.count('interrupted')} interrupted")
        return text + (f", {self.count(TO_RUN)} {TO_RUN}" if self.interrupted else "")

    @property
    def ok(self) -> bool:
        return not self.interrupted and not self.errors


def _check_devices(runs: list[RunSpec], gpus: float) -> None:
    wants_cuda = sorted({r.arm for r in runs if r.config.train.device.startswith("cuda")})
    if wants_cuda and gpus <= 0:
        raise BackendError(
            f"arms {wants_cuda} set train.device to cuda but runs get no GPU (--gpus-per-run 0 or a cluster "
            "without GPUs); use train.device: auto, or give each run a GPU"
        )


def _mirror(rd: RunDir, run: RunSpec, outcome: RunOutcome) -> None:
    """A worker on another node without a shared workspace wrote its run directory there; keep
    the driver's copy complete so planning skips the run next time."""
    if rd.state() == SUCCESS:
        return
    rd.path.mkdir(parents=True, exist_ok=True)
    write_json(rd.spec_file, run.to_dict())
    write_json(rd.env_file, outcome.env)
    write_atomic(rd.metrics_file, "".join(json.dumps(r) + "\n" for r in outcome.metrics))
    write_json(rd.summary_file, {"summary": outcome.summary, "info": outcome.info})
    rd.set_status(SUCCESS, mirrored_from=outcome.host)


def mark_interrupted(rd: RunDir, submission: str, why: str) -> None:
    status = rd.status() or {}
    lease = rd.lease() or {}
    if status.get("state") in (RUNNING, None) and lease.get("submission") in (submission, None):
        if rd.path.exists():
            rd.set_status(INTERRUPTED, submission=submission, error=why)
        rd.release(submission)


class StopOnSignal:
    """SIGINT/SIGTERM -> a flag; the second one raises KeyboardInterrupt right away."""

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


def preflight(study: Study, runs: list[RunSpec], address: str | None, *, allow_underpowered: bool = False) -> None:
    """Every check `reslab run` makes before it writes or dispatches anything: the study can reach alpha,
    the address answers (a dead one fails in seconds) or the local devices exist, and each run's token
    budget fits its prepared corpus."""
    from reslab.experiments.budget import check_budget, study_budget
    from reslab.orchestrator.dispatch.ray_backend import check_local_devices, probe_address

    if not allow_underpowered:
        check_confirmatory(study.comparisons, len(study.seeds), study.grid_sizes(), study=study.name)
    if address is None:
        check_local_devices(runs)
    else:
        probe_address(address)
    check_budget(study_budget(runs, prepare_stdlib_corpus=True), require_prepared=True)


def submit(
    study: Study,
    runs: list[RunSpec],
    workspace: Workspace,
    backend: Backend,
    tracker: Any | None,
    options: SubmitOptions = SubmitOptions(),
    *,
    stream: TextIO | None = None,
    tty: bool | None = None,
    say=print,
) -> SubmitResult:
    """Run every run of `runs` that is not finished; see the module docstring.

    Raises `results.power.UnderpoweredStudy` before anything is planned or dispatched when a
    confirmatory comparison cannot reach alpha, unless `options.allow_underpowered`.
    """
    if not options.allow_underpowered:
        check_confirmatory(study.comparisons, len(study.seeds), study.grid_sizes(), study=study.name)
    t0 = time.time()
    submission = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    # run storage has no per-node leases: one driver per study at a time, held by a marker there
    with hold_workspace_study(workspace, study.name, submission, options.lease_timeout_s, options.heartbeat_s):
        return _drive(study, runs, workspace, backend, tracker, options, submission, t0, stream, tty, say)


def _drive(study: Study, runs: list[RunSpec], workspace: Workspace, backend: Backend, tracker: Any | None,
           options: SubmitOptions, submission: str, t0: float, stream: TextIO | None, tty: bool | None,
           say: Any) -> SubmitResult:
    if workspace.storage:
        pulled = pull_study(workspace, study.name, [r.run_id for r in runs])
        say(f"{study.name}: run storage {workspace.run_storage()}: pulled the records of {len(pulled)} run(s)")
    entries = plan(runs, workspace, rerun_failed=options.rerun_failed, lease_timeout_s=options.lease_timeout_s)
    result = SubmitResult(submission=submission, entries=entries)
    by_id = {r.run_id: r for r in runs}
    to_run = [e for e in entries if e.action == RUN]
    say(f"{study.name}: {summarize(entries)} (submission {submission})")

    code = submission_code()  # the git version and the fingerprint every worker checks its code against
    progress = Progress(study.name, stream=stream, tty=tty) if stream is not None else Progress(study.name, tty=tty)
    for e in entries:
        state = {RUN: TO_RUN, SKIP: "skipped", BUSY: "busy"}[e.action]
        progress.add(e.run.run_id, e.run.label, e.run.config.train.steps, state=state, detail=e.reason)
        if e.action != RUN:
            result.states[e.run.run_id] = "skipped" if e.action == SKIP else "busy"
        if e.action == BUSY:
            say(f"  busy {e.run.label}: {e.reason}")
        elif e.action == RUN and e.state == RUNNING:  # a crashed or stopped holder: say why it is taken over
            say(f"  taking over {e.run.label}: {e.reason}")

    for e in entries:
        rd = workspace.run_dir(study.name, e.run.run_id)
        if e.action == SKIP and e.state == SUCCESS and rd.state() != SUCCESS and \
                rd.restore_complete(options.lease_timeout_s):
            say(f"  {e.run.label}: finished (summary.json) but its status was lost or stale; restored SUCCESS")

    if tracker is not None:
        result.parent_run_id = tracker.begin(
            study.name, submission=submission, code=code, plan=[{"run_id": e.run.run_id, "label": e.run.label,
                                                                "action": e.action, "reason": e.reason}
                                                               for e in entries],
            study_file=study.path,
            settings={"retries": options.retries, "rerun_failed": options.rerun_failed,
                      "cpus_per_run": options.cpus_per_run, "gpus_per_run": options.gpus_per_run,
                      "max_concurrent": options.max_concurrent},
        )
        synced = 0
        for e in entries:
            if e.action == SKIP and e.state == SUCCESS:
                synced += tracker.sync(e.run, workspace.run_dir(study.name, e.run.run_id))
            elif e.action == SKIP and e.state == FAILED:
                synced += tracker.sync_failed(e.run, e.error or "failed")
        if synced:
            say(f"  mirrored {synced} finished run(s) from their run directories into MLflow")

    if not to_run:
        if tracker is not None and not synced:
            tracker.discard_parent()  # nothing ran, nothing mirrored: no empty parent per no-op re-run
            result.parent_run_id = None
        elif tracker is not None:
            tracker.end(SUCCESS, {"planned": len(entries), "skipped": len(entries)})
        result.wall_s = time.time() - t0
        return result

    status = FAILED  # until the loop completes: a backend that cannot start fails the submission
    inflight: dict[str, RunTask] = {}
    stop = StopOnSignal()
    try:
        cluster = backend.start()
        stop.__enter__()
        result.cluster = cluster
        gpus = options.gpus_per_run if options.gpus_per_run is not None else (1.0 if cluster.gpus > 0 else 0.0)
        resources = Resources(cpus=options.cpus_per_run, gpus=gpus)
        _check_devices([e.run for e in to_run], resources.gpus)
        backend.resources(resources)
        if options.max_concurrent:
            limit = options.max_concurrent
        elif resources.gpus > 0:
            limit = max(1, int(cluster.gpus // resources.gpus))
        else:
            limit = max(1, int(cluster.cpus // max(resources.cpus, 1e-9)))
        say(f"  cluster {cluster.address}: {cluster.nodes} node(s), {cluster.cpus:g} CPU, {cluster.gpus:g} GPU; "
            f"each run {resources.cpus:g} CPU + {resources.gpus:g} GPU, up to {limit} at once")

        storage = workspace.run_storage()
        queue = deque(
            RunTask(run=e.run, run_dir=str(workspace.run_dir(study.name, e.run.run_id).path), submission=submission,
                    attempt=1, threads=max(1, int(resources.cpus)), code=code,
                    lease_timeout_s=options.lease_timeout_s, heartbeat_s=options.heartbeat_s,
                    storage=storage.run_uri(study.name, e.run.run_id) if storage else None)
            for e in to_run
        )
        while queue or inflight:
            if stop.requested:
                raise KeyboardInterrupt
            while queue and len(inflight) < limit:
                task = queue.popleft()
                backend.submit(task, resources)
                inflight[task.run_id] = task
            events, done = backend.poll(options.poll_s)
            for ev in events:
                rid = ev.get("run_id")
                run = by_id.get(rid) if isinstance(rid, str) else None
                if run is None:
                    continue
                if tracker is not None:
                    tracker.on_event(run, ev)
                progress.event(ev)
            if tracker is not None:
                tracker.flush()
            for completion in done:
                inflight.pop(completion.task.run_id, None)
                retry = _complete(completion, by_id, workspace, study, tracker, progress, result, options)
                if retry is not None:
                    queue.append(retry)
            progress.render()
        status = FAILED if result.errors else SUCCESS
    except KeyboardInterrupt:
        status = INTERRUPTED
        result.interrupted = True
        stopped = backend.cancel()
        try:  # events the workers sent before they stopped: MLflow should have them too
            late, _ = backend.poll(0)
        except Exception:  # a broken backend must not block the cleanup
            late = []
        for ev in late:
            if tracker is not None and ev.get("run_id") in by_id:
                tracker.on_event(by_id[ev["run_id"]], ev)
        for task in stopped:
            run = by_id[task.run_id]
            rd = workspace.run_dir(study.name, run.run_id)
            pull_completed(workspace, study.name, run.run_id)
            if rd.state() == SUCCESS:  # it finished just before the interrupt reached it
                result.states[run.run_id] = "succeeded"
                progress.finished(run.run_id, SUCCESS.label)
                if tracker is not None:
                    tracker.sync(run, rd)
                continue
            mark_interrupted(rd, submission, "interrupted (Ctrl-C); the next `reslab run` resumes it")
            result.states[run.run_id] = "interrupted"
            progress.finished(run.run_id, "interrupted")
            if tracker is not None:
                tracker.kill(run)
        for e in to_run:
            result.states.setdefault(e.run.run_id, TO_RUN)
        stopped_runs = result.count("interrupted")
        if stopped_runs:
            say(f"\n{study.name}: interrupted; {stopped_runs} run(s) stopped. Run the same command again to resume "
                "them from their checkpoints.")
        else:
            say(f"\n{study.name}: interrupted before any run started; nothing to resume (the same command starts "
                "them).")
    except Exception:
        # the driver itself failed (a bug, a backend that broke): no MLflow child may stay RUNNING; the
        # run directories' leases expire and the next submission resumes the runs
        if tracker is not None:
            for task in inflight.values():
                with contextlib.suppress(Exception):
                    tracker.kill(by_id[task.run_id])
        raise
    finally:
        stop.__exit__()
        progress.close()
        try:
            backend.shutdown()
        finally:
            if tracker is not None:
                counts = {"planned": len(entries), "succeeded": result.count("succeeded"),
                          "failed": result.count("failed"), "skipped": result.count("skipped")}
                tracker.end(status, counts)
    result.wall_s = time.time() - t0
    return result


def _complete(c: Completion, by_id: dict[str, RunSpec], workspace: Workspace, study: Study, tracker: Any,
              progress: Progress, result: SubmitResult, options: SubmitOptions) -> RunTask | None:
    """Handle one finished attempt; returns the next attempt's task when it is retried."""
    task, outcome = c.task, c.outcome
    run = by_id[task.run_id]
    rd = workspace.run_dir(study.name, run.run_id)
    pull_completed(workspace, study.name, run.run_id)
    if outcome is not None and outcome.state == SUCCESS:
        _mirror(rd, run, outcome)  # a no-op when the pull brought SUCCESS
        if tracker is not None:
            # metrics and diagnostics whose events were lost on the way (a progress actor that restarted)
            tracker.finish(run, outcome.summary, metrics=outcome.metrics, env=outcome.env, info=outcome.info,
                           diagnostics=rd.diagnostics())
        result.states[run.run_id] = "succeeded"
        s = outcome.summary
        progress.finished(run.run_id, SUCCESS.label, f"val {s.get('val_loss', float('nan')):.4f} "
                                              f"(tail {s.get('val_loss_tail', float('nan')):.4f})")
        return None
    if outcome is not None and outcome.state == "DONE":
        if tracker is not None:
            tracker.sync(run, rd)
        result.states[run.run_id] = "skipped"
        progress.finished(run.run_id, "skipped", "finished by another submission")
        return None
    if outcome is not None and outcome.state == "BUSY":
        result.states[run.run_id] = "busy"
        progress.finished(run.run_id, "busy", outcome.error or "")
        return None
    if outcome is not None and outcome.state == INTERRUPTED:
        result.states[run.run_id] = "interrupted"
        if tracker is not None:
            tracker.kill(run)
        progress.finished(run.run_id, "interrupted", outcome.error or "")
        return None

    error = (outcome.error if outcome is not None else c.error) or "unknown error"
    retryable = outcome.retryable if outcome is not None else True
    if outcome is None:
        # The worker never returned (its process died): its run directory still says RUNNING.
        status = rd.status() or {}
        if status.get("state") in (RUNNING, None) and rd.path.exists():
            rd.set_status(FAILED, attempt=task.attempt, submission=task.submission, error=error, retryable=True)
            rd.release(task.submission)
    if retryable and task.attempt <= options.retries:
        if tracker is not None:
            tracker.fail(run, error, final=False)
        progress.retry(run.run_id, task.attempt + 1, error)
        return dataclasses.replace(task, attempt=task.attempt + 1)
    if tracker is not None:
        tracker.fail(run, error, final=True)
    result.states[run.run_id] = "failed"
    result.errors[run.run_id] = error
    progress.finished(run.run_id, "failed", error)
    return None
