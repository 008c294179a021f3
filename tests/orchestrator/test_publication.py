"""The study's result on the submission's parent MLflow run: the parent is FINISHED only once everything is
published, and a publication cut short (the driver killed right after its runs ended) is completed by any
later `reslab run`, a no-op one included; publishing twice adds nothing twice.

`submit` is given the publication `reslab run` gives it (`cli/study.py`, `_submit_study`): the study's
result gathered and published before the parent run ends.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from orch_helpers import KilledDriver, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.gathering.gather import publish_result, publish_study_result
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.layout import PUBLISHED_TAG
from reslab.orchestrator.tracking.store import import_mlflow

RESULT = {"report.html", "paired_table.json", "paired_table.csv", "forest.png"}


def _submit(study, runs, workspace, before=None):
    """`reslab run`'s submission: its publication, after `before(tracker)` (a check, or a kill)."""
    tracker = GuardedTracker(workspace.default_tracking_uri(), workspace)

    def publish(result):
        if before is not None:
            before(tracker)
        result.published = publish_result(study, result.runs, workspace, tracker, result.result_key)

    tracker.publisher = publish
    result = submit(study, runs, workspace, LocalBackend(), tracker, ExecutionOptions(), stream=io.StringIO(),
                    say=lambda *_: None)
    return tracker, result


def _parents(workspace, study: str) -> list:
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    experiment = client.get_experiment_by_name(study)
    return client.search_runs([experiment.experiment_id], "tags.reslab_kind = 'submission'")


def _artifacts(workspace, parent: str) -> set[str]:
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    return {a.path for a in client.list_artifacts(parent)}


def test_a_result_cut_short_is_published_whole_by_the_next_run_and_only_then_finished(tmp_path, workspace):
    """The driver is killed right after the runs ended, before its result was whole on the parent: no parent
    is FINISHED without it. The next `reslab run`, which has nothing to run, publishes it on its own parent
    (kept for that), which is FINISHED only after; the one after finds it published and leaves no parent.
    Publishing again on one parent (an outage's retry) logs no table row and no series point twice."""
    study = load_study(write_study(tmp_path, name="cut", steps=3))
    runs = expand(study)

    def killed(tracker):
        raise KilledDriver

    with pytest.raises(KilledDriver):
        _submit(study, runs, workspace, killed)
    (first,) = _parents(workspace, "cut")
    assert first.info.status != "FINISHED" and not RESULT & _artifacts(workspace, first.info.run_id)

    def still_running(tracker):
        assert tracker.writer.client.get_run(tracker.writer.parent_id).info.status == "RUNNING"

    tracker, again = _submit(study, runs, workspace, still_running)
    assert again.count("skipped") == 4 and again.parent_run_id is not None and again.published is not None
    parent = again.parent_run_id
    second = next(p for p in _parents(workspace, "cut") if p.info.run_id == parent)
    assert second.info.status == "FINISHED" and _artifacts(workspace, parent) >= RESULT
    assert second.data.tags[PUBLISHED_TAG] == again.result_key == tracker.published_key()

    publish_study_result(again.published, tracker, again.result_key)
    client = tracker.writer.client
    table = client.download_artifacts(parent, "paired_table.json", str(tmp_path))
    assert len(json.loads(Path(table).read_text())["data"]) == len(again.published.table)
    for key in client.get_run(parent).data.metrics:
        steps = [m.step for m in client.get_metric_history(parent, key)]
        assert len(steps) == len(set(steps)), key

    _, third = _submit(study, runs, workspace)
    assert third.parent_run_id is None and third.published is None and len(_parents(workspace, "cut")) == 2
