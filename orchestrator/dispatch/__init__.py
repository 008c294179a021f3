"""Backends: where a run's worker function executes. The driver loop (`orchestrator.driving.loop`)
is written once against the `Backend` protocol below.

- `ray_backend.RayBackend`: one Ray task per run (local Ray started on demand, or a cluster by
  address). The only backend that imports ray (besides it, only `orchestrator.attempt.distributed_run` and
  `orchestrator.driving.jobs` do).
- `failure_text`: a task's failure text in one line (Ray's out-of-memory report), the whole text saved in the
  run's folder.
- `local_backend.LocalBackend`: the same `orchestrator.attempt.worker.execute_run`, called in-process one
  run at a time. For tests only (see its docstring).
"""

from __future__ import annotations

from typing import Any, Protocol

from reslab.common.errors import ReslabError
from reslab.orchestrator.tasks import ClusterInfo, Completion, Resources, RunTask


class BackendError(ReslabError, RuntimeError):
    """The backend cannot run the study as asked (no GPU in the cluster, cannot connect, ...)."""


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


__all__ = ["Backend", "BackendError"]
