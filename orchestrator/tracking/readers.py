"""Reading a store: a study's child runs as plain records (`fetch_study_runs`), and paging (`search_all`).

Readers never create a store: a missing SQLite file reads as no runs, a damaged one is an error
naming the file. A tracking server or database is probed (`store.probe_store`) before it is read,
and any store that cannot be read is one line (`store.store_error`).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from reslab.orchestrator.tracking.layout import KIND_RUN
from reslab.orchestrator.tracking.store import import_mlflow, probe_store, sqlite_file, store_error, store_uri

log = logging.getLogger(__name__)


def search_all(client: Any, experiment_ids: list[str], filter_string: str = "") -> list[Any]:
    """Every run the search matches, page by page."""
    out, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string=filter_string, max_results=1000, page_token=token)
        out.extend(page)
        token = page.token
        if not token:
            return out


_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's database stores, by URI scheme (less +driver)
_CHILDREN = """FROM runs r JOIN experiments e ON e.experiment_id = r.experiment_id
 JOIN tags k ON k.run_uuid = r.run_uuid AND k.key = 'reslab_kind' AND k.value = :kind
 WHERE e.name = :study AND r.lifecycle_stage = 'active'"""


def fetch_study_runs(tracking_uri: str, study: str, *, params: bool = True) -> list[dict[str, Any]]:
    """Every child run of a study as plain data: {mlflow_run_id, status, start_time, end_time,
    tags, metrics, params}; [] when the study has no experiment or the SQLite file does not exist
    (a read never creates a store). `params=False` leaves each record's params empty (the readouts never
    read them: ~70 a run, most of what a database store holds).

    A database store (SQLite, PostgreSQL) is read with three queries of its tables (the runs, their tags,
    their latest metrics: `_fetch_sql`), what `search_runs` returns, without MLflow building an ORM object
    per tag, param and metric (10^4 runs: minutes; issue 39); a tracking server, or a schema the queries do
    not fit, is read through `search_runs`."""
    tracking_uri = store_uri(tracking_uri)
    db = sqlite_file(tracking_uri)
    if db is not None and not db.is_file():
        return []
    probe_store(tracking_uri)  # a server or database that does not answer: one line, in seconds
    if tracking_uri.partition("://")[0].split("+")[0] in _DATABASES:
        try:
            return _fetch_sql(tracking_uri, study, params)
        except Exception as exc:  # another MLflow schema: read through MLflow, which knows its own
            log.debug("direct read of %s failed (%s); reading through MLflow", tracking_uri, exc)
    try:
        client = import_mlflow()(tracking_uri=tracking_uri)
        exp = client.get_experiment_by_name(study)
        if exp is None:
            return []
        runs = search_all(client, [exp.experiment_id], f"tags.reslab_kind = '{KIND_RUN}'")
    except Exception as exc:  # sqlalchemy/sqlite errors arrive wrapped variously
        raise store_error(tracking_uri, exc) from None
    return [
        {
            "mlflow_run_id": r.info.run_id, "status": r.info.status, "start_time": r.info.start_time,
            "end_time": r.info.end_time, "tags": dict(r.data.tags), "metrics": dict(r.data.metrics),
            "params": dict(r.data.params) if params else {},
        }
        for r in runs
    ]


def _fetch_sql(tracking_uri: str, study: str, params: bool) -> list[dict[str, Any]]:
    """`fetch_study_runs` of a database store, straight from MLflow's tables (its `runs`, `tags`,
    `latest_metrics` and `params`), in `search_runs`' order (newest start first)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri)
    bind = {"kind": KIND_RUN, "study": study}
    try:
        with engine.connect() as conn:
            runs = conn.execute(sqlalchemy.text(
                f"SELECT r.run_uuid, r.status, r.start_time, r.end_time {_CHILDREN} "
                "ORDER BY r.start_time DESC, r.run_uuid"), bind).all()
            records = {uid: {"mlflow_run_id": uid, "status": status, "start_time": start, "end_time": end,
                             "tags": {}, "metrics": {}, "params": {}} for uid, status, start, end in runs}
            tables = [("tags", "tags", "0"), ("latest_metrics", "metrics", "x.is_nan")]
            for table, field, nan in tables + ([("params", "params", "0")] if params else []):
                rows = conn.execute(sqlalchemy.text(
                    f"SELECT x.run_uuid, x.key, x.value, {nan} FROM {table} x JOIN (SELECT r.run_uuid {_CHILDREN}) c "
                    "ON c.run_uuid = x.run_uuid"), bind)
                for uid, key, value, is_nan in rows:
                    records[uid][field][key] = math.nan if is_nan else value
    finally:
        engine.dispose()
    return list(records.values())

