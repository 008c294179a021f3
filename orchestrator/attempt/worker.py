"""The worker entry point: one run, start to finish, in whatever process a backend gives it.

`execute_run(task, reporter)` is the only function a backend calls; the Ray backend wraps it in a
task and the in-process test backend calls it directly, so both run the same code. It

1. claims the run directory (skips a run that already succeeded or whose `summary.json` says it
   finished, leaves one another submission holds), writes `spec.json`, `env.json` (with the
   fingerprint of the code this process imports) and `status: RUNNING`, and starts a lease
   heartbeat; code that differs from the driver's fails the run with `StaleCode`, not retried
   (`envinfo.check_code_fingerprint`);
2. calls `models.training.train(cfg, run_dir, resume=True, ...)` with the step hooks
   `orchestrator.attempt.hooks.step_hooks` builds (the recorder, the lease fence, a search's pruner), which
   resumes from the run's newest checkpoint (`models.checkpoint`); a run on N ranks (`task.ranks`,
   `--gpus-per-run N`) trains on N ranks that Ray Train starts (`orchestrator.attempt.distributed_run`),
   while this process waits for them;
3. records every train log and eval in `metrics.jsonl` / `diagnostics.jsonl` and reports it to
   the driver as an event (the driver does all MLflow writes, see `orchestrator.tracking`); on N
   ranks, rank 0 does this (`distributed_run.rank_main`), with the attempt's fence token and event reporter;
4. writes `summary.json`, then `status: SUCCESS` last; or `FAILED` with the error, or
   `INTERRUPTED` when cancelled or stopped (the outcome says `PRUNED` when a search's pruner
   stopped it).

Every write that changes the run's state (status, each checkpoint's rename, the summary) is
fenced by the claim's token (`RunDir.fenced`): once another process has taken the run over, this
attempt stops with `LeaseLost` and leaves the run directory to the new holder. Events carry the
token, so the driver can drop those of an attempt that lost its lease.

A claimed attempt holds its claim in one `with` block (`_Attempt`, the shape of marin's
`step_lock`): entering starts the heartbeat; every way out (success, a stop, a failure, a cancel, a
lost lease) releases in one order: the metrics fsynced, the final status under the fence with the
lease dropped, the events flushed to the driver (before `SUCCESS`, which comes last; not for a
cancel), the end-of-attempt push, then the heartbeat stopped and train.log closed. A lost lease
ends nothing: the run is the new holder's.

Run storage (`RunTask.storage`, `orchestrator.durability.storage`): the attempt trains in a node-local scratch
directory, `$RESLAB_SCRATCH/<study>/<run_id>` (`task.run_dir` when `$RESLAB_SCRATCH` is unset). Before
the claim it pulls every file of the run, the checkpoint included, when storage is ahead of the
scratch copy (`storage.progress`), so any node resumes from the last checkpoint any node pushed.
It pushes the run's files after every checkpoint, from a snapshot, by a thread beside training
(`storage_sync.StorageSync`; a storage error is logged to train.log and the push is tried again at the next
checkpoint: storage never takes training down or holds it up; not for a run on N ranks, whose
checkpoints rank 0 sees in another process) and at the end of every attempt,
SUCCESS, FAILED or INTERRUPTED (tried `storage.PUSH_TRIES` times; when it still fails, a finished
run is still SUCCESS, "finished, not yet durable": its outcome says why in `not_stored`, and once
storage answers the driver has this node push its copy, whole: a push task, `push_copy`, which the
backend places on the node the outcome and the status name). Storage that does not answer before
the claim is an outcome the driver waits out (`storage_unreachable`), not a failure of the run; either
way the outcome says since when this attempt's storage operations failed (`storage_down_since`), where
the driver's outage clock starts. The claim, the
lease and the fencing work on the scratch directory exactly as without storage, so they hold per
node; one writer per run across nodes comes from the driver (see `orchestrator.durability.storage`).

Failures come back as a `RunOutcome` value, not an exception, so the driver sees the error text
and whether a retry can help: a diverged run or a config error fails the same way every time and
is not retried; anything else (a crash, an OOM kill, a lost node) is.
On N ranks the same holds for what the ranks raise: Ray Train first starts the ranks again after a
crash (`RunTask.ranks.restarts` times, each resuming from the last committed checkpoint, inside this
one attempt), and only then does the attempt fail, with the rank's own exception.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from reslab.common.errors import ReslabError
from reslab.orchestrator.attempt.envinfo import check_code_fingerprint, code_fingerprint, environment
from reslab.orchestrator.attempt.hooks import Recorder, flush_events, log_line, step_hooks
from reslab.orchestrator.attempt.simulate import SimulatedTrain, simulated_train_fn
from reslab.orchestrator.attempt.threads import set_threads
from reslab.orchestrator.durability.storage import StorageError, StoredRun
from reslab.orchestrator.durability.storage_sync import StorageSync
from reslab.orchestrator.durability.workspace import (
    LeaseLost,
    RunDir,
    heartbeat_interval,
    write_json,
)
from reslab.orchestrator.tasks import (
    FAILED,
    INTERRUPTED,
    PRUNED,
    RUNNING,
    SUCCESS,
    Action,
    EventReporter,
    RunOutcome,
    RunState,
    RunTask,
)

if TYPE_CHECKING:
    from reslab.models.training import StopRun, TrainResult
    from reslab.orchestrator.attempt.pruning import PruningHook


class _Heartbeat(threading.Thread):
    def __init__(self, rd: RunDir, token: int, every: float) -> None:
        super().__init__(name="reslab-lease-heartbeat", daemon=True)
        self.rd, self.token, self.every = rd, token, every
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.rd.heartbeat(self.token)
            except LeaseLost:
                return  # the next fenced write stops the run
            except OSError:
                pass  # a full or flaky disk must not kill training; the lease just ages

    def stop(self) -> None:
        self.stopped.set()


def scratch_dir(task: RunTask) -> Path:
    """Where a run with storage trains: `$RESLAB_SCRATCH/<study>/<run_id>`, else the driver's `task.run_dir`."""
    scratch = os.environ.get("RESLAB_SCRATCH")
    return Path(scratch) / task.run.study / task.run_id if scratch else Path(task.run_dir)


