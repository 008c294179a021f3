"""The contrasts readout: a study's declared contrasts (weighted sums of arms, the fraction of a gain a
cheaper arm keeps) on per-seed values (`results.contrasts`)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.contrasts import contrast_table, contrast_text
from reslab.results.readouts.base import Readout, StudyData, Style
from reslab.results.report import Labels, no_labels
from reslab.results.report import cell_number as _num

__all__ = ["ContrastsReadout", "contrast_section"]


def contrast_section(contrasts: pd.DataFrame | None, labels: Labels = no_labels) -> list[str]:
    if contrasts is None or contrasts.empty:
        return []
    head = ("contrast", "grid point", "definition", "seeds", "estimate", "CI", "p", "Holm p", "verdict")
    rows = []
    for r in contrasts.to_dict("records"):
        cells = [r["contrast"], labels(r["grid_key"]) if r["grid_key"] else "-", r["definition"]]
        numbers = [str(r["seeds"]), _num(r["estimate"]), f"[{_num(r['ci_low'])}, {_num(r['ci_high'])}]",
                   _num(r["p"]), _num(r["p_holm"])]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "".join(f'<td class="num">{html.escape(c)}</td>' for c in numbers)
                    + f"<td>{html.escape(r['verdict'])}</td></tr>")
    return ["<h2>Contrasts</h2>",
            "<p>Per-seed contrast values; exact sign-flip p (one-sided below the margin for non-inferiority), Holm "
            "over the study's tested contrasts; paired-t intervals, Fieller's for the fraction a cheaper arm keeps."
            "</p>",
            f'<table id="contrasts"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>"]


class ContrastsReadout(Readout):
    name = "contrasts"

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        return contrast_table(data.runs, data.contrasts, alpha=data.alpha) if data.contrasts else None

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        return [contrast_text(result, data.alpha)]

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        return contrast_section(result, data.labels)

    def json(self, result: pd.DataFrame, data: StudyData) -> list[dict[str, Any]]:
        return result.to_dict("records")

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "contrasts.csv", index=False)
        return {"contrasts_table.json": result}
