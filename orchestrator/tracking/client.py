"""One opened tracking store, `StoreClient`: the MLflow client under the workspace's lock, and the
writes every record is made of.

Opening. A store that does not answer is one line (`store.probe_store`). The store is created (or
migrated) once, under an `flock` on `<workspace>/.tracking.lock` (beside the SQLite file when there is
no workspace); a new workspace's SQLite file is copied from the cached empty one (`tracking.template`),
and a moved or copied workspace's store is pointed back into its `mlartifacts/` (`tracking.relocate`).

The study's experiment is created with `views.study_tags()`. Its children are found by
`tags.run_id` once, when a submission begins; duplicates left by older versions or by drivers on different
machines sharing a tracking server are reconciled then (the best one is kept: FINISHED first, then the oldest;
the others are deleted). A submission whose driver process is gone from this host is closed as KILLED.

After that, the child of a run is looked up by its MLflow id, never searched for again: the id comes from the
snapshot taken when the submission began, or from the `ChildLedger` where every driver sharing the lock
appends the children it creates. MLflow's search by tag reads every child of the experiment (~75 ms a search
at 10^4 children on SQLite, growing with them), so a search per new child made a study of N runs cost O(N^2)
(issue 39).

Params and tags go in `log_batch` calls of at most 100 (a param truncated at 6000 characters, a tag at
5000); every write retries briefly on a locked database (`store.retry`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from reslab.common.io import file_lock
from reslab.orchestrator.durability.lease import process_alive
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.layout import KILLED, KIND_RUN, KIND_SUBMISSION, MLFLOW_STATUS, PUBLISHED_TAG
from reslab.orchestrator.tracking.readers import fetch_study_runs, search_all
from reslab.orchestrator.tracking.relocate import relocate_artifacts
from reslab.orchestrator.tracking.store import (
    import_mlflow,
    probe_store,
    retry,
    sqlite_file,
    store_error,
    store_uri,
)
from reslab.orchestrator.tracking.template import (
    own_default_experiment,
    restore_template,
    save_template,
    template_unusable,
)
from reslab.orchestrator.tracking.views import study_tags

_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores, by URI scheme (less +driver)
_MAX_PARAM = 6000
_MAX_TAG = 5000
BATCH_METRICS = 1000
_BATCH_PARAMS = 100
BATCH_TAGS, MAX_TAG = _BATCH_PARAMS, _MAX_TAG  # MLflow's limits on one `log_batch`'s tags and a tag's length


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 20] + "...[truncated]"


def _best_first(children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """FINISHED before RUNNING, KILLED, FAILED; then the oldest (records as `_record` makes them)."""
    order = [MLFLOW_STATUS[s] for s in (RunState.SUCCESS, RunState.RUNNING, RunState.INTERRUPTED, RunState.FAILED)]
    rank = {status: i for i, status in enumerate(order)}
    return sorted(children, key=lambda c: (rank.get(c["status"], len(rank)), c["start_time"] or 0, c["mlflow_run_id"]))


def _record(run: Any) -> dict[str, Any]:
    """An MLflow run as `readers.fetch_study_runs` gives one, the fields a child is reconciled by."""
    return {"mlflow_run_id": run.info.run_id, "status": run.info.status, "start_time": run.info.start_time,
            "tags": dict(run.data.tags)}


class ChildLedger:
    """The MLflow children of one experiment known to this driver: run id -> MLflow run id.

    It starts from the children the submission found when it began (`StoreClient.existing_children`) and
    follows a file beside the tracking lock, one line per child (`<run id> <MLflow run id>`), to which every
    driver sharing the lock appends the children it creates, under the lock. Each lookup first reads the lines
    added since the last one (only those: the file is read from where this driver left it), so a child another
    driver of the workspace created meanwhile is reused, not duplicated. A line is not fsynced: one lost with
    the machine costs at most a duplicate child, which the next submission reconciles, as it does for drivers on
    different machines sharing a tracking server (they share no lock, so no ledger). Memory: ~200 bytes a run.
    """

    def __init__(self, path: Path, known: dict[str, str]) -> None:
        self.path, self.ids = path, dict(known)
        try:
            self.offset = path.stat().st_size
        except FileNotFoundError:
            self.offset = 0

    def _read_new(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            run_id, _, mlflow_id = line.partition(" ")
            if run_id and mlflow_id:
                self.ids.setdefault(run_id, mlflow_id)  # the first child recorded for a run is the one kept

    def lookup(self, run_id: str) -> str | None:
        """The MLflow id of `run_id`'s child, if this driver or another sharing the lock has one (under the lock)."""
        self._read_new()
        return self.ids.get(run_id)

    def add(self, run_id: str, mlflow_id: str) -> None:
        """A child this driver just created (under the lock, after `lookup` found none)."""
        self.ids[run_id] = mlflow_id
        line = f"{run_id} {mlflow_id}\n".encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as f:
                f.write(line)
            self.offset += len(line)  # nothing else was appended meanwhile: the lock is held
        except OSError as exc:
            logging.getLogger(__name__).warning("could not record MLflow child %s of run %s in %s (%s); another "
                                                "driver of this workspace may create a duplicate, reconciled by "
                                                "the next submission", mlflow_id, run_id, self.path, exc)


