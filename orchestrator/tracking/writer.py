"""The plain MLflow writer, `MlflowWriter`: the MLflow writes of one submission of one study, with no
outage logic (a write that fails raises; `tracking.guarded` waits outages out around it).

Who writes: the driver, alone. Workers append to their run directory and report each train log,
eval (with its routing diagnostics) and checkpoint to the driver as an event
(`orchestrator.attempt.worker`); the driver's writer turns events into MLflow calls, batching metrics
with one `log_batch` per run per poll tick (~40 ms, against ~0.7 s for 100 `log_metric` calls).
Why not log from the workers: the embedded store is one SQLite file, and N workers writing it
contend for its single write lock ("database is locked"), which needs retries in every worker and
still stalls training; a cluster's workers would also all need the tracking URI and credentials.
One writer has no contention by construction, keeps MLflow out of the training processes, and
makes the run directory the source of truth with MLflow its mirror: `sync` rebuilds a run's
MLflow record from its directory, which also heals a driver killed between a run's `SUCCESS` and
its MLflow update. Writes still retry briefly on a locked database (`store.retry`).

What it writes is `tracking.layout`. A resumed or re-submitted run reuses its child (found by
`tags.run_id`); metric steps already logged are skipped (tags `reslab.logged_train_step` /
`reslab.logged_eval_step` for earlier drivers, the steps this one logged), so a resumed run adds
no duplicates, and a replay of a run's rows (a lost progress actor's events, a driver restart)
logs exactly the steps MLflow's history lacks, whatever order they came in. A re-submission that
runs and mirrors nothing deletes its parent (`discard_parent`).

Several drivers on one workspace: under the store's lock (`client.StoreClient`) a child is looked
up by `tags.run_id` right before it is created, so there is one child per run id whatever the
races; duplicates are reconciled when a submission begins. Events carry the attempt's fencing
token (`orchestrator.durability.workspace`): the caller drops an event from an attempt whose lease was taken
over (`stale`), so a stale worker cannot revive its child.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reslab.experiments.expand import RESULTS_VERSION, RunSpec
from reslab.orchestrator.attempt.envinfo import short_code_version, submitter_code_version
from reslab.orchestrator.durability.lease import proc_start
from reslab.orchestrator.durability.workspace import RunDir, Workspace
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.children import (
    FLUSH_BUDGET_S,
    SUMMARY_VAL_LOSS,
    Child,
    MetricWriter,
    config_params,
    mirrored,
    run_tags,
)
from reslab.orchestrator.tracking.client import BATCH_METRICS, StoreClient
from reslab.orchestrator.tracking.layout import (
    ANALYSIS_HASH_TAG,
    COST_MACHINE_TAG,
    FINISHED,
    KIND_SUBMISSION,
    MLFLOW_STATUS,
    NOTE_TAG,
    PUBLISHED_TAG,
    RESULT_BEGIN,
    RESULT_END,
    SIMULATED_TAG,
    SUMMARY_TAG,
    result_note,
)
from reslab.orchestrator.tracking.store import retry

if TYPE_CHECKING:
    from reslab.results.readout import Publication

def _log_heatmaps(store: StoreClient, child: Child) -> None:
    """The final eval's depth x depth routing heatmap (one PNG per route) and per-site
    entropy / max-weight bars, as `diagnostics/*.png`."""
    from reslab.models.diagnostics import plot_entropy, render_routing_heatmap

    diag = child.last_diag
    if diag is None:
        raise RuntimeError(f"no diagnostics to draw for run {child.run.run_id}")
    routing = diag.get("routing") or {}
    if not routing.get("sites"):
        return
    title = f"{child.run.label} step {diag['step']}"
    with tempfile.TemporaryDirectory() as tmp:
        render_routing_heatmap(diag, Path(tmp) / "routing_heatmap.png", title=title)
        plot_entropy(diag, Path(tmp) / "routing_entropy.png", title=title)
        retry(lambda: store.client.log_artifacts(child.mlflow_id, tmp, "diagnostics"), "log heatmaps")


def _describe_result(store: StoreClient, experiment_id: str, parent: str, result: Publication) -> None:
    """The experiment's description (the first thing its MLflow page shows) gets the latest paired table
    and links to this submission's run and report (`layout.result_note`)."""
    client = store.client
    previous = retry(lambda: client.get_experiment(experiment_id), "read experiment").tags.get(NOTE_TAG, "")
    submission = retry(lambda: client.get_run(parent), "read parent run").info.run_name
    note = result_note(previous, result.table_md, experiment_id, parent, submission, verdicts=result.answer)
    retry(partial(client.set_experiment_tag, experiment_id, NOTE_TAG, note), "describe experiment")
    retry(partial(client.set_tag, parent, NOTE_TAG, note.partition(RESULT_BEGIN)[2].partition(RESULT_END)[0]),
          "describe parent run")


