"""The bench's simulated trainer (`orchestrator.attempt.simulate`) goes through the same worker, run records,
run storage and MLflow path as a real run: a real one-run study and its simulated twin, each submitted on
the in-process backend with local run storage, leave the same files in the workspace and in storage, the same
record shapes, and MLflow children with the same parameters and tag and metric names (the simulated one adds
its `reslab.simulated` tag and `sim/*` metrics; the real one its summary and cost tags). The reference is
the real run, trained here by `models.training.train`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from orch_helpers import ONE_RUN, train_stored_study

from reslab.common.errors import ConfigError
from reslab.orchestrator.attempt.simulate import SIMULATE_ENV, parse_simulation
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tracking.layout import SIMULATED_TAG

SIM = "sleep=0.3,report_every=0.05,metrics=6,eval_every=3,checkpoint_every=3"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}


def _child(ws, study: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(ws.default_tracking_uri())
    experiment = client.get_experiment_by_name(study)
    (run,) = client.search_runs([experiment.experiment_id], filter_string="tags.reslab_kind = 'run'")
    return run


def _trained(tmp_path: Path, name: str):
    (tmp_path / name).mkdir()
    study, runs, ws, lines, result = train_stored_study(tmp_path / name, name, ONE_RUN.format(name=name))
    assert result.ok and result.count("succeeded") == 1, lines
    (run,) = runs
    return ws, run, tmp_path / name / "storage" / "runs" / name / run.run_id


def test_a_simulated_run_takes_the_real_runs_path(tmp_path, monkeypatch):
    ws, real, real_stored = _trained(tmp_path, "real")
    monkeypatch.setenv(SIMULATE_ENV, SIM)
    sim_ws, sim, sim_stored = _trained(tmp_path, "simulated-twin")

    real_rd, sim_rd = ws.run_dir("real", real.run_id), sim_ws.run_dir("simulated-twin", sim.run_id)
    assert _files(sim_rd.path) == _files(real_rd.path)
    assert _files(sim_stored) == _files(real_stored) and _files(real_stored)
    assert sim_rd.status()["state"] == real_rd.status()["state"] == "SUCCESS"
    real_summary, sim_summary = (json.loads((rd.summary_file).read_text()) for rd in (real_rd, sim_rd))
    assert sim_summary.keys() == real_summary.keys() == {"summary", "info"}
    assert set(sim_summary["summary"]) <= set(real_summary["summary"])
    assert sim_summary["info"]["simulated"] == parse_simulation(SIM).text()
    rows = RunDir(sim_rd.path).metrics()
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [3, 6]

    real_child, sim_child = _child(ws, "real"), _child(sim_ws, "simulated-twin")
    assert sim_child.info.status == real_child.info.status == "FINISHED"
    assert set(sim_child.data.params) == set(real_child.data.params)
    assert sim_child.data.tags[SIMULATED_TAG] == parse_simulation(SIM).text()
    assert SIMULATED_TAG not in real_child.data.tags
    sim_only = set(sim_child.data.tags) - set(real_child.data.tags)
    real_only = set(real_child.data.tags) - set(sim_child.data.tags)
    assert sim_only == {SIMULATED_TAG}
    assert all(t.startswith(("summary/", "cost/")) for t in real_only), real_only
    sim_metrics = {k for k in sim_child.data.metrics if not k.startswith("sim/")}
    assert sim_metrics and sim_metrics <= set(real_child.data.metrics)
    assert {f"sim/m{i}" for i in range(2)} <= set(sim_child.data.metrics)


def test_a_study_not_named_simulated_is_refused_not_simulated(tmp_path, monkeypatch):
    monkeypatch.setenv(SIMULATE_ENV, SIM)
    study, runs, ws, lines, result = train_stored_study(tmp_path, "plain", ONE_RUN.format(name="plain"))
    assert result.count("failed") == 1
    status = ws.run_dir("plain", runs[0].run_id).status()
    assert status["state"] == "FAILED" and status["retryable"] is False
    assert f"${SIMULATE_ENV} is set but study 'plain' is not a simulation" in status["error"]


@pytest.mark.parametrize("text, names", [("sleep=x", "sleep='x'"), ("report_every=0", "report_every=0"),
                                          ("nap=1", "'nap=1'"), ("metrics", "'metrics'")])
def test_a_bad_simulation_spec_is_one_line_naming_it(text, names):
    with pytest.raises(ConfigError, match=f"RESLAB_SIMULATE: {names}") as exc:
        parse_simulation(text)
    assert "\n" not in str(exc.value)


def test_a_bad_simulation_is_refused_by_the_driver_before_any_run(tmp_path, monkeypatch, capsys):
    """`reslab run` checks `$RESLAB_SIMULATE` against the study before dispatch: a value that does not parse, or a
    study that is not a simulation, is one line and exit 2, and no run is recorded (before, each run failed in its
    worker and stayed failed, so fixing the variable did not rerun it)."""
    from reslab.orchestrator.cli import main

    for name, value, says in (("simulated-bad", "sleep=abc", "$RESLAB_SIMULATE: sleep='abc' is not a number"),
                              ("real", "sleep=1", "study 'real' is not a simulation")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(ONE_RUN.format(name=name))
        monkeypatch.setenv(SIMULATE_ENV, value)
        ws = tmp_path / f"ws-{name}"
        assert main(["run", str(path), "--workspace", str(ws)]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err, err
        assert not (ws / "runs" / name).exists() or not any((ws / "runs" / name).iterdir())  # no run began
