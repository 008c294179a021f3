"""MLflow tracking, one module per role; the package imports nothing (mlflow costs ~3 s, loaded lazily).

Import from the role module:

    layout.py     the MLflow layout: record kinds, `MLFLOW_STATUS` (a run's state to MLflow's statuses, read
                  from the vocabulary table `orchestrator.tasks.WORDS`), the `summary/<name>` tags
    store.py      the store: `store_uri`, `sqlite_file`, the mlflow import (HTTP retries bounded), `retry` on a
                  locked database, the probes (`check_server`, `check_database`, `probe_store`), one-line
                  errors (`store_error`, `TrackingUnavailable`), `is_outage`
    writer.py     `Tracker`: the driver's writer, the only code that writes to MLflow; it waits out
                  tracking outages and catches runs up from their run directories
    protocol.py   `DriverTracker`: what the driver needs from a tracker (no mlflow import)
    readers.py    `fetch_study_runs`, `search_all`: reads that never create a store
    relocate.py   `relocate_artifacts`: a moved or copied workspace's store pointed back into it
    template.py   a new workspace's SQLite store copied from a cached empty one (no migrations to run)
    views.py      the study's experiment tags, its runs view grouped by arm and the links to it
    dashboard.py  `start_dashboard`: the `mlflow server` process behind `reslab dashboard`

Dependencies point one way: layout, store, relocate and protocol are leaves; template uses store; readers and views use
layout and store; the writer uses all but protocol (which it satisfies); the dashboard uses the store.
No other reslab module imports mlflow: `store.import_mlflow` does, on first use (and the writer then
takes MLflow's entity classes, the template its version).
"""
