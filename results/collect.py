"""Collect a study's runs from MLflow into one tidy table, one row per run, cached as Parquet.

Columns: `run_id, study, arm, grid_key, seed, pair_key, residual, status, mlflow_run_id,
code_version, results_version, start_time, end_time, error` (the failure a FAILED run recorded,
e.g. its divergence), then one float column per summary metric
(`common.metrics.SUMMARY_METRICS`, the registry training reports from). `status` is MLflow's
(`FINISHED`, `RUNNING`, `FAILED`, `KILLED`), or `MISSING` for a run the study expects that MLflow
has never seen. Summary metrics come from the `summary/<name>` tags the driver sets when a run
succeeds (`repr` of the float; stores written before reslab moved them out of the metrics, to keep
them off MLflow's run charts, have them as `summary/<name>` metrics, read as well), so an unfinished
run has NaN there, never a mid-training value.

The records are plain dicts (`orchestrator.tracking.readers.fetch_study_runs` reads them from MLflow and
hands them over; nothing here imports the orchestrator or mlflow). `collect` tabulates them and
rewrites the cache `<cache_dir>/<study>.parquet`; `load_cached` reads the cache alone, for
notebooks or when the tracking server is unreachable. `runs_table` and `pairs_table` are pure
functions of their inputs.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reslab.common.errors import ConfigError
from reslab.common.io import write_atomic
from reslab.common.metrics import SUMMARY_METRICS

log = logging.getLogger(__name__)
KEY_COLUMNS: tuple[str, ...] = (
    "run_id", "study", "arm", "grid_key", "seed", "pair_key", "residual", "status", "mlflow_run_id",
    "code_version", "results_version", "start_time", "end_time", "error", "machine",
)
COLUMNS = KEY_COLUMNS + SUMMARY_METRICS
# The tags and metrics `runs_table` reads from a record: its key tags and each summary metric's `summary/<name>`
# (a tag, or a metric in older stores). What `fetch_study_runs(keys=...)` needs to fetch, and no more.
RECORD_KEYS: tuple[str, ...] = (
    "run_id", "study", "arm", "grid_key", "seed", "pair_key", "residual", "code_version", "results_version",
    "error", "cost/machine", *(f"summary/{name}" for name in SUMMARY_METRICS),
)
FINISHED = "FINISHED"  # MLflow's status of a run that ended with a whole summary
MISSING = "MISSING"  # the status of an expected run MLflow has never seen
_STATUS_RANK = {FINISHED: 0, "RUNNING": 1, "SCHEDULED": 2, "KILLED": 3, "FAILED": 4}


_SUMMARY_KEYS = tuple(f"summary/{name}" for name in SUMMARY_METRICS)
_SUMMARY_TAGS = operator.itemgetter(*_SUMMARY_KEYS)  # every summary tag at once: a finished run's
_RUN_ID, _STATUS, _START = (COLUMNS.index(name) for name in ("run_id", "status", "start_time"))


def _row(rec: dict[str, Any]) -> tuple[Any, ...]:
    """One table row, its values in `COLUMNS` order (a tuple: 10^5 runs' dicts took seconds; issue 39); raises
    ValueError/TypeError for a record of the wrong shape."""
    tags, metrics = rec.get("tags") or {}, rec.get("metrics") or {}
    seed = tags.get("seed")
    try:
        summary: Iterable[float] = map(float, _SUMMARY_TAGS(tags))
    except KeyError:  # an unfinished run, or an older store's summary metrics
        summary = [float(value) if (value := tags.get(key, metrics.get(key))) is not None else math.nan
                   for key in _SUMMARY_KEYS]
    return (
        tags.get("run_id"), tags.get("study"), tags.get("arm"), tags.get("grid_key", ""),
        int(seed) if seed not in (None, "") else None, tags.get("pair_key"), tags.get("residual"), rec.get("status"),
        rec.get("mlflow_run_id"), tags.get("code_version"), tags.get("results_version"),
        _ts(rec.get("start_time")), _ts(rec.get("end_time")), tags.get("error") or None,
        tags.get("cost/machine") or None, *summary,
    )


def _missing(run: Any) -> tuple[Any, ...]:
    """The row of an expected run MLflow has never seen: its key columns, status `MISSING`, no values."""
    row: dict[str, Any] = {c: None for c in KEY_COLUMNS} | {m: math.nan for m in SUMMARY_METRICS}
    row.update(run_id=run.run_id, study=run.study, arm=run.arm, grid_key=run.grid_key, seed=run.seed,
               pair_key=run.pair_key, residual=run.config.residual.name, status=MISSING)
    return tuple(row[c] for c in COLUMNS)


_MS_MAX = pd.Timestamp.max.value // 1_000_000  # the milliseconds since the epoch a pandas timestamp can hold


def _ts(ms: Any) -> int | None:
    """MLflow's start or end time as whole milliseconds since the epoch (None: not set), made a timestamp column
    at once by `runs_table` (one `pd.Timestamp` per value took seconds at 10^5 runs; issue 39); OverflowError
    for a time no timestamp holds, as `pd.Timestamp` raises it."""
    if not ms:
        return None
    value = int(ms)
    if abs(value) > _MS_MAX:
        raise OverflowError(f"{value} ms since the epoch is out of the range of a timestamp")
    return value


def _rows(records: Iterable[dict[str, Any]]) -> Iterable[tuple[Any, ...]]:
    """Each record's row; a record of the wrong shape (a hand-made or foreign MLflow run: a
    non-numeric seed tag, a bad timestamp) is left out with a warning naming it, never the study."""
    for rec in records:
        try:
            yield _row(rec)
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            who = rec.get("mlflow_run_id") if isinstance(rec, dict) else repr(rec)[:80]
            log.warning("MLflow run %s: unreadable record (%s: %s); left out of the table. Fix or delete that run",
                        who, type(exc).__name__, exc)


def runs_table(records: Iterable[dict[str, Any]], expected: Iterable[Any] | None = None) -> pd.DataFrame:
    """Tidy table from `fetch_study_runs` records: one row per run id (a FINISHED MLflow run wins
    over others, then the newest).

    With `expected` (objects with `run_id, study, arm, grid_key, seed, pair_key`, e.g. the
    study's `RunSpec`s), the table holds exactly those runs, in that order: runs MLflow has under
    other ids (another results version, other `--set` overrides) are left out, and expected runs
    MLflow lacks appear with status `MISSING`, so comparisons flag them as incomplete.
    """
    best: dict[str, tuple[tuple[int, int], tuple[Any, ...]]] = {}  # run id -> (its rank, its best row)
    for row in _rows(records):
        rid = row[_RUN_ID]
        if not rid:
            continue
        cur = best.get(rid)
        key = (_STATUS_RANK.get(row[_STATUS], 9), -(row[_START] or 0))
        if cur is None or key < cur[0]:
            best[rid] = (key, row)
    rows = [row for _, row in best.values()]
    if expected is not None:
        by_id = {row[_RUN_ID]: row for row in rows}
        rows = [by_id.get(run.run_id) or _missing(run) for run in expected]
    columns = dict(zip(COLUMNS, zip(*rows, strict=True) if rows else [()] * len(COLUMNS), strict=True))
    table = pd.DataFrame({name: columns[name] for name in KEY_COLUMNS}, dtype=object)  # no inferred string dtype
    for name in SUMMARY_METRICS:
        table[name] = np.array(columns[name], dtype=np.float64)
    table["seed"] = table["seed"].astype("Int64")
    for name in ("start_time", "end_time"):
        table[name] = pd.to_datetime(table[name], unit="ms", utc=True)
    if expected is None:
        table = table.sort_values(["grid_key", "seed", "arm"], kind="stable").reset_index(drop=True)
    return table


def cache_path(cache_dir: str | Path, study: str) -> Path:
    return Path(cache_dir) / f"{study}.parquet"


def collect(study: str, records: Iterable[dict[str, Any]], *, expected: Iterable[Any] | None = None,
            cache_dir: str | Path | None = None) -> pd.DataFrame:
    """`runs_table` of the study's MLflow records; writes the Parquet cache when `cache_dir` is given."""
    table = runs_table(records, expected)
    if cache_dir is not None:
        save_cached(study, table, cache_dir)
    return table


def save_cached(study: str, table: pd.DataFrame, cache_dir: str | Path) -> None:
    """Rewrite the study's Parquet cache with `table`."""
    write_atomic(cache_path(cache_dir, study), table.to_parquet(index=False))


def load_cached(study: str, cache_dir: str | Path) -> pd.DataFrame:
    path = cache_path(cache_dir, study)
    if not path.is_file():
        raise ConfigError(f"--cached: no cached runs table for study {study!r} at {path}; run `reslab run` "
                          "once with MLflow reachable to create it")
    try:
        return pd.read_parquet(path)
    except Exception as exc:  # pyarrow raises its own types for a damaged file
        raise ConfigError(f"--cached: {path} is unreadable ({type(exc).__name__}); delete it and compare without "
                          "--cached (reads MLflow)") from None


def usable(runs: pd.DataFrame, metric: str | None = None) -> pd.Series:
    """Which runs a result reads: finished (`FINISHED`, MLflow's status of a run with a whole summary),
    with a finite `metric` when one is named. The one test of a usable run for every readout."""
    mask = runs["status"] == FINISHED
    if metric is not None:
        values = pd.to_numeric(runs[metric], errors="coerce").to_numpy(dtype=np.float64) if metric in runs \
            else np.full(len(runs), np.nan)
        mask &= np.isfinite(values)
    return mask


def recorded(runs: pd.DataFrame) -> pd.Series:
    """Which runs MLflow has a record of (every status but `MISSING`)."""
    return runs["status"] != MISSING


def matched_seeds(runs: pd.DataFrame, arms: Iterable[str], metric: str) -> pd.DataFrame:
    """The seed-matched values of `arms`: one row per (grid_key, seed) at which any of them has a run
    (a missing grid key is the empty one), sorted by grid key and seed. Columns: `grid_key`, `seed`, and
    per arm `value/<arm>`, its usable run's `metric` (NaN: none), and `run_id/<arm>`, that run's id (else
    the id of its run there that is not usable; None: no run). The one seed matcher of every readout.

    Where an arm has several runs at a cell, the first in `runs` counts. One pass over plain lists: a
    readout matches seeds once per cell (10^5 runs: 50 cells, each a pandas mask per arm took seconds; issue 39)."""
    arms = list(arms)
    mine = runs[runs["arm"].isin(arms) & runs["seed"].notna()]
    keys = list(zip(mine["grid_key"].fillna("").astype(str).tolist(), mine["seed"].astype(np.int64).tolist(),
                    strict=True))
    ids = mine["run_id"].tolist() if "run_id" in mine else [None] * len(mine)
    values = mine[metric].tolist()
    first_id: dict[str, dict[tuple[str, int], Any]] = {arm: {} for arm in arms}  # any run's
    first_usable: dict[str, dict[tuple[str, int], tuple[Any, Any]]] = {arm: {} for arm in arms}  # (id, value)
    for key, arm, run_id, ok, value in zip(keys, mine["arm"].tolist(), ids, usable(mine, metric).tolist(), values,
                                          strict=True):
        first_id[arm].setdefault(key, run_id)
        if ok:
            first_usable[arm].setdefault(key, (run_id, value))
    cells = sorted(set(keys))
    out = pd.DataFrame({"grid_key": [g for g, _ in cells], "seed": [int(s) for _, s in cells]})
    for arm in arms:
        found = first_usable[arm]
        out[f"value/{arm}"] = np.array([found[c][1] if c in found else math.nan for c in cells], dtype=np.float64)
        out[f"run_id/{arm}"] = [found[c][0] if c in found else first_id[arm].get(c) for c in cells]
    return out


def complete_seeds(matched: pd.DataFrame, arms: Iterable[str]) -> pd.DataFrame:
    """The rows of `matched_seeds` where every one of `arms` has a usable run."""
    cols = [f"value/{arm}" for arm in arms]
    return matched[np.isfinite(matched[cols].to_numpy(dtype=np.float64)).all(axis=1)]


def pairs_table(runs: pd.DataFrame, comparisons: Iterable[Any]) -> pd.DataFrame:
    """Per comparison, treatment, grid point and seed: both arms' run ids, values and the delta
    (treatment minus control). Seeds where either arm has no usable run keep a row with the
    available ids and NaN values, so an export shows what is missing."""
    out = []
    for comp in comparisons:
        for treatment in comp.treatments:
            matched = matched_seeds(runs, (comp.control, treatment), comp.metric)
            for r in matched.to_dict("records"):
                cv, tv = r[f"value/{comp.control}"], r[f"value/{treatment}"]
                out.append({
                    "comparison": comp.name, "metric": comp.metric, "grid_key": r["grid_key"], "seed": r["seed"],
                    "control": comp.control, "treatment": treatment,
                    "control_run_id": r[f"run_id/{comp.control}"], "treatment_run_id": r[f"run_id/{treatment}"],
                    "control_value": cv, "treatment_value": tv, "delta": tv - cv,
                })
    return pd.DataFrame(out, columns=["comparison", "metric", "grid_key", "seed", "control", "treatment",
                                      "control_run_id", "treatment_run_id", "control_value", "treatment_value",
                                      "delta"])
