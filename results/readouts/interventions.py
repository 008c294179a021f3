"""The interventions readout: knock-out effects of the study's finished runs (`results.interventions`), per
grid point, arm, mode, site and source averaged over seeds with a t interval over seeds, the cells whose
t test rejects 0 after Holm over their heatmap marked; per arm a heatmap of them; per run the mechanism values
(`imbalance`,
`stream<k>_knockout`), shown here as each arm's mean over seeds (the paired rows across arms are the
mechanisms readout's). In the terminal, the report, the artifacts (`interventions.csv`,
`intervention_values.csv`, the heatmaps, an MLflow table) and MLflow series of the parent run."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from reslab.results.collect import usable
from reslab.results.interventions import cell_table, intervention_values
from reslab.results.plots import DPI, Plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style

__all__ = ["InterventionsReadout", "InterventionsResult", "interventions_text", "knockout_heatmap"]

SHOWN = 8  # marked source cells the terminal shows per arm and mode, the largest


@dataclass(frozen=True)
class InterventionsResult:
    cells: pd.DataFrame   # `results.interventions.cell_table`
    values: pd.DataFrame  # `results.interventions.intervention_values`, per run


def _finished(data: StudyData) -> pd.DataFrame:
    """The intervention rows of the study's finished runs (`results.collect.usable`)."""
    records, runs = data.interventions, data.runs
    if records.empty or runs.empty:
        return records
    good = runs[usable(runs)]
    keys = set(zip(good["arm"], good["grid_key"].fillna("").astype(str), good["seed"].astype(int), strict=True))
    mask = [(a, str(g or ""), int(s)) in keys for a, g, s in zip(records["arm"], records["grid_key"].fillna(""),
                                                                 records["seed"], strict=True)]
    return records[mask]


def _sites(cells: pd.DataFrame) -> list[str]:
    """Site labels in depth order, `all` (whole streams, every gate) last."""
    numbers = sorted({int(s) for s in cells["site"] if s != "all"})
    return [str(n) for n in numbers] + (["all"] if (cells["site"] == "all").any() else [])


def knockout_heatmap(cells: pd.DataFrame, arm: str, title: str = "") -> Plot:
    """One arm's knock-out effects, a panel per mode (one above the other): sites (rows) x sources (columns),
    each cell the mean delta over seeds on a diverging scale centred at 0 shared by the panels, blank where the
    site does not read the source, `*` where the t test over seeds rejects 0 after Holm over the heatmap."""
    mine = cells[cells["arm"] == arm]
    modes = list(dict.fromkeys(mine["mode"]))
    sites, sources = _sites(mine), list(dict.fromkeys(mine["source"]))
    scale = float(np.nanmax(np.abs(mine["mean"].to_numpy(dtype=np.float64)))) if len(mine) else 1.0
    scale = scale if scale > 0 else 1.0
    from matplotlib.figure import Figure  # on first plot (issue 39)

    fig = Figure(figsize=(2.6 + 0.38 * len(sources), 0.6 + len(modes) * (1.3 + 0.3 * len(sites))), dpi=DPI,
                 layout="constrained")
    axes = fig.subplots(len(modes), 1, squeeze=False)[:, 0]
    data: dict[str, Any] = {"sites": sites, "sources": sources, "modes": modes, "vmax": scale}
    image = None
    for ax, mode in zip(axes, modes, strict=True):
        part = mine[mine["mode"] == mode]
        matrix = np.full((len(sites), len(sources)), np.nan)
        marks = np.zeros_like(matrix, dtype=bool)
        for r in part.to_dict("records"):
            i, j = sites.index(r["site"]), sources.index(r["source"])
            matrix[i, j], marks[i, j] = r["mean"], r["marked"]
        image = ax.imshow(matrix, cmap="RdBu_r", vmin=-scale, vmax=scale, aspect="auto")
        for i, j in zip(*np.nonzero(marks), strict=True):
            ax.text(j, i, "*", ha="center", va="center", fontsize="large", fontweight="bold")
        ax.set_title(f"{mode}", fontsize="small")
        ax.set_xticks(range(len(sources)), sources, rotation=60, fontsize="x-small")
        ax.set_yticks(range(len(sites)), sites, fontsize="x-small")
        ax.set_xlabel("source removed")
        ax.set_ylabel("site")
        data[mode] = {"mean": matrix, "marked": marks}
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="loss increase (nats)")
    fig.suptitle(title or arm, fontsize="medium")
    return Plot(f"knockout_{arm}", fig, data)


