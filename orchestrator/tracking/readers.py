"""Reading a store: a study's child runs as plain records (`fetch_study_runs`), and paging (`search_all`).

Readers never create a store: a missing SQLite file reads as no runs, a damaged one is an error
naming the file. A tracking server or database is probed (`store.probe_store`) before it is read,
and any store that cannot be read is one line (`store.store_error`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from typing import Any

from reslab.orchestrator.durability.fastjson import loads
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


def fetch_study_runs(tracking_uri: str, study: str, *, params: bool = True,
                     keys: Collection[str] | None = None) -> list[dict[str, Any]]:
    """Every child run of a study as plain data: {mlflow_run_id, status, start_time, end_time,
    tags, metrics, params}; [] when the study has no experiment or the SQLite file does not exist
    (a read never creates a store). `params=False` leaves each record's params empty (the readouts never
    read them: ~70 a run, most of what a database store holds); `keys` keeps only the tags and metrics of
    those names (the readouts' `results.collect.RECORD_KEYS`; None: all).

    A database store (SQLite, PostgreSQL) is read with three queries of its tables (the runs, their tags,
    their latest metrics: `_fetch_sql`), what `search_runs` returns, without MLflow building an ORM object
    per tag, param and metric (10^4 runs: minutes; issue 39); a tracking server, or a schema the queries do
    not fit, is read through `search_runs`."""
    tracking_uri = store_uri(tracking_uri)
    db = sqlite_file(tracking_uri)
    if db is not None and not db.is_file():
        return []
    probe_store(tracking_uri)  # a server or database that does not answer: one line, in seconds
    wanted = None if keys is None else frozenset(keys)
    if tracking_uri.partition("://")[0].split("+")[0] in _DATABASES:
        try:
            return _fetch_sql(tracking_uri, study, params, wanted)
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

    def kept(data: dict[str, Any]) -> dict[str, Any]:
        return dict(data) if wanted is None else {k: v for k, v in data.items() if k in wanted}

    return [
        {
            "mlflow_run_id": r.info.run_id, "status": r.info.status, "start_time": r.info.start_time,
            "end_time": r.info.end_time, "tags": kept(r.data.tags), "metrics": kept(r.data.metrics),
            "params": dict(r.data.params) if params else {},
        }
        for r in runs
    ]


_MARKS = {"qmark": "?", "format": "%s", "pyformat": "%s"}  # a DB-API driver's positional parameter mark


def _fetch_sql(tracking_uri: str, study: str, params: bool,
               keys: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """`fetch_study_runs` of a database store, straight from MLflow's tables (its `runs`, `tags`,
    `latest_metrics` and `params`), in `search_runs`' order (newest start first). The rows come through the
    driver's own cursor (`fetchmany`), only the `keys` asked for (`WHERE key IN`): 10^5 runs are millions of
    tag rows, which SQLAlchemy's result rows took half a minute to hand over (issue 39)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(tracking_uri)
    mark = _MARKS[engine.dialect.paramstyle]  # KeyError for another paramstyle: read through MLflow
    children = _CHILDREN.replace(":kind", mark).replace(":study", mark)
    bind = [KIND_RUN, study]
    conn = engine.raw_connection()
    try:
        cur = conn.cursor()
        tags_in_runs = engine.dialect.name == "sqlite" and (keys is None or bool(keys))
        tables = ([] if tags_in_runs else [("tags", "tags", keys)]) + [("latest_metrics", "metrics", keys)] \
            + ([("params", "params", None)] if params else [])
        tags, tag_bind = "", []
        if tags_in_runs:
            # each run's tags as one JSON object (strings, so exact) in the runs' own row: 10^5 rows to hand over,
            # not 3.3 million, orjson building each dict in C. `+x.key` keeps SQLite on the run_uuid index
            # (a run's ~40 tags side by side), not a (key, run_uuid) lookup per key and run (10^5 runs: 6.9 -> 3 s)
            tag_bind = sorted(keys or ())
            named = f" AND +x.key IN ({', '.join([mark] * len(tag_bind))})" if tag_bind else ""
            tags = f", (SELECT json_group_object(x.key, x.value) FROM tags x WHERE x.run_uuid = r.run_uuid{named})"
        cur.execute(f"SELECT r.run_uuid, r.status, r.start_time, r.end_time{tags} {children} "
                    "ORDER BY r.start_time DESC, r.run_uuid", tag_bind + bind)
        records = {}
        while runs := cur.fetchmany(1 << 12):  # in batches: 10^5 runs' tag objects at once are ~150 MB of text
            for uid, status, start, end, *grouped in runs:
                records[uid] = {"mlflow_run_id": uid, "status": status, "start_time": start, "end_time": end,
                                "tags": loads(grouped[0]) if grouped else {}, "metrics": {}, "params": {}}
        for table, field, only in tables:
            if only is not None and not only:
                continue
            nan = "x.is_nan" if table == "latest_metrics" else "0"
            named_keys = sorted(only or ())
            where = f" WHERE x.key IN ({', '.join([mark] * len(named_keys))})" if named_keys else ""
            cur.execute(f"SELECT 1 FROM {table} x{where} LIMIT 1", named_keys)
            if not cur.fetchall():  # one index probe: no such key in the store (a new store's summary metrics)
                continue
            joined = f"FROM {table} x JOIN (SELECT r.run_uuid {children}) c ON c.run_uuid = x.run_uuid{where}"
            cur.execute(f"SELECT x.run_uuid, x.key, x.value, {nan} {joined}", bind + named_keys)
            while rows := cur.fetchmany(1 << 16):  # in batches: 10^5 runs' tag rows at once are a gigabyte of tuples
                for uid, key, value, is_nan in rows:
                    records[uid][field][key] = math.nan if is_nan else value
        cur.close()
    finally:
        conn.close()
        engine.dispose()
    return list(records.values())
