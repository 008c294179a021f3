"""The orchestrator's vocabulary: the task a worker runs, what came of it, and every state word.

A leaf: it imports only the run spec, so the dispatch backends, the worker, the driver loop
(`orchestrator.driving.loop`) and the task sources (a study's plan, a search) all import it and never
each other for a type. Each word for a run's state lives in one enum here:

| enum          | says                                                   | written by                    |
|---------------|--------------------------------------------------------|-------------------------------|
| `RunState`    | what a run directory's `status` file records           | the worker, the driver        |
| `Claim`       | whether a worker may train a run it was handed         | `RunDir.claim`                |
| `Action`      | what a submission will do with a run                   | `orchestrator.driving.plan`   |
| `AttemptEnd`  | how one attempt ended, as the worker reports it        | `orchestrator.attempt.worker` |
| `Disposition` | what a submission did with a run, as its result prints | the task sources              |

`AttemptEnd.PRUNED` is a value the worker sets when a search's pruner stopped the run; nothing
reads it back out of an error text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # at run time the spec's import would load torch into every command that names a state
    from reslab.experiments.expand import RunSpec


class RunState(StrEnum):
    """A run's state as its run directory records it (a run without a `status` file has not started).

    `label` is the word the commands print; `tracking.layout.MLFLOW_STATUS` maps each state to the MLflow
    run status that mirrors it.
    """

    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"

    @property
    def label(self) -> str:
        return "succeeded" if self is RunState.SUCCESS else self.value.lower()


RUNNING, SUCCESS, FAILED, INTERRUPTED = RunState.RUNNING, RunState.SUCCESS, RunState.FAILED, RunState.INTERRUPTED
STATES = tuple(RunState)
TO_RUN = "to run"  # the label of a run without a status file, or one planned to run again


def summary_complete(record: Any) -> bool:
    """Whether a `summary.json` record (parsed) is a finished run's: the training loop's summary, with a
    numeric `val_loss`. This is the one test of "finished" for a local run directory and a stored copy alike:
    a status that says SUCCESS beside a missing, truncated or damaged summary is not finished."""
    summary = record.get("summary") if isinstance(record, dict) else None
    loss = summary.get("val_loss") if isinstance(summary, dict) else None
    return isinstance(loss, (int, float)) and not isinstance(loss, bool)


class Claim(StrEnum):
    """`RunDir.claim`'s verdict: train it, leave it (finished), or leave it (another holder)."""

    RUN = "run"
    DONE = "done"
    BUSY = "busy"


class Action(StrEnum):
    """What a submission plans for a run (`orchestrator.driving.plan`'s decision table)."""

    RUN = "run"
    SKIP = "skip"
    BUSY = "busy"


class AttemptEnd(StrEnum):
    """How one attempt ended. DONE: it had already finished; BUSY: another holder has it; both
    leave the run alone. PRUNED: a search's pruner stopped it (checkpointed, like INTERRUPTED)."""

    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"
    PRUNED = "PRUNED"
    DONE = "DONE"
    BUSY = "BUSY"


class Disposition(StrEnum):
    """What one submission did with a run: the words of its result and its progress lines."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    PRUNED = "pruned"
    SKIPPED = "skipped"
    BUSY = "busy"
    TO_RUN = TO_RUN


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """How many ranks train a run and how (`orchestrator.attempt.distributed_run`); execution only, never in the run id.

    `world` ranks of one GPU each (1: the attempt trains in its own process), the model replicated
    (`ddp`) or sharded (`fsdp`); each rank asks for `cpus` CPUs and runs `threads` torch threads; Ray Train
    starts the ranks again from the last committed checkpoint up to `restarts` times after one dies.
    """

    world: int = 1
    sharding: str = "ddp"
    cpus: float = 1.0
    threads: int = 1
    restarts: int = 2


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
    # the search trial this run is (`orchestrator.attempt.pruning.TrialLink`): evals are reported to it and
    # its pruner may stop the run
    trial: Any = None
    # the run's directory URI in run storage (`orchestrator.durability.storage`); None: `run_dir` is the only copy
    storage: str | None = None
    ranks: Ranks = field(default_factory=Ranks)

    @property
    def run_id(self) -> str:
        return self.run.run_id


@dataclass(kw_only=True)
class RunOutcome:
    """What came of one attempt (`AttemptEnd`)."""

    run_id: str
    state: AttemptEnd
    summary: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    retryable: bool = False
    host: str | None = None
    # finished, but the push to run storage failed every try: why (the driver pushes its copy later)
    not_stored: str | None = None
    # the attempt could not start because run storage did not answer: the driver waits for it, no retry is spent
    storage_unreachable: bool = False


@dataclass
class Completion:
    """One finished attempt: the worker's outcome, or `error` when the worker never returned
    (its process died, the node was lost, the task was cancelled)."""

    task: RunTask
    outcome: RunOutcome | None = None
    error: str | None = None

    @property
    def end(self) -> AttemptEnd | None:
        """How the attempt ended; None when the worker never returned."""
        return self.outcome.state if self.outcome is not None else None

    def error_or(self, default: str) -> str:
        """The worker's error text, or the backend's when the worker never returned, or `default`."""
        return (self.outcome.error if self.outcome is not None else self.error) or default

    @property
    def error_text(self) -> str:
        return self.error_or("unknown error")

    @property
    def retryable(self) -> bool:
        """A lost worker, or a failure the worker says a retry can fix (a crash, an OOM kill)."""
        return self.outcome is None or (self.outcome.state == AttemptEnd.FAILED and self.outcome.retryable)


@dataclass(frozen=True)
class Resources:
    """Per-run request: CPUs (also the worker's torch threads) and GPUs."""

    cpus: float = 1.0
    gpus: float = 0.0


@dataclass(frozen=True)
class ClusterInfo:
    address: str          # "in-process", "local (started here)" or the cluster address
    cpus: float
    gpus: float
    nodes: int


class EventReporter(Protocol):
    """How a worker talks to the driver. `emit` must not block on the driver; `flush` blocks
    until everything emitted so far has reached it (called once, before the run returns)."""

    def emit(self, event: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...


__all__ = ["FAILED", "INTERRUPTED", "RUNNING", "STATES", "SUCCESS", "TO_RUN", "Action", "AttemptEnd", "Claim",
           "ClusterInfo", "Completion", "Disposition", "EventReporter", "Ranks", "Resources", "RunOutcome",
           "RunState", "RunTask", "summary_complete"]
