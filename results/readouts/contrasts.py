"""The contrasts readout: a study's declared contrasts (weighted sums of arms, the fraction of a gain a
cheaper arm keeps) on per-seed values (`results.contrasts`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.contrasts import contrast_table, contrast_text
from reslab.results.readouts.base import Readout, StudyData, Style
from reslab.results.report import contrast_section

__all__ = ["ContrastsReadout"]


class ContrastsReadout(Readout):
    name = "contrasts"

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        return contrast_table(data.runs, data.contrasts, alpha=data.alpha) if data.contrasts else None

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        return [contrast_text(result, data.alpha)]

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        return contrast_section(result, data.labels)

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "contrasts.csv", index=False)
        return {"contrasts_table.json": result}
