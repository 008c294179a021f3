"""The one-page HTML report of a study: self-contained (plots inlined as base64 PNG, CSS inline,
no script, no network), readable from a file, a mail attachment or an MLflow artifact.

A pure function of plain data: `results.readout.StudyReadout.report` hands it the facts, each readout's
section and plots. The page knows no kind of result: each readout draws its own section
(`results.readouts.base.Readout.section`) from the shared pieces here (`model_tables`, `cell_number`, `figure`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import pandas as pd

from reslab.results.collect import usable
from reslab.results.export import Model, numeric_column
from reslab.results.labels import PointLabels
from reslab.results.plots import SIGNIFICANT, Plot, pngs_base64

Labels = Callable[[str], str]  # grid key -> its short label (`results.labels.PointLabels`)


def no_labels(key: str) -> str:
    return key


__all__ = ["cell_number", "exploratory_notes", "figure", "figures_html", "model_tables", "no_labels", "render_report"]

# `overflow-wrap: break-word`: a name breaks only where it cannot fit a line of its own ("anywhere" let the
# table layout squeeze arm names mid-word, `prenorm_ad|amw`)
_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: left; vertical-align: top; }
td { overflow-wrap: break-word; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; overflow-wrap: normal; }
td.word { white-space: nowrap; overflow-wrap: normal; }
img { max-width: 100%; height: auto; }
tr.significant td { background: #fde8e8; font-weight: bold; }
figure { margin: 1.5em 0; }
figcaption { color: #555; font-size: 0.9em; }
pre { background: #f4f4f4; padding: 0.8em; overflow-x: auto; }
.flags { color: #a15c00; font-size: 0.85em; }
caption { text-align: left; font-weight: bold; padding: 0.3em 0; }
.legend { color: #555; font-size: 0.85em; }
"""


def exploratory_notes(notes: Mapping[str, str], comparisons: Iterable[str]) -> list[str]:
    """Above a table of comparisons: each of `comparisons` whose analysis changed after the plan was frozen
    (`notes`: comparison -> why), marked exploratory with what changed."""
    return [f'<p class="flags" id="exploratory-{html.escape(name)}"><b>{html.escape(name)} is exploratory</b>: '
            f"{html.escape(notes[name])} (the plan frozen at the study's first submission decides its confirmatory "
            "verdict)</p>" for name in dict.fromkeys(comparisons) if name in notes]


def cell_number(value: Any, fmt: str = "{:.4g}") -> str:
    """A number in a report's cell: `-` where it is missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


_NUM = ' class="num"'
_WORD = ' class="word"'  # a verdict: one word, never broken


def model_tables(blocks: Model, legend: list[str], key: str) -> str:
    """Blocks of `results.export`'s table model as HTML tables (ids `key`, `key-2`, ...), significant rows
    highlighted, and the legend below them."""
    parts = []
    for i, (caption, header, rows) in enumerate(blocks):
        verdict = header.index("verdict")
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = []
        for row in rows:
            cls = ' class="significant"' if row[verdict] in SIGNIFICANT else ""
            cells = "".join(f"<td{_NUM if numeric_column(h) else _WORD if h == 'verdict' else ''}>{html.escape(c)}</td>"
                            for h, c in zip(header, row, strict=True))
            body.append(f"<tr{cls}>{cells}</tr>")
        parts.append(f'<table id="{key if i == 0 else f"{key}-{i + 1}"}"><caption>{html.escape(caption)}'
                     f'</caption><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>')
    parts.append('<ul class="legend">' + "".join(f"<li>{html.escape(line)}</li>" for line in legend) + "</ul>")
    return "".join(parts)


def _runs_problems(runs: pd.DataFrame, labels: Labels = no_labels) -> str:
    bad = runs[~usable(runs)]
    if bad.empty:
        return "<p>Every expected run finished.</p>"
    rows = []
    for r in bad.to_dict("records"):
        error = r.get("error") if isinstance(r.get("error"), str) else ""
        where = f"{r['arm']}/{labels(r['grid_key']) if r['grid_key'] else '-'}/s{r['seed']}"
        rows.append(f"<tr><td>{html.escape(where)}</td><td>{html.escape(str(r['run_id']))}</td>"
                    f"<td>{html.escape(str(r['status']))}</td><td>{html.escape(error or '')}</td></tr>")
    return ('<table id="incomplete"><thead><tr><th>run</th><th>run id</th><th>status</th><th>reason</th></tr>'
            f"</thead><tbody>{''.join(rows)}</tbody></table>")


def _facts(facts: Iterable[tuple[str, str]]) -> str:
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in facts)
    return f'<table id="facts">{rows}</table>'


def figure(png: str, caption: str, key: str) -> str:
    return (f'<figure id="plot-{html.escape(key)}"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{png}"><figcaption>{html.escape(caption)}</figcaption></figure>')


def _figure_ids(plots: Sequence[tuple[Plot, str]]) -> list[str]:
    """Each plot's name, `-2`, `-3`, ... on its repeats (one page, unique ids)."""
    seen: dict[str, int] = {}
    ids = []
    for plot, _ in plots:
        seen[plot.name] = seen.get(plot.name, 0) + 1
        ids.append(plot.name if seen[plot.name] == 1 else f"{plot.name}-{seen[plot.name]}")
    return ids


