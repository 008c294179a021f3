"""Every plot of a report is drawn whole (issue 52, item 15: `results.plots.layout_defects`): the golden study's
(every kind of result, a ladder, a sequential design) and a user's study whose arms share a prefix and whose
costs span more than `LOG_SPAN` (a log axis). Synthetic records (`readout_fixture`): the layout depends on the
text and the ranges the plots draw, not on training."""

from __future__ import annotations

import pytest
import readout_fixture
from test_report_layout_browser import USER_STUDY

from reslab.orchestrator.gathering.gather import gather
from reslab.results.plots import layout_defects


@pytest.mark.parametrize("study", ["golden", "user"])
def test_no_plot_of_the_report_cuts_a_label_or_overlaps_its_ticks(study, tmp_path):
    spec, runs, workspace = readout_fixture.build(tmp_path, readout_fixture.STUDY if study == "golden" else USER_STUDY)
    plots = gather(spec, runs, workspace, "sqlite:///unused", cached=True).plots()
    assert len(plots) >= (15 if study == "golden" else 5), [p.name for p, _ in plots]
    assert [d for plot, _ in plots for d in layout_defects(plot)] == []
