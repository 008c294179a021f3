"""The driver's MLflow writer, `Tracker`: the only code that writes to the tracking store.

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
its MLflow update. Writes still retry briefly on a locked database (`store.retry`). The driver
sees the writer through `protocol.DriverTracker`.

What it writes is `tracking.layout`. A resumed or re-submitted run reuses its child (found by
`tags.run_id`); metric steps already logged are skipped (tags `reslab.logged_train_step` /
`reslab.logged_eval_step` for earlier drivers, the steps this one logged), so a resumed run adds
no duplicates, and a replay of a run's rows (a lost progress actor's events, a driver restart)
logs exactly the steps MLflow's history lacks, whatever order they came in. A re-submission that
runs and mirrors nothing deletes its parent (`discard_parent`).

Several drivers on one workspace. The store is created (or migrated) once, under an `flock` on
`<workspace>/.tracking.lock`; under the same lock a child is looked up by `tags.run_id` right
before it is created, so there is one child per run id whatever the races; duplicates left by
older versions or by drivers on different machines sharing a tracking server are reconciled
when a submission begins (the best one is kept: FINISHED first, then the oldest; the others are
deleted). Events carry the attempt's fencing token (`orchestrator.workspace`): an event from an
attempt whose lease was taken over is dropped, so a stale worker cannot revive its child.

A moved or copied workspace: opening its SQLite store points the study experiments back into this
workspace's `mlartifacts/` (`tracking.relocate`).

Outages. A store that does not answer at start is one line (`store.probe_store`); one that stops
answering later (a server whose database is down answers 503, a database store refuses
connections) never stops training. Every write the driver calls goes through `_guarded`: a failure
that is an outage (`store.is_outage`; MLflow's HTTP retries are bounded, `store.HTTP_RETRIES`, so
one write gives up in seconds) starts an `outage.Outage` and the run it concerned is *behind*
(`_Behind`: which end the driver reported for it, which tags). While tracking is down, writes are
skipped without a request, except a probe when the backoff says one is due (1 s doubling to 30 s;
the loop calls `flush` every tick), and the status line says so ("tracking ... unreachable for
2m10s; runs continue; metrics queued in the run directories"). When a probe answers, every run
behind is caught up from its run directory, the truth (`_catch_up`): its child reopened from
MLflow's own history, the rows MLflow lacks replayed (exactly those steps), its tags and final state
written; then the outage ends. Writes the driver cannot go on without (the parent's end, the study's
result) wait the outage out (`_wait`), so a study ends with one FINISHED child per finished run and
its parent closed. Past the outage timeout (`--outage-timeout`) the driver stops with one line
(`TrackingUnavailable`): the run directories keep everything and the next `reslab run` mirrors them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from reslab.common.io import file_lock
from reslab.experiments.expand import RESULTS_VERSION, RunSpec
from reslab.models.config import flatten
from reslab.models.presets import resolve_model
from reslab.orchestrator.envinfo import short_code_version, submitter_code_version
from reslab.orchestrator.lease import proc_start, process_alive
from reslab.orchestrator.outage import DEFAULT_TIMEOUT_S, Outage
from reslab.orchestrator.storage import redact
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.layout import (
    FINISHED,
    KILLED,
    KIND_RUN,
    KIND_SUBMISSION,
    MLFLOW_STATUS,
    NOTE_TAG,
    RESULT_BEGIN,
    RESULT_END,
    SUMMARY_TAG,
    result_note,
    verdict_line,
)
from reslab.orchestrator.tracking.readers import search_all
from reslab.orchestrator.tracking.relocate import relocate_artifacts
from reslab.orchestrator.tracking.store import (
    TrackingUnavailable,
    check_server,
    import_mlflow,
    is_outage,
    outage_reason,
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
from reslab.orchestrator.workspace import RunDir, Workspace, read_json

_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores, by URI scheme (less +driver)
_MAX_PARAM = 6000
_MAX_TAG = 5000
_BATCH_METRICS = 1000
_BATCH_PARAMS = 100
T = TypeVar("T")


def _param_value(value: Any) -> str:
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) <= _MAX_PARAM else text[: _MAX_PARAM - 20] + "...[truncated]"


def _step_chunks(metrics: list[Any], size: int = _BATCH_METRICS) -> list[list[Any]]:
    """`metrics` in `log_batch` chunks of at most `size`, a step's metrics never split across two: a
    chunk commits whole, so a flush cut short by an outage leaves each step all logged or not at all,
    which is what `Tracker._logged_steps` reads back (one key per kind). At least one chunk (the
    tags ride on the last)."""
    groups: list[list[Any]] = []
    for m in metrics:
        if groups and groups[-1][0].step == m.step:
            groups[-1].append(m)
        else:
            groups.append([m])
    chunks: list[list[Any]] = [[]]
    for group in groups:
        if chunks[-1] and len(chunks[-1]) + len(group) > size:
            chunks.append([])
        chunks[-1].extend(group)
    return [c[i:i + size] for c in chunks for i in range(0, max(len(c), 1), size)]


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
class _Behind:
    """What MLflow missed of one run while tracking was down; `Tracker._catch_up` writes it."""

    run: RunSpec
    # the last end the driver reported: ("finish", summary, env, info), ("fail", error, final),
    # ("kill",), ("sync", run dir); None: in flight
    end: tuple[Any, ...] | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    # a finished run's rows, kept only by a tracker without a workspace (no run directory to read)
    rows: list[dict[str, Any]] = field(default_factory=list)
    diagnostics: list[dict[str, Any]] = field(default_factory=list)


_MISSED = object()  # what `Tracker._guarded` returns for a write tracking did not take


@dataclass
class _Child:
    mlflow_id: str
    # Steps up to `floor` were logged before this driver opened the child (its `reslab.logged_*_step`
    # tags): a resumed attempt's live events up to there repeat an earlier attempt's and are skipped.
    # `seen` holds every step MLflow has: the child's history when this driver opened it (a driver
    # killed between a batch's metrics commit and its tags commit leaves steps past the watermark),
    # then every step this driver logged, so an event that arrives late (after a restarted progress
    # actor) is still logged and a step recomputed after a resume is not logged twice.
    floor: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})
    seen: dict[str, set[int]] = field(default_factory=lambda: {"train": set(), "eval": set()})
    pending: list[Any] = field(default_factory=list)
    pending_tags: dict[str, Any] = field(default_factory=dict)
    new: bool = True
    diag_steps: set[int] | None = None  # None: not yet read from the artifact store
    last_diag: dict[str, Any] | None = None  # the latest eval's diagnostics, drawn at the end


def _best_first(runs: list[Any]) -> list[Any]:
    """FINISHED before RUNNING, KILLED, FAILED; then the oldest."""
    order = [MLFLOW_STATUS[s] for s in (RunState.SUCCESS, RunState.RUNNING, RunState.INTERRUPTED, RunState.FAILED)]
    rank = {status: i for i, status in enumerate(order)}
    return sorted(runs, key=lambda r: (rank.get(r.info.status, len(rank)), r.info.start_time or 0, r.info.run_id))


class Tracker:
    """The driver's MLflow writer for one submission of one study."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None, *,
                 outage_timeout_s: float = DEFAULT_TIMEOUT_S, say: Callable[[str], Any] = print) -> None:
        client_cls = import_mlflow()
        from mlflow.entities import Metric, Param, RunTag

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        self.uri = tracking_uri = store_uri(tracking_uri)
        self.workspace = workspace
        probe_store(tracking_uri)  # a server or database that does not answer: one line, in seconds
        db = sqlite_file(tracking_uri)
        if workspace is not None:
            self._lock_path: Path | None = workspace.tracking_lock
        else:
            self._lock_path = db.with_name(db.name + ".lock") if db is not None else None
        self.client = self._open(client_cls, db)
        self.experiment_id: str | None = None
        self.parent_id: str | None = None
        self.code: dict[str, Any] = {}
        self._children: dict[str, _Child] = {}
        self._existing: dict[str, Any] = {}
        self._runs: dict[str, RunSpec] = {}  # run_id -> its spec, for every run this driver wrote or missed
        self._behind: dict[str, _Behind] = {}  # what MLflow missed while tracking was down, per run id
        self._gave_up = False
        self.say = say
        self.outage = Outage(f"tracking {redact(tracking_uri)}", outage_timeout_s, say, self._give_up,
                             doing="runs continue; metrics queued in the run directories")

    def _open(self, client_cls: Any, db: Path | None) -> Any:
        """The MLflow client, its store created or migrated once under the lock; a store it cannot
        open is one line (`store_error`, `template_unusable`)."""
        with self._locked():
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
                retry(partial(self.client.set_experiment_tag, exp.experiment_id, key, value), "tag experiment")
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
            retry(functools.partial(self.client.delete_run, dup.info.run_id), "delete duplicate child")
        return keep

    def _find_child(self, run_id: str) -> Any | None:
        """The child of `run_id` as MLflow has it now (call under the lock)."""
        query = f"tags.reslab_kind = '{KIND_RUN}' and tags.run_id = '{run_id}'"
        runs = search_all(self.client, [self._experiment_id()], query)
        return self._reconcile(runs) if runs else None

    def begin(self, study: str, *, submission: str, code: dict[str, Any], plan: list[dict[str, Any]],
              study_file: Path | None = None, settings: dict[str, Any] | None = None) -> str:
        """Create the study's experiment (once) and this submission's parent run; tracking that stops
        answering now, before anything trains, is one line."""
        try:
            return self._begin(study, submission=submission, code=code, plan=plan, study_file=study_file,
                               settings=settings)
        except Exception as exc:
            if not is_outage(exc):
                raise
            raise TrackingUnavailable(f"tracking {redact(self.uri)} stopped answering as the submission began "
                                      f"({outage_reason(exc)}); nothing was trained: run the same command again "
                                      "once it answers") from None

    def _begin(self, study: str, *, submission: str, code: dict[str, Any], plan: list[dict[str, Any]],
               study_file: Path | None, settings: dict[str, Any] | None) -> str:
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
        run = retry(lambda: self.client.create_run(
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
                retry(partial(self.client.set_terminated, run.info.run_id, status=KILLED), "close parent")

    def _log_params(self, mlflow_id: str, params: dict[str, Any]) -> None:
        items = [self._Param(k, _param_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), _BATCH_PARAMS):
            retry(partial(self.client.log_batch, mlflow_id, params=items[i:i + _BATCH_PARAMS]), "log params")

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
                created = retry(lambda: self.client.create_run(self.experiment_id, run_name=run.label, tags=tags),
                                "create child run")
        if existing is not None:
            logged = {k: int(existing.data.tags.get(f"reslab.logged_{k}_step", 0)) for k in ("train", "eval")}
            child = _Child(existing.info.run_id, floor=logged, new=False, seen=self._logged_steps(existing.info.run_id))
            # Re-parent under the submission that is now producing it, refresh code tags.
            self._set_tags(child.mlflow_id, tags)
            # a child created just before tracking went down may lack its parameters
            missing = {k: v for k, v in config_params(run).items() if k not in existing.data.params}
            if missing:
                self._log_params(child.mlflow_id, missing)
        else:
            child = _Child(created.info.run_id)
            self._log_params(child.mlflow_id, config_params(run))
        self._existing[run.run_id] = self.client.get_run(child.mlflow_id)
        self._children[run.run_id] = child
        self._runs[run.run_id] = run
        return child

    def _logged_steps(self, mlflow_id: str) -> dict[str, set[int]]:
        """The steps an existing child's history holds, per kind (one metric key stands for each)."""
        steps: dict[str, set[int]] = {}
        for kind, key in (("train", "train_loss"), ("eval", "val_loss")):
            history = retry(partial(self.client.get_metric_history, mlflow_id, key), "read metric history")
            steps[kind] = {m.step for m in history}
        return steps

    def _set_tags(self, mlflow_id: str, tags: dict[str, Any]) -> None:
        items = [self._RunTag(k, str(v)[:_MAX_TAG]) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH_PARAMS):
            retry(partial(self.client.log_batch, mlflow_id, tags=items[i:i + _BATCH_PARAMS]), "set tags")

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
            retry(lambda: self.client.update_run(child.mlflow_id, status=status), "update run")
        else:
            retry(lambda: self.client.set_terminated(child.mlflow_id, status=status), "terminate run")

    def _stale(self, run: RunSpec, event: dict[str, Any]) -> bool:
        """The event comes from an attempt whose lease was since handed to another (a higher token)."""
        token = event.get("token")
        if self.workspace is None or not isinstance(token, int):
            return False
        fence = read_json(self.workspace.run_dir(run.study, run.run_id).fence_file)
        return isinstance(fence, int) and token < fence

    def _on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
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

    def _flush(self) -> None:
        """One `log_batch` per child with pending metrics (chunks of 1000)."""
        for child in self._children.values():
            tags = dict(child.pending_tags)
            if not child.pending and not tags:
                continue
            tags.update({f"reslab.logged_{k}_step": max([child.floor[k], *child.seen[k]]) for k in child.floor})
            tag_items = [self._RunTag(k, str(v)) for k, v in tags.items()]
            metrics, child.pending, child.pending_tags = child.pending, [], {}
            chunks = _step_chunks(metrics)
            for j, chunk in enumerate(chunks):
                last = j == len(chunks) - 1
                retry(partial(self.client.log_batch, child.mlflow_id, metrics=chunk, tags=tag_items if last else []),
                      "log metrics")

    def _replay(self, run: RunSpec, rows: Iterable[dict[str, Any]], diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """Log rows (metrics.jsonl form) not yet in MLflow: events a driver restart or a lost progress
        actor never delivered. Exact, whatever order the live events came in: `seen` holds the steps
        MLflow has (the child's history when this driver opened it, and what this driver logged)."""
        child = self.child(run)
        self._flush()
        for row in rows:
            kind = row.get("kind")
            if kind in child.seen:
                metrics = {k: v for k, v in row.items() if k not in ("kind", "step", "time")}
                self._queue(child, kind, row["step"], metrics, row.get("time", time.time()), floor=False)
        for diag in diagnostics:
            self._log_diagnostics(child, diag)
        self._flush()

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
        retry(lambda: self.client.log_dict(child.mlflow_id, diag, f"diagnostics/step_{step:06d}.json"),
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
            retry(lambda: self.client.log_artifacts(child.mlflow_id, tmp, "diagnostics"), "log heatmaps")

    def _finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
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

    def _fail(self, run: RunSpec, error: str, final: bool = True) -> None:
        child = self.child(run)
        self._flush()
        self._set_tags(child.mlflow_id, {"state": RunState.FAILED if final else "RETRYING", "error": error})
        if final:
            self._set_state(child, RunState.FAILED)

    def _kill(self, run: RunSpec) -> None:
        child = self.child(run)
        self._flush()
        self._set_tags(child.mlflow_id, {"state": RunState.INTERRUPTED})
        self._set_state(child, RunState.INTERRUPTED)

    def _sync(self, run: RunSpec, rd: RunDir) -> bool:
        existing = self._existing.get(run.run_id)
        if existing is not None and existing.info.status == FINISHED and \
                f"{SUMMARY_TAG}val_loss" in existing.data.tags:
            return False
        record = rd.summary() or {}
        self._finish(run, record.get("summary", {}), metrics=rd.metrics(), env=rd.env(), info=record.get("info"),
                    diagnostics=rd.diagnostics())
        return True

    def _sync_failed(self, run: RunSpec, error: str) -> bool:
        existing = self._existing.get(run.run_id)
        if existing is not None and existing.info.status == MLFLOW_STATUS[RunState.FAILED]:
            return False
        self._fail(run, error)
        return True

    def _end(self, state: RunState, counts: dict[str, int]) -> None:
        self._flush()
        now = int(time.time() * 1000)
        items = [self._Metric(f"runs_{k}", float(v), now, 0) for k, v in counts.items()]
        retry(lambda: self.client.log_batch(self._parent_id(), metrics=items), "log counts")
        retry(lambda: self.client.set_terminated(self._parent_id(), status=MLFLOW_STATUS[state]), "end parent run")

    # ------------------------------------------------------------------ what the driver calls (DriverTracker)
    # Each write goes through `_guarded` (or, where the driver cannot go on without it, `_wait`): see
    # "Outages" in the module docstring.

    def on_event(self, run: RunSpec, event: dict[str, Any]) -> None:
        if self._stale(run, event):
            return

        def missed(b: _Behind) -> None:
            if event.get("type") == "start":  # an attempt (re)started: the run is in flight again
                b.end = None
                b.tags.update(attempt=event.get("attempt", 1), start_step=event.get("start_step", 0))

        self._guarded(lambda: self._on_event(run, event), run, missed)

    def flush(self) -> None:
        """Write what `on_event` queued; while tracking is down, try it again when that is due."""
        dirty = [self._runs[rid] for rid, c in self._children.items() if c.pending or c.pending_tags]
        if self._guarded(self._flush) is _MISSED:
            for run in dirty:  # their queued rows are dropped: caught up from the run directories
                self._behind_of(run)

    def finish(self, run: RunSpec, summary: dict[str, Any], *, metrics: Iterable[dict[str, Any]] = (),
               env: dict[str, Any] | None = None, info: dict[str, Any] | None = None,
               diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """A run succeeded: late rows, artifacts, the summary as `summary/<name>` tags, then FINISHED
        (`_finish`)."""
        rows, diags = list(metrics), list(diagnostics)

        def missed(b: _Behind) -> None:
            b.end = ("finish", summary, env, info)
            if self.workspace is None:  # no run directory to catch up from: keep the rows
                b.rows, b.diagnostics = rows, diags

        self._guarded(lambda: self._finish(run, summary, metrics=rows, env=env, info=info, diagnostics=diags),
                      run, missed)

    def fail(self, run: RunSpec, error: str, *, final: bool = True) -> None:
        """A run's attempt failed; `final` when no retry follows."""
        self._guarded(lambda: self._fail(run, error, final), run,
                      lambda b: setattr(b, "end", ("fail", error, final)))

    def kill(self, run: RunSpec) -> None:
        """A run was interrupted (Ctrl-C); the next submission resumes the same child."""
        if run.run_id in self._children or run.run_id in self._behind:
            self._guarded(lambda: self._kill(run), run, lambda b: setattr(b, "end", ("kill",)))

    def sync(self, run: RunSpec, rd: RunDir) -> bool:
        """Mirror a finished run directory that MLflow does not show as FINISHED (a driver that
        died before logging it, a new tracking server); True when something was written (or will be,
        once tracking answers)."""
        done = self._guarded(lambda: self._sync(run, rd), run, lambda b: setattr(b, "end", ("sync", rd)))
        return True if done is _MISSED else bool(done)

    def sync_failed(self, run: RunSpec, error: str) -> bool:
        done = self._guarded(lambda: self._sync_failed(run, error), run,
                             lambda b: setattr(b, "end", ("fail", error, True)))
        return True if done is _MISSED else bool(done)

    def tag_child(self, run: RunSpec, tags: dict[str, Any]) -> None:
        """Extra tags on a run's child (a tuning trial's number, state and parameters)."""
        self._guarded(lambda: self._set_tags(self.child(run).mlflow_id, tags), run, lambda b: b.tags.update(tags))

    def log_parent_files(self, local_dir: Path, artifact_path: str) -> None:
        """Every file of `local_dir` as artifacts of this submission's parent run."""
        self._wait(lambda: retry(lambda: self.client.log_artifacts(self._parent_id(), str(local_dir), artifact_path),
                                 "log parent artifacts"))

    def discard_parent(self) -> None:
        """Delete this submission's parent run: a re-submission that ran and mirrored nothing
        would otherwise leave one empty parent per no-op `reslab run` in the dashboard."""
        if self.parent_id is not None:
            self._wait(lambda: retry(partial(self.client.delete_run, self._parent_id()), "delete empty parent run"))
            self.parent_id = None

    def log_study_result(self, table: Any, local_dir: Path, tables: dict[str, Any] | None = None,
                         series: dict[str, list[tuple[int, float]]] | None = None) -> str:
        """The study's result on this submission's parent run: the paired table as an MLflow table
        (`paired_table.json`, shown in the artifact view), any further `tables` (artifact file ->
        DataFrame, e.g. a ladder's), every file of `local_dir` (CSV, plots, report), and metric `series`
        (key -> (step, value) points: MLflow's own charts plot them against the step)."""
        parent = self._parent_id()

        def write() -> None:
            for name, data in {"paired_table.json": table, **(tables or {})}.items():
                retry(partial(self.client.log_table, parent, data=data, artifact_file=name), f"log {name}")
            retry(partial(self.client.log_artifacts, parent, str(local_dir)), "log study result")
            now = int(time.time() * 1000)
            points = [self._Metric(key, float(v), now, step) for key, pts in (series or {}).items() for step, v in pts]
            for chunk in ([points[i:i + _BATCH_METRICS] for i in range(0, len(points), _BATCH_METRICS)]):
                retry(partial(self.client.log_batch, parent, metrics=chunk), "log series")
            self._describe_result(table, parent)

        self._wait(write)
        return parent

    def _describe_result(self, table: Any, parent: str) -> None:
        """The experiment's description (the first thing its MLflow page shows) gets the latest paired table
        and links to this submission's run and report (`layout.result_note`)."""
        from reslab.results.export import format_table

        exp = self._experiment_id()
        previous = retry(lambda: self.client.get_experiment(exp), "read experiment").tags.get(NOTE_TAG, "")
        submission = retry(lambda: self.client.get_run(parent), "read parent run").info.run_name
        note = result_note(previous, format_table(table, "md"), exp, parent, submission, verdicts=verdict_line(table))
        retry(partial(self.client.set_experiment_tag, exp, NOTE_TAG, note), "describe experiment")
        retry(partial(self.client.set_tag, parent, NOTE_TAG, note.partition(RESULT_BEGIN)[2].partition(RESULT_END)[0]),
              "describe parent run")

    def end(self, state: RunState, counts: dict[str, int]) -> None:
        """Close the parent run: SUCCESS, FAILED (a run failed) or INTERRUPTED, as MLflow statuses.
        Tracking that is down is waited out first (every run caught up, nothing left RUNNING), up to
        the outage timeout; an interrupted driver, or one that already gave up, tries once."""
        if self.parent_id is None:
            return
        if state is RunState.INTERRUPTED or self._gave_up:
            if self.outage.down:
                self._probe()
            if self._guarded(lambda: self._end(state, counts)) is _MISSED:
                self.say(f"{self.outage.what} unreachable: this submission's MLflow record stays open until the "
                         "next `reslab run`, which closes it and mirrors the run directories")
            return
        self._wait(lambda: self._end(state, counts))

    # ------------------------------------------------------------------ outages

    def _guarded(self, write: Callable[[], T], run: RunSpec | None = None,
                 missed: Callable[[_Behind], Any] | None = None) -> T | object:
        """`write()`, or `_MISSED` when tracking is down (a try is made when one is due) or goes down
        during it: then `run`, if given, is behind (`missed` notes what it lacks) and is caught up
        from its run directory once tracking answers. An error that is not an outage propagates."""
        if run is not None:
            self._runs[run.run_id] = run
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

    def _note(self, run: RunSpec | None, missed: Callable[[_Behind], Any] | None) -> None:
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

    def _behind_of(self, run: RunSpec) -> _Behind:
        self._runs[run.run_id] = run
        return self._behind.setdefault(run.run_id, _Behind(run))

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
                self.client.search_experiments(max_results=1)
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
        rows (`_replay` logs exactly the steps MLflow lacks), tags and state. A run is done with once
        all of it is written; an outage midway leaves it behind for the next try."""
        done = 0
        for run_id, b in list(self._behind.items()):
            self._children.pop(run_id, None)  # MLflow's history, not this driver's queue, says what is there
            rd = self.workspace.run_dir(b.run.study, run_id) if self.workspace is not None else None
            kind = b.end[0] if b.end else None
            if kind == "sync" and b.end is not None:
                self._sync(b.run, b.end[1])
            elif kind == "finish":
                summary, env, info = b.end[1:] if b.end else ({}, None, None)
                self._finish(b.run, summary, metrics=rd.metrics() if rd else b.rows, env=env, info=info,
                             diagnostics=rd.diagnostics() if rd else b.diagnostics)
            else:
                child = self.child(b.run)
                self._replay(b.run, rd.metrics() if rd else b.rows, rd.diagnostics() if rd else b.diagnostics)
                if b.tags:
                    self._set_tags(child.mlflow_id, b.tags)
                if kind == "fail":
                    self._fail(b.run, b.end[1], b.end[2])  # type: ignore[index]
                elif kind == "kill":
                    self._kill(b.run)
                else:
                    self._set_state(child, RunState.RUNNING)
            if b.tags and kind in ("sync", "finish"):
                self._set_tags(self.child(b.run).mlflow_id, b.tags)
            del self._behind[run_id]
            done += 1
        return done
