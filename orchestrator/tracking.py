"""MLflow tracking; the only module that imports mlflow (lazily, it costs ~3 s).

Who writes: the driver, alone. Workers append to their run directory and report each train log,
eval (with its routing diagnostics) and checkpoint to the driver as an event
(`orchestrator.worker`); the driver's `Tracker` turns events into MLflow calls, batching metrics
with one `log_batch` per run per poll tick (~40 ms, against ~0.7 s for 100 `log_metric` calls).
Why not log from the workers: the embedded store is one SQLite file, and N workers writing it
contend for its single write lock ("database is locked"), which needs retries in every worker and
still stalls training; a cluster's workers would also all need the tracking URI and credentials.
One writer has no contention by construction, keeps MLflow out of the training processes, and
makes the run directory the source of truth with MLflow its mirror: `sync` rebuilds a run's
MLflow record from its directory, which also heals a driver killed between a run's `SUCCESS` and
its MLflow update. Writes still retry briefly on a locked database, for a second `reslab`
process (or the dashboard) touching the same file.

Layout: one experiment per study (named after it), one parent run per submission, one child run
per run id, named `arm/grid point/s<seed>`. A child is found again by `tags.run_id` (never by
params, which compare as strings), so a resumed or re-submitted run reuses its child and is moved
under the submission that completes it; metric steps already logged are skipped (tags
`reslab.logged_train_step` / `reslab.logged_eval_step` for earlier drivers, the steps this one
logged), so a resumed run adds no duplicates, and a replay of a run's rows (a lost progress actor's
events, a driver restart) logs exactly the steps MLflow's history lacks, whatever order they came in.

Child runs carry params = the flattened resolved config, model sizes resolved from the preset
(values over MLflow's 6000-character limit are truncated with a marker; `config.json` holds them
whole); tags `run_id, study, arm, seed, pair_key, grid_key, residual, code_version, git_sha,
results_version, reslab_kind=run` and, once it succeeds, `summary/<name>` (its final summary; tags,
not metrics, see `finish`); metrics = every train log and eval at its step; artifacts =
`config.json` (the RunSpec), `env.json`, `info.json` and `diagnostics/step_NNNNNN.json`. The
study's experiment carries `study_tags()`: the "Model training" kind and a saved runs view
grouped by arm, which `study_view_url` opens. The
parent run carries the study's result after `reslab run` (`log_study_result`): the paired table
(MLflow table and CSV), the forest plot, the sweep curves and the HTML report. A re-submission
that runs and mirrors nothing deletes its parent (`discard_parent`).

Several drivers on one workspace. The store is created (or migrated) once, under an `flock` on
`<workspace>/.tracking.lock`; under the same lock a child is looked up by `tags.run_id` right
before it is created, so there is one child per run id whatever the races; duplicates left by
older versions or by drivers on different machines sharing a tracking server are reconciled
when a submission begins (the best one is kept: FINISHED first, then the oldest; the others are
deleted). Events carry the attempt's fencing token (`orchestrator.workspace`): an event from an
attempt whose lease was taken over is dropped, so a stale worker cannot revive its child.

A moved or copied workspace: the embedded store records absolute artifact locations; when the
writer opens a store whose study experiments point into another workspace's `mlartifacts/`, it
rewrites them (experiments and runs) to this workspace, so a copy never writes into the original.

Readers (`fetch_study_runs`) never create a store: a missing SQLite file reads as no runs, a
damaged one is an error naming the file.

Other stores. A database URI goes through `store_uri` (a bare `postgresql://` is pinned to psycopg
3, the `reslab[postgres]` extra); a tracking server (`http(s)://`, e.g. `mlflow server
--backend-store-uri postgresql+psycopg://... --allowed-hosts mlflow:5000`) is probed by
`check_server` before a writer or reader uses it, so a server that is down, or whose
`--allowed-hosts` refuses the Host header this client sends, is a one-line error, not a traceback.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import importlib.util
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from reslab.experiments.expand import RESULTS_VERSION, RunSpec
from reslab.models.config import flatten
from reslab.common.errors import ReslabError
from reslab.common.io import file_lock
from reslab.models.presets import resolve_model
from reslab.orchestrator import reaper
from reslab.orchestrator.envinfo import short_code_version, submitter_code_version
from reslab.orchestrator.storage import redact
from reslab.orchestrator.workspace import (
    RunDir,
    RunState,
    Workspace,
    proc_start,
    process_alive,
    read_json,
)

T = TypeVar("T")
KIND_RUN, KIND_SUBMISSION = "run", "submission"
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores, by URI scheme (less +driver)
_MAX_PARAM = 6000
_MAX_TAG = 5000
_BATCH_METRICS = 1000
_BATCH_PARAMS = 100
# The one mapping of a run's state (its run directory) to the status of its MLflow child run.
MLFLOW_STATUS: dict[RunState, str] = {
    RunState.RUNNING: "RUNNING", RunState.SUCCESS: "FINISHED", RunState.FAILED: "FAILED",
    RunState.INTERRUPTED: "KILLED",
}
FINISHED, KILLED = MLFLOW_STATUS[RunState.SUCCESS], MLFLOW_STATUS[RunState.INTERRUPTED]
SUMMARY_TAG = "summary/"  # + a summary metric's name: the tag holding its final value (repr of the float)
# MLflow 3's experiment kind; UIs without 3.17's GenAI / Model training switch open the experiment
# in its model-training view when it is set (3.17 ignores it: see `study_view_url`).
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
# A saved view of the experiment's runs page (MLflow 3.17 keeps saved views as experiment tags
# `mlflow.sharedViewState.<id>` holding a JSON envelope with the deflated page state): runs grouped by
# their arm tag, every run shown in the charts, the headline metrics and the seed as columns.
BY_ARM_VIEW_ID = "reslab-by-arm"
BY_ARM_VIEW_TAG = f"mlflow.sharedViewState.{BY_ARM_VIEW_ID}"
BY_ARM_VIEW_NAME = "runs by arm (reslab)"
BY_ARM_VIEW_STATE: dict[str, Any] = {
    "searchFilter": "", "orderByKey": "attributes.start_time", "orderByAsc": False, "startTime": "ALL",
    "lifecycleFilter": "Active", "datasetsFilter": [], "modelVersionFilter": "All Runs",
    "selectedColumns": ["metrics.`val_loss_tail`", "metrics.`val_loss`", "tags.`seed`", "tags.`grid_key`"],
    "columnOrder": [], "columnWidths": {}, "runsHiddenMode": "SHOWALL", "viewMaximized": False,
    "runListHidden": False, "isAccordionReordered": False, "useGroupedValuesInCharts": True, "hideEmptyCharts": True,
    "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "tag", "groupByData": "arm"}]},
    "groupsExpanded": {},
    "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
}


def _import_mlflow():
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from mlflow import MlflowClient

    for name in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient


def _retry(fn: Callable[[], T], what: str, attempts: int = 6) -> T:
    """Retry a write that hit a locked SQLite database (another process holds the write lock)."""
    delay = 0.2
    for i in range(attempts):
        try:
            return fn()
        except Exception as exc:  # mlflow wraps sqlalchemy errors variously
            if "locked" not in str(exc).lower() or i == attempts - 1:
                raise
            logging.getLogger(__name__).warning("%s: database locked, retrying in %.1fs", what, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 20] + "...[truncated]"


def study_tags() -> dict[str, str]:
    """The tags of a study's experiment: its kind and the saved view `BY_ARM_VIEW_NAME`."""
    state = "deflate;" + base64.b64encode(zlib.compress(json.dumps(BY_ARM_VIEW_STATE).encode())).decode()
    view = {"name": BY_ARM_VIEW_NAME, "createdAt": int(time.time() * 1000), "state": state}
    return {"reslab_kind": "study", EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, BY_ARM_VIEW_TAG: json.dumps(view)}


