"""The driver's tracker, `GuardedTracker`: the plain `writer.MlflowWriter` wrapped so that a tracking
outage never stops training. The driver sees it through `protocol.DriverTracker`.

A store that does not answer at start is one line (`store.probe_store`, as the writer opens it); one
that stops answering as the submission begins is one line too (nothing has trained). One that stops
answering later (a server whose database is down answers 503, a database store refuses connections)
never stops training. Every write the driver calls goes through `_guarded`: a failure that is an
outage (`store.is_outage`; MLflow's HTTP retries are bounded, `store.HTTP_RETRIES`, so one write gives
up in seconds) starts an `outage.Outage`, and the run it concerned is *behind*: a `Behind` record
holds the last end the driver reported for it (`Missed`: in flight, finished, failed, killed, synced
from its run directory) and the tags MLflow lacks. While tracking is down, writes are skipped without a
request, except a probe when the backoff says one is due (1 s doubling to 30 s; the loop calls `flush`
every tick), and the status line says so ("tracking ... unreachable for 2m10s; runs continue; metrics
queued in the run directories"). When a probe answers, every run behind is caught up from its run
directory, the truth (`_catch_up`, one writer call per `Missed`): its child reopened from MLflow's own
history, the rows MLflow lacks replayed (exactly those steps), its tags and final state written; then
the outage ends. Writes the driver cannot go on without (the parent's end, the study's result) wait the
outage out (`_wait`), so a study ends with one FINISHED child per finished run and its parent closed.
Past the outage timeout (`--outage-timeout`) the driver stops with one line (`TrackingUnavailable`):
the run directories keep everything and the next `reslab run` mirrors them.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from reslab.experiments.expand import RunSpec
from reslab.orchestrator.durability.outage import DEFAULT_TIMEOUT_S, Outage
from reslab.orchestrator.durability.storage import redact
from reslab.orchestrator.durability.workspace import RunDir, Workspace
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.store import TrackingUnavailable, check_server, is_outage, outage_reason
from reslab.orchestrator.tracking.writer import MlflowWriter

if TYPE_CHECKING:
    from reslab.results.readout import Publication

T = TypeVar("T")


class Missed(enum.Enum):
    """The last end the driver reported for a run whose writes tracking missed."""

    IN_FLIGHT = "in flight"  # no end yet (or an attempt restarted): caught up as RUNNING
    FINISH = "finish"
    FAIL = "fail"
    KILL = "kill"
    SYNC = "sync"  # a finished run directory to mirror


@dataclass
class Behind:
    """What MLflow missed of one run while tracking was down; `GuardedTracker._catch_up` writes it."""

    run: RunSpec
    end: Missed = Missed.IN_FLIGHT
    tags: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)  # FINISH
    env: dict[str, Any] | None = None  # FINISH
    info: dict[str, Any] | None = None  # FINISH
    error: str = ""  # FAIL
    final: bool = True  # FAIL
    run_dir: RunDir | None = None  # SYNC
    # a finished run's rows, kept only by a tracker without a workspace (no run directory to read)
    rows: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)

    def failed(self, error: str, final: bool) -> None:
        self.end, self.error, self.final = Missed.FAIL, error, final

    def synced(self, rd: RunDir) -> None:
        self.end, self.run_dir = Missed.SYNC, rd


_MISSED = object()  # what `GuardedTracker._guarded` returns for a write tracking did not take


class GuardedTracker:
    """The driver's tracker for one submission of one study: an `MlflowWriter` that waits out outages."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None, *,
                 outage_timeout_s: float = DEFAULT_TIMEOUT_S, say: Callable[[str], Any] = print) -> None:
        self.writer = MlflowWriter(tracking_uri, workspace)
        self.uri = self.writer.uri
        self.publisher: Callable[[Any], None] | None = None  # `DriverTracker.publisher`
        self._behind: dict[str, Behind] = {}  # what MLflow missed while tracking was down, per run id
        self._gave_up = False
        self.say = say
        self.outage = Outage(f"tracking {redact(self.uri)}", outage_timeout_s, say, self._give_up,
                             doing="runs continue; metrics queued in the run directories")
        self._catch_up_end: dict[Missed, Callable[[Behind], None]] = {
            Missed.IN_FLIGHT: self._catch_up_running, Missed.FINISH: self._catch_up_finish,
            Missed.FAIL: self._catch_up_fail, Missed.KILL: self._catch_up_kill, Missed.SYNC: self._catch_up_sync,
        }

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: dict[str, Any],
              study_file: Path | None = None, settings: dict[str, Any] | None = None,
              analysis: dict[str, Any] | None = None) -> str:
        """Create the study's experiment (once) and this submission's parent run; tracking that stops
        answering now, before anything trains, is one line."""
        try:
            return self.writer.begin(study, submission=submission, code=code, plan=plan, study_file=study_file,
                                     settings=settings, analysis=analysis)
        except Exception as exc:
            if not is_outage(exc):
                raise
            raise TrackingUnavailable(f"tracking {redact(self.uri)} stopped answering as the submission began "
                                      f"({outage_reason(exc)}); nothing was trained: run the same command again "
                                      "once it answers") from None

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
        if self.writer.stale(run, event):
            return

        def missed(b: Behind) -> None:
            if event.get("type") == "start":  # an attempt (re)started: the run is in flight again
                b.end = Missed.IN_FLIGHT
                b.tags.update(attempt=event.get("attempt", 1), start_step=event.get("start_step", 0))

        self._guarded(lambda: self.writer.on_event(run, event), run, missed)

    def flush(self) -> None:
        """Write what `on_event` queued, for at most `children.FLUSH_BUDGET_S` (the loop calls this every poll tick;
        the runs left wait for the next); while tracking is down, try it again when that is due."""
        dirty = self.writer.queued()
        if self._guarded(self.writer.flush) is _MISSED:
            for run in dirty:  # their queued rows are dropped: caught up from the run directories
                self._behind_of(run)

    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """A run succeeded: late rows, artifacts, the summary as `summary/<name>` tags, then FINISHED
        (`MlflowWriter.finish`)."""
        rows, diags = list(metrics), list(diagnostics)

        def missed(b: Behind) -> None:
            b.end, b.summary, b.env, b.info = Missed.FINISH, summary, env, info
            if self.writer.workspace is None:  # no run directory to catch up from: keep the rows
                b.rows, b.diagnostics = rows, diags

        self._guarded(lambda: self.writer.finish(run, summary, metrics=rows, env=env, info=info, diagnostics=diags),
                      run, missed)

    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None:
        """A run's attempt failed; `final` when no retry follows."""
        self._guarded(lambda: self.writer.fail(run, error, final=final), run, lambda b: b.failed(error, final))

    def kill(self, run: RunSpec) -> None:
        """A run was interrupted (Ctrl-C); the next submission resumes the same child."""
        if self.writer.has_child(run.run_id) or run.run_id in self._behind:
            self._guarded(lambda: self.writer.kill(run), run, lambda b: setattr(b, "end", Missed.KILL))

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        """Mirror a finished run directory that MLflow does not show as FINISHED (a driver that
        died before logging it, a new tracking server); True when something was written (or will be,
        once tracking answers)."""
        done = self._guarded(lambda: self.writer.sync(run, rd), run, lambda b: b.synced(rd))
        return True if done is _MISSED else bool(done)

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        done = self._guarded(lambda: self.writer.sync_failed(run, error), run, lambda b: b.failed(error, True))
        return True if done is _MISSED else bool(done)

    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None:
        """Extra tags on a run's child (a tuning trial's number, state and parameters)."""
        self._guarded(lambda: self.writer.tag_child(run, tags), run, lambda b: b.tags.update(tags))

    def log_after(self, run: RunSpec, metrics: dict[str, float], tables: dict[str, list[dict[str, Any]]]) -> None:
        """While tracking is down the metrics and tables are skipped: the units' records in the run directory hold
        them (`reslab compare` and the readouts read those, not MLflow)."""
        self._guarded(lambda: self.writer.log_after(run, metrics, tables))

    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of `local_dir` as artifacts of this submission's parent run."""
        self._wait(lambda: self.writer.log_parent_files(local_dir, artifact_path))

    def discard_parent(self) -> None:
        """Delete this submission's parent run (`MlflowWriter.discard_parent`)."""
        if self.writer.parent_id is not None:
            self._wait(self.writer.discard_parent)

    def log_study_result(self, result: Publication, local_dir: Path) -> str:
        """The study's result on this submission's parent run (`MlflowWriter.log_study_result`)."""
        return self._wait(lambda: self.writer.log_study_result(result, local_dir))

    def mark_published(self, key: str) -> None:
        """The publication is whole (`MlflowWriter.mark_published`)."""
        self._wait(lambda: self.writer.mark_published(key))

    def published_key(self) -> str | None:
        """The key of the study's last whole publication (`MlflowWriter.published_key`)."""
        return self._wait(self.writer.published_key)

    def end(self, state: RunState, counts: dict[str, int]) -> None:
        """Close the parent run: SUCCESS, FAILED (a run failed) or INTERRUPTED, as MLflow statuses.
        Tracking that is down is waited out first (every run caught up, nothing left RUNNING), up to
        the outage timeout; an interrupted driver, or one that already gave up, tries once."""
        if self.writer.parent_id is None:
            return
        if state is RunState.INTERRUPTED or self._gave_up:
            if self.outage.down:
                self._probe()
            if self._guarded(lambda: self.writer.end(state, counts)) is _MISSED:
                self.say(f"{self.outage.what} unreachable: this submission's MLflow record stays open until the "
                         "next `reslab run`, which closes it and mirrors the run directories")
            return
        self._wait(lambda: self.writer.end(state, counts))

    def _guarded(self, write: Callable[[], T], run: RunSpec | None = None,
                 missed: Callable[[Behind], Any] | None = None) -> T | object:
        """`write()`, or `_MISSED` when tracking is down (a try is made when one is due) or goes down
        during it: then `run`, if given, is behind (`missed` notes what it lacks) and is caught up
        from its run directory once tracking answers. An error that is not an outage propagates."""
        if not self._down_now():
            try:
                return write()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                self._note(run, missed)
                self.outage.failed(outage_reason(exc))  # raises past the timeout
                return _MISSED
        self._note(run, missed)
        return _MISSED

    def _note(self, run: RunSpec | None, missed: Callable[[Behind], Any] | None) -> None:
        if run is not None:
            b = self._behind_of(run)
            if missed is not None:
                missed(b)

    def _wait(self, write: Callable[[], T]) -> T:
        """`write()` once tracking answers (and every run is caught up), waiting out an outage with
        backoff; the one-line error past the timeout."""
        while True:
            done = self._guarded(write)
            if done is not _MISSED:
                return done  # type: ignore[return-value]
            time.sleep(max(0.0, self.outage.next_try - time.time()))

    def _behind_of(self, run: RunSpec) -> Behind:
        return self._behind.setdefault(run.run_id, Behind(run))

    def _down_now(self) -> bool:
        """Whether tracking is down, after a try when one is due (which may end the outage)."""
        if self.outage.down and self.outage.due():
            self._probe()
        return self.outage.down

    def _probe(self) -> None:
        """Try tracking: when it answers, catch every run up, then end the outage; else note the failure."""
        try:
            if self.uri.startswith(("http://", "https://")):
                check_server(self.uri)
            else:
                self.writer.client.search_experiments(max_results=1)
            caught_up = self._catch_up()
        except Exception as exc:  # the probe's own errors all mean "not yet"; a catch-up's only outages do
            if isinstance(exc, TrackingUnavailable) or is_outage(exc):
                self.outage.failed(outage_reason(exc))
                return
            raise
        self.outage.ok()
        if caught_up:
            self.say(f"  {self.outage.what}: caught up {caught_up} run(s) from their run directories")

    def _give_up(self, line: str) -> TrackingUnavailable:
        self._gave_up = True
        return TrackingUnavailable(f"{line}; gave up: the run directories keep every result, and the next "
                                   "`reslab run` mirrors them into MLflow")

    def _catch_up(self) -> int:
        """Write what MLflow missed of each run behind, from its run directory (the truth): its
        rows (`MlflowWriter.replay` logs exactly the steps MLflow lacks), tags and state. A run is done
        with once all of it is written; an outage midway leaves it behind for the next try."""
        done = 0
        for run_id, b in list(self._behind.items()):
            self.writer.forget(run_id)  # MLflow's history, not this driver's queue, says what is there
            self._catch_up_end[b.end](b)
            del self._behind[run_id]
            done += 1
        return done

    def _history(self, b: Behind) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The run's rows and diagnostics: its run directory's, else those kept with the record."""
        if self.writer.workspace is None:
            return b.rows, b.diagnostics
        rd = self.writer.workspace.run_dir(b.run.study, b.run.run_id)
        return rd.metrics(), rd.diagnostics()

    def _catch_up_sync(self, b: Behind) -> None:
        assert b.run_dir is not None  # set with Missed.SYNC
        self.writer.sync(b.run, b.run_dir)
        if b.tags:
            self.writer.tag_child(b.run, b.tags)

    def _catch_up_finish(self, b: Behind) -> None:
        rows, diags = self._history(b)
        self.writer.finish(b.run, b.summary, metrics=rows, env=b.env, info=b.info, diagnostics=diags)
        if b.tags:
            self.writer.tag_child(b.run, b.tags)

    def _replay(self, b: Behind) -> str:
        """A run with no end written yet: its child, the rows MLflow lacks, then its tags; the child's id."""
        child = self.writer.child(b.run)
        self.writer.replay(b.run, *self._history(b))
        if b.tags:
            self.writer.store.set_tags(child.mlflow_id, b.tags)
        return child.mlflow_id

    def _catch_up_running(self, b: Behind) -> None:
        self.writer.store.set_state(self._replay(b), RunState.RUNNING)

    def _catch_up_fail(self, b: Behind) -> None:
        self._replay(b)
        self.writer.fail(b.run, b.error, final=b.final)

    def _catch_up_kill(self, b: Behind) -> None:
        self._replay(b)
        self.writer.kill(b.run)
