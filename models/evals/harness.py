"""lm-evaluation-harness as the evaluator: which tasks exist, whether they can run here, and one evaluation of a
model on tasks, through the harness's Python API (`lm_eval.simple_evaluate` with a `ReslabLM`), returning its
per-task metrics and every item's record as `log_samples` gives them.

Tasks are found by the harness's `TaskManager`: its own registry plus `include_path` folders (the local
`reslab_next_line` task's folder, `models.evals.next_line`). Checks, each one line (`ConfigError`):

- an unknown task name, with the registry's closest names;
- a task whose data set cannot be read offline: the harness reads data sets through `datasets`; a local file
  (`dataset_path: json|csv|parquet|text` with `data_files`) must exist; a hub data set must be in the
  Hugging Face cache when the hub is off (`HF_DATASETS_OFFLINE` or `HF_HUB_OFFLINE` set), which is how tests
  and clusters without internet run (README: offline caches).

Generation tasks (`output_type: generate_until`) run on `Decoder.generate` (`models.decoding`).

Item records (`item_records`): one row per (task, doc_id): `doc_hash` (the harness's hash of the document,
the same whatever model is scored, so items pair across runs by it), `target`, every per-item metric the task
reports (`acc`, `acc_norm`, `exact_match`, ...) as floats, `loglikelihoods` (each choice's, for
log-likelihood tasks) and `response` (the generated text, for generation tasks).
"""

from __future__ import annotations

import difflib
import functools
import importlib.metadata
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.common.errors import ConfigError
from reslab.models.evals.task_files import check_file, files_digest, local_files, next_line_digest

RECORD_COLUMNS = ("task", "doc_id", "doc_hash", "target", "loglikelihoods", "response")


def harness_version() -> str:
    """The installed lm-evaluation-harness's version (part of an evaluation's content id)."""
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("evals: lm-evaluation-harness is not installed; allowed: pip install 'reslab[eval]'") \
            from None


def task_manager(include_paths: Sequence[Path] = ()) -> Any:
    """The harness's task registry with `include_paths` added (quiet: the harness logs every folder it scans)."""
    harness_version()
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    paths = [str(p) for p in include_paths]
    return TaskManager(verbosity="WARNING", include_path=paths or None)


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
               for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _check_data(name: str, config: dict[str, Any]) -> None:
    """The task's data set can be read here (module docstring)."""
    path = config.get("dataset_path")
    if not isinstance(path, str):
        return  # a task class that builds its own data
    builder, files = local_files(config)
    if files:
        for f in files:
            if not f.exists():
                raise ConfigError(f"evals.tasks: {name!r} reads {f}, which does not exist; allowed: a task whose "
                                  "data files are on this machine")
            check_file(name, f, builder)  # a damaged file: refused here, not after the runs train (issue 52)
        return
    if not _offline():
        return
    import datasets

    try:
        datasets.load_dataset_builder(path, config.get("dataset_name"), **(config.get("dataset_kwargs") or {}))
    except Exception as exc:  # datasets raises many types for a data set it cannot find offline
        raise ConfigError(f"evals.tasks: {name!r} needs the data set {path!r} (config {config.get('dataset_name')!r}),"
                          f" which is not in the Hugging Face cache and the hub is offline ({type(exc).__name__}); "
                          "allowed: a task whose data set is cached (README: offline caches), or unset "
                          "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE where the hub can be reached") from None


def check_tasks(names: Sequence[str], include_paths: Sequence[Path] = (), manager: Any = None) -> None:
    """Every task name is in the harness's registry (with `include_paths`) and its data can be read here; each
    failure is one `ConfigError` line."""
    manager = manager or task_manager(include_paths)
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigError(f"evals.tasks: {name!r} is not a task of lm-evaluation-harness {harness_version()} or "
                              f"reslab's local tasks{hint} (allowed: a name `lm_eval --tasks list` shows, or "
                              "reslab_next_line)")
    for leaf in _leaves(manager, names):
        _check_data(leaf, manager._get_config(leaf))


