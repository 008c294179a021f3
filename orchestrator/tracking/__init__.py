"""MLflow tracking, one module per role; the package imports nothing (mlflow costs ~3 s, loaded lazily).

Import from the role module:

    layout.py     the MLflow layout: record kinds, `MLFLOW_STATUS` (a run's state to MLflow's statuses, read
                  from the vocabulary table `orchestrator.tasks.WORDS`), the `summary/<name>` tags
    store.py      the store: `store_uri`, `sqlite_file`, the mlflow import (HTTP retries bounded), `retry` on a
                  locked database, the probes (`check_server`, `check_database`, `probe_store`), one-line
                  errors (`store_error`, `TrackingUnavailable`), `is_outage`
    client.py     `StoreClient`: one opened store (created or migrated once under the workspace's lock), the
                  study's experiment, its children found and reconciled by run id, batched params and tags
    children.py   the children of one submission: `ChildLedger` (a run's child looked up by run id, created
                  once, held while it runs), `MetricWriter` (its rows and tags queued and written in batches)
    writer.py     `MlflowWriter`: the plain MLflow writes of one submission (parent run, each run's life cycle on
                  its child, events, the study's result), on the children's roles; with its client and
                  children, the only code that writes to MLflow; no outage logic
    guarded.py    `GuardedTracker`: the driver's tracker, an `MlflowWriter` that waits out tracking outages;
                  what a run missed is a `Behind` record (`Missed`: its last end), caught up from its run dir
    protocol.py   `DriverTracker`: what the driver needs from a tracker, and `NullTracker`, which records
                  nothing (no mlflow import, no reslab import at run time)
    readers.py    `fetch_study_runs`, `search_all`: reads that never create a store
    relocate.py   `relocate_artifacts`: a moved or copied workspace's store pointed back into it
    template.py   a new workspace's SQLite store copied from a cached empty one (no migrations to run)
    views.py      the study's experiment tags, its runs view grouped by arm and the links to it
    dashboard.py  `start_dashboard`: the `mlflow server` process behind `reslab dashboard`

Dependencies point one way: layout, store, relocate and protocol are leaves; template uses store; readers and views use
layout and store; the client uses store, template, relocate, readers, views and layout; children use the client,
store and layout, the writer children, the client, store and layout; the guarded tracker uses the writer and store;
the dashboard uses the store. The writer and the guarded tracker satisfy protocol without importing it.
No other reslab module imports mlflow: `store.import_mlflow` does, on first use (and the client then
takes MLflow's entity classes, the template its version).
"""
