"""The orchestrator's vocabulary: the task a worker runs, what came of it, and every state word.

A leaf: it imports only the run spec, so the dispatch backends, the worker, the driver loop
(`orchestrator.driving.loop`) and the task sources (a study's plan, a search) all import it and never
each other for a type. A run's life cycle has two enums and one table of words:

- `RunState`: what a run is, or how one attempt at it ended (a run without a `status` file has not
  started). The worker and the driver write it to the run directory's `status` file.
- `Action`: what is done with a run instead of waiting for a state: the plan's decision
  (`orchestrator.driving.plan`), a worker's claim (`RunDir.claim`) and, when an attempt did not train, its
  outcome (SKIP: the run had finished; BUSY: another holder has it). A submission's result says of
  each run the `RunState` it ended in or the `Action` it took (`Word`).

`WORDS` is the one table from a word to what each layer shows (`tracking.layout.MLFLOW_STATUS`
reads its MLflow column):

| word                   | CLI prints    | MLflow run status | status file, MLflow `state` tag |
|------------------------|---------------|-------------------|---------------------------------|
| `RunState.RUNNING`     | running       | RUNNING           | RUNNING (status file only)      |
| `RunState.SUCCESS`     | succeeded     | FINISHED          | SUCCESS                         |
| `RunState.FAILED`      | failed        | FAILED            | FAILED                          |
| `RunState.INTERRUPTED` | interrupted   | KILLED            | INTERRUPTED                     |
| `RunState.PRUNED`      | pruned        | KILLED            | INTERRUPTED (checkpointed)      |
| `Action.RUN`           | to run        |                   |                                 |
| `Action.SKIP`          | skipped       |                   |                                 |
| `Action.BUSY`          | busy          |                   |                                 |

The plan's lines print an action's value (run, skip, busy). `RunState.PRUNED` is a value the worker
sets when a search's pruner stopped the run; nothing reads it back out of an error text. A failed
attempt the loop retries is tagged RETRYING in MLflow, and shows as "to run" until it starts again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # at run time the spec's import would load torch into every command that names a state
    from reslab.experiments.expand import RunSpec


class RunState(StrEnum):
    """What a run is, or how one attempt at it ended; the value is the status file's spelling (since 0.1)."""

    RUNNING = "RUNNING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"
    PRUNED = "PRUNED"

    @property
    def label(self) -> str:
        return WORDS[self].cli


class Action(StrEnum):
    """What is done with a run: train it, skip it (it has finished, or failed and is not forced), or leave
    it to the other holder of its lease. The value is the word of the plan's lines."""

    RUN = "run"
    SKIP = "skip"
    BUSY = "busy"

    @property
    def label(self) -> str:
        return WORDS[self].cli


Word = RunState | Action  # what a submission made of a run: the state it ended in, or the action it took


class Words(NamedTuple):
    """One row of the vocabulary table (module docstring)."""

    cli: str                  # what the commands print: status and progress lines, a submission's result
    mlflow: str | None        # the status of the run's MLflow child run; None: no MLflow run is in it
    recorded: RunState | None  # the status file's state and the MLflow `state` tag; None: not recorded


WORDS: dict[Word, Words] = {
    RunState.RUNNING: Words("running", "RUNNING", RunState.RUNNING),
    RunState.SUCCESS: Words("succeeded", "FINISHED", RunState.SUCCESS),
    RunState.FAILED: Words("failed", "FAILED", RunState.FAILED),
    RunState.INTERRUPTED: Words("interrupted", "KILLED", RunState.INTERRUPTED),
    RunState.PRUNED: Words("pruned", "KILLED", RunState.INTERRUPTED),
    Action.RUN: Words("to run", None, None),
    Action.SKIP: Words("skipped", None, None),
    Action.BUSY: Words("busy", None, None),
}
RUNNING, SUCCESS, FAILED, INTERRUPTED = RunState.RUNNING, RunState.SUCCESS, RunState.FAILED, RunState.INTERRUPTED
PRUNED = RunState.PRUNED
RECORDED = tuple(s for s in RunState if WORDS[s].recorded is s)  # the states a `status` file may hold


def summary_complete(record: Any) -> bool:
    """Whether a `summary.json` record (parsed) is a finished run's: the training loop's summary, with a
    numeric `val_loss`. This is the one test of "finished" for a local run directory and a stored copy alike:
    a status that says SUCCESS beside a missing, truncated or damaged summary is not finished."""
    summary = record.get("summary") if isinstance(record, dict) else None
    loss = summary.get("val_loss") if isinstance(summary, dict) else None
    return isinstance(loss, (int, float)) and not isinstance(loss, bool)


@dataclass(frozen=True, kw_only=True)
class Ranks:
    """How many ranks train a run and how (`orchestrator.attempt.distributed_run`); execution only, never in the run id.

    `world` ranks of one GPU each, or CPU ranks (`on_cpu_ranks`; 1: the attempt trains in its own process), the
    model replicated (`ddp`) or sharded (`fsdp`); each rank asks for `cpus` CPUs and runs `threads` torch
    threads; Ray Train starts the ranks again from the last committed checkpoint up to `restarts` times after
    one dies. `stages` >= 2: the ranks are `world / stages` replicas of the run's pipeline stages instead
    (`models.staged`), under `schedule` with each batch in `microbatches` (`resources.pipeline_*` of the study),
    each rank running `virtual_stages` stages, with Kimi's cross-stage caching when `cache`.
    """

    world: int = 1
    sharding: str = "ddp"
    cpus: float = 1.0
    threads: int = 1
    restarts: int = 2
    stages: int = 1
    schedule: str = "gpipe"
    microbatches: int = 1
    virtual_stages: int = 1
    cache: bool = False

    @property
    def layout(self) -> str:
        """What the ranks hold, in words: "ddp", "fsdp", "pipeline 2 stages" or "pipeline 2 stages x 2 replicas"."""
        if self.stages < 2:
            return self.sharding
        replicas = self.world // self.stages
        return f"pipeline {self.stages} stages" + (f" x {replicas} replicas" if replicas > 1 else "")


