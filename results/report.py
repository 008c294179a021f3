"""The one-page HTML report of a study: self-contained (plots inlined as base64 PNG, CSS inline,
no script, no network), readable from a file, a mail attachment or an MLflow artifact.

A pure function of plain data; the orchestrator gathers it (`orchestrator/report.py`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

from reslab.results.plots import SIGNIFICANT, Plot

__all__ = ["TABLE_COLUMNS", "render_report"]

TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("comparison", "comparison"), ("grid_key", "grid point"), ("treatment", "treatment"),
    ("control", "control"), ("metric", "metric"), ("n", "pairs"), ("mean_delta", "mean delta"),
    ("ci", "CI"), ("p_adj", "p (corrected)"), ("verdict", "verdict"), ("flags", "flags"),
)

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.significant td { background: #fde8e8; font-weight: bold; }
figure { margin: 1.5em 0; }
figcaption { color: #555; font-size: 0.9em; }
pre { background: #f4f4f4; padding: 0.8em; overflow-x: auto; }
.flags { color: #a15c00; font-size: 0.85em; }
"""


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _cell(row: dict, key: str) -> tuple[str, bool]:
    """(text, numeric) of one table cell."""
    if key == "ci":
        return f"[{_num(row['ci_low'])}, {_num(row['ci_high'])}]", True
    if key in ("mean_delta", "p_adj"):
        return _num(row[key]), True
    if key == "n":
        return str(row[key]), True
    if key == "flags":
        return "; ".join(f for f in str(row.get("flags") or "").split(";") if f), False
    return str(row.get(key) if row.get(key) is not None else ""), False


def _paired_table(table: pd.DataFrame) -> str:
    head = "".join(f"<th>{html.escape(label)}</th>" for _, label in TABLE_COLUMNS)
    body = []
    for row in table.to_dict("records"):
        cls = ' class="significant"' if row["verdict"] in SIGNIFICANT else ""
        cells = []
        for key, _ in TABLE_COLUMNS:
            text, numeric = _cell(row, key)
            css = ' class="num"' if numeric else (' class="flags"' if key == "flags" else "")
            cells.append(f"<td{css}>{html.escape(text)}</td>")
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f'<table id="paired"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _runs_problems(runs: pd.DataFrame) -> str:
    bad = runs[runs["status"] != "FINISHED"]
    if bad.empty:
        return "<p>Every expected run finished.</p>"
    rows = []
    for r in bad.to_dict("records"):
        error = r.get("error") if isinstance(r.get("error"), str) else ""
        where = f"{r['arm']}/{r['grid_key'] or '-'}/s{r['seed']}"
        rows.append(f"<tr><td>{html.escape(where)}</td><td>{html.escape(str(r['run_id']))}</td>"
                    f"<td>{html.escape(str(r['status']))}</td><td>{html.escape(error or '')}</td></tr>")
    return ('<table id="incomplete"><thead><tr><th>run</th><th>run id</th><th>status</th><th>reason</th></tr>'
            f"</thead><tbody>{''.join(rows)}</tbody></table>")


def _facts(facts: Iterable[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    return f'<table id="facts">{rows}</table>'


def _figure(plot: Plot, caption: str) -> str:
    return (f'<figure id="plot-{html.escape(plot.name)}"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{plot.png_base64()}"><figcaption>{html.escape(caption)}</figcaption>'
            "</figure>")


def render_report(*, study: str, description: str, facts: Sequence[tuple[str, str]], table: pd.DataFrame,
                  runs: pd.DataFrame, plots: Sequence[tuple[Plot, str]], reproduce: Sequence[str]) -> str:
    """The HTML page: what was run (`facts`: label, value), the paired table (significant rows
    highlighted), the plots with their captions, the runs that did not finish with their reasons,
    and the commands that reproduce the study."""
    finished = int((runs["status"] == "FINISHED").sum())
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>reslab report: {html.escape(study)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Study {html.escape(study)}</h1>",
        f"<p>{html.escape(description)}</p>" if description else "",
        "<h2>What was run</h2>", _facts([*facts, ("runs finished", f"{finished}/{len(runs)}")]),
        "<h2>Paired comparisons</h2>",
        "<p>delta = treatment - control on the same grid point and seed; CI is the paired-t interval; "
        "p is the sign-flip permutation p after the family's correction.</p>",
        _paired_table(table),
        "<h2>Plots</h2>", *[_figure(p, c) for p, c in plots],
        "<h2>Incomplete or failed runs</h2>", _runs_problems(runs),
        "<h2>How to reproduce</h2>", f"<pre>{html.escape(chr(10).join(reproduce))}</pre>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