def study_view_url(base_url: str, experiment_id: str, by_arm: bool = True) -> str:
    """The dashboard page of a study's runs, grouped by arm (the saved view) when `by_arm`, in the
    "Model training" view. MLflow 3.17 picks GenAI or Model training from the `workflowType` query
    parameter, else from the browser's last choice, else GenAI; the experiment kind tag does not
    decide it, so the link names it."""
    view = f"viewStateShareKey={BY_ARM_VIEW_ID}&" if by_arm else ""
    return f"{base_url.rstrip('/')}/#/experiments/{experiment_id}/runs?{view}workflowType=machine_learning"


def study_links(tracking_uri: str, base_url: str) -> list[tuple[str, str]]:
    """(study, its `study_view_url`) for every study experiment of the store, by name; grouped by
    arm where the experiment has the saved view (an experiment made before it gets it from its next
    `reslab run`)."""
    client = _import_mlflow()(tracking_uri=store_uri(tracking_uri))
    found = client.search_experiments(filter_string="tags.reslab_kind = 'study'", max_results=1000)
    return sorted((e.name, study_view_url(base_url, e.experiment_id, BY_ARM_VIEW_TAG in e.tags)) for e in found)


def run_tags(run: RunSpec, code: dict[str, Any]) -> dict[str, str]:
    return {
        "reslab_kind": KIND_RUN, "run_id": run.run_id, "study": run.study, "arm": run.arm,
        "seed": str(run.seed), "pair_key": run.pair_key, "grid_key": run.grid_key,
        "residual": run.config.residual.name, "code_version": short_code_version(code),
        "git_sha": code.get("git_sha") or "", "results_version": RESULTS_VERSION,
    }


def config_params(run: RunSpec) -> dict[str, Any]:
    """The flattened config with the model sizes the preset leaves unset resolved (`model.d_model: 64`,
    not null); the vocabulary size, which the tokenizer fixes at training time, stays as configured."""
    params = flatten(run.config)
    shape = resolve_model(run.config.model, vocab_size=1)
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len"):
        params[f"model.{name}"] = getattr(shape, name)
    return params