def _where(key: str, data: StudyData) -> str:
    return f" [{data.labels(key)}]" if key else ""


def _value_means(values: pd.DataFrame) -> pd.DataFrame:
    """Each (grid point, arm, metric)'s mean over seeds and its seed count."""
    if values.empty:
        return pd.DataFrame(columns=["grid_key", "arm", "metric", "mean", "n"])
    grouped = values.groupby(["grid_key", "arm", "metric"], sort=False)["value"]
    return grouped.agg(mean="mean", n="size").reset_index()


def _cell_text(r: dict[str, Any]) -> str:
    ci = "" if not np.isfinite(r["ci_low"]) else f" [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]"
    return f"{r['mean']:+.4f}{ci}{' *' if r['marked'] else ''}"


def interventions_text(result: InterventionsResult, data: StudyData, shown: int = SHOWN) -> str:
    """The terminal's lines: per arm and mode how many cells are marked, its stream and gate rows and its marked
    source rows (the largest `shown`, in menu order; every cell is in the report and `interventions.csv`), then
    the per-run values' means."""
    lines = [f"interventions: loss with the source removed - without, on each run's eval windows; mean over seeds "
             f"and its {1 - data.alpha:.0%} t interval over seeds; * the t test over seeds rejects 0 after Holm over "
             "the heatmap's cells (streams, gates and marked sources shown; every cell in the report and "
             "interventions.csv)"]
    for (key, arm, mode), part in result.cells.groupby(["grid_key", "arm", "mode"], sort=False):
        n, marked = int(part["n"].max()), int(part["marked"].sum())
        lines.append(f"  {arm}{_where(key, data)} ({mode}, {n} seed(s)): {marked} of {len(part)} cells marked")
        whole = part[part["kind"] != "source"]
        sources = part[(part["kind"] == "source") & part["marked"]]
        top = sources.loc[sources["mean"].abs().sort_values(ascending=False).index[:shown]].sort_index()
        lines += [f"    {r['kind']:<6} site {r['site']:>3}  {r['source']:<10} {_cell_text(r)}"
                  for r in pd.concat([whole, top]).to_dict("records")]
        if len(sources) > len(top):
            lines.append(f"    ... and {len(sources) - len(top)} more marked source(s)")
    for r in _value_means(result.values).to_dict("records"):
        lines.append(f"  {r['arm']}{_where(r['grid_key'], data)}: {r['metric']} {r['mean']:+.4f} "
                     f"(mean of {int(r['n'])} seed(s))")
    return "\n".join(lines) + "\n"


def _row_html(r: dict[str, Any], data: StudyData) -> str:
    interval = f"[{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]" if np.isfinite(r["ci_low"]) else ""
    cells = [r["arm"] + _where(r["grid_key"], data), r["mode"], r["kind"], r["site"], str(r["source"]), str(r["n"]),
             f"{r['mean']:+.4f}", interval + (" *" if r["marked"] else "")]
    mark = ' class="marked"' if r["marked"] else ""
    return f"<tr{mark}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"


def _key(text: str) -> str:
    return re.sub(r"[^\w./ -]", "_", text)


