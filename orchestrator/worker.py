"""The worker entry point: one run, start to finish, in whatever process a backend gives it.

`execute_run(task, reporter)` is the only function a backend calls; the Ray backend wraps it in a
task and the in-process test backend calls it directly, so both run the same code. It

1. claims the run directory (skips a run that already succeeded, leaves one another submission
   holds), writes `spec.json`, `env.json` and `status: RUNNING`, and starts a lease heartbeat;
2. calls `models.training.train(cfg, run_dir, callback=..., resume=True)`, which resumes from
   `checkpoint.pt` when one exists;
3. records every train log and eval in `metrics.jsonl` / `diagnostics.jsonl` and reports it to
   the driver as an event (the driver does all MLflow writes, see `orchestrator.tracking`);
4. writes `summary.json`, then `status: SUCCESS` last; or `FAILED` with the error, or
   `INTERRUPTED` when cancelled.

Failures come back as a `RunOutcome` value, not an exception, so the driver sees the error text
and whether a retry can help: a diverged run or a config error fails the same way every time and
is not retried; anything else (a crash, an OOM kill, a lost node) is.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from reslab.experiments.expand import RunSpec
from reslab.models.config import ConfigError
from reslab.orchestrator.envinfo import environment
from reslab.orchestrator.workspace import FAILED, INTERRUPTED, RUNNING, SUCCESS, RunDir, read_jsonl, write_json


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


def _set_threads(n: int) -> int:
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
    def __init__(self, rd: RunDir, submission: str, every: float) -> None:
        super().__init__(name="reslab-lease-heartbeat", daemon=True)
        self.rd, self.submission, self.every = rd, submission, every
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.rd.heartbeat(self.submission)
            except OSError:
                pass  # a full or flaky disk must not kill training; the lease just ages

    def stop(self) -> None:
        self.stopped.set()


class _Recorder:
    """The `TrainCallback`: run directory files first, then an event to the driver."""

    def __init__(self, task: RunTask, rd: RunDir, reporter: EventReporter) -> None:
        self.task, self.rd, self.reporter = task, rd, reporter
        self.metrics_f = None
        self.diag_f = None

    def _event(self, kind: str, **data: Any) -> None:
        self.reporter.emit({"type": kind, "run_id": self.task.run_id, "attempt": self.task.attempt,
                            "time": time.time(), **data})

    def _reopen(self, start_step: int) -> None:
        """Keep only lines up to the resumed step: later ones belong to an attempt that died
        after its last checkpoint and will be recomputed identically."""
        for path in (self.rd.metrics_file, self.rd.diagnostics_file):
            rows = [r for r in read_jsonl(path) if r.get("step", 0) <= start_step] if start_step else []
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(_dumps(r) for r in rows))
            tmp.replace(path)
        self.metrics_f = open(self.rd.metrics_file, "a")
        self.diag_f = open(self.rd.diagnostics_file, "a")

    def close(self) -> None:
        for f in (self.metrics_f, self.diag_f):
            if f is not None and not f.closed:
                f.flush()
                os.fsync(f.fileno())
                f.close()

    def on_start(self, info: dict[str, Any]) -> None:
        start_step = int(info.get("start_step", 0))
        self._reopen(start_step)
        self.rd.set_status(RUNNING, attempt=self.task.attempt, submission=self.task.submission,
                           start_step=start_step)
        # What the run directory kept from earlier attempts: the driver logs whatever of it
        # MLflow lacks (events an interrupted driver never received), so resumes leave no gaps.
        self._event("start", start_step=start_step, steps=self.task.run.config.train.steps, info=info,
                    history=read_jsonl(self.rd.metrics_file), diagnostics=read_jsonl(self.rd.diagnostics_file))

    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"kind": "train", "step": step, **metrics, "time": time.time()}
        self.metrics_f.write(_dumps(row))
        self.metrics_f.flush()
        self._event("train", step=step, metrics=metrics)

    def on_eval(self, step: int, metrics: dict[str, float], diagnostics: dict[str, Any]) -> None:
        row = {"kind": "eval", "step": step, **metrics, "time": time.time()}
        self.metrics_f.write(_dumps(row))
        self.metrics_f.flush()
        if diagnostics:
            self.diag_f.write(_dumps({"step": step, **diagnostics}))
            self.diag_f.flush()
        self._event("eval", step=step, metrics=metrics, diagnostics=diagnostics)

    def on_checkpoint(self, step: int, path: Path) -> None:
        for f in (self.metrics_f, self.diag_f):
            f.flush()
            os.fsync(f.fileno())
        self.rd.update_status(checkpoint_step=step)
        self._event("checkpoint", step=step)


def _dumps(row: dict[str, Any]) -> str:
    return json.dumps(row, allow_nan=True, separators=(",", ":")) + "\n"


def _flush(reporter: EventReporter, log: Callable[[str], None]) -> None:
    """Wait for the driver to have every event; a driver that is gone must not fail a finished
    run: the run directory has the record and the next submission mirrors it into MLflow."""
    try:
        reporter.flush()
    except Exception as exc:  # noqa: BLE001 - whatever the transport raises
        log(f"could not reach the driver ({type(exc).__name__}: {exc}); the run directory has the record")


def execute_run(task: RunTask, reporter: EventReporter, *, train_fn: Callable[..., Any] | None = None) -> RunOutcome:
    """Run one attempt of one run; never raises for a training failure (see the module doc).

    `train_fn` defaults to `models.training.train`; it exists so the resume test can stop a run
    part-way with `stop_after`, not to swap the training loop.
    """
    from reslab.models.training import TrainingDiverged, train

    host = socket.gethostname()
    rd = RunDir(Path(task.run_dir))
    verdict, why = rd.claim(task.submission, task.lease_timeout_s)
    if verdict == "done":
        return RunOutcome(run_id=task.run_id, state="DONE", summary=(rd.summary() or {}).get("summary", {}), host=host)
    if verdict == "busy":
        return RunOutcome(run_id=task.run_id, state="BUSY", error=why, host=host)

    spec = task.run.to_dict()
    previous = rd.spec()
    if previous is not None and previous.get("config") != spec["config"]:
        rd.release(task.submission)
        return RunOutcome(
            run_id=task.run_id, state=FAILED, host=host,
            error=f"{rd.spec_file} holds a different config under the same run id; the run directory "
                  "was edited or RESULTS_VERSION reused. Move it away to rerun.",
        )
    write_json(rd.spec_file, spec)
    # Restored at the end, for an in-process caller (the test backend) whose other work should
    # not inherit this run's thread count.
    previous_threads = _set_threads(task.threads)
    env = {**environment(task.code), "torch_threads": task.threads}
    write_json(rd.env_file, env)
    attempts = int((rd.status() or {}).get("attempts", 0)) + 1
    rd.set_status(RUNNING, attempt=task.attempt, attempts=attempts, submission=task.submission)
    heartbeat = _Heartbeat(rd, task.submission, task.heartbeat_s)
    heartbeat.start()
    recorder = _Recorder(task, rd, reporter)
    log_f = open(rd.log_file, "a")

    def log(line: str) -> None:
        log_f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        log_f.flush()

    try:
        log(f"attempt {task.attempt} of submission {task.submission} on {host}")
        result = (train_fn or train)(task.run.config, rd.path, callback=recorder, resume=True, log=log)
        recorder.close()
        if "interrupted_at" in result.summary:  # only a test's stop_after gets here
            rd.set_status(INTERRUPTED, attempt=task.attempt, submission=task.submission,
                          error=f"stopped at step {int(result.summary['interrupted_at'])}")
            rd.release(task.submission)
            _flush(reporter, log)
            return RunOutcome(run_id=task.run_id, state=INTERRUPTED, env=env, host=host)
        write_json(rd.summary_file, {"summary": result.summary, "info": result.info})
        outcome = RunOutcome(
            run_id=task.run_id, state=SUCCESS, summary=result.summary, info=result.info, env=env,
            metrics=rd.metrics(), host=host,
        )
        _flush(reporter, log)
        rd.set_status(SUCCESS, attempt=task.attempt, submission=task.submission)
        rd.release(task.submission)
        return outcome
    except (KeyboardInterrupt, SystemExit):
        recorder.close()
        rd.set_status(INTERRUPTED, attempt=task.attempt, submission=task.submission, error="cancelled")
        rd.release(task.submission)
        raise
    except Exception as exc:  # noqa: BLE001 - every training failure becomes a FAILED record
        recorder.close()
        tb = traceback.format_exc()
        log(tb)
        error = f"{type(exc).__name__}: {exc}"
        retryable = not isinstance(exc, (TrainingDiverged, ConfigError))
        rd.set_status(FAILED, attempt=task.attempt, submission=task.submission, error=error, traceback=tb,
                      retryable=retryable)
        rd.release(task.submission)
        _flush(reporter, log)
        return RunOutcome(run_id=task.run_id, state=FAILED, error=error, traceback=tb, retryable=retryable,
                          env=env, host=host)
    finally:
        heartbeat.stop()
        log_f.close()
        _set_threads(previous_threads)
