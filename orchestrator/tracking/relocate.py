"""A moved or copied workspace: its SQLite store's artifact locations pointed back into it.

The embedded store records absolute artifact locations; when the writer opens a store whose study
experiments point into another workspace's `mlartifacts/`, it rewrites them (experiments and runs)
to this workspace (`relocate_artifacts`), so a copy never writes into the original.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path


def relocate_artifacts(db: Path, artifacts_uri: str) -> int:
    """Point the study experiments (and their runs) of the SQLite store `db` that live under
    another workspace's `mlartifacts/` at `artifacts_uri` instead; returns how many moved.

    MLflow has no API to change an experiment's artifact location, so this edits its tables
    (`experiments.artifact_location`, `runs.artifact_uri`) directly; call it under the tracking lock.
    """
    moved = 0
    con = sqlite3.connect(db, timeout=30)
    try:
        with con:
            rows = con.execute("SELECT experiment_id, name, artifact_location FROM experiments").fetchall()
            for experiment_id, name, location in rows:
                suffix = f"/mlartifacts/{name}"
                if not (location or "").endswith(suffix) or location == f"{artifacts_uri}/{name}":
                    continue
                old = location[: -len(suffix)] + "/mlartifacts/"
                con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                            (f"{artifacts_uri}/{name}", experiment_id))
                con.execute("UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                            "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                            (artifacts_uri + "/", len(old) + 1, experiment_id, len(old), old))
                moved += 1
    finally:
        con.close()
    if moved:
        logging.getLogger(__name__).warning("%s: %d experiment(s) pointed into another workspace's artifacts; "
                                            "now at %s", db, moved, artifacts_uri)
    return moved
