"""One life-cycle vocabulary (`tasks.WORDS`): every word's CLI word, MLflow status and recorded state."""

from __future__ import annotations

from reslab.orchestrator.tasks import RECORDED, WORDS, Action, RunState
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
    assert MLFLOW_STATUS[RunState.PRUNED] == "KILLED"


def test_run_states_read_back_from_status_files_and_print_as_words():
    assert RunState("SUCCESS") is RunState.SUCCESS  # the status file's spelling since 0.1
    assert RECORDED == (RunState.RUNNING, RunState.SUCCESS, RunState.FAILED, RunState.INTERRUPTED)
    assert WORDS[RunState.PRUNED].recorded is RunState.INTERRUPTED  # checkpointed: the next attempt resumes it
    assert [s.label for s in RunState] == ["running", "succeeded", "failed", "interrupted", "pruned"]


def test_every_word_has_one_row_and_one_cli_word():
    assert set(WORDS) == set(RunState) | set(Action)
    words = [w.label for w in WORDS]
    assert len(set(words)) == len(words)
    assert [a.label for a in Action] == ["to run", "skipped", "busy"]
    assert all(WORDS[a].mlflow is None and WORDS[a].recorded is None for a in Action)