@functools.lru_cache(maxsize=64)
def _task_files(task: str) -> tuple[Path, ...]:
    """The local data files of a harness task (its leaves', for a group), looked up once per process."""
    manager = task_manager()
    if task not in set(manager.all_tasks):
        return ()
    return tuple(f for leaf in _leaves(manager, [task]) for f in local_files(manager._get_config(leaf))[1])


def task_data_digest(task: str, corpus: Path | None) -> str | None:
    """The hash of the local files `task`'s items come from (`models.evals.task_files`), part of an evaluation's
    content id: `reslab_next_line`'s items built from `corpus`, a harness task's local data files; None for a
    task of a hub data set."""
    from reslab.models.evals.next_line import TASK_NAME

    if task == TASK_NAME:
        return None if corpus is None else next_line_digest(corpus)
    return files_digest(f for f in _task_files(task) if f.is_file())


def _leaves(manager: Any, names: Sequence[str]) -> list[str]:
    """The tasks under the named groups and tags (a group's data is its tasks'), in order, each once."""
    leaves: list[str] = []
    for name in names:
        entry = manager.task_index.get(name, {})
        if entry.get("type") == "tag":
            leaves += _leaves(manager, entry.get("task", []))
        elif entry.get("type") == "group":
            subtasks = manager._get_config(name).get("task", [])
            leaves += _leaves(manager, [t for t in subtasks if isinstance(t, str)])
        elif entry:
            leaves.append(name)
    return list(dict.fromkeys(leaves))


@dataclass(frozen=True)
class Evaluation:
    """One model's evaluation: per-task metrics (task -> metric -> value), which metrics are better higher,
    and the item records (module docstring)."""

    metrics: dict[str, dict[str, float]]
    higher_is_better: dict[str, dict[str, bool]]
    records: pd.DataFrame


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    return None


def item_records(samples: dict[str, list[dict[str, Any]]]) -> pd.DataFrame:
    """The harness's `log_samples` as one row per (task, doc_id) (module docstring)."""
    rows = []
    for task, examples in samples.items():
        for ex in examples:
            row: dict[str, Any] = {"task": task, "doc_id": int(ex["doc_id"]), "doc_hash": str(ex.get("doc_hash", "")),
                                   "target": str(ex.get("target", "")), "loglikelihoods": None, "response": None}
            responses = ex.get("filtered_resps") or []
            if responses and isinstance(responses[0], list | tuple) and responses[0] and \
                    isinstance(responses[0][0], float | int):
                row["loglikelihoods"] = [float(r[0]) for r in responses]
            elif responses and isinstance(responses[0], float | int):
                row["loglikelihoods"] = [float(r) for r in responses]
            elif responses and isinstance(responses[0], str):
                row["response"] = responses[0]
            for metric in ex.get("metrics", []):
                value = _number(ex.get(metric))
                if value is not None:
                    row[metric] = value
            rows.append(row)
    frame = pd.DataFrame(rows)
    return frame if len(frame) else pd.DataFrame(columns=list(RECORD_COLUMNS))


def run_tasks(lm: Any, tasks: Sequence[str], *, include_paths: Sequence[Path] = (), num_fewshot: int | None = None,
              limit: int | None = None, seed: int = 0, manager: Any = None) -> Evaluation:
    """Evaluate `lm` (a `ReslabLM`) on `tasks` with the harness, every item logged (`manager`: a task registry
    already built with `include_paths`, which takes the harness seconds to index)."""
    from lm_eval import simple_evaluate

    manager = manager or task_manager(include_paths)
    check_tasks(tasks, manager=manager)
    out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, log_samples=True,
                          task_manager=manager, bootstrap_iters=0, random_seed=seed, numpy_random_seed=seed,
                          torch_random_seed=seed, fewshot_random_seed=seed, verbosity="WARNING")
    metrics = {task: {key.split(",")[0]: float(v) for key, v in values.items()
                      if isinstance(v, int | float) and not isinstance(v, bool) and "_stderr" not in key}
               for task, values in out["results"].items()}
    higher = {task: {m: bool(v) for m, v in values.items()} for task, values in out.get("higher_is_better", {}).items()}
    return Evaluation(metrics=metrics, higher_is_better=higher, records=item_records(out["samples"]))
