"""What a run's training calls back into, built in one place (`step_hooks`) for one process and for
every rank of a run on N ranks.

`train`'s hooks for a run: the `Recorder` (the `TrainCallback`: metrics.jsonl and diagnostics.jsonl,
an event to the driver for every log, eval and checkpoint, the push of each checkpoint to run
storage) with its `commit`, the lease fence around each checkpoint's rename; the run's log; and
`on_step`, which runs, in order, a search's `PruningHook` (when the run is a trial) and the hook named
by `$RESLAB_STEP_HOOK`.

`$RESLAB_STEP_HOOK`, the extension point, is `module:factory`: `step_hooks` imports the module and
calls `factory(task, rank)` in every process that trains the run (once per rank, rank 0 the only
rank of a run in one process), before training starts; what it returns (a callable taking the number
of steps done, or None) joins `on_step`, which `train` runs on rank 0 only after each step. Unset, it
adds nothing. The module must import where the run trains: with Ray, on the workers' `PYTHONPATH`.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from reslab.common.errors import ConfigError
from reslab.common.io import write_atomic
from reslab.orchestrator.durability.workspace import RunDir, metrics_row_ok, read_jsonl
from reslab.orchestrator.tasks import RUNNING, EventReporter, RunTask

if TYPE_CHECKING:
    from reslab.orchestrator.attempt.pruning import PruningHook

STEP_HOOK_ENV = "RESLAB_STEP_HOOK"


class Recorder:
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
        metrics_f.write(dumps_row(row))
        metrics_f.flush()
        self._event("train", step=step, metrics=metrics, time=row["time"])

    def on_eval(self, step: int, metrics: dict[str, float], diagnostics: dict[str, Any]) -> None:
        self.last_eval = (step, metrics)
        row = {"kind": "eval", "step": step, **metrics, "time": time.time()}
        metrics_f, diag_f = self._files()
        metrics_f.write(dumps_row(row))
        metrics_f.flush()
        if diagnostics:
            diag_f.write(dumps_row({"step": step, **diagnostics}))
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


@dataclass
class StepHooks:
    """`train`'s keyword arguments for one process or one rank (`train_kwargs`), and the search's pruner
    among them (the attempt reports PRUNED when it stopped the run)."""

    train_kwargs: dict[str, Any]
    pruner: PruningHook | None = None


def step_hooks(task: RunTask, rank: int, recorder: Recorder | None,
               log: Callable[[str], None] | None) -> StepHooks:
    """The hooks of `task`'s training in this process (module docstring): `recorder` and `log` where this
    process records the run (one process, or rank 0), None on the other ranks."""
    on_step: list[Callable[[int], None]] = []
    pruner = None
    if recorder is not None and log is not None and task.trial is not None:
        from reslab.orchestrator.attempt.pruning import PruningHook

        pruner = PruningHook(task.trial, recorder, log)
        on_step.append(pruner)
    extension = _extension(task, rank)
    if extension is not None:
        on_step.append(extension)
    kwargs: dict[str, Any] = {}
    if recorder is not None:
        kwargs.update(callback=recorder, log=log, commit=recorder.commit)
    if on_step:

        def each(done: int) -> None:
            for hook in on_step:
                hook(done)

        kwargs["on_step"] = each
    return StepHooks(kwargs, pruner)


def _extension(task: RunTask, rank: int) -> Callable[[int], None] | None:
    """What `$RESLAB_STEP_HOOK`'s factory returns for this rank of `task`; None when unset."""
    spec = os.environ.get(STEP_HOOK_ENV)
    if not spec:
        return None
    module, _, name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"${STEP_HOOK_ENV}: {spec!r} does not name a factory ({type(exc).__name__}: {exc}); "
                          "allowed: module:function, importable where the run trains") from None
    return factory(task, rank)


def dumps_row(row: dict[str, Any]) -> str:
    return json.dumps(row, allow_nan=True, separators=(",", ":")) + "\n"


def write_json_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(dumps_row(r) for r in rows))


def flush_events(reporter: EventReporter, log: Callable[[str], None]) -> None:
    """Wait for the driver to have every event; a driver that is gone must not fail a finished
    run: the run directory has the record and the next submission mirrors it into MLflow."""
    try:
        reporter.flush()
    except Exception as exc:  # whatever the transport raises
        log(f"could not reach the driver ({type(exc).__name__}: {exc}); the run directory has the record")


def log_line(f: TextIO, line: str) -> None:
    f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
    f.flush()
