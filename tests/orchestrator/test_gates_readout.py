"""A gates study's readout in every medium, through the code paths a user's commands take (issue 54): `reslab compare`
(plain and Markdown), `reslab export` (Markdown, LaTeX, CSV), `reslab report` (its fact, its section, the plot
marking each gate's decision) and the submission's parent MLflow run (its files, tables, one metric series per gate
and treatment, the experiment's description with the gates' answer). The study is `readout_fixture`'s synthetic
records (no training) written as the gates would have run them: every arm at gate 1's two rungs, only the treatment
gate 1 promotes at the third rung, so the saving is counted against a full ladder."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import readout_fixture

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.gathering.gather import gather, publish_study_result
from reslab.orchestrator.tracking.store import import_mlflow
from reslab.orchestrator.tracking.writer import MlflowWriter
from reslab.results.collect import collect
from reslab.results.gate_results import gates_readout

pytestmark = pytest.mark.slow  # five gatherings through the CLI and an MLflow store

STUDY = """\
study: gates_toy
description: gates on synthetic records
base:
  model: {preset: tiny, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 1}
arms:
  control: prenorm
  attnres: {residual: attnres}
  prenorm_warmup: {residual: prenorm, optim: {warmup_steps: 3}}
seeds: 4
ladder:
  model.d_model: [16, 24, 32]
  model.n_layers: [2, 3, 4]
  model.ffn_hidden: [32, 48, 64]
  train.steps: [4, 6, 8]
gates:
  control: control
  looks: [3, 4]
  target: [1.0e9, 1.0e12]
  law: {floor: 1.0}
  draws: 200
  stages:
    - {name: gate1, rungs: [0, 1]}
    - {name: gate2, rungs: [0, 1, 2], at: 1.0e9}
