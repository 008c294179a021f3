"""The MLflow children of one submission, by role (`tracking.writer.MlflowWriter` builds on them):

- `ChildLedger`: the lookup of a run's child by `tags.run_id` (reused when one exists, created under the store's
  lock otherwise, so there is one child per run id whatever the races), the children this driver holds (the runs
  in flight, forgotten at each run's end), and the fence check of a worker's event (`stale`);
- `MetricWriter`: a child's metric rows and tags queued and written in `log_batch` chunks, a step never split
  across two (`flush` each poll tick under a time budget, `replay` of rows a lost event never delivered, exact
  whatever order they came in), and each eval's diagnostics logged once.

See `tracking.writer` for who writes and why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from reslab.experiments.expand import RESULTS_VERSION, RunSpec
from reslab.models.config import flatten
from reslab.models.presets import resolve_model
from reslab.orchestrator.attempt.envinfo import short_code_version
from reslab.orchestrator.durability.workspace import Workspace, read_json
from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.client import BATCH_METRICS, BATCH_TAGS, MAX_TAG, StoreClient
from reslab.orchestrator.tracking.layout import KIND_RUN, MLFLOW_STATUS, SUMMARY_TAG
from reslab.orchestrator.tracking.store import retry

# the longest the dispatch loop's flush each poll tick goes on writing runs' metrics (`MetricWriter.flush`)
FLUSH_BUDGET_S = 0.5


def _step_chunks(metrics: list[Any], size: int = BATCH_METRICS) -> list[list[Any]]:
    """`metrics` in `log_batch` chunks of at most `size`, a step's metrics never split across two: a
    chunk commits whole, so a flush cut short by an outage leaves each step all logged or not at all,
    which is what `StoreClient.logged_steps` reads back (one key per kind). At least one chunk (the
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
    not null); the vocabulary size, which the tokenizer fixes at training time, stays as configured. The `optim`
    section is in the form the run id hashes (`models.optim.hashed_config`): the flat `optim.muon_*` and
    `optim.cooldown_*` params of before the registries, for the kinds that had them, so a study's MLflow params
    and the columns a user compares by are those of its earlier runs."""
    from reslab.models.optim import hashed_config  # torch: imported where a child's params are first written

    params = flatten(hashed_config(run.config))
    shape = resolve_model(run.config.model, vocab_size=1)
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len"):
        params[f"model.{name}"] = getattr(shape, name)
    return params


@dataclass
class Child:
    mlflow_id: str
    run: RunSpec
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
    new: bool = True  # created by this driver
    started: bool = False  # this driver has had its start event
    flushed_at: float = -math.inf  # when `flush` last wrote its rows (time.monotonic)
    diag_steps: set[int] | None = None  # None: not yet read from the artifact store
    last_diag: dict[str, Any] | None = None  # the latest eval's diagnostics, drawn at the end


SUMMARY_VAL_LOSS = f"{SUMMARY_TAG}val_loss"


def mirrored(status: str, tags: dict[str, str]) -> tuple[str, bool]:
    """What `MlflowWriter.sync` needs of an MLflow child: its status, and whether it holds the summary."""
    return status, SUMMARY_VAL_LOSS in tags


class ChildLedger:
    """The children of one submission's parent run, one per run id (module docstring)."""

    def __init__(self, tracking_uri: str, workspace: Workspace | None = None) -> None:
        self.store = StoreClient(tracking_uri, workspace)
        self.client, self.workspace = self.store.client, workspace
        self.experiment_id: str | None = None
        self.parent_id: str | None = None
        self.code: dict[str, Any] = {}
        self._children: dict[str, Child] = {}
        # run_id -> (its child's MLflow status, whether it holds a summary) when this driver opened it: a few
        # bytes per run, not the child's whole record (its ~100 parameters), for a study of 10^5 runs
        self._existing: dict[str, tuple[str, bool]] = {}

    def _experiment_id(self) -> str:
        if self.experiment_id is None:
            raise RuntimeError("the MLflow tracker has no experiment yet: begin() comes first")
        return self.experiment_id

    def _parent_id(self) -> str:
        if self.parent_id is None:
            raise RuntimeError("the MLflow tracker has no submission run yet: begin() comes first")
        return self.parent_id

    def child(self, run: RunSpec) -> Child:
        """This run's MLflow child: reused when one exists (found by `tags.run_id`), else created."""
        if run.run_id in self._children:
            return self._children[run.run_id]
        tags = run_tags(run, self.code)
        tags["mlflow.parentRunId"] = self._parent_id()
        with self.store.locked():
            # another driver may have created it since this one began: look again before creating
            existing = self.store.find_child(self._experiment_id(), run.run_id)
            if existing is None:
                created = retry(lambda: self.client.create_run(self.experiment_id, run_name=run.label, tags=tags),
                                "create child run")
                self.store.created_child(self._experiment_id(), run.run_id, created.info.run_id)
        if existing is not None:
            logged = {k: int(existing.data.tags.get(f"reslab.logged_{k}_step", 0)) for k in ("train", "eval")}
            child = Child(existing.info.run_id, run, floor=logged, new=False,
                           seen=self.store.logged_steps(existing.info.run_id))
            # Re-parent under the submission that is now producing it, refresh code tags.
            self.store.set_tags(child.mlflow_id, tags)
            # a child created just before tracking went down may lack its parameters
            missing = {k: v for k, v in config_params(run).items() if k not in existing.data.params}
            if missing:
                self.store.log_params(child.mlflow_id, missing)
        else:
            child = Child(created.info.run_id, run)
            self.store.log_params(child.mlflow_id, config_params(run))
        self._existing[run.run_id] = (mirrored(existing.info.status, existing.data.tags) if existing is not None
                                      else (MLFLOW_STATUS[RunState.RUNNING], False))
        self._children[run.run_id] = child
        return child

    def has_child(self, run_id: str) -> bool:
        return run_id in self._children

    def forget(self, run_id: str) -> None:
        """Drop this driver's record of a child (its queue, its steps): MLflow's history says what is there.
        Done at each run's end (`finish`, a final `fail`, `kill`), so the driver holds the runs in flight, not
        every run of a 10^5-run submission with the steps each one logged, and `flush` looks at those only;
        anything written for the run later (a late row, a tuning trial's tags, an evaluation's metrics) reopens
        its child by id, with the steps MLflow has (`child`)."""
        self._children.pop(run_id, None)

    def queued(self) -> list[RunSpec]:
        """The runs with rows or tags `flush` has yet to write."""
        return [c.run for c in self._children.values() if c.pending or c.pending_tags]

    def stale(self, run: RunSpec, event: dict[str, Any]) -> bool:
        """The event comes from an attempt whose lease was since handed to another (a higher token)."""
        token = event.get("token")
        if self.workspace is None or not isinstance(token, int):
            return False
        fence = read_json(self.workspace.run_dir(run.study, run.run_id).fence_file)
        return isinstance(fence, int) and token < fence


