"""The ladder readout: across a ladder of sizes or budgets, each treatment's compute-equivalent
multiplier in FLOPs and wall-clock and the trend of its gain with size (`results.ladder`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.ladder import LadderResult, ladder_readout, ladder_text
from reslab.results.plots import Plot, scaling_plot
from reslab.results.readouts.base import Readout, StudyData, Style
from reslab.results.report import ladder_section

__all__ = ["LadderReadout"]


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