@dataclass
class _Child:
    mlflow_id: str
    # Steps up to `floor` were logged before this driver opened the child (its `reslab.logged_*_step`
    # tags): a resumed attempt's live events up to there repeat an earlier attempt's and are skipped.
    # Within this driver, `seen` holds every step logged, so an event that arrives late (after a
    # restarted progress actor) is still logged; a replay checks MLflow's own history (`_replay`).
    floor: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    seen: dict[str, set[int]] = field(default_factory=lambda: {"train": set(), "eval": set()})
    pending: list[Any] = field(default_factory=list)
    pending_tags: dict[str, Any] = field(default_factory=dict)
    new: bool = True
    diag_steps: set[int] | None = None  # None: not yet read from the artifact store
    last_diag: dict[str, Any] | None = None  # the latest eval's diagnostics, drawn at the end


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for any other store."""
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0]) if uri.startswith("sqlite:///") else None


def store_uri(uri: str) -> str:
    """The tracking URI as MLflow is given it. A PostgreSQL store named without a driver
    (`postgresql://`, or `postgres://`, which SQLAlchemy rejects) gets psycopg 3,
    `postgresql+psycopg://` (the `reslab[postgres]` extra): SQLAlchemy 2.0 picks psycopg2 for a bare
    `postgresql://` and 2.1 psycopg, so naming the driver makes every driver process and server use
    the one the extra installs. A URI that names its driver (`postgresql+psycopg2://`) is kept as
    given. A PostgreSQL driver that is not installed is a one-line error, not a traceback from
    SQLAlchemy's import."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        return uri
    driver = scheme.partition("+")[2] or "psycopg"
    if importlib.util.find_spec(driver) is None:
        raise TrackingUnavailable(
            f"tracking URI {redact(uri)} (--tracking-uri / $MLFLOW_TRACKING_URI): the PostgreSQL driver {driver!r} "
            "is not installed; pip install 'reslab[postgres]' (psycopg 3), or name an installed driver "
            "(postgresql+<driver>://)")
    return f"postgresql+{driver}://{rest}"


def _unusable(db: Path, exc: Exception) -> TrackingUnavailable:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return TrackingUnavailable(f"{db}: not a usable MLflow database ({first}); move it away and run `reslab run` "
                               "again: it rebuilds the store from the run directories")


def _best_first(runs: list[Any]) -> list[Any]:
    """FINISHED before RUNNING, KILLED, FAILED; then the oldest."""
    order = [MLFLOW_STATUS[s] for s in (RunState.SUCCESS, RunState.RUNNING, RunState.INTERRUPTED, RunState.FAILED)]
    rank = {status: i for i, status in enumerate(order)}
    return sorted(runs, key=lambda r: (rank.get(r.info.status, len(rank)), r.info.start_time or 0, r.info.run_id))


