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
from reslab.results.export import (
    NA_TEXT,
    PRINT_FORMATS,
    Labels,
    Model,
    ci_decimals,
    ci_level,
    fmt_number,
    is_missing,
    latex_escape,
    note_marks,
    numeric_column,
    point_column,
    render_model,
    rich_model,
    tex_body,
    tex_float,
    tex_head,
    tex_text,
)
from reslab.results.plots import Plot, cost_plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style, TableFormat, listed
from reslab.results.report import model_tables
from reslab.results.stats import _natural_key

__all__ = ["CostsReadout", "cost_model", "cost_renderables", "cost_section", "cost_series", "format_costs"]


# a cost's word coloured as a verdict: the better side green (a throughput faster, a size smaller)
_COST_STYLES = {"faster": "bold green", "smaller": "bold green", "slower": "bold red", "larger": "bold red"}
_MAX_RATIO_DECIMALS = 6


def _cost_caption(metric: str, direction: str) -> str:
    info = METRICS.get(metric)
    units = f" ({info.unit})" if info else ""
    better = "lower" if direction == "minimize" else "higher"
    defined = f"; {metric} is {info.description}" if info else ""
    return f"cost {metric}{units}, {better} is better; ratio = treatment / control on the same seed{defined}"


def _cost_value(metric: str, x: float) -> str:
    if is_missing(x):
        return NA_TEXT
    return format(x, METRICS[metric].fmt) if metric in METRICS else f"{x:.4g}"


def _cost_rows(block: pd.DataFrame, marks: list[str], labels: Labels | None = None
               ) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells of one cost metric's ratio rows; the ratios share the decimals that
    show two significant digits of the narrowest interval's half-width (three of a point ratio)."""
    grid_head, grid_cells = point_column(list(block["grid_key"]), labels)
    header = ["comparison", grid_head, "control", "treatment", "n", "control geo. mean", "treatment geo. mean",
              f"ratio [{ci_level(block)} CI]", "W/L", "verdict", "notes"]
    records = block.to_dict("records")
    dec = min(_MAX_RATIO_DECIMALS, max(ci_decimals((r["ratio_high"] - r["ratio_low"]) / 2.0, r["ratio"])
                                       for r in records))
    rows = []
    for r, note, grid in zip(records, marks, grid_cells, strict=True):
        ratio = fmt_number(r["ratio"], dec)
        if not is_missing(r["ratio_low"]):
            ratio += f" [{fmt_number(r['ratio_low'], dec)}, {fmt_number(r['ratio_high'], dec)}]"
        rows.append([str(r["comparison"]), grid, str(r["control"]), str(r["treatment"]), str(int(r["n"])),
                     _cost_value(r["metric"], r["control_geomean"]),
                     _cost_value(r["metric"], r["treatment_geomean"]),
                     ratio, f"{int(r['wins'])}/{int(r['losses'])}", str(r["verdict"]), note])
    return header, rows


def _cost_parts(costs: pd.DataFrame, labels: Labels | None = None) -> tuple[Model, list[str], dict[str, str]]:
    """The cost rows' blocks, the lines that explain them, and their notes (mark -> text)."""
    marks, legend = note_marks([[f for f in str(r["flags"]).split(";") if f] for r in costs.to_dict("records")])
    mark_of = dict(zip(costs.index, marks, strict=True))
    blocks = []
    for (metric, direction), block in costs.groupby(["metric", "direction"], sort=False):
        blocks.append((_cost_caption(str(metric), str(direction)),
                       *_cost_rows(block, [mark_of[i] for i in block.index], labels)))
    level = ci_level(costs)
    lines = [
        f"ratio: the geometric mean over the seeds of treatment / control on the same grid point and seed (exp "
        f"of the mean log ratio), with the {level} seed-paired t interval of the mean log ratio, exponentiated; "
        "it assumes normal log ratios; the geometric means are each arm's over those seeds (their quotient is the "
        "ratio); a measured cost's pairs timed on different kinds of machine are left out (notes)",
        "verdict: faster or slower (a throughput), larger or smaller (a size, memory, FLOPs) when the interval "
        "excludes 1, else no difference; descriptive, without a multiplicity correction; W/L = seeds where the "
        "treatment's cost was better/worse",
    ]
    return blocks, lines, legend


