"""Each plot of results.plots draws the arrays of its table: checked against numpy/scipy recomputations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from reslab.results import compare
from reslab.results.comparison import Comparison
from reslab.results.plots import (
    concentration_profile,
    deff_plot,
    delta_curve,
    forest_plot,
    loss_curves,
    pngs_base64,
    routing_heatmaps,
    sweep_curve,
)


def _runs(grid: list[str], shift: dict[str, float], seeds: int = 8) -> pd.DataFrame:
    """Runs table: control and treatment per grid point and seed; treatment = control + shift + noise.
    8 seeds: the smallest exact sign-flip p, 2/2**8, stays below 0.05 after Holm over 3 rows."""
    rng = np.random.default_rng(0)
    rows = []
    for g in grid:
        for s in range(seeds):
            base = 3.0 + rng.normal(0, 0.05)
            rows.append({"run_id": f"c{g}{s}", "arm": "control", "grid_key": g, "seed": s, "status": "FINISHED",
                         "val_loss_tail": base})
            rows.append({"run_id": f"t{g}{s}", "arm": "mharl", "grid_key": g, "seed": s, "status": "FINISHED",
                         "val_loss_tail": base + shift[g] + rng.normal(0, 0.002)})
    return pd.DataFrame(rows)


def test_forest_plot_draws_each_rows_delta_ci_threshold_and_corrected_significance(tmp_path):
    grid = ["heads=1", "heads=2", "heads=4"]
    table = compare(_runs(grid, {"heads=1": 0.0, "heads=2": -0.05, "heads=4": -0.1}),
                    [Comparison(name="sweep", control="control", treatments=("mharl",), mei=0.01)])
    plot = forest_plot(table)
    np.testing.assert_allclose(plot.data["mean"], table["mean_delta"].to_numpy())
    np.testing.assert_allclose(plot.data["ci_low"], table["ci_low"].to_numpy())
    np.testing.assert_allclose(plot.data["ci_high"], table["ci_high"].to_numpy())
    np.testing.assert_allclose(plot.data["threshold"], 0.01)
    assert plot.data["significant"].tolist() == [v in ("better", "worse") for v in table["verdict"]]
    # H=1 has no real effect (noise only); H=2 and H=4 are 25-50 noise SDs better
    assert plot.data["significant"].tolist() == [False, True, True]
    assert plot.save(tmp_path / "forest.png").stat().st_size > 0
    assert plot.save(tmp_path / "forest.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="allowed: .png, .svg"):
        plot.save(tmp_path / "forest.pdf")


def test_sweep_curve_orders_the_axis_numerically_with_the_ci_band():
    grid = ["heads=8", "heads=1", "heads=16"]  # out of order on purpose: "16" < "8" as text
    table = compare(_runs(grid, {"heads=1": 0.0, "heads=8": -0.04, "heads=16": -0.02}),
                    [Comparison(name="sweep", control="control", treatments=("mharl",), exploratory=True)])
    data = sweep_curve(table, "heads").data["sweep: mharl"]
    assert data["x"].tolist() == [1.0, 8.0, 16.0]
    by_key = table.set_index("grid_key")
    for x, mean, lo, hi in zip(data["x"], data["mean"], data["ci_low"], data["ci_high"], strict=True):
        row = by_key.loc[f"heads={int(x)}"]
        assert (mean, lo, hi) == (row["mean_delta"], row["ci_low"], row["ci_high"])
    with pytest.raises(ValueError, match="grid axis 'blocks'"):
        sweep_curve(table, "blocks")


def _evals() -> pd.DataFrame:
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(4):
        for tokens in (100, 200, 300):
            base = 5.0 - tokens / 1000 + rng.normal(0, 0.01)
            rows.append({"arm": "control", "grid_key": "", "seed": seed, "tokens": tokens, "val_loss": base})
            rows.append({"arm": "attnres", "grid_key": "", "seed": seed, "tokens": tokens,
                         "val_loss": base - 0.02 + rng.normal(0, 0.003)})
    return pd.DataFrame(rows)


def test_loss_curves_mean_and_band_over_seeds():
    evals = _evals()
    minmax = loss_curves(evals).data["control"]
    ci = loss_curves(evals, band="ci").data["control"]
    for i, tokens in enumerate((100, 200, 300)):
        v = evals[(evals["arm"] == "control") & (evals["tokens"] == tokens)]["val_loss"].to_numpy()
        assert minmax["tokens"][i] == tokens and minmax["seeds"][i] == 4
        assert minmax["mean"][i] == pytest.approx(v.mean())
        assert (minmax["low"][i], minmax["high"][i]) == (v.min(), v.max())
        # reference: scipy's one-sample t interval of the mean
        lo, hi = sps.ttest_1samp(v, 0.0).confidence_interval(0.95)
        assert (ci["low"][i], ci["high"][i]) == (pytest.approx(lo), pytest.approx(hi))
    with pytest.raises(ValueError, match="band 'sd'"):
        loss_curves(evals, band="sd")  # type: ignore[arg-type]


def test_delta_curve_pairs_seeds_and_matches_the_paired_t_interval():
    evals = _evals()
    data = delta_curve(evals, "control", "attnres").data["attnres - control"]
    for i, tokens in enumerate((100, 200, 300)):
        at = evals[evals["tokens"] == tokens].sort_values("seed")
        ctrl = at[at["arm"] == "control"]["val_loss"].to_numpy()
        trt = at[at["arm"] == "attnres"]["val_loss"].to_numpy()
        res = sps.ttest_rel(trt, ctrl)  # reference: scipy's paired t-test
        lo, hi = res.confidence_interval(0.95)
        assert data["mean"][i] == pytest.approx((trt - ctrl).mean())
        assert (data["ci_low"][i], data["ci_high"][i]) == (pytest.approx(lo), pytest.approx(hi))
        assert data["pairs"][i] == 4
    with pytest.raises(ValueError, match="no evaluation pairs"):
        delta_curve(evals, "control", "missing_arm")


def test_routing_heatmaps_share_one_colour_scale_and_profiles_keep_gaps():
    a = np.array([[1.0, np.nan], [0.3, 0.7]])
    b = np.array([[1.0, np.nan, np.nan], [0.2, 0.1, 0.9]]) * 0.5
    plot = routing_heatmaps({"attnres": (a, ["attn 1", "mlp 1"]), "block": (b, ["attn 1", "mlp 1"])})
    assert (plot.data["vmin"], plot.data["vmax"]) == (0.0, 1.0)
    images = [ax.images[0] for ax in plot.figure.axes if ax.images]
    assert [im.get_clim() for im in images] == [(0.0, 1.0), (0.0, 1.0)]
    profile = concentration_profile({"attnres": [None, 0.4, 0.6]}).data["attnres"]
    assert np.isnan(profile["concentration"][0]) and profile["concentration"][1:].tolist() == [0.4, 0.6]
    with pytest.raises(ValueError, match="no arm"):
        routing_heatmaps({})


def test_figures_drawn_by_forked_workers_are_the_bytes_one_process_draws():
    """`reslab report` draws a large grid's figures on every core (issue 39): each figure, in its place, is
    byte for byte the PNG this process draws. Each call gets new figures: a constrained layout drawn a second
    time moves by a pixel."""

    def plots():
        return [concentration_profile({"a": [0.1 * i, None, 0.5], "b": [0.2, 0.3 + 0.01 * i]}) for i in range(17)]

    alone = pngs_base64(plots())
    assert len(set(alone)) == 17  # every figure differs: an order mistake would show
    assert pngs_base64(plots(), workers=2) == alone
    assert pngs_base64(plots(), workers=3) == alone  # 17 // 8: at most two workers


def test_deff_plot_means_per_arm_against_f_l():
    depths = pd.DataFrame({"arm": ["a", "a", "b"], "seed": [0, 1, 0], "d_eff": [1.0, 1.2, 1.5],
                           "f_l": [2 * 4 / 5] * 3})
    data = deff_plot(depths).data
    assert data["a"]["mean"] == pytest.approx(1.1) and data["b"]["mean"] == 1.5
    assert data["a"]["f_l"] == pytest.approx(1.6)


def test_deff_plot_keeps_grid_points_apart():
    # a depth ladder: F_L is 2L/(L+1) of each point's own L, and seeds of different depths never pool
    depths = pd.DataFrame({"arm": ["a", "a", "a", "a"], "grid_key": ["L=2", "L=2", "L=4", "L=4"],
                           "seed": [0, 1, 0, 1], "d_eff": [1.0, 1.2, 1.5, 1.7], "f_l": [4 / 3, 4 / 3, 1.6, 1.6]})
    data = deff_plot(depths).data
    assert set(data) == {"a [L=2]", "a [L=4]"}
    assert data["a [L=2]"]["mean"] == pytest.approx(1.1) and data["a [L=2]"]["f_l"] == pytest.approx(4 / 3)
    assert data["a [L=4]"]["mean"] == pytest.approx(1.6) and data["a [L=4]"]["f_l"] == pytest.approx(1.6)


def _ladder_evals() -> pd.DataFrame:
    """The shipped CPU ladder's shape: two arms at four rungs whose grid keys name four axes each."""
    from test_report_presentation import LADDER

    rng = np.random.default_rng(2)
    rows = []
    for r, key in enumerate(LADDER):
        for seed in range(3):
            for tokens in (100, 200, 300):
                base = 5.0 - r * 0.3 - tokens / 1000 + rng.normal(0, 0.01)
                rows += [{"arm": "control", "grid_key": key, "seed": seed, "tokens": tokens, "val_loss": base},
                         {"arm": "attnres", "grid_key": key, "seed": seed, "tokens": tokens, "val_loss": base - 0.02}]
    return pd.DataFrame(rows)


