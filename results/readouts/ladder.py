"""The ladder readout: across a ladder of sizes or budgets, each treatment's compute-equivalent
multiplier in FLOPs and wall-clock and the trend of its gain with size (`results.ladder`)."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.ladder import SIZE, LadderResult, interval_text, ladder_readout, ladder_text
from reslab.results.plots import Plot, scaling_plot
from reslab.results.readouts.base import Readout, StudyData, Style
from reslab.results.report import Labels, no_labels

__all__ = ["LadderReadout", "ladder_section"]


def ladder_section(ladder: LadderResult | None, labels: Labels = no_labels) -> list[str]:
    """'Across scale': each summary row's statement and trend, then the per-rung table (rungs by their short
    labels)."""
    if ladder is None or ladder.summary.empty:
        return []
    items = []
    for row in ladder.summary.to_dict("records"):
        where = f" [{labels(row['scope'])}]" if row["scope"] else ""
        trend = ("" if math.isnan(row["trend_slope"]) else
                 f"; delta against log size {row['trend_slope']:+.4f} per e-fold of {SIZE}, sign-flip p "
                 f"{row['trend_p']:.3g}")
        flags = f' <span class="flags">{html.escape(row["flags"])}</span>' if row["flags"] else ""
        items.append(f"<li><b>{html.escape(row['comparison'] + where)}</b>: "
                     f"{html.escape(row['statement'] + trend)} ({row['seeds']} seeds){flags}</li>")
    head = ("comparison", "treatment", "rung", "params", "FLOPs/run", "s/run control", "s/run treatment",
            "loss control", "loss treatment", "delta", "k FLOPs [CI]", "k wall-clock [CI]")
    rows = []
    for r in ladder.rungs.to_dict("records"):
        cells = [r["comparison"], r["treatment"], labels(r["grid_key"]) or str(r["rung"])]
        numbers = [f"{r['params_treatment']:.3g}", f"{r['flops_treatment']:.3g}", f"{r['wall_s_control']:.3g}",
                   f"{r['wall_s_treatment']:.3g}", f"{r['loss_control']:.4f}", f"{r['loss_treatment']:.4f}",
                   f"{r['mean_delta']:+.4f}", interval_text(r["k_flops"], r["k_flops_low"], r["k_flops_high"]),
                   interval_text(r["k_wall"], r["k_wall_low"], r["k_wall_high"])]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "".join(f'<td class="num">{html.escape(c)}</td>' for c in numbers) + "</tr>")
    return ["<h2>Across scale</h2>",
            "<p>k is the compute the control needs to reach the treatment's fitted loss (L(C) = E + A C^-alpha, "
            "Huber in log space, many starts), over the treatment's compute: k &gt; 1 favours the treatment. The "
            "headline k is at the geometric middle of the rungs, one number only when the fitted exponents agree; "
            "intervals from a paired seed bootstrap (seeds resampled jointly across arms and rungs). Wall-clock k "
            "uses each run's measured training tokens/s.</p>",
            f'<ul id="ladder">{"".join(items)}</ul>',
            f'<table id="rungs"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>"]


class LadderReadout(Readout):
    name = "ladder"

    def compute(self, data: StudyData) -> LadderResult | None:
        if not data.ladder:
            return None
        cost = {key: (c.flops, c.params) for key, c in data.costs.items()}
        return ladder_readout(data.runs, data.comparisons, data.ladder, cost, alpha=data.alpha)

    def text(self, result: LadderResult, data: StudyData, style: Style) -> list[Any]:
        return [ladder_text(result, data.alpha)]

    def section(self, result: LadderResult, data: StudyData) -> list[str]:
        return ladder_section(result, data.labels)

    def json(self, result: LadderResult, data: StudyData) -> dict[str, Any]:
        """The summary (k per comparison, scope and treatment) and the rung table, as rows."""
        return {"summary": result.summary.to_dict("records"), "rungs": result.rungs.to_dict("records")}

    def plots(self, result: LadderResult, data: StudyData) -> list[tuple[Plot, str]]:
        plots = []
        metric = {c.name: c.metric for c in data.comparisons}
        for (name, scope), ladders in result.arms.items():
            mults = {t: m for (c, s, t), m in result.multipliers.items() if (c, s) == (name, scope)}
            at = f" at {data.labels(scope)}" if scope else ""
            plots.append((scaling_plot(ladders, mults, metric[name]),
                          f"{name}{at}: loss against training FLOPs per arm (seeds as dots, min-max band, fitted "
                          "L(C) = E + A C^-alpha dashed), and each treatment's compute-equivalent multiplier k with "
                          "its interval, FLOPs and wall-clock."))
        return plots

    def artifacts(self, result: LadderResult, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.summary.to_csv(out / "ladder_summary.csv", index=False)
        result.rungs.to_csv(out / "ladder_rungs.csv", index=False)
        return {"ladder_table.json": result.summary}
