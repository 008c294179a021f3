"""The worker entry point: one run, start to finish, in whatever process a backend gives it.

`execute_run(task, reporter)` is the only function a backend calls; the Ray backend wraps it in a
task and the in-process test backend calls it directly, so both run the same code. It

1. claims the run directory (skips a run that already succeeded or whose `summary.json` says it
   finished, leaves one another submission holds), writes `spec.json`, `env.json` (with the
   fingerprint of the code this process imports) and `status: RUNNING`, and starts a lease
   heartbeat; code that differs from the driver's fails the run with `StaleCode`, not retried
   (`envinfo.check_fingerprint`);
2. calls `models.training.train(cfg, run_dir, callback=..., resume=True)`, which resumes from
   `checkpoint.pt` when one exists;
3. records every train log and eval in `metrics.jsonl` / `diagnostics.jsonl` and reports it to
   the driver as an event (the driver does all MLflow writes, see `orchestrator.tracking`);
4. writes `summary.json`, then `status: SUCCESS` last; or `FAILED` with the error, or
   `INTERRUPTED` when cancelled.

Every write that changes the run's state (status, each checkpoint's rename, the summary) is
fenced by the claim's token (`RunDir.fenced`): once another process has taken the run over, this
attempt stops with `LeaseLost` and leaves the run directory to the new holder. Events carry the
token, so the driver can drop those of an attempt that lost its lease.

Run storage (`RunTask.storage`, `orchestrator.storage`): the attempt trains in a node-local scratch
directory, `$RESLAB_SCRATCH/<study>/<run_id>` (`task.run_dir` when `$RESLAB_SCRATCH` is unset). Before
the claim it pulls every file of the run, the checkpoint included, when storage is ahead of the
scratch copy (`storage.progress`), so any node resumes from the last checkpoint any node pushed.
It pushes the run's files after every checkpoint, from a snapshot, by a thread beside training
(`_Sync`; a storage error is logged to train.log and the push is tried again at the next
checkpoint: storage never takes training down or holds it up) and at the end of every attempt,
SUCCESS, FAILED or INTERRUPTED (tried `storage.PUSH_TRIES` times; when it still fails, a finished
run's outcome is a retryable FAILED naming the storage error). The claim, the
lease and the fencing work on the scratch directory exactly as without storage, so they hold per
node; one writer per run across nodes comes from the driver (see `orchestrator.storage`).

Failures come back as a `RunOutcome` value, not an exception, so the driver sees the error text
and whether a retry can help: a diverged run or a config error fails the same way every time and
is not retried; anything else (a crash, an OOM kill, a lost node) is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from reslab.experiments.expand import RunSpec
from reslab.common.errors import ReslabError
from reslab.common.io import write_atomic
from reslab.orchestrator.envinfo import check_fingerprint, code_fingerprint, environment
from reslab.orchestrator.storage import (
    CHECKPOINT,
    PUSH_TRIES,
    RECORDS,
    StorageError,
    StoredRun,
    local_progress,
    pull_if_ahead,
    push_with_retries,
)
from reslab.orchestrator.workspace import (
    FAILED,
    INTERRUPTED,
    RUNNING,
    SUCCESS,
    LeaseLost,
    RunDir,
    heartbeat_interval,
    lease_state,
    metrics_row_ok,
    read_jsonl,
    write_json,
)

SNAPSHOT_DIR = ".push"  # in the scratch run directory: checkpoint snapshots waiting for their upload


class EventReporter(Protocol):
    """How a worker talks to the driver. `emit` must not block on the driver; `flush` blocks
    until everything emitted so far has reached it (called once, before the run returns)."""

    def emit(self, event: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RunTask:
    """Everything a worker needs; plain picklable data. Nothing here enters the run id."""

    run: RunSpec
    run_dir: str
    submission: str
    attempt: int = 1
    threads: int = 1
    code: dict[str, Any] = field(default_factory=dict)
    lease_timeout_s: float = 120.0
    heartbeat_s: float = 10.0
    # an Optuna trial this run is (`orchestrator.tune.TrialLink`): evals are reported to it and
    # its pruner may stop the run
    trial: Any = None
    # the run's directory URI in run storage (`orchestrator.storage`); None: `run_dir` is the only copy
    storage: str | None = None

    @property
    def run_id(self) -> str:
        return self.run.run_id


@dataclass(kw_only=True)
class RunOutcome:
    """What came of one attempt. `state`: SUCCESS | FAILED | INTERRUPTED, or DONE (it had
    already succeeded) and BUSY (another submission holds it): both leave the run alone."""

    run_id: str
    state: str
    summary: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    retryable: bool = False
    host: str | None = None


def default_threads() -> int:
    """Torch threads for `reslab train` when `--threads` is not given: half the CPUs this process
    may use, at most 4, at least 1.

    Torch's own default (one thread per core) collapses when anything else uses a core: its
    OpenMP threads wait at every barrier for the one that lost its core: beside one busy process
    on 2 cores, 2 threads ran 17x slower than alone, 1 thread 1.23x (bench/RESULTS.md). Half the
    cores leaves room for the rest of the machine, and past 4 threads the small CPU presets gain
    little; `--threads` overrides it on a machine of one's own.
    """
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


def set_threads(n: int) -> int:
    """Set torch's intra-op threads, returning the previous count.

    The only torch call outside models/: a Ray worker process is reused across tasks and may
    have imported torch already, so OMP_NUM_THREADS alone would not take effect.
    """
    import torch

    previous = torch.get_num_threads()
    if previous != n:
        torch.set_num_threads(n)
    return previous


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


class _Recorder:
    """The `TrainCallback`: run directory files first, then an event to the driver."""

    def __init__(self, task: RunTask, rd: RunDir, reporter: EventReporter, token: int,
                 push: Callable[[], None] | None = None) -> None:
        self.task, self.rd, self.reporter, self.token, self.push = task, rd, reporter, token, push
        self.metrics_f: TextIO | None = None
        self.diag_f: TextIO | None = None
        self.last_eval: tuple[int, dict[str, float]] | None = None

    def _files(self) -> tuple[TextIO, TextIO]:
        """The metrics and diagnostics files `on_start` opened."""
        if self.metrics_f is None or self.diag_f is None:
            raise RuntimeError(f"run {self.task.run_id}: a training callback came before on_start opened its files")
        return self.metrics_f, self.diag_f

    def _event(self, kind: str, **data: Any) -> None:
        """A train or eval event carries its metrics.jsonl row's `time`: MLflow's SQL store drops a
        metric identical in (key, step, timestamp, value), so a driver that replays the rows after
        a crash between its metrics commit and its watermark tag adds no duplicate point."""
        self.reporter.emit({"type": kind, "run_id": self.task.run_id, "attempt": self.task.attempt,
                            "token": self.token, "time": time.time(), **data})

    def commit(self, rename: Callable[[], None]) -> None:
        """`train`'s checkpoint rename, only while this attempt holds the lease."""
        with self.rd.fenced(self.token):
            rename()

    def _reopen(self, start_step: int) -> None:
        """Keep only lines up to the resumed step: later ones belong to an attempt that died
        after its last checkpoint and will be recomputed identically."""
        with self.rd.fenced(self.token):
            for path in (self.rd.metrics_file, self.rd.diagnostics_file):
                valid = metrics_row_ok if path == self.rd.metrics_file else None
                kept = read_jsonl(path, valid) if valid else read_jsonl(path)
                rows = [r for r in kept if r["step"] <= start_step] if start_step else []
                write_json_lines(path, rows)
        # appended to by every callback until close()
        self.metrics_f = open(self.rd.metrics_file, "a")  # noqa: SIM115
        self.diag_f = open(self.rd.diagnostics_file, "a")  # noqa: SIM115

    def close(self) -> None:
        for f in (self.metrics_f, self.diag_f):
            if f is not None and not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()

    def on_start(self, info: dict[str, Any]) -> None:
        start_step = int(info.get("start_step", 0))
        self._reopen(start_step)
        with self.rd.fenced(self.token):
            self.rd.set_status(RUNNING, attempt=self.task.attempt, submission=self.task.submission,
                               start_step=start_step)
        # What the run directory kept from earlier attempts: the driver logs whatever of it
        # MLflow lacks (events an interrupted driver never received), so resumes leave no gaps.
        self._event("start", start_step=start_step, steps=self.task.run.config.train.steps, info=info,
                    history=self.rd.metrics(), diagnostics=self.rd.diagnostics())

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"kind": "train", "step": step, **metrics, "time": time.time()}
        metrics_f, _ = self._files()
        metrics_f.write(_dumps(row))
        metrics_f.flush()
        self._event("train", step=step, metrics=metrics, time=row["time"])

    def on_eval(self, step: int, metrics: dict[str, float], diagnostics: dict[str, Any]) -> None:
        self.last_eval = (step, metrics)
        row = {"kind": "eval", "step": step, **metrics, "time": time.time()}
        metrics_f, diag_f = self._files()
        metrics_f.write(_dumps(row))
        metrics_f.flush()
        if diagnostics:
            diag_f.write(_dumps({"step": step, **diagnostics}))
            diag_f.flush()
        self._event("eval", step=step, metrics=metrics, diagnostics=diagnostics, time=row["time"])

    def on_checkpoint(self, step: int, path: Path) -> None:
        for f in self._files():
            f.flush()
            os.fsync(f.fileno())
        with self.rd.fenced(self.token):
            self.rd.update_status(checkpoint_step=step)
        if self.push is not None:
            self.push()
        self._event("checkpoint", step=step)


