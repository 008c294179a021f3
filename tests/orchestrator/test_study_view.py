"""A study's experiment carries the "Model training" kind and the saved runs view grouped by arm, in the
format MLflow 3.17.2's own "Save view" writes (observed: an experiment tag `mlflow.sharedViewState.<id>`
holding {"name", "createdAt", "state": "deflate;" + base64(zlib(JSON page state))}); `reslab dashboard`
links each study to it. The browser test (test_dashboard_browser.py) checks that the UI applies it."""

from __future__ import annotations

import base64
import json
import zlib

from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.orchestrator.tracking.views import (
    BY_ARM_VIEW_ID,
    BY_ARM_VIEW_NAME,
    BY_ARM_VIEW_TAG,
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    study_links,
    study_view_url,
)


def decode_view(value: str) -> tuple[str, dict]:
    envelope = json.loads(value)
    assert isinstance(envelope["createdAt"], int)
    return envelope["name"], json.loads(zlib.decompress(base64.b64decode(envelope["state"].removeprefix("deflate;"))))


def test_study_experiments_get_the_kind_and_the_by_arm_view_and_keep_a_users_view(workspace):
    uri = workspace.default_tracking_uri()
    tracker = GuardedTracker(uri, workspace)
    client = tracker.writer.client
    mine = json.dumps({"name": "my view", "createdAt": 1, "state": "{}"})  # the user overrode the saved view
    older = client.create_experiment("older", tags={"reslab_kind": "study", BY_ARM_VIEW_TAG: mine})
    legacy = client.create_experiment("legacy", tags={"reslab_kind": "study"})  # no `reslab run` since
    client.create_experiment("not-a-study")

    new = tracker.writer.store.experiment("new")
    assert tracker.writer.store.experiment("older") == older
    new_tags, older_tags = client.get_experiment(new).tags, client.get_experiment(older).tags
    assert new_tags[EXPERIMENT_KIND_TAG] == older_tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert older_tags[BY_ARM_VIEW_TAG] == mine
    name, state = decode_view(new_tags[BY_ARM_VIEW_TAG])
    assert name == BY_ARM_VIEW_NAME
    assert state["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "arm"}]
    assert state["runsHiddenMode"] == "SHOWALL" and "metrics.`val_loss_tail`" in state["selectedColumns"]

    base = "http://127.0.0.1:5000"
    assert study_links(uri, base) == [
        ("legacy", f"{base}/#/experiments/{legacy}/runs?workflowType=machine_learning"),
        ("new", f"{base}/#/experiments/{new}/runs?viewStateShareKey={BY_ARM_VIEW_ID}&workflowType=machine_learning"),
        ("older", study_view_url(base, older)),
    ]
