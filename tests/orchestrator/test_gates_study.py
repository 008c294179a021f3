"""A gates study's driver (issue 54): its looks gate by gate on run directories written from known laws (the
fast tier: which runs each look releases, the decisions, reuse of earlier gates' runs, `reslab status`, a driver
run again), and end to end on local Ray (the slow tier): real training of tiny decoders, three arms whose learning
rates differ a hundredfold, so gate 1 promotes `fast` and drops `still` and only `fast` and the control train gate
2's third rung. The decisions are recomputed from the finished runs by `results.gates.run_gates` (what the readout
does), a second submission trains nothing and replays the same decisions from the run directories, and the gates
readout shows them in `compare`, the report and the parent MLflow run."""

from __future__ import annotations

import io
import textwrap

import numpy as np
import pytest
from mlflow import MlflowClient

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.ray_backend import RayBackend
from reslab.orchestrator.driving.gates import GateLooks, rung_flops, rung_index, where_gates_stand
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace, write_json
from reslab.orchestrator.gathering.gather import gather, publish_study_result
from reslab.orchestrator.tasks import SUCCESS, Action
from reslab.orchestrator.tracking.guarded import GuardedTracker
from reslab.results.gates import run_gates
from reslab.results.scaling import Ladder

LAWS = """
study: gatelaw
base:
  model: {preset: tiny, d_model: 16, n_layers: 1, n_heads: 2, n_kv_heads: 2, ffn_hidden: 32, seq_len: 32}
  optim: {batch_size: 4}
  train: {device: cpu}
arms:
  control: prenorm
  fast: {residual: prenorm, optim: {lr: 1.0e-2}}
  still: {residual: prenorm, optim: {lr: 1.0e-5}}
  same: {residual: prenorm, optim: {lr: 1.1e-3}}
seeds: 4
ladder: {train.steps: [10, 40, 160]}
gates:
  control: control
  looks: [3, 4]
  law: {floor: 0.5}
  draws: 200
  stages:
    - {name: small, rungs: [0, 1]}
    - {name: large, rungs: [0, 1, 2]}
"""
# each arm's k against the control: the arm's loss at C is the control's at k C
K = {"control": 1.0, "fast": 2.0, "still": 0.5, "same": 1.0}


def _finish(ws, study, runs, done) -> None:
    """Finished run directories for the runs `done` holds: loss 0.5 + 40 (k C)^-0.1, a seed offset both arms
    share and a little noise of the run's own (seeded by the run)."""
    index, flops = rung_index(study), rung_flops(study, runs)
    for r in runs:
        if r.run_id in done:
            rd = ws.run_dir(r.study, r.run_id)
            rd.path.mkdir(parents=True, exist_ok=True)
            own = np.random.default_rng([r.seed, index[r.grid_key], list(K).index(r.arm)]).normal(0, 1e-3)
            c = K[r.arm] * flops[r.arm, index[r.grid_key]]
            write_json(rd.summary_file, {"summary": {"val_loss": 0.5 + 40 * c ** -0.1 + 0.01 * r.seed + own},
                                         "info": {}})
            rd.set_status(SUCCESS)