class _Sync:
    """The attempt's side of run storage (see the module docstring).

    Checkpoint pushes run beside training: `after_checkpoint` snapshots the files the checkpoint
    leaves into `<run dir>/.push/<n>/` (the checkpoint hard-linked: `train` renames each new one
    into place, so the linked file never changes; the small records copied, times kept) and hands
    the snapshot to one uploader thread, which pushes it checkpoint first and status last, as a
    synchronous push would. A snapshot still waiting when the next checkpoint comes is replaced by
    the newer one. At most two snapshots exist, so a slow store costs at most two checkpoints of
    scratch disk, never training time. `at_end` waits for the upload under way, drops a waiting
    one (its files are older than the run directory's) and pushes the run directory itself."""

    def __init__(self, stored: StoredRun, rd: RunDir) -> None:
        self.stored, self.rd = stored, rd
        self.pushed: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) last pushed
        self.pulled: tuple[int, ...] | None = None
        self.snapshots = rd.path / SNAPSHOT_DIR
        self._count = 0
        self._pending: Path | None = None  # the newest snapshot not yet taken by the uploader
        self._closing = False
        self._wake = threading.Condition()
        self._uploader: threading.Thread | None = None
        self._log: Callable[[str], None] = lambda line: None

    def pull(self, lease_timeout_s: float) -> None:
        """Before the claim: pull when storage is ahead and no live holder on this node is writing."""
        self.rd.path.mkdir(parents=True, exist_ok=True)
        with self.rd.locked():
            if not lease_state(self.rd.lease(), lease_timeout_s)[0]:
                self.pulled = pull_if_ahead(self.stored, self.rd)

    def after_checkpoint(self, log: Callable[[str], None]) -> None:
        if self._uploader is None:  # under this attempt's lease: snapshots left by a killed attempt go
            shutil.rmtree(self.snapshots, ignore_errors=True)
        try:
            snapshot = self._snapshot()
        except OSError as exc:
            log(f"run storage {self.stored}: snapshotting the run for its push failed ({exc}); training goes on, "
                "the push is tried again at the next checkpoint")
            return
        with self._wake:
            replaced, self._pending, self._log = self._pending, snapshot, log
            if self._uploader is None:
                self._uploader = threading.Thread(target=self._upload, name=f"reslab-push-{self.rd.run_id}",
                                                  daemon=True)
                self._uploader.start()
            self._wake.notify()
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)

    def _snapshot(self) -> Path:
        self._count += 1
        snapshot = self.snapshots / str(self._count)
        snapshot.mkdir(parents=True)
        for name in (CHECKPOINT, *RECORDS):
            source = self.rd.path / name
            if not source.exists():
                continue
            if name == CHECKPOINT:
                try:
                    os.link(source, snapshot / name)
                    continue
                except OSError:  # a filesystem without hard links
                    pass
            shutil.copy2(source, snapshot / name)
        return snapshot

    def _upload(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                snapshot, self._pending = self._pending, None
            assert snapshot is not None
            try:
                self.stored.push(RunDir(snapshot), skip=self.pushed)
            except (StorageError, OSError) as exc:  # OSError: a local file that cannot be read
                self._log(f"{exc}; training goes on, the push is tried again at the next checkpoint")
            finally:
                shutil.rmtree(snapshot, ignore_errors=True)

    def close(self) -> None:
        """Stop the uploader: the upload under way finishes, a waiting snapshot is dropped."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._uploader is not None:
            self._uploader.join()
        shutil.rmtree(self.snapshots, ignore_errors=True)

    def at_end(self, log: Callable[[str], None] | None = None) -> str | None:
        """The end-of-attempt push, after the checkpoint uploads; the error text when it failed every try."""
        self.close()
        try:
            push_with_retries(self.stored, self.rd, self.pushed)
        except StorageError as exc:
            if log is not None:
                log(f"{exc}; gave up after {PUSH_TRIES} tries")
            return str(exc)
        return None

    def settle(self) -> str | None:
        """A run this node had finished: push it when storage is behind."""
        try:
            if local_progress(self.rd) <= self.stored.progress():
                return None
        except StorageError as exc:
            return str(exc)
        return self.at_end()


def scratch_dir(task: RunTask) -> Path:
    """Where a run with storage trains: `$RESLAB_SCRATCH/<study>/<run_id>`, else the driver's `task.run_dir`."""
    scratch = os.environ.get("RESLAB_SCRATCH")
    return Path(scratch) / task.run.study / task.run_id if scratch else Path(task.run_dir)


def _dumps(row: dict[str, Any]) -> str:
    return json.dumps(row, allow_nan=True, separators=(",", ":")) + "\n"


def write_json_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(_dumps(r) for r in rows))


