"""Reading a store: a study's child runs as plain records (`fetch_study_runs`), and paging (`search_all`).

Readers never create a store: a missing SQLite file reads as no runs, a damaged one is an error
naming the file. A tracking server or database is probed (`store.probe_store`) before it is read,
and any store that cannot be read is one line (`store.store_error`).
"""

from __future__ import annotations

from typing import Any

from reslab.orchestrator.tracking.layout import KIND_RUN
from reslab.orchestrator.tracking.store import import_mlflow, probe_store, sqlite_file, store_error, store_uri


def search_all(client: Any, experiment_ids: list[str], filter_string: str = "") -> list[Any]:
    """Every run the search matches, page by page."""
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
    probe_store(tracking_uri)  # a server or database that does not answer: one line, in seconds
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
            "params": dict(r.data.params),
        }
        for r in runs
    ]
