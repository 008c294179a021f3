"""The report of a study with declared costs, rendered by headless Chromium: the cost section's tables and
its loss-versus-cost plots are laid out inside the page's body (no horizontal overflow) in a 1200-pixel window,
every plot decoded at a non-zero size."""

from __future__ import annotations

import re

import pytest
from test_cost_cli import cached_study
from test_report import CHROMIUM, chromium

from reslab.orchestrator.cli import main

pytestmark = pytest.mark.slow

WIDTH = 1200
# Appended to a copy of the page only: writes the right edge of the body's content box, and each cost table's
# and plot image's right edge and each image's decoded size into the DOM for --dump-dom.
LAYOUT_SCRIPT = """<script>
window.addEventListener('load', () => {
  const out = document.createElement('pre'); out.id = 'layout';
  const boxes = [...document.querySelectorAll('table[id^=costs], figure[id^=plot-cost_] img')]
    .map(e => (e.id || e.parentElement.id) + '=' + Math.ceil(e.getBoundingClientRect().right));
  const images = [...document.querySelectorAll('figure[id^=plot-cost_] img')]
    .map(i => i.naturalWidth + 'x' + i.naturalHeight);
  const body = document.body.getBoundingClientRect().right - parseFloat(getComputedStyle(document.body).paddingRight);
  out.textContent = [Math.floor(body), boxes.join(' '), images.join(' ')].join('|');
  document.body.appendChild(out);
});
</script>"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install chromium)")
def test_the_cost_section_renders_inside_the_window(tmp_path):
    args = cached_study(tmp_path, "[decode_tps, params_total]", {"decode_tps": 100.0, "params_total": 2.0e5})
    page_path = tmp_path / "report.html"
    assert main(["report", *args, "-o", str(page_path)]) == 0
    page = page_path.read_text()
    assert "<h2>Costs</h2>" in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", LAYOUT_SCRIPT + "</body>"))
    dom = chromium(tmp_path, f"--window-size={WIDTH},3000", "--virtual-time-budget=10000", "--dump-dom",
                   probe.as_uri())
    layout = re.search(r'<pre id="layout">([^<]*)</pre>', dom)
    assert layout, dom[-2000:]
    body, boxes, images = layout.group(1).split("|")
    rights = dict(b.split("=") for b in boxes.split())
    assert set(rights) == {"costs", "costs-2", "plot-cost_decode_tps", "plot-cost_params_total"}, rights
    assert int(body) < WIDTH and all(int(r) <= int(body) for r in rights.values()), (body, rights)
    dims = [tuple(map(int, s.split("x"))) for s in images.split()]
    assert len(dims) == 2 and all(w > 0 and h > 0 for w, h in dims), dims
    rows = re.search(r'<table id="costs">.*?<tbody>(.*?)</tbody>', dom, re.S)
    assert rows and rows.group(1).count("<tr") == 1 and "slower" in rows.group(1)
