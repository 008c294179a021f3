"""The direct read of a database store (`readers._fetch_sql`, issue 39) against MLflow's own `search_runs`
(the reference, `fetch_study_runs` on a store the direct read refuses): the same records, run for run."""

from __future__ import annotations

import math

import pytest

from reslab.orchestrator.tracking import readers
from reslab.orchestrator.tracking.readers import fetch_study_runs


def _store(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("tiny")
    other = client.create_experiment("other")
    parent = client.create_run(exp, tags={"reslab_kind": "submission"})
    for i in range(5):
        run = client.create_run(exp, tags={"reslab_kind": "run", "run_id": f"prenorm-{i:012d}", "seed": str(i),
                                           "mlflow.parentRunId": parent.info.run_id}, start_time=1000 + i)
        rid = run.info.run_id
        client.log_param(rid, "optim.lr", 0.001 * (i + 1))
        for step in (1, 2):
            client.log_metric(rid, "val_loss", 3.0 - step / 10 + i, step=step)
        client.log_metric(rid, "train_loss", math.nan if i == 2 else 2.5, step=2)
        client.set_tag(rid, "summary/val_loss", repr(2.8 + i))
        # JSON's hard cases, which the SQLite read carries as one JSON object of a run's tags
        client.set_tag(rid, "error", 'a "quoted"\nline, \\ back, \u00e9\u4e2d, \x01' if i == 3 else "")
        client.set_terminated(rid, "FINISHED" if i != 3 else "FAILED")
    client.delete_run(client.create_run(exp, tags={"reslab_kind": "run", "run_id": "gone"}).info.run_id)
    client.create_run(other, tags={"reslab_kind": "run", "run_id": "elsewhere"})
    return uri


def _by_id(records):
    return {r["mlflow_run_id"]: r for r in records}


def test_direct_read_is_what_search_runs_returns(tmp_path, monkeypatch):
    uri = _store(tmp_path)
    direct = readers._fetch_sql(uri, "tiny", True)  # raises if the queries do not fit the schema
    assert _by_id(direct) == _by_id(fetch_study_runs(uri, "tiny"))  # what the readouts get: the direct read
    monkeypatch.setattr(readers, "_fetch_sql", lambda *a: (_ for _ in ()).throw(RuntimeError("refused")))
    reference = fetch_study_runs(uri, "tiny")
    assert len(direct) == len(reference) == 5
    got, want = _by_id(direct), _by_id(reference)
    assert got.keys() == want.keys()
    for uid, rec in want.items():
        mine = got[uid]
        assert {k: mine[k] for k in ("status", "start_time", "end_time", "tags", "params")} == \
            {k: rec[k] for k in ("status", "start_time", "end_time", "tags", "params")}
        assert mine["metrics"].keys() == rec["metrics"].keys()
        for key, value in rec["metrics"].items():
            assert mine["metrics"][key] == pytest.approx(value, nan_ok=True)
    assert [r["mlflow_run_id"] for r in direct] == [r["mlflow_run_id"] for r in reference]  # newest first
    assert all(r["params"] == {} for r in fetch_study_runs(uri, "tiny", params=False))
    assert fetch_study_runs(uri, "nope") == []


def test_keys_keep_only_those_tags_and_metrics(tmp_path, monkeypatch):
    """`keys`: the direct read (`WHERE key IN`) and the read through MLflow give each run only the named tags and
    metrics, the same as the whole records filtered by hand (the reference)."""
    uri = _store(tmp_path)
    keys = ("run_id", "seed", "summary/val_loss", "train_loss", "absent")
    whole = _by_id(fetch_study_runs(uri, "tiny"))
    want = {uid: {**rec, "tags": {k: v for k, v in rec["tags"].items() if k in keys},
                  "metrics": {k: v for k, v in rec["metrics"].items() if k in keys}} for uid, rec in whole.items()}
    assert all(set(r["tags"]) == {"run_id", "seed", "summary/val_loss"} for r in want.values())
    direct = _by_id(fetch_study_runs(uri, "tiny", keys=keys))
    monkeypatch.setattr(readers, "_fetch_sql", lambda *a: (_ for _ in ()).throw(RuntimeError("refused")))
    through_mlflow = _by_id(fetch_study_runs(uri, "tiny", keys=keys))
    for got in (direct, through_mlflow):
        assert got.keys() == want.keys()
        for uid, rec in want.items():
            assert got[uid]["tags"] == rec["tags"]
            assert got[uid]["metrics"].keys() == rec["metrics"].keys() == {"train_loss"}
    assert all(r["tags"] == r["metrics"] == {} for r in fetch_study_runs(uri, "tiny", keys=()))  # none asked