class Tracker:
    """The driver's MLflow writer for one submission of one study."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None) -> None:
        client_cls = _import_mlflow()
        from mlflow.entities import Metric, Param, RunTag

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        tracking_uri = store_uri(tracking_uri)
        self.uri = tracking_uri
        self.workspace = workspace
        if tracking_uri.startswith(("http://", "https://")):
            check_server(tracking_uri)
        db = sqlite_file(tracking_uri)
        if workspace is not None:
            self._lock_path: Path | None = workspace.tracking_lock
        else:
            self._lock_path = db.with_name(db.name + ".lock") if db is not None else None
        with self._locked():
            self.client = client_cls(tracking_uri=tracking_uri)
            try:
                self.client.search_experiments(max_results=1)  # creates or migrates the schema, once
            except Exception as exc:  # sqlalchemy/sqlite errors arrive wrapped variously
                if db is None:
                    raise
                raise _unusable(db, exc) from None
            if db is not None and workspace is not None:
                relocate_artifacts(db, workspace.artifacts.as_uri())
        self.experiment_id: str | None = None
        self.parent_id: str | None = None
        self.code: dict[str, Any] = {}
        self._children: dict[str, _Child] = {}
        self._existing: dict[str, Any] = {}

    def _experiment_id(self) -> str:
        if self.experiment_id is None:
            raise RuntimeError("the MLflow tracker has no experiment yet: begin() comes first")
        return self.experiment_id

    def _parent_id(self) -> str:
        if self.parent_id is None:
            raise RuntimeError("the MLflow tracker has no submission run yet: begin() comes first")
        return self.parent_id

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self._lock_path) if self._lock_path is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ setup

    def _artifact_location(self, study: str) -> str | None:
        """A database store, the embedded SQLite file or one named by `--tracking-uri
        postgresql://...`, keeps artifacts in `<workspace>/mlartifacts/<study>` (MLflow's own default
        would be `./mlruns` of whatever directory the driver runs in); a server decides for itself
        (its `--default-artifact-root` / artifact proxy)."""
        if self.workspace is None or self.uri.partition("://")[0].split("+")[0] not in _DATABASES:
            return None
        return (self.workspace.artifacts / study).as_uri()

    def experiment(self, study: str) -> str:
        """The study's experiment, created with `study_tags()`; one made by an older reslab gets the
        tags it lacks (a saved view the user has since overridden is kept)."""
        exp = self.client.get_experiment_by_name(study)
        if exp is None:
            try:
                return _retry(lambda: self.client.create_experiment(
                    study, artifact_location=self._artifact_location(study), tags=study_tags()), "create experiment")
            except Exception:  # created concurrently by another process
                exp = self.client.get_experiment_by_name(study)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            _retry(lambda: self.client.restore_experiment(exp.experiment_id), "restore experiment")
        for key, value in study_tags().items():
            if key not in exp.tags:
                _retry(partial(self.client.set_experiment_tag, exp.experiment_id, key, value), "tag experiment")
        return exp.experiment_id

    def existing_children(self) -> dict[str, Any]:
        """run_id -> its one MLflow child; duplicates are reconciled (see the module doc)."""
        by_id: dict[str, list[Any]] = {}
        with self._locked():
            for run in search_all(self.client, [self._experiment_id()], f"tags.reslab_kind = '{KIND_RUN}'"):
                rid = run.data.tags.get("run_id")
                if rid:
                    by_id.setdefault(rid, []).append(run)
            return {rid: self._reconcile(runs) for rid, runs in by_id.items()}

    def _reconcile(self, runs: list[Any]) -> Any:
        keep, *extra = _best_first(runs)
        for dup in extra:
            logging.getLogger(__name__).warning("run %s had %d MLflow children; deleting duplicate %s (kept %s)",
                                                keep.data.tags.get("run_id"), len(runs), dup.info.run_id,
                                                keep.info.run_id)
            _retry(functools.partial(self.client.delete_run, dup.info.run_id), "delete duplicate child")
        return keep

    def _find_child(self, run_id: str) -> Any | None:
        """The child of `run_id` as MLflow has it now (call under the lock)."""
        query = f"tags.reslab_kind = '{KIND_RUN}' and tags.run_id = '{run_id}'"
        runs = search_all(self.client, [self._experiment_id()], query)
        return self._reconcile(runs) if runs else None

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: list[dict[str, Any]],
              study_file: Path | None = None, settings: dict[str, Any] | None = None) -> str:
        """Create the study's experiment (once) and this submission's parent run."""
        self.code = code
        self.experiment_id = self.experiment(study)
        self._existing = self.existing_children()
        self._close_abandoned_submissions()
        tags = {
            "reslab_kind": KIND_SUBMISSION, "study": study, "submission": submission,
            "code_version": short_code_version(code), "git_sha": code.get("git_sha") or "",
            "results_version": RESULTS_VERSION, "driver_host": socket.gethostname(),
            "driver_pid": str(os.getpid()), "driver_pid_start": proc_start(os.getpid()) or "",
        }
        run = _retry(lambda: self.client.create_run(
            self.experiment_id, run_name=f"submission {time.strftime('%Y-%m-%d %H:%M:%S')}", tags=tags),
            "create parent run")
        self.parent_id = run.info.run_id
        params = {f"settings.{k}": v for k, v in (settings or {}).items()}
        params.update({"runs_planned": len(plan)})
        self._log_params(self.parent_id, params)
        self.client.log_dict(self.parent_id, {"plan": plan}, "plan.json")
        if study_file is not None and study_file.is_file():
            self.client.log_artifact(self.parent_id, str(study_file))
        # a dirty tree's `git diff HEAD` (the submitter's, for a Ray job): what `git_diff_sha256` hashes
        diff = submitter_code_version().get("git_diff")
        if diff:
            self.client.log_text(self.parent_id, diff, "code.diff")
        return self.parent_id

    def _close_abandoned_submissions(self) -> None:
        """A driver killed outright (SIGKILL, a lost login node) leaves its parent run RUNNING;
        one that ran on this host and whose process is gone is marked KILLED."""
        query = f"tags.reslab_kind = '{KIND_SUBMISSION}' and attributes.status = 'RUNNING'"
        for run in search_all(self.client, [self._experiment_id()], query):
            t = run.data.tags
            pid = int(t["driver_pid"]) if t.get("driver_pid", "").isdigit() else None
            if process_alive(t.get("driver_host"), pid, t.get("driver_pid_start") or None) is False:
                self._set_tags(run.info.run_id, {"state": "ABANDONED (driver process gone)"})
                _retry(partial(self.client.set_terminated, run.info.run_id, status=KILLED), "close parent")

    def _log_params(self, mlflow_id: str, params: dict[str, Any]) -> None:
        items = [self._Param(k, _param_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _BATCH_PARAMS):
            _retry(partial(self.client.log_batch, mlflow_id, params=items[i:i + _BATCH_PARAMS]), "log params")

    # ------------------------------------------------------------------ children

    def child(self, run: RunSpec) -> _Child:
        """This run's MLflow child: reused when one exists (found by `tags.run_id`), else created."""
        if run.run_id in self._children:
            return self._children[run.run_id]
        tags = run_tags(run, self.code)
        tags["mlflow.parentRunId"] = self._parent_id()
        with self._locked():
            # another driver may have created it since this one began: look again before creating
            existing = self._find_child(run.run_id)
            if existing is None:
                created = _retry(lambda: self.client.create_run(self.experiment_id, run_name=run.label, tags=tags),
                                 "create child run")
        if existing is not None:
            logged = {k: int(existing.data.tags.get(f"reslab.logged_{k}_step", 0)) for k in ("train", "eval")}
            child = _Child(existing.info.run_id, floor=logged, new=False)
            # Re-parent under the submission that is now producing it, refresh code tags.
            self._set_tags(child.mlflow_id, tags)
        else:
            child = _Child(created.info.run_id)
            self._log_params(child.mlflow_id, config_params(run))
        self._existing[run.run_id] = self.client.get_run(child.mlflow_id)
        self._children[run.run_id] = child
        return child

    def _set_tags(self, mlflow_id: str, tags: dict[str, Any]) -> None:
        items = [self._RunTag(k, str(v)[:_MAX_TAG]) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH_PARAMS):
            _retry(partial(self.client.log_batch, mlflow_id, tags=items[i:i + _BATCH_PARAMS]), "set tags")

    def _queue(self, child: _Child, kind: str, step: int, metrics: dict[str, Any], when: float, *,
               floor: bool = True) -> None:
        if step in child.seen[kind] or (floor and step <= child.floor[kind]):
            return
        ts = int(when * 1000)
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                child.pending.append(self._Metric(key, float(value), ts, step))
        child.seen[kind].add(step)

    def _set_state(self, child: _Child, state: RunState) -> None:
        status = MLFLOW_STATUS[state]
        if state is RunState.RUNNING:
            _retry(lambda: self.client.update_run(child.mlflow_id, status=status), "update run")
        else:
            _retry(lambda: self.client.set_terminated(child.mlflow_id, status=status), "terminate run")

    def _stale(self, run: RunSpec, event: dict[str, Any]) -> bool:
        """The event comes from an attempt whose lease was since handed to another (a higher token)."""
        token = event.get("token")
        if self.workspace is None or not isinstance(token, int):
            return False
        fence = read_json(self.workspace.run_dir(run.study, run.run_id).fence_file)
        return isinstance(fence, int) and token < fence

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
        if self._stale(run, event):
            return
        kind = event.get("type")
        child = self.child(run)
        if kind == "start":
            self._set_state(child, RunState.RUNNING)
            self._set_tags(child.mlflow_id, {"attempt": event.get("attempt", 1),
                                             "start_step": event.get("start_step", 0)})
            if event.get("history") or event.get("diagnostics"):
                self._replay(run, event.get("history", ()), event.get("diagnostics", ()))
        elif kind in ("train", "eval"):
            self._queue(child, kind, event["step"], event.get("metrics", {}), event.get("time", time.time()))
            if kind == "eval" and event.get("diagnostics"):
                self._log_diagnostics(child, {"step": event["step"], **event["diagnostics"]})
        elif kind == "checkpoint":
            child.pending_tags["checkpoint_step"] = event["step"]

    def flush(self) -> None:
        """One `log_batch` per child with pending metrics (chunks of 1000)."""
        for child in self._children.values():
            tags = dict(child.pending_tags)
            if not child.pending and not tags:
                continue
            tags.update({f"reslab.logged_{k}_step": max([child.floor[k], *child.seen[k]]) for k in child.floor})
            tag_items = [self._RunTag(k, str(v)) for k, v in tags.items()]
            metrics, child.pending, child.pending_tags = child.pending, [], {}
            chunks = [metrics[i:i + _BATCH_METRICS] for i in range(0, len(metrics), _BATCH_METRICS)] or [[]]
            for j, chunk in enumerate(chunks):
                last = j == len(chunks) - 1
                _retry(partial(self.client.log_batch, child.mlflow_id, metrics=chunk, tags=tag_items if last else []),
                       "log metrics")

    def _replay(self, run: RunSpec, rows: Iterable[dict[str, Any]], diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """Log rows (metrics.jsonl form) not yet in MLflow: events a driver restart or a lost progress
        actor never delivered. Exact, whatever order the live events came in: the steps a child opened
        from an earlier driver already has are read from MLflow's history (one key per kind)."""
        child = self.child(run)
        self.flush()
        present: dict[str, set[int]] = {"train": set(), "eval": set()}
        if not child.new:
            for name, key in (("train", "train_loss"), ("eval", "val_loss")):
                history = _retry(partial(self.client.get_metric_history, child.mlflow_id, key), "read metric history")
                present[name] = {m.step for m in history}
        for row in rows:
            kind = row.get("kind")
            if kind in present and row["step"] not in present[kind]:
                metrics = {k: v for k, v in row.items() if k not in ("kind", "step", "time")}
                self._queue(child, kind, row["step"], metrics, row.get("time", time.time()), floor=False)
        for diag in diagnostics:
            self._log_diagnostics(child, diag)
        self.flush()

    def _log_diagnostics(self, child: _Child, diag: dict[str, Any]) -> None:
        """One artifact per eval step, `diagnostics/step_NNNNNN.json`, each logged once."""
        if child.diag_steps is None:
            child.diag_steps = set()
            if not child.new:
                for a in self.client.list_artifacts(child.mlflow_id, "diagnostics"):
                    name = Path(a.path).stem
                    if name.startswith("step_") and name[5:].isdigit():
                        child.diag_steps.add(int(name[5:]))
        step = int(diag["step"])
        if child.last_diag is None or step >= int(child.last_diag["step"]):
            child.last_diag = diag
        if step in child.diag_steps:
            return
        _retry(lambda: self.client.log_dict(child.mlflow_id, diag, f"diagnostics/step_{step:06d}.json"),
               "log diagnostics")
        child.diag_steps.add(step)

    def _log_heatmaps(self, child: _Child, run: RunSpec) -> None:
        """The final eval's depth x depth routing heatmap (one PNG per route) and per-site
        entropy / max-weight bars, as `diagnostics/*.png`."""
        import tempfile

        from reslab.models.diagnostics import plot_entropy, render_routing_heatmap

        diag = child.last_diag
        if diag is None:
            raise RuntimeError(f"no diagnostics to draw for run {run.run_id}")
        routing = diag.get("routing") or {}
        if not routing.get("sites"):
            return
        title = f"{run.label} step {diag['step']}"
        with tempfile.TemporaryDirectory() as tmp:
            render_routing_heatmap(diag, Path(tmp) / "routing_heatmap.png", title=title)
            plot_entropy(diag, Path(tmp) / "routing_entropy.png", title=title)
            _retry(lambda: self.client.log_artifacts(child.mlflow_id, tmp, "diagnostics"), "log heatmaps")

    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """A run succeeded: late rows, artifacts, the summary as `summary/<name>` tags, then FINISHED.

        The summary is tags, not metrics: MLflow's run page draws every metric as a chart and puts
        prefixed sections (`summary/`) before the unprefixed curves, so ten single-point summary
        charts opened the Metrics tab. A tag holds `repr(float)`, which reads back exactly; the
        curves' last points already give the headline values as metric columns."""
        child = self.child(run)
        self._replay(run, metrics, diagnostics)
        self.client.log_dict(child.mlflow_id, run.to_dict(), "config.json")
        if env:
            self.client.log_dict(child.mlflow_id, env, "env.json")
        if info:
            self.client.log_dict(child.mlflow_id, info, "info.json")
        if child.last_diag is not None:
            self._log_heatmaps(child, run)
        summary_tags = {f"{SUMMARY_TAG}{k}": repr(float(v)) for k, v in summary.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._set_tags(child.mlflow_id, {**summary_tags, "state": RunState.SUCCESS, "error": ""})
        self._set_state(child, RunState.SUCCESS)

    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None:
        """A run's attempt failed; `final` when no retry follows."""
        child = self.child(run)
        self.flush()
        self._set_tags(child.mlflow_id, {"state": RunState.FAILED if final else "RETRYING", "error": error})
        if final:
            self._set_state(child, RunState.FAILED)

    def kill(self, run: RunSpec) -> None:
        """A run was interrupted (Ctrl-C); the next submission resumes the same child."""
        if run.run_id not in self._children:
            return
        child = self._children[run.run_id]
        self.flush()
        self._set_tags(child.mlflow_id, {"state": RunState.INTERRUPTED})
        self._set_state(child, RunState.INTERRUPTED)

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        """Mirror a finished run directory that MLflow does not show as FINISHED (a driver that
        died before logging it, a new tracking server); True when something was written."""
        existing = self._existing.get(run.run_id)
        if existing is not None and existing.info.status == FINISHED and \
                f"{SUMMARY_TAG}val_loss" in existing.data.tags:
            return False
        record = rd.summary() or {}
        self.finish(run, record.get("summary", {}), metrics=rd.metrics(), env=rd.env(), info=record.get("info"),
                    diagnostics=rd.diagnostics())
        return True

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        existing = self._existing.get(run.run_id)
        if existing is not None and existing.info.status == MLFLOW_STATUS[RunState.FAILED]:
            return False
        self.fail(run, error)
        return True

    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None:
        """Extra tags on a run's child (a tuning trial's number, state and parameters)."""
        self._set_tags(self.child(run).mlflow_id, tags)

    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of `local_dir` as artifacts of this submission's parent run."""
        _retry(lambda: self.client.log_artifacts(self._parent_id(), str(local_dir), artifact_path),
               "log parent artifacts")

    def discard_parent(self) -> None:
        """Delete this submission's parent run: a re-submission that ran and mirrored nothing
        would otherwise leave one empty parent per no-op `reslab run` in the dashboard."""
        if self.parent_id is not None:
            _retry(partial(self.client.delete_run, self.parent_id), "delete empty parent run")
            self.parent_id = None

    def log_study_result(self, table: Any, local_dir: Path) -> str:
        """The study's result on this submission's parent run: the paired table as an MLflow table
        (`paired_table.json`, shown in the artifact view) and every file of `local_dir` (CSV,
        plots, report)."""
        parent = self._parent_id()
        _retry(partial(self.client.log_table, parent, data=table, artifact_file="paired_table.json"),
               "log paired table")
        _retry(partial(self.client.log_artifacts, parent, str(local_dir)), "log study result")
        return parent

    def end(self, state: RunState, counts: dict[str, int]) -> None:
        """Close the parent run: SUCCESS, FAILED (a run failed) or INTERRUPTED, as MLflow statuses."""
        status = MLFLOW_STATUS[state]
        if self.parent_id is None:
            return
        self.flush()
        now = int(time.time() * 1000)
        items = [self._Metric(f"runs_{k}", float(v), now, 0) for k, v in counts.items()]
        _retry(lambda: self.client.log_batch(self.parent_id, metrics=items), "log counts")
        _retry(lambda: self.client.set_terminated(self.parent_id, status=status), "end parent run")


class TrackingUnavailable(ReslabError, RuntimeError):
    """The tracking server does not answer."""


_API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"


def host_header(url: str) -> str:
    """The Host header an HTTP client (requests, under MLflow's client) sends for `url`: its host,
    with the port unless that is the scheme's default."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    return host if parts.port in (None, 443 if parts.scheme == "https" else 80) else f"{host}:{parts.port}"


def check_server(uri: str, timeout: float = 10.0) -> None:
    """Fail in seconds, not after MLflow's minutes of HTTP retries, when a server is down or refuses
    this client. `/health` answers any Host, while MLflow's host check (`mlflow server
    --allowed-hosts`, its DNS-rebinding protection) answers 403 on the API to a Host it does not
    list; so an API endpoint is probed as well, with the Host header MLflow's client sends. A 401
    there (a server with authentication) passes: MLflow's client brings the credentials."""
    base, host = uri.rstrip("/"), host_header(uri)
    path = "/health"
    try:
        with urllib.request.urlopen(base + path, timeout=timeout):  # a status other than 2xx raises
            pass
        path = _API_PROBE
        probe = urllib.request.Request(base + path)
        probe.add_unredirected_header("Host", host)
        with urllib.request.urlopen(probe, timeout=timeout):
            return
    except urllib.error.HTTPError as exc:
        body = exc.read(500).decode(errors="replace")
        if exc.code == 403 and "Invalid Host header" in body:
            raise TrackingUnavailable(
                f"the MLflow tracking server at {redact(uri)} refuses the Host header this client sends (Host: {host}; "
                f"HTTP 403 on its API, while /health answers): add {host} to the server's --allowed-hosts "
                "(or $MLFLOW_SERVER_ALLOWED_HOSTS), or use a --tracking-uri host it allows") from None
        if exc.code == 401 and path == _API_PROBE:
            return
        why = f"HTTP {exc.code} on {path.split('?')[0]}"
    except (urllib.error.URLError, OSError) as exc:
        why = str(getattr(exc, "reason", exc))
    raise TrackingUnavailable(f"the MLflow tracking server at {redact(uri)} does not answer ({why}); start it, or drop "
                              "--tracking-uri / MLFLOW_TRACKING_URI to use the workspace's SQLite store")


# ----------------------------------------------------------------------------- reading


def search_all(client: Any, experiment_ids: list[str], filter_string: str = "") -> list[Any]:
    out, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


def fetch_study_runs(tracking_uri: str, study: str) -> list[dict[str, Any]]:
    """Every child run of a study as plain data: {mlflow_run_id, status, start_time, end_time,
    tags, metrics, params}; [] when the study has no experiment or the SQLite file does not exist
    (a read never creates a store)."""
    tracking_uri = store_uri(tracking_uri)
    db = sqlite_file(tracking_uri)
    if db is not None and not db.is_file():
        return []
    if tracking_uri.startswith(("http://", "https://")):
        check_server(tracking_uri)
    try:
        client = _import_mlflow()(tracking_uri=tracking_uri)
        exp = client.get_experiment_by_name(study)
        if exp is None:
            return []
        runs = search_all(client, [exp.experiment_id], f"tags.reslab_kind = '{KIND_RUN}'")
    except Exception as exc:  # sqlalchemy/sqlite errors arrive wrapped variously
        if db is None:
            raise
        raise _unusable(db, exc) from None
    return [
        {
            "mlflow_run_id": r.info.run_id, "status": r.info.status, "start_time": r.info.start_time,
            "end_time": r.info.end_time, "tags": dict(r.data.tags), "metrics": dict(r.data.metrics),
            "params": dict(r.data.params),
        }
        for r in runs
    ]


def relocate_artifacts(db: Path, artifacts_uri: str) -> int:
    """Point the study experiments (and their runs) of the SQLite store `db` that live under
    another workspace's `mlartifacts/` at `artifacts_uri` instead; returns how many moved.

    MLflow has no API to change an experiment's artifact location, so this edits its tables
    (`experiments.artifact_location`, `runs.artifact_uri`) directly; call it under the tracking lock.
    """
    import sqlite3

    moved = 0
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            rows = con.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall()
            for experiment_id, name, location in rows:
                suffix = f"/mlartifacts/{name}"
                if not (location or "").endswith(suffix) or location == f"{artifacts_uri}/{name}":
                    continue
                old = location[: -len(suffix)] + "/mlartifacts/"
                con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                            (f"{artifacts_uri}/{name}", experiment_id))
                con.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                            "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                            (artifacts_uri + "/", len(old) + 1, experiment_id, len(old), old))
                moved += 1
    finally:
        con.close()
    if moved:
        logging.getLogger(__name__).warning("%s: %d experiment(s) pointed into another workspace's artifacts; "
                                            "now at %s", db, moved, artifacts_uri)
    return moved


# ----------------------------------------------------------------------------- the dashboard


def _mlflow_cli() -> list[str]:
    exe = Path(sys.executable).with_name("mlflow")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "mlflow"]


@dataclass
class Dashboard:
    process: subprocess.Popen
    url: str
    reaper: subprocess.Popen | None = None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM the server's process group (uvicorn and its worker), then SIGKILL if needed."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.reaper is not None:
            self.reaper.terminate()
            self.reaper.wait()
            self.reaper = None
        return self.process.returncode


def check_bind(host: str, port: int) -> bool:
    """Raise `TrackingUnavailable` naming --host/--port when a server could not listen there (an
    unknown host, an address of another machine, a port in use); return whether it is loopback."""
    if not 0 < port < 65536:
        raise TrackingUnavailable(f"--port {port}: expected a port from 1 to 65535 (the UI's URL must be known)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise TrackingUnavailable(f"--host {host!r}: not an address of this machine ({exc}); "
                                  "use 127.0.0.1 (the default) or one of this machine's addresses") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise TrackingUnavailable(f"--port {port}: {host}:{port} is already in use; stop what listens "
                                          "there or pick another port (--port)") from None
            raise TrackingUnavailable(f"--host {host!r}: cannot listen on {host}:{port} ({exc.strerror}); "
                                      "use 127.0.0.1 (the default) or one of this machine's addresses") from None
    return ipaddress.ip_address(address[0]).is_loopback


def start_dashboard(workspace: Workspace, *, host: str = "127.0.0.1", port: int = 5000,
                    tracking_uri: str | None = None, timeout: float = 120.0, log_path: Path | None = None) -> Dashboard:
    """Serve the MLflow UI for the workspace store and wait until it answers.

    `mlflow server --workers 1` with job execution off (`MLFLOW_SERVER_ENABLE_JOB_EXECUTION`
    false; reslab submits no MLflow jobs) starts in ~8 s and ~0.5 GB. It runs in its own process
    group so `stop` ends the server and its worker together, and under `reaper.watch`, which ends
    them within a second if this process dies without stopping them (SIGKILL included). The port
    is checked before the server starts (a busy port would otherwise answer the health check for
    it), and a host other than loopback is warned about: the MLflow UI has no authentication.
    """
    if not check_bind(host, port):
        print(f"reslab: warning: --host {host} serves the MLflow UI, which has no authentication, to every "
              "machine that can reach this one; use the default 127.0.0.1 with an SSH tunnel instead", file=sys.stderr)
    uri = store_uri(tracking_uri or workspace.default_tracking_uri())
    workspace.root.mkdir(parents=True, exist_ok=True)  # the server's log and artifacts live there
    if uri.startswith("sqlite:"):
        # Create the schema first, under the drivers' lock: the server would otherwise race its
        # own migration, or a driver's.
        with file_lock(workspace.tracking_lock):
            _import_mlflow()(tracking_uri=uri).search_experiments(max_results=1)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    parts = urllib.parse.urlsplit(uri)
    if parts.password is not None and parts.scheme.startswith("postgres"):
        # libpq reads PGPASSWORD: the password stays off the server's command line (visible in `ps`)
        env["PGPASSWORD"] = urllib.parse.unquote(parts.password)
        uri = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", "@", 1)).geturl()
    cmd = [
        *_mlflow_cli(), "server", "--backend-store-uri", uri,
        "--default-artifact-root", workspace.artifacts.as_uri(),
        "--artifacts-destination", workspace.artifacts.as_uri(),
        "--host", host, "--port", str(port), "--workers", "1",
    ]
    log_path = log_path or workspace.root / "dashboard.log"
    with open(log_path, "ab") as log_f:
        proc = subprocess.Popen(cmd, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    dash = Dashboard(proc, url, reaper.watch([proc.pid]))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                last = (log_path.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
                raise TrackingUnavailable(f"mlflow server exited with code {proc.returncode} ({last.strip()}); "
                                          f"log: {log_path}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200 and proc.poll() is None:
                        return dash
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TrackingUnavailable(f"mlflow server did not answer on {url} within {timeout:.0f}s; log: {log_path}")
    except BaseException:  # Ctrl-C while waiting included: never leave a server behind
        dash.stop()
        raise

