"""A ladder study end to end on real training: every rung trains, `reslab compare` prints the
multipliers, the trend, the contrasts and the comparison at equal FLOPs, the parent MLflow run holds
the ladder's tables, and the report's compute plot renders in headless Chromium."""

from __future__ import annotations

import re

import pytest
from mlflow.tracking import MlflowClient
from orch_helpers import write_study
from test_dashboard_browser import submit_and_publish
from test_report import CHROMIUM, SIZES_SCRIPT, chromium

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main

pytestmark = pytest.mark.slow

LADDER_STUDY = """
study: minilad
base:
  model: {preset: tiny, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 1}
  cost: {measure: false}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 3
ladder:
  model.d_model: [16, 24, 32]
  model.n_layers: [2, 3, 4]
  model.ffn_hidden: [32, 48, 64]
  train.steps: [4, 6, 8]
comparisons:
  - {name: main, control: control, treatments: [attnres], metric: val_loss, exploratory: true}
  - {name: per-flop, control: control, treatments: [attnres], metric: val_loss, at: flops, exploratory: true}
contrasts:
  - {name: gain, metric: val_loss, weights: {attnres: 1, control: -1}}
"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_a_ladder_study_reads_out_across_scale_and_its_report_draws_the_compute_plot(tmp_path, workspace, capsys):
    spec = write_study(tmp_path, "minilad", text=LADDER_STUDY)
    study = load_study(spec)
    runs = expand(study)
    assert len(runs) == 2 * 3 * 3
    parent = submit_and_publish(study, runs, workspace)
    assert parent is not None

    assert main(["compare", str(spec), "--workspace", str(workspace.root)]) == 0
    out = capsys.readouterr().out
    assert "18/18 runs finished" in out
    across = out[out.index("across scale (val_loss)"):]
    for name in ("main", "per-flop"):  # the same ladder (fitted once), stated for each comparison
        line = next(x for x in across.splitlines() if x.startswith(f"{name}: attnres "))
        # a multiplier with its interval, FLOPs and wall-clock side by side (or said to drift)
        assert re.search(r"\d\.\d\dx \[\d+\.\d\d, (\d+\.\d\d|inf)\]", line) and "FLOPs" in line, line
        assert "wall-clock" in line, line
    assert across.count("delta against log size: ") == 2
    assert "at equal FLOPs: each arm's val_loss read from its eval curve" in out
    # one line per contrast and rung (the fraction a cheaper arm keeps: tests/results/test_contrasts.py)
    assert len(re.findall(r"gain \[model.d_model=\d+[^]]*\]: attnres - control on val_loss = .* over 3 seeds, p ",
                          out)) == 3
    artifacts = {a.path for a in MlflowClient(workspace.default_tracking_uri()).list_artifacts(parent)}
    assert {"ladder_summary.csv", "ladder_rungs.csv", "ladder_table.json", "contrasts.csv", "report.html"} <= artifacts

    page_path = tmp_path / "report.html"
    assert main(["report", str(spec), "--workspace", str(workspace.root), "-o", str(page_path)]) == 0
    page = page_path.read_text()
    assert "<h2>Across scale</h2>" in page and '<figure id="plot-scaling">' in page
    assert "<h2>Contrasts</h2>" in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", SIZES_SCRIPT + "</body>"))
    dom = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    ladder = re.search(r'<ul id="ladder">(.*?)</ul>', dom, re.S)
    assert ladder and ladder.group(1).count("<li>") == 2, dom[:2000]
    rungs = re.search(r'<table id="rungs">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert rungs and rungs.group(1).count("<tr") == 2 * 3  # three rungs per summary row
    sizes = re.search(r'<pre id="image-sizes">([^<]*)</pre>', dom)
    assert sizes, dom[-2000:]
    figures = re.findall(r'<figure id="plot-([^"]+)"', dom)
    dims = dict(zip(figures, (tuple(map(int, s.split("x"))) for s in sizes.group(1).split()), strict=False))
    # the compute plot: two panels side by side, rendered at its full size
    assert {"scaling", "scaling-2"} <= set(figures) and len(figures) == len(set(figures))  # one id each
    assert dims["scaling"][0] > 1000 and dims["scaling"][1] > 300, dims
    shot = tmp_path / "report.png"
    chromium(tmp_path, "--window-size=1200,3000", f"--screenshot={shot}", page_path.as_uri())
    assert shot.stat().st_size > 0