class MetricWriter(ChildLedger):
    """The children's metric rows, tags and diagnostics, queued and written in batches (module docstring)."""

    def _queue(self, child: Child, kind: str, step: int, metrics: dict[str, Any], when: float, *,
               floor: bool = True) -> None:
        if step in child.seen[kind] or (floor and step <= child.floor[kind]):
            return
        ts = int(when * 1000)
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                child.pending.append(self.store.Metric(key, float(value), ts, step))
        child.seen[kind].add(step)

    def flush(self) -> None:
        """One `log_batch` per child with pending metrics (chunks of 1000), for at most `FLUSH_BUDGET_S`: the
        children that waited longest first, and no further child once the flush has taken that long (at least
        one is written). The dispatch loop flushes every poll tick, so with 1,000 runs in flight it still
        dispatches and completes runs every tick and the tracking server gets at most what it absorbs in that
        time; the others keep their rows for a later tick, or their run's end (`finish`, `fail` and `kill` write
        their run's rows, and only theirs: one run's end costs one run's writes, whatever else is in flight)."""
        self._flush(FLUSH_BUDGET_S)

    def _flush(self, budget_s: float | None) -> None:
        start = time.monotonic()
        waiting = sorted((c for c in self._children.values() if c.pending or c.pending_tags),
                         key=lambda c: c.flushed_at)
        for n, child in enumerate(waiting):
            if budget_s is not None and n and time.monotonic() - start > budget_s:
                break
            self._write(child)

    def _write(self, child: Child) -> None:
        """The child's queued rows and tags, in `log_batch` chunks (the tags on the last)."""
        child.flushed_at = time.monotonic()
        tags = dict(child.pending_tags)
        if not child.pending and not tags:
            return
        tags.update({f"reslab.logged_{k}_step": max([child.floor[k], *child.seen[k]]) for k in child.floor})
        tag_items = [self.store.RunTag(k, str(v)[:MAX_TAG]) for k, v in tags.items()]
        metrics, child.pending, child.pending_tags = child.pending, [], {}
        chunks = _step_chunks(metrics)
        for j, chunk in enumerate(chunks):
            last = j == len(chunks) - 1
            retry(partial(self.client.log_batch, child.mlflow_id, metrics=chunk,
                          tags=tag_items[:BATCH_TAGS] if last else []), "log metrics")
        for start in range(BATCH_TAGS, len(tag_items), BATCH_TAGS):  # past one batch's limit, in more
            retry(partial(self.client.log_batch, child.mlflow_id, tags=tag_items[start:start + BATCH_TAGS]),
                  "log tags")

    def replay(self, run: RunSpec, rows: Iterable[dict[str, Any]], diagnostics: Iterable[dict[str, Any]] = ()) -> None:
        """Log rows (metrics.jsonl form) not yet in MLflow: events a driver restart or a lost progress
        actor never delivered. Exact, whatever order the live events came in: `seen` holds the steps
        MLflow has (the child's history when this driver opened it, and what this driver logged)."""
        child = self.child(run)
        self._queue_rows(child, rows, diagnostics)
        self._write(child)  # with what the child had queued; the other runs' rows wait for the loop's flush

    def _queue_rows(self, child: Child, rows: Iterable[dict[str, Any]], diagnostics: Iterable[dict[str, Any]]) -> None:
        for row in rows:
            kind = row.get("kind")
            if kind in child.seen:
                metrics = {k: v for k, v in row.items() if k not in ("kind", "step", "time")}
                self._queue(child, kind, row["step"], metrics, row.get("time", time.time()), floor=False)
        for diag in diagnostics:
            self._log_diagnostics(child, diag)

    def _log_diagnostics(self, child: Child, diag: dict[str, Any]) -> None:
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


__all__ = ["FLUSH_BUDGET_S", "SUMMARY_VAL_LOSS", "Child", "ChildLedger", "MetricWriter", "config_params", "mirrored",
           "run_tags"]