def test_the_looks_release_each_gate_reuse_its_runs_and_replay_from_the_run_directories(tmp_path, capsys):
    path = tmp_path / "gatelaw.yaml"
    path.write_text(textwrap.dedent(LAWS))
    study, ws = load_study(path), Workspace(tmp_path / "ws")
    runs = expand(study)
    index = rung_index(study)
    looks = GateLooks(study, runs, ws)
    assert main(["plan", str(path), "--workspace", str(tmp_path / "ws")]) == 0
    plan = capsys.readouterr().out
    assert "gatelaw: 48 runs: 48 to run, 0 to skip, 0 busy elsewhere; 24 of those to run are in later looks" in plan
    assert "  now: small at 3 seeds (control, fast, same, still), 24 of its runs not finished" in plan
    assert "runs: at most 48 (every treatment promoted through every gate at 4 seeds), at least 24" in plan

    def cells(batch):
        return sorted({(r.arm, index[r.grid_key], r.seed) for r in batch})

    first = looks.next()  # gate small at 3 seeds: every arm on rungs 0 and 1
    assert cells(first) == sorted((a, g, s) for a in K for g in (0, 1) for s in range(3))
    _finish(ws, study, runs, {r.run_id for r in first})
    status = where_gates_stand(study, runs, ws)  # a driver run again replays to the same look
    second = looks.next()  # fast promoted, still dropped: only the control and `same` add a seed
    assert cells(second) == [(a, g, 3) for a in ("control", "same") for g in (0, 1)]
    assert [(o.treatment, o.decision) for o in looks.outcomes] == [("fast", "promote"), ("still", "drop")]
    assert status.current == "small at 4 seeds" and status.word(second[0].run_id) is None
    _finish(ws, study, runs, {r.run_id for r in second})
    third = looks.next()  # `same` undecided at the last look; fast alone goes on: rung 2's runs only, 3 seeds
    assert looks.outcomes[-1].decision == "undecided" and looks.outcomes[-1].treatment == "same"
    assert cells(third) == [(a, 2, s) for a in ("control", "fast") for s in range(3)]
    _finish(ws, study, runs, {r.run_id for r in third})
    assert looks.next() is None and looks.outcomes[-1].treatment == "fast"

    # the readout's replay from the same ladders gives the same decisions and bounds
    arms = looks.ladders()
    replayed, _ = run_gates(study.gates.plan, arms.pop("control"), arms)
    assert [(o.gate, o.treatment, o.decision, o.seeds) for o in replayed] == [
        (o.gate, o.treatment, o.decision, o.seeds) for o in looks.outcomes]
    assert all(np.allclose(a.last.low, b.last.low) for a, b in zip(replayed, looks.outcomes, strict=True))
    # runs trained: 24 + 4 + 6 = 34 of the full ladder's 4 arms x 3 rungs x 4 seeds = 48
    assert len(looks.covered) == 34 and len(runs) == 48

    assert main(["status", str(path), "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    assert "gatelaw: 48 runs: 34 succeeded, 0 running, 0 failed, 0 to run, 0 later look, 14 not needed" in out
    assert "  small: fast promote after 3 seeds: k 2" in out and "  small: still drop after 3 seeds: k 0.5" in out
    assert "  small: same undecided after 4 seeds" in out and "  large: fast " in out
    assert "  done: " in out


STUDY = """
study: gatetiny
base:
  model: {preset: tiny, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 1, lr: 1.0e-3}
  train: {eval_every: 4, log_every: 4, eval_windows: 8, tail_k: 1, checkpoint_every: 100}
  cost: {measure: false}
arms:
  control: prenorm
  fast: {residual: prenorm, optim: {lr: 1.0e-2}}
  still: {residual: prenorm, optim: {lr: 1.0e-5}}
seeds: 3
ladder:
  model.d_model: [16, 24, 32]
  model.n_layers: [1, 2, 2]
  model.ffn_hidden: [32, 48, 64]
  train.steps: [8, 12, 16]
gates:
  control: control
  alpha: 0.2
  looks: [3]
  target: [1.0e+12]
  draws: 200
  law: {floor: 0.5}
  stages:
    - {name: small, rungs: [0, 1]}
    - {name: large, rungs: [0, 1, 2], at: 1.0e+9}
"""


def _ladders(study, runs, ws):
    """Each arm's ladder from the run directories' summaries, written here apart from the driver's reading."""
    index, flops = rung_index(study), rung_flops(study, runs)
    loss = {a.name: np.full((3, 3), np.nan) for a in study.arms}
    for r in runs:
        rd = ws.run_dir(study.name, r.run_id)
        if rd.complete():
            loss[r.arm][r.seed, index[r.grid_key]] = rd.summary()["summary"]["val_loss"]
    return {a: Ladder(np.array([flops[a, i] for i in range(3)]), loss[a]) for a in loss}, loss


@pytest.mark.slow
def test_a_gates_study_promotes_and_drops_as_the_data_says_and_resumes_from_its_runs(tmp_path, workspace,
                                                                                     ray_session):
    path = tmp_path / "gatetiny.yaml"
    path.write_text(textwrap.dedent(STUDY))
    study = load_study(path)
    runs = expand(study)
    said: list[str] = []
    tracker = GuardedTracker(workspace.default_tracking_uri(), workspace)  # the readout reads MLflow's runs
    result = submit(study, runs, workspace, RayBackend(workspace=workspace.root), tracker,
                    ExecutionOptions(retries=0), stream=io.StringIO(), say=said.append)
    assert result.ok, result.errors

    ladders, loss = _ladders(study, runs, workspace)
    index = rung_index(study)
    trained = {(r.arm, index[r.grid_key]) for r in runs if workspace.run_dir(study.name, r.run_id).complete()}
    # what the data says: fast below the control at every seed of gate 1's rungs, still above it
    assert np.all(loss["fast"][:, :2] < loss["control"][:, :2])
    assert np.all(loss["still"][:, :2] > loss["control"][:, :2])
    # 2 gates: 3 arms x 2 rungs x 3 seeds at gate 1, then the control and fast at rung 2: 24 of the full 27 runs
    assert ("still", 2) not in trained and {("control", 2), ("fast", 2)} <= trained
    assert sum(workspace.run_dir(study.name, r.run_id).complete() for r in runs) == 24

    table = result.sequential
    decided = {(row["name"], row["treatment"]): row["decision"] for row in table.to_dict("records")}
    assert decided[("small", "fast")] == "promote" and decided[("small", "still")] == "drop"
    assert ("large", "still") not in decided and ("large", "fast") in decided
    assert any("small: still drop after 3 seeds" in line for line in said)
    assert any("large: look at 3 seeds on rungs 0, 1, 2 (6 new runs of control, fast)" in line for line in said)

    # the readout's replay: run_gates on the finished runs gives the driver's decisions and bounds
    control = ladders.pop("control")
    replayed, _ = run_gates(study.gates.plan, control, ladders)
    assert [(o.gate, o.treatment, o.decision) for o in replayed] == [
        (int(row["gate"]), row["treatment"], row["decision"]) for row in table.drop_duplicates(["gate", "treatment"])
        .to_dict("records")]
    got = table[(table["name"] == "small") & (table["treatment"] == "fast")]
    assert np.allclose(got["k_low"], replayed[0].last.low) and np.all(got["k_low"] > 1)

    # the readout rebuilds the driver's decisions from MLflow's runs: compare, the report with its plot marking each
    # gate's decision, the saving of the runs not trained, and one series per gate on the parent run
    readout = gather(study, runs, workspace, workspace.default_tracking_uri())
    gates = next(got for r, got in readout.results if r.name == "gates")
    states = gates.decisions.drop_duplicates(["gate", "treatment"])
    assert [(r["gate"], r["treatment"], r["decision"]) for r in states.to_dict("records")
            if r["decision"] != "not reached"] == [(o.gate, o.treatment, o.decision) for o in replayed]
    assert states.set_index(["name", "treatment"]).loc[("large", "still"), "decision"] == "not reached"
    saving = gates.saving.set_index("arm").loc["all"]
    assert saving["runs"] == 24 and 0 < saving["saved"] < 1  # 24 of the full ladder's 27 runs
    assert any(line.split()[:2] == ["small", "still"] and "dropped (futility)" in line
               for line in "".join(readout.text()).splitlines())
    page = readout.report()
    assert "<h2>Gates</h2>" in page and 'id="plot-gates"' in page and 'id="gates-projection"' in page
    plot = next(p for p, _ in readout.plots() if p.name == "gates")
    assert plot.data["decisions"][("small", "still")] == "drop"
    parent = publish_study_result(readout, tracker)
    history = MlflowClient(workspace.default_tracking_uri()).get_metric_history(parent, "gates/small/fast/k_low")
    assert [m.step for m in history] == [3] and history[0].value == pytest.approx(replayed[0].last.low.min())

    # a second submission trains nothing and replays the same decisions; status says where the gates stand
    again = submit(study, runs, workspace, RayBackend(workspace=workspace.root), None, ExecutionOptions(retries=0),
                   stream=io.StringIO(), say=lambda *_: None)
    assert again.ok and again.planned.actions[Action.RUN] == 0 and again.sequential.equals(table)
    status = where_gates_stand(study, runs, workspace)
    lines = status.lines()
    assert status.current is None and "  done: fast through every gate; no run is left to run" in lines
    assert status.word(next(r.run_id for r in runs if r.arm == "still" and index[r.grid_key] == 2)) == "not needed"
