"""`LocalBackend`: runs `orchestrator.attempt.worker.execute_run` in this process, one run at a time.

For tests only; `reslab run` always uses Ray. It exists because starting Ray costs ~5.5 s and
0.4-0.8 GB per session and its first torch task per worker ~1 s more, which would make every test
of planning, idempotency, retries, resume and MLflow tracking pay for dispatch it does not
exercise. It calls the *same* worker function as a Ray task, with an event reporter that hands
events straight to the driver, so those tests exercise the production code path from the driver
loop down to `train()`; only the process boundary is missing. The Ray path itself is covered by
the end-to-end tests (a real `reslab run`, interrupted and resumed).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

from reslab.orchestrator.attempt.worker import execute_run
from reslab.orchestrator.dispatch import BackendError
from reslab.orchestrator.tasks import ClusterInfo, Completion, Resources, RunTask


class _ListReporter:
    def __init__(self, sink: list[dict[str, Any]]) -> None:
        self.sink = sink

    def emit(self, event: dict[str, Any]) -> None:
        self.sink.append(event)

    def flush(self) -> None:
        pass


class LocalBackend:
    """In-process, sequential: `poll` runs the next queued task to completion."""

    def __init__(self, train_fn: Callable[..., Any] | None = None) -> None:
        self.train_fn = train_fn
        self.queue: deque[RunTask] = deque()
        self.events: list[dict[str, Any]] = []

    def start(self) -> ClusterInfo:
        return ClusterInfo(address="in-process", cpus=float(len(os.sched_getaffinity(0))), gpus=0.0, nodes=1)

    def resources(self, requested: Resources) -> None:
        ranks = max(requested.ranks, int(requested.gpus))
        if ranks >= 2:  # N ranks (on GPUs or CPUs): Ray Train starts them, and this backend has no Ray
            raise BackendError(f"each run asks for {ranks} ranks ({requested.gpus:g} GPUs); the in-process backend "
                               "trains a run in one process. Use the Ray backend")

    def submit(self, task: RunTask, resources: Resources) -> None:
        self.queue.append(task)

    def poll(self, timeout: float) -> tuple[list[dict[str, Any]], list[Completion]]:
        done: list[Completion] = []
        if self.queue:
            task = self.queue.popleft()
            done.append(self.execute(task))
        events, self.events = self.events, []
        return events, done

    def execute(self, task: RunTask) -> Completion:
        return Completion(task, outcome=execute_run(task, _ListReporter(self.events), train_fn=self.train_fn))

    def cancel(self) -> list[RunTask]:
        tasks = list(self.queue)
        self.queue.clear()
        return tasks

    def shutdown(self) -> None:
        self.queue.clear()