class InterventionsReadout(Readout):
    name = "interventions"

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        return [("interventions", data.intervention_plan)] if data.intervention_plan else []

    def compute(self, data: StudyData) -> InterventionsResult | None:
        records = _finished(data)
        if records.empty:
            return None
        return InterventionsResult(cell_table(records, data.alpha), intervention_values(records))

    def text(self, result: InterventionsResult, data: StudyData, style: Style) -> list[Any]:
        return [("\n" if style == "md" else "") + interventions_text(result, data)]

    def json(self, result: InterventionsResult, data: StudyData) -> dict[str, Any]:
        """Each (arm, mode, kind, site, source) cell's mean delta and interval, and the per-run values, as rows."""
        return {"cells": result.cells.to_dict("records"), "values": result.values.to_dict("records")}

    def section(self, result: InterventionsResult, data: StudyData) -> list[str]:
        head = "".join(f"<th>{h}</th>" for h in ("arm", "mode", "kind", "site", "source", "seeds", "mean delta",
                                                 "interval"))
        body = "".join(_row_html(r, data) for r in result.cells.to_dict("records"))
        values = "".join(f"<li>{html.escape(r['arm'] + _where(r['grid_key'], data))}: {r['metric']} "
                         f"{r['mean']:+.4f} (mean of {int(r['n'])} seed(s))</li>"
                         for r in _value_means(result.values).to_dict("records"))
        return ["<h2>Interventions</h2>",
                "<p>Each finished run's held-out loss with one source removed at one site (zeroed, or replaced by "
                "its mean over the eval windows), a whole stream dropped, or a gate pinned, minus its loss "
                f"without, on its eval windows; the mean over seeds and its {1 - data.alpha:.0%} t interval over "
                "seeds (each run is its own control); * marks a cell whose t test over seeds rejects 0 after Holm's "
                "correction over its heatmap (grid point, arm and mode).</p>",
                *([f"<ul>{values}</ul>"] if values else []),
                f"<details><summary>every cell ({len(result.cells)}; {int(result.cells['marked'].sum())} marked)"
                "</summary>",
                f'<table id="interventions"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>',
                "</details>"]

    def _plots(self, result: InterventionsResult, data: StudyData) -> list[tuple[Plot, str, str]]:
        out = []
        for (key, arm), part in result.cells.groupby(["grid_key", "arm"], sort=False):
            plot = knockout_heatmap(part, arm, f"{arm}{_where(key, data)}: knock-out effects")
            out.append((plot, f"{arm}{_where(key, data)}: loss increase when each source is removed at each site "
                              "(rows; `all`: a whole stream, or every gate), mean over seeds; * its interval over "
                              "seeds excludes 0", key))
        return out

    def plots(self, result: InterventionsResult, data: StudyData) -> list[tuple[Plot, str]]:
        return [(plot, caption) for plot, caption, _ in self._plots(result, data)]

    def artifacts(self, result: InterventionsResult, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.cells.to_csv(out / "interventions.csv", index=False)
        result.values.to_csv(out / "intervention_values.csv", index=False)
        for plot, _, key in self._plots(result, data):
            point = re.sub(r"[^\w.=-]", "_", key)
            plot.save(out / (f"{plot.name}_{point}.png" if point else f"{plot.name}.png"))
        return {"interventions_table.json": result.cells}

    def series(self, result: InterventionsResult, data: StudyData) -> Series:
        """`knockout/<arm>[/<grid point>]/<mode>/<site>/<source>`: each cell's mean delta, stepped by its seeds;
        `mechanism/<arm>[/<grid point>]/<metric>`: each per-run value's mean over seeds."""
        out: Series = {}
        for r in result.cells.to_dict("records"):
            where = f"/{r['grid_key']}" if r["grid_key"] else ""
            out[_key(f"knockout/{r['arm']}{where}/{r['mode']}/{r['site']}/{r['source']}")] = [
                (int(r["n"]), float(r["mean"]))]
        for r in _value_means(result.values).to_dict("records"):
            where = f"/{r['grid_key']}" if r["grid_key"] else ""
            out[_key(f"mechanism/{r['arm']}{where}/{r['metric']}")] = [(int(r["n"]), float(r["mean"]))]
        return out