"""
LARGEST = "model.d_model=32"  # the third rung's grid key names its width


def _build(directory: Path):
    spec = directory / "golden.yaml"
    spec.write_text(STUDY)
    study = load_study(spec)
    runs = expand(study)
    workspace = Workspace(directory / "ws")
    workspace.root.mkdir(parents=True)
    rng, cost_rng = np.random.default_rng(20261202), np.random.default_rng(20260611)
    # as the gates ran them: the dropped arm never trains the third rung
    ran = [r for r in runs if not (r.arm == "prenorm_warmup" and LARGEST in r.grid_key)]
    with pytest.MonkeyPatch.context() as patch:  # a treatment clearly worse than the control: gate 1 drops it
        patch.setitem(readout_fixture.GAIN, "prenorm_warmup", 0.08)
        records = [readout_fixture._write_run(workspace, run, rng, cost_rng) for run in ran]
    collect(study.name, records, expected=ran, cache_dir=workspace.cache)
    return study, runs, ran, workspace


def _cli(spec: str, ws: str, *args: str) -> str:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main([*args, spec, "--workspace", ws, "--cached"]) == 0
    return buf.getvalue()


def _gates(readout):
    return next(result for r, result in readout.results if r.name == "gates")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gates")
    study, runs, ran, workspace = _build(tmp)
    spec, ws = str(tmp / "golden.yaml"), str(tmp / "ws")
    got = {"compare": _cli(spec, ws, "compare"), "compare.md": _cli(spec, ws, "compare", "--format", "md")}
    for fmt, ext in (("md", "md"), ("latex", "tex"), ("csv", "csv")):
        _cli(spec, ws, "export", "--format", fmt, "-o", str(tmp / f"export.{ext}"))
    got["md"], got["tex"] = (tmp / "export.md").read_text(), (tmp / "export.tex").read_text()
    got["csv"] = pd.read_csv(tmp / "export.csv")
    _cli(spec, ws, "report", "-o", str(tmp / "report.html"))
    got["report"] = (tmp / "report.html").read_text()
    readout = gather(study, runs, workspace, "sqlite:///unused", cached=True)
    return got, readout, workspace, ran


def test_the_gates_decide_and_the_saving_counts_the_runs_not_trained(rendered):
    _, readout, _, ran = rendered
    gates = _gates(readout)
    # the readout is the pure function of the same runs, study and FLOPs
    design, flops = readout.data.gates, {k: c.flops for k, c in readout.data.costs.items()}
    again = gates_readout(readout.data.runs, design, flops)
    pd.testing.assert_frame_equal(gates.decisions, again.decisions)
    states = gates.decisions.drop_duplicates(["gate", "treatment"]).set_index(["name", "treatment"])["decision"]
    assert states["gate1", "attnres"] == "promote" and states["gate1", "prenorm_warmup"] == "drop"
    assert states["gate2", "prenorm_warmup"] == "not reached"
    used = sum(flops[r.arm, r.grid_key] for r in ran)
    full = 4 * sum(flops.values())
    assert gates.saving.iloc[-1]["saved"] == pytest.approx(1 - used / full) and 0 < 1 - used / full < 1


def test_compare_and_every_export_show_the_gates(rendered):
    got, _, _, _ = rendered
    for text in (got["compare"], got["compare.md"], got["md"]):
        assert "gates: the decision at each gate" in text and "projection to the target compute" in text
        assert "what the gates saved" in text and "dropped (futility)" in text and "not reached" in text
    assert "\\caption{gates: the decision at each gate" in got["tex"] and "\\begin{table*}" in got["tex"]
    csv = got["csv"]
    assert {"gate", "projection", "backtest", "saving"} <= set(csv["role"])
    wall = csv[csv["role"] == "projection"]
    assert wall["k_wall"].notna().any() and wall["k_wall_low"].notna().any()


def test_the_report_has_the_gates_section_fact_and_plot(rendered):
    got, readout, _, _ = rendered
    page = got["report"]
    assert "<h2>Gates</h2>" in page and 'id="gates-answer"' in page and 'id="gates-projection"' in page
    assert "<th>gates</th>" in page  # the fact
    assert 'id="plot-gates"' in page
    plot = next(p for p, _ in readout.plots() if p.name == "gates")
    assert plot.data["decisions"][("gate1", "attnres")] == "promote"
    assert plot.data["decisions"][("gate2", "prenorm_warmup")] == "not reached"


def test_the_gates_are_on_the_parent_mlflow_run(rendered, tmp_path):
    _, readout, workspace, _ = rendered
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    writer = MlflowWriter(uri, workspace)
    writer.begin("gates_toy", submission="gates-test", code={}, plan={})
    parent = publish_study_result(readout, writer)
    client = import_mlflow()(tracking_uri=uri)
    files = {a.path for a in client.list_artifacts(parent)}
    assert {"gates_decisions.csv", "gates_projection.csv", "gates_saving.csv", "gates_table.json",
            "report.html"} <= files
    looks = {(g, t): [(int(n), float(k)) for n, k in zip(rows["seeds"], rows["k_low"], strict=True)]
             for (g, t), rows in _gates(readout).looks.groupby(["name", "treatment"])}
    for (gate, treatment), points in looks.items():  # one series per gate and treatment, stepped by seeds
        history = client.get_metric_history(parent, f"gates/{gate}/{treatment}/k_low")
        assert [m.step for m in history] == [p[0] for p in points]
        assert [m.value for m in history] == pytest.approx([p[1] for p in points])
    run = client.get_run(parent)
    experiment = client.get_experiment(run.info.experiment_id)
    answer = readout.headline.answer  # the dashboard's banner: the gates' answer in one line
    assert answer.startswith("attnres ") and "prenorm_warmup dropped (futility) at gate1" in answer
    assert f"### Latest result: {answer}" in experiment.tags["mlflow.note.content"]


def test_the_full_ladder_is_priced_from_the_study_when_only_the_runs_reached_are_read(rendered):
    """`reslab run` publishes from the runs its looks reached; the rungs no look reached are priced all the same (the
    gates reader's FLOPs), so the saving is the one `compare` shows over every run of the design."""
    _, readout, workspace, ran = rendered
    study = load_study(Path(workspace.root).parent / "golden.yaml")
    reached = gather(study, ran, workspace, "sqlite:///unused", cached=True)
    pd.testing.assert_frame_equal(_gates(reached).saving, _gates(readout).saving)