def _flush(reporter: EventReporter, log: Callable[[str], None]) -> None:
    """Wait for the driver to have every event; a driver that is gone must not fail a finished
    run: the run directory has the record and the next submission mirrors it into MLflow."""
    try:
        reporter.flush()
    except Exception as exc:  # whatever the transport raises
        log(f"could not reach the driver ({type(exc).__name__}: {exc}); the run directory has the record")


def execute_run(task: RunTask, reporter: EventReporter, *, train_fn: Callable[..., Any] | None = None) -> RunOutcome:
    """Run one attempt of one run; never raises for a training failure (see the module doc).

    `train_fn` defaults to `models.training.train`; it exists so the resume test can stop a run
    part-way (an `on_step` callback raising `StopRun`: the run ends INTERRUPTED, checkpointed),
    not to swap the training loop.
    """
    from reslab.models.training import train

    host = socket.gethostname()
    sync = None
    if task.storage:
        rd = RunDir(scratch_dir(task))
        try:
            sync = _Sync(StoredRun.at(task.storage), rd)
            sync.pull(task.lease_timeout_s)
        except (ReslabError, OSError) as exc:
            # storage or this node's disk may do better on the next try; a URI this node cannot open will not
            retryable = isinstance(exc, (StorageError, OSError))
            return RunOutcome(run_id=task.run_id, state=FAILED, host=host, retryable=retryable,
                              error=f"{type(exc).__name__}: {exc} (before claiming the run on {host})")
    else:
        rd = RunDir(Path(task.run_dir))
    every = heartbeat_interval(task.lease_timeout_s, task.heartbeat_s)
    verdict, why, token = rd.claim(task.submission, task.lease_timeout_s, every)
    if verdict == "done":
        stored_error = sync.settle() if sync is not None else None
        if stored_error:
            return RunOutcome(run_id=task.run_id, state=FAILED, retryable=True, host=host,
                              error=f"finished on {host}, but not in run storage: {stored_error}")
        return RunOutcome(run_id=task.run_id, state="DONE", summary=(rd.summary() or {}).get("summary", {}), host=host)
    if verdict == "busy":
        return RunOutcome(run_id=task.run_id, state="BUSY", error=why, host=host)
    try:
        return _execute_claimed(task, reporter, rd, token, every, train_fn or train, host, sync)
    except LeaseLost as exc:
        return RunOutcome(run_id=task.run_id, state="BUSY", error=f"taken over: {exc}", host=host)


