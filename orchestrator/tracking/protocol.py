"""What the driver needs from a tracker: `DriverTracker`, a typed Protocol, and `NullTracker`, the
tracker that records nothing. The module imports no mlflow and no reslab module at run time.

The driver loop (`orchestrator.driving.loop`), the study (`orchestrator.driving.submit`), the search
(`orchestrator.driving.tune`) and the study's result (`orchestrator.gathering`) call a tracker only through
these methods. `tracking.guarded.GuardedTracker` is the driver's MLflow tracker (it waits out
outages); the plain `tracking.writer.MlflowWriter` under it has the same methods. `NullTracker`
stands in for `tracker=None`. Typing against the Protocol keeps those modules free of MLflow's
import and lets a test hand them any object with these methods.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:

    from reslab.experiments.expand import RunSpec
    from reslab.orchestrator.durability.workspace import RunDir
    from reslab.orchestrator.tasks import RunState
    from reslab.results.readout import Publication


class DriverTracker(Protocol):
    """The writer of one submission of one study: a parent run, one child per run id."""

    uri: str  # the tracking URI, as the store is read back (`gathering.gather`)
    # what puts the study's result on the parent run before the submission ends it, called with the submission's
    # result (`reslab run` sets it: `gathering.gather.publish_result`); None: no result is published
    publisher: Callable[[Any], None] | None

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: dict[str, Any],
              study_file: Path | None = None, settings: dict[str, Any] | None = None,
              analysis: dict[str, Any] | None = None) -> str | None:
        """Open the study (once) and this submission's parent run; returns the parent's id (None: a
        tracker that records nothing). `analysis`: the study's analysis plan (`{"hash", "versions"}`:
        `durability.plans`), the parent's `reslab.analysis_hash` tag and its `analysis_plan.json`."""
        ...

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        """Mirror a finished run directory the store lacks; True when something was written."""
        ...

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        """Mirror a failed run the store does not show as failed; True when something was written."""
        ...

    def discard_parent(self) -> None:
        """Delete this submission's parent run (it ran and mirrored nothing)."""
        ...

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
        """A worker's event (start, train, eval, checkpoint), queued or written."""
        ...

    def flush(self) -> None:
        """Write what `on_event` queued (the dispatch loop calls it every poll tick; a tracker may leave some runs'
        rows for the next tick, to bound the time a tick spends writing: `children.FLUSH_BUDGET_S`)."""
        ...

    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """A run succeeded: its late rows, artifacts and summary, then finished."""
        ...

    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None:
        """A run's attempt failed; `final` when no retry follows."""
        ...

    def kill(self, run: RunSpec) -> None:
        """A run was interrupted; the next submission resumes it."""
        ...

    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None:
        """Extra tags on a run's record (a tuning trial's number, state and parameters)."""
        ...

    def log_after(self, run: RunSpec, metrics: dict[str, float], tables: dict[str, list[dict[str, Any]]]) -> None:
        """A finished run's work after training on its record: metrics by their whole key (`eval/<task>/<metric>`,
        `knockout/<mode>/<site>/<source>`) and tables (artifact file -> rows)."""
        ...

    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of `local_dir` on this submission's parent run, under `artifact_path`."""
        ...

    def log_study_result(self, result: Publication, local_dir: Path) -> str:
        """The study's result (`results.readout.StudyReadout.publish`: the paired table, further tables,
        metric series such as a confidence sequence seed by seed, the experiment's description) and the
        files of `local_dir` on the parent run; returns its id."""
        ...

    def mark_published(self, key: str) -> None:
        """The parent run's publication is whole (its last step): `key` names the finished runs it came from."""
        ...

    def published_key(self) -> str | None:
        """The key of the study's last whole publication; None when there is none."""
        ...

    def end(self, state: RunState, counts: dict[str, int]) -> None:
        """Close the parent run in `state`, with the run counts."""
        ...


class NullTracker:
    """No tracking (`tracker=None`): every call records nothing."""

    uri = ""
    publisher: Callable[[Any], None] | None = None

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: dict[str, Any],
              study_file: Path | None = None, settings: dict[str, Any] | None = None,
              analysis: dict[str, Any] | None = None) -> str | None:
        return None

    def log_study_result(self, result: Publication, local_dir: Path) -> str:
        return ""

    def mark_published(self, key: str) -> None: ...

    def published_key(self) -> str | None:
        return None

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        return False

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        return False

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None: ...
    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None: ...
    def kill(self, run: RunSpec) -> None: ...
    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None: ...
    def log_after(self, run: RunSpec, metrics: dict[str, float], tables: dict[str, list[dict[str, Any]]]) -> None: ...
    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None: ...
    def discard_parent(self) -> None: ...
    def end(self, state: RunState, counts: dict[str, int]) -> None: ...