def _legend_places(plot) -> list[tuple[bool, bool]]:
    """Per legend of the figure (its own and its axes'): (over no axes, inside the figure), from the drawn
    extents in pixels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plot.figure
    canvas = FigureCanvasAgg(fig)  # the renderer `Plot.save` draws with
    canvas.draw()
    renderer = canvas.get_renderer()
    box = fig.bbox
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
    assert legends
    out = []
    for legend in legends:
        extent = legend.get_window_extent(renderer)
        clear = not any(extent.overlaps(ax.get_window_extent(renderer)) for ax in fig.axes)
        inside = (extent.x0 >= box.x0 - 1 and extent.x1 <= box.x1 + 1 and extent.y0 >= box.y0 - 1
                  and extent.y1 <= box.y1 + 1)
        out.append((clear, inside))
    return out


def test_the_legends_of_a_ladders_curves_cover_no_curve_and_stay_in_their_figure():
    """Issue 35: the loss-curve legend (eight entries, each a whole grid key) covered the curves, the delta-curve
    legend ran out of its figure, the D_eff legend covered a bar's F_L line. Each legend now sits below its
    axes, inside the figure; with the short labels (`r0: d32 L2 ...`) the entries say where."""
    from test_report_presentation import LADDER

    from reslab.results.labels import point_labels

    evals = _ladder_evals()
    labels = point_labels(LADDER, [("", LADDER)])
    depths = pd.DataFrame([{"arm": arm, "grid_key": key, "seed": s, "d_eff": 1.3 + 0.1 * s, "f_l": 2 * L / (L + 1)}
                           for L, key in enumerate(LADDER, start=2) for arm in ("attnres", "block") for s in range(3)])
    for named in (None, labels):  # whole grid keys (what `plots` draws without labels) and short labels
        kw = {} if named is None else {"labels": named}
        for plot in (loss_curves(evals, **kw), delta_curve(evals, "control", "attnres", **kw), deff_plot(depths, **kw)):
            assert _legend_places(plot) == [(True, True)], (plot.name, named)
    entries = [t.get_text() for t in loss_curves(evals, labels=labels).figure.legends[0].get_texts()]
    assert "attnres [r0: d32 L2 ff96 st300]" in entries and len(entries) == 8