class StoreClient:
    """The MLflow client of one store, opened once under the workspace's lock (see the module docstring)."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None) -> None:
        client_cls = import_mlflow()
        from mlflow.entities import Metric, Param, RunTag

        self.Metric, self.RunTag, self._Param = Metric, RunTag, Param
        self.uri = tracking_uri = store_uri(tracking_uri)
        self.workspace = workspace
        probe_store(tracking_uri)  # a server or database that does not answer: one line, in seconds
        db = sqlite_file(tracking_uri)
        if workspace is not None:
            self._lock_path: Path | None = workspace.tracking_lock
        else:
            self._lock_path = db.with_name(db.name + ".lock") if db is not None else None
        self.client = self._open(client_cls, db)
        self._ledgers: dict[str, ChildLedger] = {}  # experiment id -> its children (`existing_children` on)

    def _open(self, client_cls: Any, db: Path | None) -> Any:
        """The MLflow client, its store created or migrated once under the lock; a store it cannot
        open is one line (`store_error`, `template_unusable`)."""
        with self.locked():
            fresh = db is not None and self.workspace is not None and not db.exists()
            seeded = fresh and db is not None and restore_template(db)
            try:  # MLflow opens the store (and checks its schema) when the client is built
                client = client_cls(tracking_uri=self.uri)
                client.search_experiments(max_results=1)  # creates or migrates the schema, once
            except Exception as exc:  # sqlalchemy/sqlite errors arrive wrapped variously
                raise (template_unusable(db, exc) if seeded and db is not None else store_error(self.uri, exc)) \
                    from None
            if db is not None and self.workspace is not None:
                if fresh:
                    if not seeded:
                        save_template(db)
                    own_default_experiment(db, self.workspace.artifacts.as_uri())
                relocate_artifacts(db, self.workspace.artifacts.as_uri())
        return client

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return file_lock(self._lock_path) if self._lock_path is not None else contextlib.nullcontext()

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
                return retry(lambda: self.client.create_experiment(
                    study, artifact_location=self._artifact_location(study), tags=study_tags()), "create experiment")
            except Exception:  # created concurrently by another process
                exp = self.client.get_experiment_by_name(study)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            retry(lambda: self.client.restore_experiment(exp.experiment_id), "restore experiment")
        for key, value in study_tags().items():
            if key not in exp.tags:
                retry(functools.partial(self.client.set_experiment_tag, exp.experiment_id, key, value),
                      "tag experiment")
        return exp.experiment_id

    def existing_children(self, experiment_id: str, study: str, tags: Collection[str] = ()) -> dict[str, Any]:
        """run_id -> its one MLflow child, as `readers.fetch_study_runs` reads it: {mlflow_run_id, status,
        start_time, tags: its `run_id` and `tags` of these names}; duplicates are reconciled (see the module
        doc). Read from a database store's tables, not by MLflow's search, which builds every child's whole
        record (~70 params, ~40 tags: minutes at 10^4 children, for a resubmission). From here on `find_child`
        in this experiment looks children up in a `ChildLedger` started from these."""
        by_id: dict[str, list[dict[str, Any]]] = {}
        with self.locked():
            for record in fetch_study_runs(self.uri, study, params=False, keys={"run_id", *tags}):
                rid = record["tags"].get("run_id")
                if rid:
                    by_id.setdefault(rid, []).append(record)
            children = {rid: self._reconcile(records) for rid, records in by_id.items()}
            if self._lock_path is not None:
                self._ledgers[experiment_id] = ChildLedger(self._ledger_path(experiment_id),
                                                           {rid: c["mlflow_run_id"] for rid, c in children.items()})
            return children

    def _ledger_path(self, experiment_id: str) -> Path:
        """`<lock name less .lock>.children/<hash of the store and experiment>`, beside the lock."""
        assert self._lock_path is not None
        key = hashlib.sha256(f"{self.uri}\0{experiment_id}".encode()).hexdigest()[:24]
        return self._lock_path.with_name(self._lock_path.name.removesuffix(".lock") + ".children") / key

    def _reconcile(self, children: list[dict[str, Any]]) -> dict[str, Any]:
        keep, *extra = _best_first(children)
        for dup in extra:
            logging.getLogger(__name__).warning("run %s had %d MLflow children; deleting duplicate %s (kept %s)",
                                                keep["tags"].get("run_id"), len(children), dup["mlflow_run_id"],
                                                keep["mlflow_run_id"])
            retry(functools.partial(self.client.delete_run, dup["mlflow_run_id"]), "delete duplicate child")
        return keep

    def find_child(self, experiment_id: str, run_id: str) -> Any | None:
        """The child of `run_id` as MLflow has it now (call under the lock): fetched by its id from the
        experiment's `ChildLedger`; searched for by tag without a ledger (no lock to share, `existing_children`
        not called) or when the ledger's child has since been deleted."""
        ledger = self._ledgers.get(experiment_id)
        if ledger is not None:
            mlflow_id = ledger.lookup(run_id)
            if mlflow_id is None:
                return None
            run = self._get_run(mlflow_id)
            if run is not None and run.info.lifecycle_stage == "active" and run.info.experiment_id == experiment_id:
                return run
        query = f"tags.reslab_kind = '{KIND_RUN}' and tags.run_id = '{run_id}'"
        runs = {run.info.run_id: run for run in search_all(self.client, [experiment_id], query)}
        return runs[self._reconcile([_record(r) for r in runs.values()])["mlflow_run_id"]] if runs else None

    def created_child(self, experiment_id: str, run_id: str, mlflow_id: str) -> None:
        """Record a child just created for `run_id` (under the lock), for this driver and the others."""
        ledger = self._ledgers.get(experiment_id)
        if ledger is not None:
            ledger.add(run_id, mlflow_id)

    def _get_run(self, mlflow_id: str) -> Any | None:
        from mlflow.exceptions import MlflowException

        try:
            return retry(functools.partial(self.client.get_run, mlflow_id), "read child run")
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def close_abandoned_submissions(self, experiment_id: str) -> None:
        """A driver killed outright (SIGKILL, a lost login node) leaves its parent run RUNNING;
        one that ran on this host and whose process is gone is marked KILLED."""
        query = f"tags.reslab_kind = '{KIND_SUBMISSION}' and attributes.status = 'RUNNING'"
        for run in search_all(self.client, [experiment_id], query):
            t = run.data.tags
            pid = int(t["driver_pid"]) if t.get("driver_pid", "").isdigit() else None
            if process_alive(t.get("driver_host"), pid, t.get("driver_pid_start") or None) is False:
                self.set_tags(run.info.run_id, {"state": "ABANDONED (driver process gone)"})
                retry(functools.partial(self.client.set_terminated, run.info.run_id, status=KILLED), "close parent")

    def drop_emptied_submissions(self, experiment_id: str, current: str) -> int:
        """Delete (MLflow's soft delete: restorable, hidden by the UI's "Active" filter) the parents of earlier
        submissions that ended FAILED or KILLED and hold no run any more: every child they had was re-parented
        under a later submission that produced it, so each failed try would otherwise stay in the dashboard as
        an empty parent under "Additional runs". A parent still holding a run, or carrying a publication, stays.
        Returns how many were deleted."""
        query = (f"tags.reslab_kind = '{KIND_SUBMISSION}' and attributes.status != 'FINISHED' "
                 "and attributes.status != 'RUNNING'")
        dropped = 0
        for run in search_all(self.client, [experiment_id], query):
            parent = run.info.run_id
            if parent == current or PUBLISHED_TAG in run.data.tags:
                continue
            held = retry(functools.partial(self.client.search_runs, [experiment_id],
                                           f"tags.mlflow.parentRunId = '{parent}'", max_results=1),
                         "read a parent's runs")
            if not held:
                self.set_tags(parent, {"state": f"EMPTIED (its runs went on under submission run {current})"})
                retry(functools.partial(self.client.delete_run, parent), "delete emptied parent")
                dropped += 1
        return dropped

    def log_params(self, mlflow_id: str, params: dict[str, Any]) -> None:
        items = [self._Param(k, _param_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _BATCH_PARAMS):
            retry(functools.partial(self.client.log_batch, mlflow_id, params=items[i:i + _BATCH_PARAMS]), "log params")

    def set_tags(self, mlflow_id: str, tags: dict[str, Any]) -> None:
        items = [self.RunTag(k, str(v)[:_MAX_TAG]) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH_PARAMS):
            retry(functools.partial(self.client.log_batch, mlflow_id, tags=items[i:i + _BATCH_PARAMS]), "set tags")

    def set_state(self, mlflow_id: str, state: RunState) -> None:
        status = MLFLOW_STATUS[state]
        if state is RunState.RUNNING:
            retry(lambda: self.client.update_run(mlflow_id, status=status), "update run")
        else:
            retry(lambda: self.client.set_terminated(mlflow_id, status=status), "terminate run")

    def logged_steps(self, mlflow_id: str) -> dict[str, set[int]]:
        """The steps a child's history holds, per kind (one metric key stands for each)."""
        steps: dict[str, set[int]] = {}
        for kind, key in (("train", "train_loss"), ("eval", "val_loss")):
            history = retry(functools.partial(self.client.get_metric_history, mlflow_id, key), "read metric history")
            steps[kind] = {m.step for m in history}
        return steps
