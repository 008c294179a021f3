"""The cost readout: a study's declared costs (`costs:`) as paired ratio rows, treatment / control per
comparison, treatment, grid point and cost metric (`results.costs`), and per cost and grid point the loss
against that cost with the arms' Pareto front."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.common.metrics import METRICS
from reslab.results.comparison import Comparison
from reslab.results.costs import check_recorded, cost_points, cost_table
from reslab.results.export import cost_renderables, format_costs
from reslab.results.plots import Plot, cost_plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style
from reslab.results.report import cost_section
from reslab.results.stats import _natural_key

__all__ = ["CostsReadout", "cost_series"]


def cost_series(table: pd.DataFrame) -> Series:
    """The ratio rows as MLflow metrics of the parent run, stepped by their pairs:
    `cost/<comparison>/<treatment>[/<grid point>]/<metric>/` + `ratio`, `ratio_low`, `ratio_high` (finite ones)."""
    out: Series = {}
    for r in table.to_dict("records"):
        where = f"/{r['grid_key']}" if r["grid_key"] else ""
        key = re.sub(r"[^\w./ -]", "_", f"cost/{r['comparison']}/{r['treatment']}{where}/{r['metric']}")
        for name in ("ratio", "ratio_low", "ratio_high"):
            if pd.notna(r[name]):
                out[f"{key}/{name}"] = [(int(r["n"]), float(r[name]))]
    return out


def _by_metric(comparisons: tuple[Comparison, ...]) -> dict[tuple[str, str], list[str]]:
    """(loss metric, its direction) -> the arms of the comparisons on it, controls first, in study order."""
    out: dict[tuple[str, str], list[str]] = {}
    for comp in comparisons:
        arms = out.setdefault((comp.metric, comp.direction), [])
        arms += [a for a in (comp.control, *comp.treatments) if a not in arms]
    return out


def _file_name(plot: Plot, grid_key: str) -> str:
    """`cost_<metric>[_<grid point>].png`, the grid point's characters outside `\\w.=-` as `_`."""
    point = re.sub(r"[^\w.=-]", "_", grid_key)
    return f"{plot.name}_{point}.png" if point else f"{plot.name}.png"


class CostsReadout(Readout):
    name = "costs"

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        if not data.cost_metrics:
            return None
        check_recorded(data.runs, data.cost_metrics, data.name)
        return cost_table(data.runs, data.comparisons, data.cost_metrics, alpha=data.alpha)

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        if style == "rich":
            return cost_renderables(result)
        if style == "md":  # a blank line ends the paired table's legend list, which would swallow the caption
            return ["\n" + format_costs(result, "md")]
        return [format_costs(result, "text")]

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        return cost_section(result, data.labels)

    def _plots(self, data: StudyData) -> list[tuple[Plot, str, str]]:
        """(plot, caption, grid key) per cost, loss metric and grid point with a run usable on both."""
        runs = data.runs
        plots = []
        groups = _by_metric(data.comparisons)
        for cost in data.cost_metrics:
            for (metric, direction), arms in groups.items():
                mine = runs[runs["arm"].isin(arms)]
                for key in sorted(set(mine["grid_key"].fillna("")), key=_natural_key):
                    points = cost_points(runs, arms, cost, metric, key)
                    if points.empty:
                        continue
                    at = f" at {data.labels(key)}" if key else ""
                    plot = cost_plot(points, cost, metric, cost_direction=METRICS[cost].direction,
                                     metric_direction=direction, title=f"{metric} against {cost}{at}")
                    caption = (f"{metric} against {cost}{at}: each arm's seeds (dots) and mean (labelled; the cost's "
                               "geometric mean over seeds), the Pareto front circled and joined (arms that no "
                               "other arm matches or beats on both); a log cost axis when the costs span more "
                               "than 3x.")
                    plots.append((plot, caption, key))
        return plots

    def plots(self, result: pd.DataFrame, data: StudyData) -> list[tuple[Plot, str]]:
        return [(plot, caption) for plot, caption, _ in self._plots(data)]

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "costs.csv", index=False)
        for plot, _, key in self._plots(data):
            plot.save(out / _file_name(plot, key))
        return {"costs_table.json": result}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        return cost_series(result)