def execute_run(task: RunTask, reporter: EventReporter, *, train_fn: Callable[..., Any] | None = None,
                node: str | None = None) -> RunOutcome:
    """Run one attempt of one run, a push task (`RunTask.push_from`: `push_copy`), or the task's own work
    (`RunTask.work`, e.g. work after training: its function); never raises for a training failure (see the module doc).

    `train_fn` defaults to `models.training.train`; it exists so the resume test can stop a run
    part-way (an `on_step` callback raising `StopRun`: the run ends INTERRUPTED, checkpointed),
    not to swap the training loop. A run on N ranks ignores it: its ranks call `train` themselves.
    `node` is the backend's id of the node this runs on (Ray's; None in-process): the status and the
    outcome say it, so the driver can have this node push its copy of the run later.
    With `$RESLAB_SIMULATE` set (bench only), the run's training is simulated (`orchestrator.attempt.simulate`).
    """
    host = socket.gethostname()
    if task.push_from is not None:
        outcome = push_copy(task, host)
    elif task.work is not None:
        outcome = task.work.run(task, host)
    else:
        outcome = _execute(task, reporter, train_fn or simulated_train_fn(task) or _train(), host, node)
    outcome.node = node
    return outcome


def _train() -> Callable[..., Any]:
    from reslab.models.training import train

    return train


def _execute(task: RunTask, reporter: EventReporter, train_fn: Callable[..., Any], host: str,
             node: str | None) -> RunOutcome:
    rd = RunDir(scratch_dir(task) if task.storage else Path(task.run_dir))
    sync: StorageSync | None = None
    try:
        if task.storage:
            sync = StorageSync(StoredRun.at(task.storage), rd)
            _pull(task, rd, sync)
    except (ReslabError, OSError) as exc:
        # storage or this node's disk may do better on the next try; a URI this node cannot open will not.
        # Unreachable storage is an outage the driver waits out, not a failure of the run.
        unreachable = isinstance(exc, StorageError)
        return RunOutcome(run_id=task.run_id, state=FAILED, host=host,
                          retryable=unreachable or isinstance(exc, OSError), storage_unreachable=unreachable,
                          storage_down_since=sync.down_since if sync is not None else None,
                          error=f"{type(exc).__name__}: {exc} (before claiming the run on {host})")
    every = heartbeat_interval(task.lease_timeout_s, task.heartbeat_s)
    verdict, why, token = rd.claim(task.submission, task.lease_timeout_s, every)
    if verdict == Action.SKIP:
        return _finished(task, rd, sync, host)
    if verdict == Action.BUSY:
        return RunOutcome(run_id=task.run_id, state=Action.BUSY, error=why, host=host)
    attempt = _Attempt(task=task, reporter=reporter, rd=rd, token=token, every=every, host=host, node=node,
                       sync=sync)
    try:
        outcome = _execute_claimed(attempt, train_fn)
    except LeaseLost as exc:
        return RunOutcome(run_id=task.run_id, state=Action.BUSY, error=f"taken over: {exc}", host=host)
    if sync is not None:
        outcome.storage_down_since = sync.down_since
    return outcome