def _end(rd: RunDir, token: int, state: str, **fields: Any) -> None:
    """Write a final state and drop the lease, if this attempt still holds it."""
    with contextlib.suppress(LeaseLost), rd.fenced(token):
        rd.set_status(state, **fields)
        rd.lease_file.unlink(missing_ok=True)


def _execute_claimed(task: RunTask, reporter: EventReporter, rd: RunDir, token: int, every: float,
                     train_fn: Callable[..., Any], host: str, sync: _Sync | None = None) -> RunOutcome:
    from reslab.models.training import CheckpointUnreadable, StopRun, TrainingDiverged

    spec = task.run.to_dict()
    previous = rd.spec()
    if previous is not None and previous.get("config") != spec["config"]:
        rd.release(task.submission, token)
        return RunOutcome(
            run_id=task.run_id, state=FAILED, host=host,
            error=f"{rd.spec_file} holds a different config under the same run id; the run directory "
                  "was edited or RESULTS_VERSION reused. Move it away to rerun.",
        )
    fingerprint = code_fingerprint()
    env = {**environment(task.code), "code_fingerprint": fingerprint["digest"], "torch_threads": task.threads}
    with rd.fenced(token):
        write_json(rd.spec_file, spec)
        write_json(rd.env_file, env)
        attempts = int((rd.status() or {}).get("attempts", 0)) + 1
        rd.set_status(RUNNING, attempt=task.attempt, attempts=attempts, submission=task.submission)
    # Restored at the end, for an in-process caller (the test backend) whose other work should
    # not inherit this run's thread count.
    previous_threads = set_threads(task.threads)
    heartbeat = _Heartbeat(rd, token, every)
    heartbeat.start()
    recorder = _Recorder(task, rd, reporter, token, push=(lambda: sync.after_checkpoint(log)) if sync else None)
    log_f = open(rd.log_file, "a")  # noqa: SIM115 - closed in the finally below

    def log(line: str) -> None:
        log_f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        log_f.flush()

    try:
        log(f"attempt {task.attempt} of submission {task.submission} on {host}")
        if sync is not None:
            pulled = f"pulled from it (attempts {sync.pulled[1]}, checkpoint step {sync.pulled[2]})" if sync.pulled \
                else "nothing newer there than the scratch copy"
            log(f"run storage {sync.stored}: {pulled}; scratch {rd.path}")
        check_fingerprint(task.code.get("fingerprint"), fingerprint, host)  # StaleCode: not retryable
        extra: dict[str, Any] = {}
        if task.trial is not None:
            from reslab.orchestrator.tune import pruning_callback

            extra["on_step"] = pruning_callback(task.trial, recorder, task.run.config.train.steps, log)
        result = train_fn(task.run.config, rd.path, callback=recorder, resume=True, log=log, commit=recorder.commit,
                          **extra)
        recorder.close()
        # summary.json marks the run complete (see workspace): written once, by the lease holder
        with rd.fenced(token):
            if not rd.complete():
                write_json(rd.summary_file, {"summary": result.summary, "info": result.info})
        outcome = RunOutcome(
            run_id=task.run_id, state=SUCCESS, summary=result.summary, info=result.info, env=env,
            metrics=rd.metrics(), host=host,
        )
        _flush(reporter, log)
        _end(rd, token, SUCCESS, attempt=task.attempt, submission=task.submission)
        stored_error = sync.at_end(log) if sync is not None else None
        if stored_error:  # finished here, lost elsewhere: a retry pushes it (the claim finds it done)
            outcome.state, outcome.retryable = FAILED, True
            outcome.error = f"finished on {host}, but not in run storage: {stored_error}"
        return outcome
    except LeaseLost as exc:
        recorder.close()
        log(f"stopped: {exc}")
        raise
    except StopRun as stop:
        recorder.close()
        _end(rd, token, INTERRUPTED, attempt=task.attempt, submission=task.submission, error=str(stop))
        _flush(reporter, log)
        stored_error = sync.at_end(log) if sync is not None else None
        return RunOutcome(run_id=task.run_id, state=INTERRUPTED, env=env, host=host,
                          error=str(stop) + (f"; {stored_error}" if stored_error else ""),
                          info={"stopped_step": stop.step, "reason": str(stop)})
    except (KeyboardInterrupt, SystemExit):
        recorder.close()
        _end(rd, token, INTERRUPTED, attempt=task.attempt, submission=task.submission, error="cancelled")
        if sync is not None:
            sync.at_end(log)
        raise
    except Exception as exc:  # every training failure becomes a FAILED record
        recorder.close()
        tb = traceback.format_exc()
        log(tb)
        error = f"{type(exc).__name__}: {exc}"
        # a diverged run, a damaged checkpoint or a user error (exit code 2: config, spec) fails
        # the same way every time
        retryable = not (isinstance(exc, (TrainingDiverged, CheckpointUnreadable))
                         or (isinstance(exc, ReslabError) and exc.exit_code == 2))
        _end(rd, token, FAILED, attempt=task.attempt, submission=task.submission, error=error, traceback=tb,
             retryable=retryable)
        _flush(reporter, log)
        stored_error = sync.at_end(log) if sync is not None else None
        if stored_error:
            error = f"{error}; {stored_error}"
        return RunOutcome(run_id=task.run_id, state=FAILED, error=error, traceback=tb, retryable=retryable,
                          env=env, host=host)
    finally:
        if sync is not None:  # before the log closes: the uploader writes to it
            sync.close()
        heartbeat.stop()
        log_f.close()
        set_threads(previous_threads)
