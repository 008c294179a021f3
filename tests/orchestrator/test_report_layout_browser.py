"""The report's layout in headless Chromium at 1280 px (issue 35 item 15): no table overflows its column and
no page scrolls sideways, on a quickstart-like study and on the shipped CPU ladder study, whose every cell,
legend entry and plot label used to repeat the whole grid key (`model.d_model=32,model.n_layers=2,...`).
The records are synthetic (`readout_fixture`): the layout depends on the text the report writes, not on
training."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import readout_fixture
from test_report import CHROMIUM, chromium

from reslab.orchestrator.gathering.gather import gather

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get "
                                                          "install chromium)")]

EXPERIMENTS = Path(__file__).parents[2] / "experiments"
# experiments/quickstart.yaml's study with the fixture's arm names (its GAIN) and its model shrunk, as
# `readout_fixture.STUDY` does: three arms, three seeds, one family of two rows with an MEI
QUICKSTART = """\
study: quickstart
description: prenorm vs Full AttnRes vs Block AttnRes, tiny decoder, 200 steps, 3 seeds (CPU)
base:
  model: {preset: tiny, d_model: 64, n_layers: 4, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  data: {corpus: stdlib, tokenizer: byte}
  optim: {lr: 2.0e-3, warmup_steps: 2, batch_size: 4}
  train: {steps: 8, eval_every: 2, eval_windows: 8, tail_k: 1, log_every: 1}
arms:
  control: prenorm
  attnres: {residual: attnres}
  block:
    residual: {name: block_attnres, options: {block_size: 2}}
seeds: 3
comparisons:
  - name: routing-vs-prenorm
    control: control
    treatments: [attnres, block]
    metric: val_loss_tail
    family: quickstart
    mei: 0.02
    exploratory: true
"""
# Appended to a copy of the page: each table's and image's width against its container's, and the page's
MEASURE = """<script>
window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'widths';
  const rows = [...document.querySelectorAll('table')].map(
    (t, i) => `table ${t.id || i} ${t.scrollWidth} ${t.parentElement.clientWidth}`);
  rows.push(...[...document.images].map(
    (m, i) => `img ${m.closest('figure').id} ${m.getBoundingClientRect().width} ${m.parentElement.clientWidth}`));
  rows.push(`page body ${document.documentElement.scrollWidth} ${document.documentElement.clientWidth}`);
  out.textContent = rows.join('\\n'); document.body.appendChild(out);
});
</script>"""


def _widths(page: str, tmp_path: Path) -> list[tuple[str, str, float, float]]:
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", MEASURE + "</body>"), encoding="utf-8")
    dom = chromium(tmp_path, "--window-size=1280,900", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="widths">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    return [(kind, name, float(w), float(c)) for kind, name, w, c in (ln.split() for ln in found.group(1).splitlines())]


@pytest.mark.parametrize("study", ["quickstart", "ladder"])
def test_no_table_or_plot_is_wider_than_its_column_at_1280_px(study, tmp_path):
    text = QUICKSTART if study == "quickstart" else (EXPERIMENTS / "scaling_ladder_cpu.yaml").read_text()
    spec, runs, workspace = readout_fixture.build(tmp_path, text)
    page = gather(spec, runs, workspace, "sqlite:///unused", cached=True).report()
    widths = _widths(page, tmp_path)
    over = [(kind, name, width - column) for kind, name, width, column in widths if width > column]
    assert not over, f"wider than their column at 1280 px (px over): {over}"
    tables = {name for kind, name, _, _ in widths if kind == "table"}
    assert {"facts", "paired"} <= tables and (study == "quickstart" or {"points", "rungs"} <= tables), tables
    if study == "ladder":  # the grid keys are spelled out once, in the key table, not in every cell
        assert "r0: d32 L2 ff96 st300" in page
        assert page.count("model.d_model=32,model.n_layers=2,model.ffn_hidden=96,train.steps=300") == 0


# Issue 52, item 15: a user's study as the report met it. Arms that share a prefix, a description that states more
# steps and seeds than this copy runs, two pipeline stages, and costs with their Pareto plots.
USER_STUDY = """\
study: users
description: prenorm with a longer warmup vs Full AttnRes, tiny decoder, 100 steps, 3 seeds (CPU)
base:
  model: {preset: tiny, d_model: 64, n_layers: 4, n_heads: 2, n_kv_heads: 2, seq_len: 32}
  optim: {lr: 2.0e-3, warmup_steps: 2, batch_size: 4}
  train: {steps: 12, eval_every: 2, eval_windows: 8, tail_k: 1, log_every: 1}
arms:
  prenorm_adamw: prenorm
  prenorm_warmup: {residual: prenorm, optim: {warmup_steps: 4}}
  attnres_full_history: {residual: attnres}
seeds: 2
resources: {gpus_per_run: 2, pipeline_stages: 2, pipeline_schedule: 1f1b, microbatches: 2}
comparisons:
  - {name: main, control: prenorm_adamw, treatments: [prenorm_warmup, attnres_full_history], exploratory: true}
costs: [decode_tps, decode_state_bytes]
"""
# Appended to a copy of the page: the lines each name cell's text takes (1: the name is whole), and the facts
LINES = """<script>
window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'lines';
  const lines = c => { const r = document.createRange(); r.selectNodeContents(c);
                       return new Set([...r.getClientRects()].map(b => Math.round(b.top))).size; };
  out.textContent = [...document.querySelectorAll('table td')].filter(c => /^[a-z_]+$/.test(c.innerText))
    .map(c => `${c.innerText} ${lines(c)}`).join('\\n');
  document.body.appendChild(out);
});
</script>"""


def test_arm_names_stay_whole_and_the_page_says_what_ran(tmp_path):
    spec, runs, workspace = readout_fixture.build(tmp_path, USER_STUDY)
    page = gather(spec, runs, workspace, "sqlite:///unused", cached=True).report()
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", LINES + "</body>"), encoding="utf-8")
    dom = chromium(tmp_path, "--window-size=1280,900", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = re.search(r'<pre id="lines">([^<]*)</pre>', dom)
    assert found, dom[-2000:]
    cells = [line.rsplit(" ", 1) for line in found.group(1).splitlines()]
    names = {"prenorm_adamw", "prenorm_warmup", "attnres_full_history"}
    assert names <= {name for name, _ in cells}, cells
    assert [(name, n) for name, n in cells if name in names and n != "1"] == [], "arm names broken across lines"
    # the description is the study file's words: what this copy ran stands beside the counts it states
    assert "100 steps, 3 seeds (CPU) [the study file&#x27;s description; as run: 12 steps, 2 seeds]" in page
    assert ("<tr><th>resources</th><td>2 rank(s) per run; pipeline: 2 stages x 1 replica(s), 1f1b, "
            "2 micro-batch(es)</td></tr>") in page
    chromium(tmp_path, "--window-size=1280,2400", f"--screenshot={tmp_path / 'report.png'}", probe.as_uri())
    assert (tmp_path / "report.png").stat().st_size > 0
