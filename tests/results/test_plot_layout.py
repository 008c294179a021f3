"""The report's plots as a reader sees them (issue 52, item 15): no text cut by the figure's edge, no two tick
labels drawn over each other (`results.plots.layout_defects`, which lays the figure out with Agg as the saved PNG
is). A delta curve's y label named the pair and ran past the figure's edge; a log cost axis wrote `3x10^0` and
`4x10^0` over each other when the costs spanned about a decade."""

from __future__ import annotations

import itertools

import matplotlib
import numpy as np
import pandas as pd
import pytest

from reslab.results.plots import Plot, cost_plot, delta_curve, layout_defects

matplotlib.use("Agg")


def test_the_check_finds_a_cut_label_and_overlapping_ticks():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("a y label far longer than the axes are tall, which the figure's edge must cut")
    ax.set_xticks([0.0, 0.01], ["a long tick label", "another long one"])
    found = layout_defects(Plot("probe", fig))
    assert any("is cut by the figure's edge" in d for d in found), found
    assert any("overlap" in d for d in found), found


@pytest.mark.parametrize(("low", "span"), list(itertools.product([0.7, 3.3, 12.0, 45.0, 180.0, 2500.0, 9000.0, 6e4],
                                                                 [3.2, 5.0, 8.0, 15.0, 40.0, 120.0, 900.0, 3e4])))
def test_a_log_cost_axis_never_writes_its_tick_labels_over_each_other(low, span):
    costs = [low, low * 1.05, low * span ** 0.5, low * span ** 0.5 * 1.02, low * span / 1.05, low * span]
    points = pd.DataFrame({"arm": ["a", "a", "b", "b", "c", "c"], "seed": [0, 1] * 3, "cost": costs,
                           "loss": [4.3, 4.31, 4.2, 4.22, 4.1, 4.12]})
    plot = cost_plot(points, "prefill_tps", "val_loss", cost_direction="maximize", metric_direction="minimize")
    assert plot.data["log_x"]
    assert layout_defects(plot) == []


def test_a_delta_curve_of_long_arm_names_fits_its_figure():
    rows = [{"arm": arm, "grid_key": "", "seed": seed, "tokens": float(tokens), "val_loss": 4.0 + d + 0.01 * seed}
            for arm, d in (("prenorm_adamw", 0.0), ("attnres_full_history_with_readout", -0.05))
            for seed in range(3) for tokens in (512, 1024, 1536)]
    plot = delta_curve(pd.DataFrame(rows), "prenorm_adamw", "attnres_full_history_with_readout")
    assert layout_defects(plot) == []
    assert np.allclose(plot.data["attnres_full_history_with_readout - prenorm_adamw"]["mean"], -0.05)
