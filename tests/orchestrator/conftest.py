"""Shared fixtures: a workspace with a ready MLflow database, and one Ray session."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(scope="session")
def mlflow_db_template(tmp_path_factory) -> Path:
    """An MLflow SQLite file with its schema created once (the migration takes 5-10 s)."""
    from reslab.orchestrator.tracking.store import import_mlflow

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    import_mlflow()(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)
    return path


@pytest.fixture
def workspace(tmp_path, mlflow_db_template):
    from reslab.orchestrator.durability.workspace import Workspace

    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir(parents=True)
    shutil.copy(mlflow_db_template, ws.mlflow_db)
    return ws


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray instance for every in-process Ray test (~6 s and ~0.5 GB to start)."""
    from reslab.orchestrator.dispatch.ray_backend import RayBackend

    backend = RayBackend("local", workspace=tmp_path_factory.mktemp("ray-ws"), num_cpus=2)
    info = backend.start()
    yield info
    backend.shutdown()


def pytest_collection_modifyitems(config, items):
    """MLflow 3.17's SQLAlchemy store warns about its own use of a deprecated loader; not ours."""
    here = Path(__file__).parent
    mark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated:DeprecationWarning")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(mark)
