"""Backends: where a run's worker function executes. The driver loop (`orchestrator.submit`)
is written once against the `Backend` protocol below.

- `ray_backend.RayBackend`: one Ray task per run (local Ray started on demand, or a cluster by
  address). The only module that imports ray.
- `local_backend.LocalBackend`: the same `orchestrator.worker.execute_run`, called in-process one
  run at a time. For tests only (see its docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from reslab.common.errors import ReslabError
from reslab.orchestrator.worker import RunOutcome, RunTask


class BackendError(ReslabError, RuntimeError):
    """The backend cannot run the study as asked (no GPU in the cluster, cannot connect, ...)."""


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


@dataclass
class Completion:
    """One finished attempt: the worker's outcome, or `error` when the worker never returned
    (its process died, the node was lost, the task was cancelled)."""

    task: RunTask
    outcome: RunOutcome | None = None
    error: str | None = None


class Backend(Protocol):
    def start(self) -> ClusterInfo: ...
    def resources(self, requested: Resources) -> None:
        """Check that the cluster can ever satisfy `requested`; raise BackendError if not."""
    def submit(self, task: RunTask, resources: Resources) -> None: ...
    def poll(self, timeout: float) -> tuple[list[dict[str, Any]], list[Completion]]:
        """Events reported since the last poll, and attempts that finished."""
    def cancel(self) -> list[RunTask]:
        """Stop every attempt in flight; returns their tasks."""
    def shutdown(self) -> None: ...


__all__ = ["Backend", "BackendError", "ClusterInfo", "Completion", "Resources"]