class MlflowWriter(MetricWriter):
    """The MLflow writes of one submission of one study: a parent run, one child per run id (looked up and held
    by `children.ChildLedger`, their rows written by `children.MetricWriter`); this class holds each run's life
    cycle on its child (a start, its end: `finish`, `fail`, `kill`, `sync`) and the parent run's (`begin`, the
    study's result, `end`)."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None) -> None:
        super().__init__(tracking_uri, workspace)
        self.uri = self.store.uri
        self.publisher: Callable[[Any], None] | None = None  # `DriverTracker.publisher`

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: dict[str, Any],
              study_file: Path | None = None, settings: dict[str, Any] | None = None,
              analysis: dict[str, Any] | None = None) -> str:
        """The study's experiment (created once, its duplicate children reconciled, its abandoned
        submissions closed) and this submission's parent run; returns the parent's id."""
        self.code = code
        self.experiment_id = self.store.experiment(study)
        existing = self.store.existing_children(self.experiment_id, study, tags=(SUMMARY_VAL_LOSS,))
        self._existing = {rid: mirrored(c["status"], c["tags"]) for rid, c in existing.items()}
        self.store.close_abandoned_submissions(self.experiment_id)
        tags = {
            "reslab_kind": KIND_SUBMISSION, "study": study, "submission": submission,
            "code_version": short_code_version(code), "git_sha": code.get("git_sha") or "",
            "results_version": RESULTS_VERSION, "driver_host": socket.gethostname(),
            "driver_pid": str(os.getpid()), "driver_pid_start": proc_start(os.getpid()) or "",
        }
        if analysis is not None:
            tags[ANALYSIS_HASH_TAG] = analysis["hash"]
        run = retry(lambda: self.client.create_run(
            self.experiment_id, run_name=f"submission {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags),
            "create parent run")
        self.parent_id = run.info.run_id
        params = {f"settings.{k}": v for k, v in (settings or {}).items()}
        params.update({"runs_planned": plan.get("runs", 0)})
        self.store.log_params(self.parent_id, params)
        # the plan counted (runs per action, per arm and action: `plan.PlanCounts.to_dict`), never listed run by
        # run: its size is the arms', whatever the study's
        self.client.log_dict(self.parent_id, {"plan": plan}, "plan.json")
        if analysis is not None:  # the analysis plan frozen at the study's first submission, and its later versions
            self.client.log_dict(self.parent_id, analysis, "analysis_plan.json")
        if study_file is not None and study_file.is_file():
            self.client.log_artifact(self.parent_id, str(study_file))
        # a dirty tree's `git diff HEAD` (the submitter's, for a Ray job): what `git_diff_sha256` hashes
        diff = submitter_code_version().get("git_diff")
        if diff:
            self.client.log_text(self.parent_id, diff, "code.diff")
        return self.parent_id

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
        """A worker's event: a start is written now, train and eval rows are queued for `flush`, an eval's
        diagnostics logged. The caller drops stale events first (`stale`)."""
        kind = event.get("type")
        child = self.child(run)
        if kind == "start":
            if not child.new or child.started:  # a child this driver created is RUNNING already: one write less
                self.store.set_state(child.mlflow_id, RunState.RUNNING)
            child.started = True
            tags = {"attempt": event.get("attempt", 1), "start_step": event.get("start_step", 0)}
            simulated = (event.get("info") or {}).get("simulated")
            if simulated:  # a bench's simulated run (`orchestrator.attempt.simulate`): never a result
                tags[SIMULATED_TAG] = simulated
            self.store.set_tags(child.mlflow_id, tags)
            if event.get("history") or event.get("diagnostics"):
                self.replay(run, event.get("history", ()), event.get("diagnostics", ()))
        elif kind in ("train", "eval"):
            self._queue(child, kind, event["step"], event.get("metrics", {}), event.get("time", time.time()))
            if kind == "eval" and event.get("diagnostics"):
                self._log_diagnostics(child, {"step": event["step"], **event["diagnostics"]})
        elif kind == "checkpoint":
            child.pending_tags["checkpoint_step"] = event["step"]

    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """A run succeeded: late rows, artifacts, the summary as `summary/<name>` tags, then FINISHED.

        The summary is tags, not metrics: MLflow's run page draws every metric as a chart and puts
        prefixed sections (`summary/`) before the unprefixed curves, so ten single-point summary
        charts opened the Metrics tab. A tag holds `repr(float)`, which reads back exactly; the
        curves' last points already give the headline values as metric columns."""
        child = self.child(run)
        summary_tags = {f"{SUMMARY_TAG}{k}": repr(float(v)) for k, v in summary.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}
        machine = ((info or {}).get("cost") or {}).get("machine") or {}
        if isinstance(machine, dict) and isinstance(machine.get("name"), str):
            summary_tags[COST_MACHINE_TAG] = machine["name"]
        if (info or {}).get("simulated"):
            summary_tags[SIMULATED_TAG] = str((info or {})["simulated"])
        # one write for the late rows and the summary: FINISHED, written last, says the record is whole
        self._queue_rows(child, metrics, diagnostics)
        child.pending_tags.update({**summary_tags, "state": RunState.SUCCESS, "error": ""})
        self._write(child)
        self.client.log_dict(child.mlflow_id, run.to_dict(), "config.json")
        if env:
            self.client.log_dict(child.mlflow_id, env, "env.json")
        if info:
            self.client.log_dict(child.mlflow_id, info, "info.json")
        if child.last_diag is not None:
            _log_heatmaps(self.store, child)
        self.store.set_state(child.mlflow_id, RunState.SUCCESS)
        self.forget(run.run_id)

    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None:
        """A run's attempt failed; `final` when no retry follows."""
        child = self.child(run)
        self._write(child)
        self.store.set_tags(child.mlflow_id, {"state": RunState.FAILED if final else "RETRYING", "error": error})
        if final:
            self.store.set_state(child.mlflow_id, RunState.FAILED)
            self.forget(run.run_id)

    def kill(self, run: RunSpec) -> None:
        """A run was interrupted (Ctrl-C); the next submission resumes the same child."""
        child = self.child(run)
        self._write(child)
        self.store.set_tags(child.mlflow_id, {"state": RunState.INTERRUPTED})
        self.store.set_state(child.mlflow_id, RunState.INTERRUPTED)
        self.forget(run.run_id)

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        """Mirror a finished run directory that MLflow does not show as FINISHED (a driver that died
        before logging it, a new tracking server); True when something was written."""
        if self._existing.get(run.run_id) == (FINISHED, True):
            return False
        record = rd.summary() or {}
        self.finish(run, record.get("summary", {}), metrics=rd.metrics(), env=rd.env(), info=record.get("info"),
                    diagnostics=rd.diagnostics())
        return True

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        """Mirror a failed run that MLflow does not show as failed; True when something was written."""
        existing = self._existing.get(run.run_id)
        if existing is not None and existing[0] == MLFLOW_STATUS[RunState.FAILED]:
            return False
        self.fail(run, error)
        return True

    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None:
        """Extra tags on a run's child (a tuning trial's number, state and parameters)."""
        self.store.set_tags(self.child(run).mlflow_id, tags)

    def log_after(self, run: RunSpec, metrics: dict[str, float], tables: dict[str, list[dict[str, Any]]]) -> None:
        """A finished run's work after training on its child: metrics by their whole key (`eval/<task>/<metric>`,
        `knockout/<mode>/<site>/<source>`; step 0, one point per unit: a unit runs once per content id) and
        tables (artifact file -> rows) as CSV files, written whole (a retry replaces, never appends)."""
        child = self.child(run)
        now = int(time.time() * 1000)
        points = [self.store.Metric(key, float(value), now, 0) for key, value in metrics.items()
                  if isinstance(value, (int, float)) and not isinstance(value, bool)]
        for start in range(0, len(points), BATCH_METRICS):
            batch = points[start:start + BATCH_METRICS]
            retry(partial(self.client.log_batch, child.mlflow_id, metrics=batch), "log metrics after training")
        for name, rows in tables.items():
            retry(partial(self.client.log_text, child.mlflow_id, _csv(rows), name), f"log {name}")

    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of `local_dir` as artifacts of this submission's parent run."""
        retry(lambda: self.client.log_artifacts(self._parent_id(), str(local_dir), artifact_path),
              "log parent artifacts")

    def discard_parent(self) -> None:
        """Delete this submission's parent run: a re-submission that ran and mirrored nothing
        would otherwise leave one empty parent per no-op `reslab run` in the dashboard."""
        if self.parent_id is not None:  # ended first: a deleted run still shows its status (MLflow's trash)
            retry(partial(self.client.set_terminated, self._parent_id(), "FINISHED"), "end empty parent run")
            retry(partial(self.client.delete_run, self._parent_id()), "delete empty parent run")
            self.parent_id = None

    def log_study_result(self, result: Publication, local_dir: Path) -> str:
        """The study's result on this submission's parent run: the paired table as an MLflow table
        (`paired_table.json`, shown in the artifact view), the result's further tables (artifact file ->
        DataFrame, e.g. a ladder's), every file of `local_dir` (CSV, plots, report), and its metric series
        (key -> (step, value) points: MLflow's own charts plot them against the step); the experiment's
        description gets the table. Returns the parent's id.

        Idempotent, so a publication cut short (an outage, `GuardedTracker` trying it again) is completed by
        the next try: a table already there is kept (MLflow's `log_table` would append its rows again), files
        are overwritten, and only the series points the parent lacks are logged."""
        parent = self._parent_id()
        tables = {"paired_table.json": result.table, **result.tables}
        there = {a.path for folder in {str(Path(name).parent).strip(".") or None for name in tables}
                 for a in retry(partial(self.client.list_artifacts, parent, folder), "list parent artifacts")}
        for name, data in tables.items():
            if name not in there:
                retry(partial(self.client.log_table, parent, data=data, artifact_file=name), f"log {name}")
        retry(partial(self.client.log_artifacts, parent, str(local_dir)), "log study result")
        now = int(time.time() * 1000)
        points = []
        for key, pts in result.series.items():
            logged = {m.step for m in retry(partial(self.client.get_metric_history, parent, key), "read series")}
            points += [self.store.Metric(key, float(v), now, step) for step, v in pts if step not in logged]
        for chunk in ([points[i:i + BATCH_METRICS] for i in range(0, len(points), BATCH_METRICS)]):
            retry(partial(self.client.log_batch, parent, metrics=chunk), "log series")
        _describe_result(self.store, self._experiment_id(), parent, result)
        return parent

    def mark_published(self, key: str) -> None:
        """A publication's last step: the parent run and the study's experiment get `PUBLISHED_TAG` = `key`
        (the finished runs the result came from), which says the publication is whole (`layout`)."""
        self.store.set_tags(self._parent_id(), {PUBLISHED_TAG: key})
        retry(partial(self.client.set_experiment_tag, self._experiment_id(), PUBLISHED_TAG, key), "mark published")

    def published_key(self) -> str | None:
        """The key of the study's last whole publication (`mark_published`); None when it has none."""
        experiment = retry(lambda: self.client.get_experiment(self._experiment_id()), "read experiment")
        key = experiment.tags.get(PUBLISHED_TAG)
        return str(key) if key else None

    def end(self, state: RunState, counts: dict[str, int]) -> None:
        """Close the parent run in `state` (as MLflow's status), with the run counts as `runs_<count>`; earlier
        failed or killed parents this submission emptied are deleted (`StoreClient.drop_emptied_submissions`)."""
        self._flush(None)
        now = int(time.time() * 1000)
        items = [self.store.Metric(f"runs_{k}", float(v), now, 0) for k, v in counts.items()]
        retry(lambda: self.client.log_batch(self._parent_id(), metrics=items), "log counts")
        retry(lambda: self.client.set_terminated(self._parent_id(), status=MLFLOW_STATUS[state]), "end parent run")
        self.store.drop_emptied_submissions(self._experiment_id(), self._parent_id())


def _csv(rows: list[dict[str, Any]]) -> str:
    """Rows as CSV text, the columns in the first row's order (a float as its repr: it reads back exactly)."""
    import csv
    import io

    out = io.StringIO()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    writer = csv.DictWriter(out, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


__all__ = ["FLUSH_BUDGET_S", "MlflowWriter", "config_params", "run_tags"]