# what the task of a run on N ranks asks for: it waits on its ranks, its heartbeat and its pushes
COORDINATOR_CPUS = 0.1


def on_cpu_ranks(cluster_gpus: float, devices: list[str]) -> bool:
    """Whether a run on N >= 2 ranks trains on CPU ranks: each rank asks Ray for CPUs only and the ranks talk
    gloo. So when the cluster has no GPU, or every one of `devices` (the runs' `train.device`) is "cpu"; else
    each rank asks for one GPU. The driver decides it for a submission's accounting (its runs' devices), the
    attempt for its own ranks (its run's device), with the same rule."""
    return cluster_gpus <= 0 or (bool(devices) and all(d == "cpu" for d in devices))


@dataclass(frozen=True)
class Node:
    """Where an attempt ran, and so where its copy of the run directory is: the backend's node id (a Ray node's;
    None in-process) and the host's name (what places the copy when that node is gone, e.g. restarted)."""

    id: str | None = None
    host: str | None = None


@dataclass(frozen=True)
class EvalJob:
    """What an evaluation task evaluates: a study's `evals:` (`experiments.evals.EvalSpec`) on the run's device
    (`device` overrides its `train.device`), `batch_size` requests per forward; `only`: the submission trains
    nothing, it only evaluates the runs finished before (`reslab eval`)."""

    spec: Any
    device: str | None = None
    batch_size: int = 16
    only: bool = False


@dataclass(frozen=True)
class InterventionJob:
    """What an intervention task does: a study's `interventions:` (`experiments.interventions.InterventionSpec`)
    on the run's eval windows, on the run's device (`device` overrides its `train.device`)."""

    spec: Any
    device: str | None = None


class Work(Protocol):
    """What a task does instead of training its run: its function, and what it asks the backend for. A kind of work
    after training (`orchestrator.attempt.after.AfterTraining`: a finished run's evaluations and interventions) is
    one; the worker runs `run`, a backend places the task by `asks`, and nothing else looks inside. Plain picklable
    data, like the task that carries it."""

    @property
    def name(self) -> str:
        """A word for the backend's name of the task (the Ray task "reslab:<study>:<run>:<name>")."""
    def run(self, task: RunTask, host: str) -> RunOutcome:
        """The work, in the worker; never raises for a failure of the work (its outcome says it, and whether a
        retry can help)."""
    def asks(self, task: RunTask, resources: Resources) -> tuple[float, float]:
        """The CPUs and GPUs the task asks for, given what each run asks for."""


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
    # a push task: train nothing; push the finished copy of the run on this node to run storage, whole (the
    # driver's request once storage answers after an outage, or when storage lacks a run finished there)
    push_from: Node | None = None
    # a task of other work than training the run (`Work`): the worker runs its function instead, e.g. the finished
    # run's evaluations and interventions (`orchestrator.attempt.after`), released by a source wrapped around the
    # study's (`orchestrator.driving.after.AfterSource`)
    work: Work | None = None

    @property
    def run_id(self) -> str:
        return self.run.run_id


@dataclass(kw_only=True)
class RunOutcome:
    """What came of one attempt: the state it left the run in, or the action it took instead of training."""

    run_id: str
    state: RunState | Action
    summary: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    retryable: bool = False
    host: str | None = None
    node: str | None = None  # the backend's id of the node it ran on (`Node.id`)
    # finished, but the push to run storage failed every try: why (the driver has this node push it later)
    not_stored: str | None = None
    # the attempt could not start because run storage did not answer: the driver waits for it, no retry is spent
    storage_unreachable: bool = False
    # when this attempt's storage operations began to fail (and had not worked since): the outage's start
    storage_down_since: float | None = None
    # a task of work after training (`orchestrator.attempt.after`): its units, each {"kind": "eval" |
    # "intervention", "name", "id", "metrics", "rows"} (metrics None: done before, skipped; rows: an intervention's
    # records)
    units: list[dict[str, Any]] = field(default_factory=list)

    @property
    def where(self) -> Node:
        return Node(self.node, self.host)


@dataclass
class Completion:
    """One finished attempt: the worker's outcome, or `error` when the worker never returned
    (its process died, the node was lost, the task was cancelled)."""

    task: RunTask
    outcome: RunOutcome | None = None
    error: str | None = None

    @property
    def end(self) -> RunState | Action | None:
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
        return self.outcome is None or (self.outcome.state == FAILED and self.outcome.retryable)


@dataclass(frozen=True)
class Resources:
    """Per-run request: CPUs (also the worker's torch threads) and GPUs, and the ranks that train it (`Ranks.world`:
    on CPU ranks a run on N ranks asks for no GPU)."""

    cpus: float = 1.0
    gpus: float = 0.0
    ranks: int = 1


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


__all__ = ["COORDINATOR_CPUS", "FAILED", "INTERRUPTED", "PRUNED", "RECORDED", "RUNNING", "SUCCESS", "WORDS", "Action",
           "ClusterInfo", "Completion", "EvalJob", "EventReporter", "InterventionJob", "Node", "Ranks", "Resources",
           "RunOutcome", "RunState", "RunTask", "Word", "Words", "Work", "on_cpu_ranks", "summary_complete"]