def cost_model(costs: pd.DataFrame, labels: Labels | None = None) -> tuple[Model, list[str]]:
    """`table_model` of the cost ratio rows (`results.costs.cost_table`): per cost metric a (caption, header,
    rows) block, then the legend lines; `labels` as `table_model`'s."""
    blocks, lines, legend = _cost_parts(costs, labels)
    return blocks, lines + [f"{k}: {v}" for k, v in legend.items()]


def format_costs(costs: pd.DataFrame, fmt: str = "md") -> str:
    """The cost ratio rows as Markdown (``"md"``) or aligned plain text (``"text"``), like `format_table`."""
    if fmt not in PRINT_FORMATS:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return render_model(*cost_model(costs), fmt) if len(costs) else "no cost rows\n"


def cost_renderables(costs: pd.DataFrame) -> list[Any]:
    """The cost rows for a terminal (`rich`), like `rich_renderables`: the better side green, the worse red."""
    from rich.text import Text

    return rich_model(*cost_model(costs), _COST_STYLES) if len(costs) else [Text("no cost rows")]


def _costs_latex(costs: pd.DataFrame) -> str:
    """The cost ratio rows (`cost_model`) as one booktabs float per cost metric, like `results.export.table_latex`."""
    blocks, lines, legend = _cost_parts(costs)
    explain = " ".join(tex_text(line) + "." for line in lines)
    out = []
    for (caption, header, rows), metric in zip(blocks, dict.fromkeys(costs["metric"]), strict=True):
        keep, body = tex_body(header, rows, ("comparison", "control", "notes"))
        used = {m for r in rows for m in r[-1].split(",") if m}
        legend_tex = " ".join(f"\\textsuperscript{{{k}}}\\,{tex_text(v)}." for k, v in legend.items() if k in used)
        name = latex_escape(str(metric))
        caption_tex = tex_text(caption).replace(name, f"\\texttt{{{name}}}")
        out += tex_float("\\footnotesize", f"{caption_tex}. Geometric mean ratio, {latex_escape(ci_level(costs))} "
                         "seed-paired CI.", "".join("r" if numeric_column(h) else "l" for h in keep),
                         [tex_head(h) for h in keep], body,
                         f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain} {legend_tex}}}")
    return "\n".join(out)


def cost_section(costs: pd.DataFrame, labels: Labels | None = None) -> list[str]:
    """The cost ratio rows as the terminal prints them (`cost_model`), one table per cost."""
    if costs.empty:
        return []
    return ["<h2>Costs</h2>",
            "<p>ratio = treatment / control on the same grid point and seed; each row is the geometric mean of the "
            "per-seed ratios with the seed-paired t interval of the mean log ratio, exponentiated. The loss against "
            "each cost, with the Pareto front, is among the plots.</p>",
            model_tables(*cost_model(costs, labels), "costs")]


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

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        if not data.cost_metrics:
            return []
        return [("costs", ", ".join(data.cost_metrics) + " (ratios treatment / control within each comparison)")]

    def tables(self, result: pd.DataFrame, data: StudyData, fmt: TableFormat) -> list[str]:
        """The ratio rows' own tables after the paired one: one per cost metric."""
        if not len(result):
            return []
        return [format_costs(result, "md") if fmt == "md" else _costs_latex(result)]

    def json(self, result: pd.DataFrame, data: StudyData) -> list[dict[str, Any]]:
        """The cost rows, every column, the seeds, machines, run ids, missing seeds and notes as lists."""
        return listed(result.to_dict("records"), {"seeds": ",", "machines": ";", "control_run_ids": ";",
                                                  "treatment_run_ids": ";", "missing": ";", "flags": ";"})

    def rows(self, result: pd.DataFrame, data: StudyData) -> pd.DataFrame | None:
        """The ratio rows as they are (`role` cost, `delta` treatment / control, the ratio and its interval in
        `ratio`, `ratio_low`, `ratio_high`); the paired rows' own statistics NaN on them."""
        return result if len(result) else None

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
