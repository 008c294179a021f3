"""A new workspace's SQLite store, copied from a template of MLflow's empty schema.

Creating an MLflow SQLite store runs every Alembic migration MLflow ships (about 1.2 s of CPU, the
largest piece of a one-run submission's fixed cost after Ray's start; bench/bench_fixed_cost.py).
An empty store depends only on the MLflow and SQLAlchemy versions, so the first store this machine
creates is copied, before anything is written to it, to
`$RESLAB_CACHE/mlflow-store/mlflow-<version>-sqlalchemy-<version>.db`, and every later new
workspace starts from a copy of that file, which MLflow then opens as it opens any store (checking
its schema revision).

The one row MLflow writes when it creates a store, the Default experiment, is then made this
store's (`own_default_experiment`, for a store made either way): created now, its artifacts in the
workspace's `mlartifacts/Default`, not in `./mlruns` of whatever directory the driver ran in. A
template that fails SQLite's check or lacks MLflow's tables is not used (MLflow creates the store),
and a store created without one replaces it; every write is atomic, so concurrent drivers at worst
each build their own.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from pathlib import Path

from reslab.common.io import cache_root, write_atomic
from reslab.orchestrator.tracking.store import TrackingUnavailable

_TABLES = {"alembic_version", "experiments", "runs", "metrics", "params", "tags"}
_log = logging.getLogger(__name__)


def template_path() -> Path:
    import mlflow
    import sqlalchemy

    return cache_root() / "mlflow-store" / f"mlflow-{mlflow.__version__}-sqlalchemy-{sqlalchemy.__version__}.db"


def restore_template(db: Path) -> bool:
    """Copy the template to `db` (which must not exist); False, and nothing written, when there is
    no usable template."""
    template = template_path()
    if not template.is_file() or not _usable(template):
        return False
    try:
        write_atomic(db, template.read_bytes())
    except OSError as exc:
        _log.debug("copying the MLflow store template %s failed: %s", template, exc)
        return False
    return True


def save_template(db: Path) -> None:
    """Keep the store MLflow just created, still empty, as the template (a consistent snapshot,
    safe while MLflow holds it open); a failure only costs the next new workspace the migrations."""
    with contextlib.suppress(OSError, sqlite3.Error):
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as con:
            snapshot = con.serialize()
        write_atomic(template_path(), snapshot)


def template_unusable(db: Path, exc: Exception) -> TrackingUnavailable:
    """The error when MLflow cannot open a store copied from the template: the copy (nothing is
    recorded in it yet) and the template are removed, so the next start lets MLflow build both."""
    db.unlink(missing_ok=True)
    template = template_path()
    template.unlink(missing_ok=True)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return TrackingUnavailable(f"{db}: MLflow could not open the store copied from the template {template} ({first}); "
                               "both are removed: run the command again and MLflow creates the store")


def own_default_experiment(db: Path, artifacts_uri: str) -> None:
    """Make the new store's Default experiment (id 0) this store's: created now, its artifacts in
    `artifacts_uri/Default`. MLflow has no API to move an experiment's artifacts, hence SQL."""
    now_ms = int(time.time() * 1000)
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                        "WHERE experiment_id = 0", (f"{artifacts_uri}/Default", now_ms, now_ms))
    finally:
        con.close()


def _usable(template: Path) -> bool:
    """An intact SQLite file with MLflow's tables, only the Default experiment and no runs."""
    try:
        with contextlib.closing(sqlite3.connect(f"{template.as_uri()}?mode=ro", uri=True)) as con:
            if con.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return False
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables >= _TABLES:
                return False
            experiments = con.execute("SELECT experiment_id FROM experiments").fetchall()
            revisions = con.execute("SELECT version_num FROM alembic_version").fetchall()
            return experiments == [(0,)] and len(revisions) == 1 and con.execute(
                "SELECT count(*) FROM runs").fetchone() == (0,)
    except sqlite3.Error:
        return False
