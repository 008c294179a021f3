"""One vocabulary of run state, mapped in one place to MLflow's run statuses."""

from __future__ import annotations

from reslab.orchestrator.tasks import RunState
from reslab.orchestrator.tracking.layout import MLFLOW_STATUS
from reslab.orchestrator.tracking.store import import_mlflow


def test_every_run_state_maps_to_a_real_mlflow_status():
    import_mlflow()
    from mlflow.entities import RunStatus  # the independent source: MLflow's own enumeration

    assert set(MLFLOW_STATUS) == set(RunState)
    assert set(MLFLOW_STATUS.values()) <= {RunStatus.to_string(s) for s in RunStatus.all_status()}
    terminal = {s for s in RunState if s is not RunState.RUNNING}
    assert all(RunStatus.is_terminated(RunStatus.from_string(MLFLOW_STATUS[s])) for s in terminal)
    assert MLFLOW_STATUS[RunState.SUCCESS] == "FINISHED" and MLFLOW_STATUS[RunState.INTERRUPTED] == "KILLED"


def test_run_states_read_back_from_status_files_and_print_as_words():
    assert RunState("SUCCESS") is RunState.SUCCESS  # the status file's spelling since 0.1
    assert [s.label for s in RunState] == ["running", "succeeded", "failed", "interrupted"]
