"""Evaluations: work after training, one unit per (run, task, settings), kept whole in the run directory.

An evaluation's content id is `experiments.evals.eval_id` (run id + task + settings + harness version + the hash
of a local task's data, `models.evals.harness.task_data_digest`). Its
records live in the run directory:

    evals/<task>-<eval id>.parquet   every item the harness logged (`models.evals.harness.item_records`),
                                     with the run id; written under a temporary name and renamed into place
    evals/<task>-<eval id>.json      the task's metrics, the settings and the harness version; written last,
                                     so it marks the evaluation done
    evals/.lock                      held while evaluating: a second evaluator of the same run waits, then
                                     finds the work done and skips it

So an evaluation happens once: a finished one is skipped (`pending` reads the markers), an interrupted one
left no marker and runs again from its start (the harness has no partial state worth keeping), and tasks
finished before the interruption are not evaluated again. Only runs whose training finished are evaluated.

An evaluation is work after training, dispatched like a run (`orchestrator.attempt.after`, a task whose
`RunTask.work` is an `AfterTraining`): one task per finished run with pending work, on the backend and resources
its training had, so on the run's device. With run storage it evaluates the node's copy of the run, pulled first
when storage is ahead (the checkpoint included), and pushes the `evals/` files storage lacks when done
(`StoredRun.push_after`), so a fresh machine sees them. Its outcome carries each unit's metrics; the driver logs
them on the run's MLflow child (it is the only MLflow writer).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.common.io import file_lock, write_atomic
from reslab.experiments.evals import EvalSpec, eval_id
from reslab.experiments.expand import RunSpec
from reslab.models.config import DataConfig
from reslab.orchestrator.durability.workspace import RunDir, UnitFiles

EVALS_DIR = "evals"


@dataclass(frozen=True)
class EvalUnit(UnitFiles):
    """One (run, task) evaluation under `settings`: where its records go."""

    run: RunSpec
    task: str
    eval_id: str
    directory: Path
    records_suffix = ".parquet"

    @property
    def stem(self) -> str:
        return f"{self.task}-{self.eval_id}"


def units(run: RunSpec, rd: RunDir, spec: EvalSpec, harness: str) -> list[EvalUnit]:
    from reslab.models.evals.harness import task_data_digest

    corpus = _corpus(run.config.data)
    return [EvalUnit(run, task, eval_id(run.run_id, task, spec, harness, task_data_digest(task, corpus)),
                     rd.path / EVALS_DIR) for task in spec.tasks]


@functools.lru_cache(maxsize=16)
def _corpus(data: DataConfig) -> Path | None:
    """The run's prepared corpus here (the local next-line task's source), None where it is not prepared."""
    from reslab.models.data.prepare import corpus_dir, read_meta

    try:
        path = corpus_dir(data)
        read_meta(path)
    except (ValueError, OSError):
        return None
    return path


def pending(run: RunSpec, rd: RunDir, spec: EvalSpec, harness: str) -> list[EvalUnit]:
    """The evaluations of a finished run still to do (none for a run that has not finished)."""
    if not rd.complete():
        return []
    return [u for u in units(run, rd, spec, harness) if not u.done()]


def _write(unit: EvalUnit, records: pd.DataFrame, metrics: dict[str, float], spec: EvalSpec, harness: str) -> None:
    unit.directory.mkdir(parents=True, exist_ok=True)
    frame = records.assign(run_id=unit.run.run_id, eval_id=unit.eval_id)
    tmp = unit.records.with_name(f".{unit.records.name}.tmp")
    frame.to_parquet(tmp, index=False)
    tmp.replace(unit.records)
    write_atomic(unit.marker, json.dumps({"run_id": unit.run.run_id, "task": unit.task, "eval_id": unit.eval_id,
                                          "settings": spec.settings(), "harness": harness, "metrics": metrics,
                                          "items": len(frame)}, indent=2) + "\n")


def evaluate(run: RunSpec, rd: RunDir, spec: EvalSpec, *, device: str | None = None,
             batch_size: int = 16) -> list[tuple[EvalUnit, dict[str, float] | None]]:
    """Evaluate the run's pending tasks (all in one harness call) and write each one's records; returns each
    unit with its metrics, or None for a unit that was done already (skipped)."""
    from reslab.models.evals.harness import harness_version
    from reslab.models.evals.run_model import evaluate_run

    harness = harness_version()
    with file_lock(rd.path / EVALS_DIR / ".lock"):
        todo = pending(run, rd, spec, harness)
        done: list[tuple[EvalUnit, dict[str, float] | None]] = [
            (u, None) for u in units(run, rd, spec, harness) if u not in todo]
        if not todo:
            return done
        result = evaluate_run(run.config, rd.path, tuple(u.task for u in todo), num_fewshot=spec.num_fewshot,
                              limit=spec.limit, batch_size=batch_size, device=device)
        for unit in todo:
            records = result.records[result.records["task"] == unit.task]
            metrics = result.metrics.get(unit.task, {})
            if records.empty:  # a group: its subtasks' items, each under its own task name
                records = result.records[~result.records["task"].isin([u.task for u in todo])]
            _write(unit, records, metrics, spec, harness)
            done.append((unit, metrics))
        return done


def primary_metric(columns: list[str]) -> str | None:
    """The metric a task's rows compare: accuracy when the task reports it, else its first numeric metric."""
    for name in ("acc", "exact_match", "acc_norm", "mc2", "f1"):
        if name in columns:
            return name
    return None


def read_items(run: RunSpec, rd: RunDir, spec: EvalSpec | None) -> list[dict[str, Any]]:
    """Every evaluated item of the run, one dict per (task, doc_id) with its primary metric's value: a study that
    declares evals, its tasks under its settings only; else the newest evaluation of each task."""
    folder = rd.path / EVALS_DIR
    if not folder.is_dir():
        return []
    markers = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)
    latest: dict[str, Path] = {}
    for marker in markers:
        info = json.loads(marker.read_text())
        if spec is None or (info.get("task") in spec.tasks and info.get("settings") == spec.settings()):
            latest[info["task"]] = marker.with_suffix(".parquet")
    rows: list[dict[str, Any]] = []
    for path in latest.values():
        if not path.is_file():
            continue
        frame = pd.read_parquet(path)
        for task, part in frame.groupby("task"):
            metric = primary_metric(list(part.columns))
            if metric is None:
                continue
            rows += [{"arm": run.arm, "grid_key": run.grid_key, "seed": run.seed, "task": task, "metric": metric,
                      "doc_id": str(doc), "value": float(value)} for doc, value in zip(part["doc_id"], part[metric],
                                                                                       strict=True)]
    return rows
