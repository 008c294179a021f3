"""`reslab report`: one self-contained HTML page, rendered by headless Chromium with its table rows and
every image at a non-zero size."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.models.diagnostics import routes_of, routing_matrix
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import submit
from reslab.orchestrator.gathering.gather import gather, read_records
from reslab.orchestrator.tracking.guarded import GuardedTracker

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")
# Appended to a copy of the page only: writes each image's decoded size into the DOM for --dump-dom.
SIZES_SCRIPT = """<script>
window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'image-sizes';
  out.textContent = [...document.images].map(i => i.naturalWidth + 'x' + i.naturalHeight).join(' ');
  document.body.appendChild(out);
});
</script>"""


def chromium(tmp_path: Path, *args: str) -> str:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_report_is_self_contained_and_renders_its_table_and_every_plot(tmp_path, workspace, capsys):
    spec = write_study(tmp_path)
    study = load_study(spec)
    runs = expand(study)
    submit(study, runs, workspace, LocalBackend(), GuardedTracker(workspace.default_tracking_uri(), workspace),
           stream=io.StringIO(), say=lambda *_: None)
    out = tmp_path / "report.html"
    assert main(["report", str(spec), "--workspace", str(workspace.root), "-o", str(out)]) == 0
    page = out.read_text()
    assert "<script" not in page and not re.search(r"""(src|href)=["']?(https?:)?//""", page)
    images = re.findall(r'<img [^>]*src="data:image/png;base64,', page)
    # forest, loss curves, delta curve, routing heatmaps, concentration profile, D_eff
    assert len(images) == 6
    for fact in ("control (prenorm), attnres (attnres)", "0, 1", "stdlib (byte tokenizer)", "d_model 32",
                 "4/4", f"reslab run {spec}"):
        assert fact in page, fact

    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", SIZES_SCRIPT + "</body>"))
    dom = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    rows = re.search(r'<table id="paired">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert rows and rows.group(1).count("<tr") == 1 and "attnres" in rows.group(1)
    sizes = re.search(r'<pre id="image-sizes">([^<]*)</pre>', dom)
    assert sizes, dom[-2000:]
    dims = [tuple(map(int, s.split("x"))) for s in sizes.group(1).split()]
    assert len(dims) == 6 and all(w > 0 and h > 0 for w, h in dims), dims
    shot = tmp_path / "report.png"
    chromium(tmp_path, "--window-size=1200,3000", f"--screenshot={shot}", out.as_uri())
    assert shot.stat().st_size > 0


def test_report_refuses_a_missing_output_directory(tmp_path, capsys):
    spec = write_study(tmp_path)
    assert main(["report", str(spec), "--workspace", str(tmp_path / "ws"), "-o", str(tmp_path / "no" / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "-o/--output: directory" in err and "does not exist" in err


GRID_STUDY = """
study: depths
base:
  model: {preset: tiny, d_model: 32, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}
  optim: {batch_size: 4, warmup_steps: 2, lr: 3.0e-3}
  train: {steps: 3, eval_every: 3, log_every: 1, eval_windows: 4}
  cost: {decode_batch: 2, new_tokens: 2, repeats: 1}
arms:
  control: prenorm
  attnres: {residual: attnres}
  block: {residual: {name: block_attnres, options: {block_size: 2}}}
seeds: 2
grid:
  model.n_layers: [2, 4]
comparisons:
  - {name: main, control: control, treatments: [attnres, block], exploratory: true}
"""


def test_routing_is_drawn_per_grid_point_on_one_colour_scale(tmp_path, workspace):
    """A depth ladder: each grid point gets its own heatmaps (a 2-layer and a 4-layer model are never
    averaged together), the seeds of one point are averaged, and every figure shares one scale."""
    study = load_study(write_study(tmp_path, text=GRID_STUDY))
    runs = expand(study)
    uri = workspace.default_tracking_uri()
    submit(study, runs, workspace, LocalBackend(), GuardedTracker(uri, workspace), stream=io.StringIO(),
           say=lambda *_: None)
    records = read_records(study, runs, workspace)
    points = list(dict.fromkeys(r.grid_key for r in runs))
    assert list(records.routing) == points and len(points) == 2
    for point, arms in records.routing.items():
        assert set(arms) == {"attnres", "block"}  # the prenorm control has no routing
        n_layers = 2 if "n_layers=2" in point else 4
        for arm, (matrix, rows) in arms.items():
            seeds = []
            for run in (r for r in runs if r.grid_key == point and r.arm == arm):
                route = workspace.run_dir(study.name, run.run_id).diagnostics()[-1]["routing"]
                seeds.append(routing_matrix(route, routes_of(route)[0])[0])
            np.testing.assert_allclose(matrix, np.mean(seeds, axis=0))
            assert len(rows) == matrix.shape[0]  # one labelled row per routing site
            assert matrix.shape[1] == 2 * n_layers + 1 or arm == "block", (arm, matrix.shape)
        assert len(records.profiles[point]["attnres"]) == n_layers + 1  # each layer, then the readout
    heatmaps = [p for p, _ in gather(study, runs, workspace, uri).plots()
                if p.name == "routing"]
    assert len(heatmaps) == 2
    vmax = max(float(np.nanmax(m)) for arms in records.routing.values() for m, _ in arms.values())
    assert all(p.data["vmax"] == vmax for p in heatmaps)
    for plot, arms in zip(heatmaps, records.routing.values(), strict=True):
        assert set(plot.data["matrices"]) == set(arms)