def _points(labels: PointLabels) -> str:
    """The key table: each grid point's short label, spelled out once."""
    rows = "".join(f"<tr><td>{html.escape(label.split(': ', 1)[0])}</td><td>{html.escape(label.split(': ', 1)[-1])}"
                   f"</td><td>{html.escape(axes)}</td></tr>" for label, axes in labels.key_rows())
    return ("<h2>Grid points</h2><p>Tables, legends and plots name each grid point by its short label: "
            "r&lt;i&gt; a ladder rung, g&lt;i&gt; a grid point, then the axes that differ between the points.</p>"
            '<table id="points"><thead><tr><th>label</th><th>short</th><th>grid point</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>")


def _labelled_facts(facts: Sequence[tuple[str, str]], labels: PointLabels) -> list[tuple[str, str]]:
    """The facts with each whole grid key written as its short label (longest keys first)."""
    keys = sorted(labels.labels, key=len, reverse=True)
    out = []
    for name, value in facts:
        for key in keys:
            value = value.replace(key, labels.labels[key])
        out.append((name, value))
    return out


def figures_html(plots: Sequence[tuple[Plot, str]], workers: int = 1) -> list[str]:
    """Each (plot, caption) as the page's figure, its PNG inlined, drawn by up to `workers` processes
    (`results.plots.pngs_base64`)."""
    pngs = pngs_base64([plot for plot, _ in plots], workers)
    return [figure(png, caption, key) for png, (_, caption), key in zip(pngs, plots, _figure_ids(plots), strict=True)]


def render_report(*, study: str, description: str, facts: Sequence[tuple[str, str]], runs: pd.DataFrame,
                  sections: Sequence[str], figures: Sequence[str], reproduce: Sequence[str],
                  labels: PointLabels | None = None) -> str:
    """The HTML page: what was run (`facts`: label, value), the key of the grid points' short `labels`, the
    readouts' `sections` in the study's readout order, the plots with their captions (`figures_html`),
    the runs that did not finish with their reasons, and the commands that reproduce the study."""
    labels = labels or PointLabels()
    finished = int(usable(runs).sum())
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>reslab report: {html.escape(study)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Study {html.escape(study)}</h1>",
        f"<p>{html.escape(description)}</p>" if description else "",
        "<h2>What was run</h2>", _facts(_labelled_facts([*facts, ("runs finished", f"{finished}/{len(runs)}")],
                                                        labels)),
        _points(labels) if labels.labels else "",
        *sections,
        "<h2>Plots</h2>", *figures,
        "<h2>Incomplete or failed runs</h2>", _runs_problems(runs, labels),
        "<h2>How to reproduce</h2>", f"<pre>{html.escape(chr(10).join(reproduce))}</pre>",
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