def _pull(task: RunTask, rd: RunDir, sync: StorageSync) -> None:
    """The attempt's side of run storage: the run pulled into `rd` when storage is ahead."""
    try:
        sync.pull(task.lease_timeout_s)
    except StorageError:
        if not rd.complete():
            raise
        # finished on this node: the claim finds it finished, and `_finished` tries the push that storage lacks


def push_copy(task: RunTask, host: str) -> RunOutcome:
    """A push task: this node's finished copy of the run, every file of it (the checkpoint, train.log and
    diagnostics included), pushed to run storage. SKIP when pushed (`not_stored` says why when storage
    failed again); FAILED when this node has no finished copy (it was wiped, or the task landed elsewhere):
    the driver then pushes what its own copy has."""
    rd = RunDir(scratch_dir(task) if task.storage else Path(task.run_dir))
    outcome = RunOutcome(run_id=task.run_id, state=Action.SKIP, host=host)
    if not task.storage or not rd.complete():
        outcome.state, outcome.error = FAILED, f"no finished copy of run {task.run_id} in {rd.path} on {host}"
        return outcome
    try:
        sync = StorageSync(StoredRun.at(task.storage), rd)
        with rd.locked():
            outcome.not_stored = sync.at_end()
    except (ReslabError, OSError) as exc:  # a URI this node cannot open, a copy it cannot read
        outcome.state, outcome.error = FAILED, f"{type(exc).__name__}: {exc} (pushing its copy on {host})"
        return outcome
    outcome.storage_down_since = sync.down_since
    return outcome


def _finished(task: RunTask, rd: RunDir, sync: StorageSync | None, host: str) -> RunOutcome:
    """A run that had finished: SKIP, pushed when run storage is behind. When the push fails, the outcome
    says so (`not_stored`) and carries the record, so the driver's copy is whole and the driver pushes it."""
    record = rd.summary() or {}
    outcome = RunOutcome(run_id=task.run_id, state=Action.SKIP, summary=record.get("summary", {}),
                         info=record.get("info", {}), host=host)
    outcome.not_stored = sync.settle() if sync is not None else None
    if outcome.not_stored:
        outcome.env, outcome.metrics = rd.env() or {}, rd.metrics()
        outcome.storage_down_since = sync.down_since if sync is not None else None
    return outcome


def _execute_claimed(attempt: _Attempt, train_fn: Callable[..., Any]) -> RunOutcome:
    """The claimed run's records under the fence, then its training inside `with attempt`, which
    ends the attempt and releases the claim however training ends."""
    task, rd = attempt.task, attempt.rd
    spec = task.run.to_dict()
    previous = rd.spec()
    from reslab.models.optim import same_config  # torch, which the attempt trains with anyway

    # a run directory of before the optimizer registries holds the flat `optim` form: the same run (`same_config`)
    if previous is not None and not same_config(previous.get("config") or {}, spec["config"]):
        rd.release(task.submission, attempt.token)
        return RunOutcome(
            run_id=task.run_id, state=FAILED, host=attempt.host,
            error=f"{rd.spec_file} holds a different config under the same run id; the run directory "
                  "was edited or RESULTS_VERSION reused. Move it away to rerun.",
        )
    fingerprint = code_fingerprint()
    attempt.env = {**environment(task.code), "code_fingerprint": fingerprint["digest"], "torch_threads": task.threads}
    with rd.fenced(attempt.token):
        write_json(rd.spec_file, spec)
        write_json(rd.env_file, attempt.env)
        attempts = int((rd.status() or {}).get("attempts", 0)) + 1
        rd.set_status(RUNNING, attempt=task.attempt, attempts=attempts, submission=task.submission,
                      host=attempt.host, node=attempt.node)
    with attempt:
        attempt.outcome = attempt.succeed(attempt.train(train_fn, fingerprint))
    assert attempt.outcome is not None  # `succeed`'s, or the one `__exit__` made of a stop or a failure
    return attempt.outcome


def _end(rd: RunDir, token: int, state: str, **fields: Any) -> None:
    """Write a final state and drop the lease, if this attempt still holds it."""
    with contextlib.suppress(LeaseLost), rd.fenced(token):
        rd.set_status(state, **fields)
        rd.lease_file.unlink(missing_ok=True)


@dataclass(kw_only=True)
class _Attempt:
    """One attempt at a claimed run, held with `with` (the shape of marin's `step_lock`).

    Entering sets torch's threads, starts the lease heartbeat and opens train.log. Every way out
    releases in one order:

        recorder closed (metrics.jsonl and diagnostics.jsonl fsynced)
        -> final status under the fence, lease dropped  (`_release`: `_end`; SUCCESS after the flush)
        -> events flushed to the driver                 (`_release`: `_flush`; not for a cancel)
        -> end-of-attempt storage push                  (`_release`: `StorageSync.at_end`)
        -> uploader closed, heartbeat stopped, train.log closed, threads restored  (`_close`)

    The body (`train`, then `succeed`) ends a finished run; `__exit__` ends the others from their
    exception: a stop (`StopRun`) or a training failure becomes `outcome` and goes no further; a
    cancel (KeyboardInterrupt, SystemExit) is ended without the flush and raised on; a lost lease
    stops after the recorder (the run is the new holder's) and is raised on.
    """

    task: RunTask
    reporter: EventReporter
    rd: RunDir
    token: int  # the claim's fencing token
    every: float  # seconds between heartbeats
    host: str
    node: str | None = None  # the backend's id of this node
    sync: StorageSync | None = None
    env: dict[str, Any] = field(default_factory=dict)  # env.json, once written
    outcome: RunOutcome | None = None
    pruner: PruningHook | None = None  # when the run is a search's trial
    pruned: bool = False  # a run on N ranks: rank 0's pruner stopped it
    # opened by __enter__, closed by _close
    previous_threads: int = field(init=False, repr=False)
    heartbeat: _Heartbeat = field(init=False, repr=False)
    recorder: Recorder = field(init=False, repr=False)
    log_f: TextIO = field(init=False, repr=False)

    def __enter__(self) -> _Attempt:
        # restored by _close, for an in-process caller (the test backend) whose other work should
        # not inherit this run's thread count
        self.previous_threads = set_threads(self.task.threads)
        self.heartbeat = _Heartbeat(self.rd, self.token, self.every)
        self.heartbeat.start()
        push = functools.partial(self.sync.after_checkpoint, self.log) if self.sync is not None else None
        self.recorder = Recorder(self.task, self.rd, self.reporter, self.token, push=push)
        self.log_f = open(self.rd.log_file, "a")  # noqa: SIM115 - closed by _close
        return self

    def log(self, line: str) -> None:
        log_line(self.log_f, line)

    def train(self, train_fn: Callable[..., Any], fingerprint: dict[str, Any]) -> TrainResult:
        """Train the run, resuming from its checkpoint; `train_fn`'s result (a run on N ranks: rank 0's)."""
        task = self.task
        self.log(f"attempt {task.attempt} of submission {task.submission} on {self.host}")
        if self.sync is not None:
            pulled = self.sync.pulled
            said = f"pulled from it (attempts {pulled[1]}, checkpoint step {pulled[2]})" if pulled \
                else "nothing newer there than the scratch copy"
            self.log(f"run storage {self.sync.stored}: {said}; scratch {self.rd.path}")
        check_code_fingerprint(task.code.get("fingerprint"), fingerprint, self.host)  # StaleCode: not retryable
        if task.ranks.world > 1 and not isinstance(train_fn, SimulatedTrain):
            return self._train_on_ranks()
        hooks = step_hooks(task, 0, self.recorder, self.log)
        self.pruner = hooks.pruner
        return train_fn(task.run.config, self.rd.path, resume=True, **hooks.train_kwargs)

    def _train_on_ranks(self) -> TrainResult:
        """Train on `task.ranks.world` ranks (`orchestrator.attempt.distributed_run`), rank 0 recording (`rank_main`);
        what ended the ranks without a result is raised here, as `train` would raise it."""
        from reslab.orchestrator.attempt.distributed_run import (
            RankEnd,
            cpu_ranks_here,
            rank_main,
            ranks_words,
            train_on_ranks,
        )

        task, ranks, path = self.task, self.task.ranks, self.rd.path.resolve()
        words = ranks_words(ranks, cpu_ranks_here(task.run.config.train.device))
        self.log(f"training on {ranks.world} ranks ({words}) through "
                 f"Ray Train, started again up to {ranks.restarts} time(s) when one dies"
                 + ("; run storage gets the checkpoint at the attempt's end" if self.sync is not None else ""))
        config = {"task": task, "run_dir": str(path), "token": self.token, "reporter": self.reporter}
        end = train_on_ranks(rank_main, config, ranks, path, device=task.run.config.train.device,
                             name=f"{task.run_id}-t{self.token}",
                             node_local=self.sync is not None and "RESLAB_SCRATCH" in os.environ)
        if not isinstance(end, RankEnd):
            raise RuntimeError(f"rank 0 returned {end!r}, not a RankEnd")
        if end.error is not None:
            self.pruned = end.pruned
            raise end.error
        assert end.result is not None
        return end.result

    def succeed(self, result: TrainResult) -> RunOutcome:
        """SUCCESS after `summary.json`. When the end-of-attempt push failed every try, still SUCCESS (the run
        is finished, and never trained again), with `not_stored` saying why: the driver pushes its copy."""
        self.recorder.close()
        # summary.json marks the run complete (see workspace): written once, by the lease holder
        with self.rd.fenced(self.token):
            if not self.rd.complete():
                write_json(self.rd.summary_file, {"summary": result.summary, "info": result.info})
        outcome = RunOutcome(run_id=self.task.run_id, state=SUCCESS, summary=result.summary,
                             info=result.info, env=self.env, metrics=self.rd.metrics(), host=self.host)
        outcome.not_stored = self._release(SUCCESS)
        return outcome

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        try:
            return exc is not None and self._ended_by(exc)
        finally:
            self._close()

    def _ended_by(self, exc: BaseException) -> bool:
        """End the attempt `exc` stopped; True when it became `outcome` (not raised on)."""
        from reslab.models.training import StopRun

        if not isinstance(exc, Exception | KeyboardInterrupt | SystemExit):
            return False  # anything rarer passes through untouched but for `_close`
        self.recorder.close()
        if isinstance(exc, LeaseLost):  # the run is the new holder's: nothing of it is ended here
            self.log(f"stopped: {exc}")
            return False
        if isinstance(exc, StopRun):
            self.outcome = self._stopped(exc)
            return True
        if not isinstance(exc, Exception):  # a cancel: no wait for the driver
            self._release(INTERRUPTED, flush=False, error="cancelled")
            return False
        self.outcome = self._failed(exc)
        return True

    def _stopped(self, stop: StopRun) -> RunOutcome:
        """INTERRUPTED, checkpointed by `train`; the outcome says PRUNED when the search's pruner stopped it."""
        stored_error = self._release(INTERRUPTED, error=str(stop))
        pruned = self.pruned or (self.pruner is not None and self.pruner.pruned)
        return RunOutcome(run_id=self.task.run_id, state=PRUNED if pruned else INTERRUPTED,
                          env=self.env, host=self.host, error=str(stop) + (f"; {stored_error}" if stored_error else ""),
                          info={"stopped_step": stop.step, "reason": str(stop)})

    def _failed(self, exc: Exception) -> RunOutcome:
        """FAILED, the traceback in train.log and the status; not retryable when it fails the same way every time."""
        tb = "".join(traceback.format_exception(exc))
        self.log(tb)
        error = f"{type(exc).__name__}: {exc}"
        retryable = _retryable(exc)
        stored_error = self._release(FAILED, error=error, traceback=tb, retryable=retryable)
        if stored_error:
            error = f"{error}; {stored_error}"
        return RunOutcome(run_id=self.task.run_id, state=FAILED, error=error, traceback=tb,
                          retryable=retryable, env=self.env, host=self.host)

    def _release(self, state: RunState, *, flush: bool = True, **fields: Any) -> str | None:
        """The release of every path that ends the run, the recorder closed: the final `state` under
        the fence with the lease dropped, the events flushed to the driver (not when `flush` is
        False), the end-of-attempt push; the push's error text when it failed every try."""
        if state == SUCCESS:  # SUCCESS is the record's last word (see workspace): after the driver has every event
            flush_events(self.reporter, self.log)
        _end(self.rd, self.token, state, attempt=self.task.attempt, submission=self.task.submission, **fields)
        if flush and state != SUCCESS:
            flush_events(self.reporter, self.log)
        return self.sync.at_end(self.log) if self.sync is not None else None

    def _close(self) -> None:
        """Every exit's last step, whatever the ending raised."""
        if self.sync is not None:  # before the log closes: the uploader writes to it
            self.sync.close()
        self.heartbeat.stop()
        self.log_f.close()
        set_threads(self.previous_threads)


def _retryable(exc: BaseException) -> bool:
    """Whether another attempt can help: not after a diverged run, a damaged checkpoint or a user error
    (exit code 2: config, spec, stale code), which fail the same way every time."""
    from reslab.models.checkpoint import CheckpointUnreadable
    from reslab.models.training import TrainingDiverged

    return not (isinstance(exc, (TrainingDiverged, CheckpointUnreadable))
                or (isinstance(exc, ReslabError) and exc.exit_code == 2))


