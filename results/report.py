"""The one-page HTML report of a study: self-contained (plots inlined as base64 PNG, CSS inline,
no script, no network), readable from a file, a mail attachment or an MLflow artifact.

A pure function of plain data: `results.readout.StudyReadout.report` hands it each readout's section and
plots; the section renderers of the result kinds (`paired_section`, `sequential_section`, `ladder_section`,
`contrast_section`) live here beside the page's shared pieces.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pandas as pd

from reslab.results.collect import usable
from reslab.results.export import cost_model, numeric_column, table_model
from reslab.results.labels import PointLabels
from reslab.results.ladder import SIZE, LadderResult, interval_text
from reslab.results.plots import SIGNIFICANT, Plot, pngs_base64
from reslab.results.sequential import TEST_WORDS

Labels = Callable[[str], str]  # grid key -> its short label (`results.labels.PointLabels`)


def _no_labels(key: str) -> str:
    return key


__all__ = ["contrast_section", "cost_section", "figures_html", "ladder_section", "paired_section", "render_report",
           "sequential_section"]

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.2em 0.4em; text-align: left; vertical-align: top; }
td { overflow-wrap: anywhere; }
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


def _num(value: Any, fmt: str = "{:.4g}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


_NUM = ' class="num"'
_WORD = ' class="word"'  # a verdict: one word, never broken


def _paired_table(table: pd.DataFrame, labels: Labels | None = None) -> str:
    """The paired table as the terminal prints it (`results.export.table_model`): per metric its caption,
    the arms' means, the delta and CI, raw and corrected p, d_z, g_z, W/L, verdict and notes; the legend below;
    grid points by their short labels."""
    blocks, legend = table_model(table, labels)
    if not blocks:
        return "<p>no comparison rows</p>"
    return _model_tables(blocks, legend, "paired")


def _model_tables(blocks: list[tuple[str, list[str], list[list[str]]]], legend: list[str], key: str) -> str:
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


def paired_section(table: pd.DataFrame, labels: Labels | None = None) -> list[str]:
    """The paired table under the sentence that says what its columns are: the `p` column is the raw
    sign-flip p, the correction's column (`Holm p`, `BH p`) the p after the family's correction."""
    blocks, _ = table_model(table)
    corrected = list(dict.fromkeys(header[header.index("p") + 1] for _, header, _ in blocks)) or ["Holm p"]
    return ["<h2>Paired comparisons</h2>",
            "<p>delta = treatment - control on the same grid point and seed; CI is the paired-t interval (a pooled "
            "row's: the shifts its stratified sign flip does not reject); "
            "p is the raw two-sided sign-flip permutation p (equivalence rows: its TOST p), before any correction; "
            f"{html.escape(' / '.join(corrected))} is that p after the family's correction, which the verdict "
            "reads.</p>",
            _paired_table(table, labels)]


def cost_section(costs: pd.DataFrame, labels: Labels | None = None) -> list[str]:
    """The cost ratio rows as the terminal prints them (`results.export.cost_model`), one table per cost."""
    if costs.empty:
        return []
    return ["<h2>Costs</h2>",
            "<p>ratio = treatment / control on the same grid point and seed; each row is the geometric mean of the "
            "per-seed ratios with the seed-paired t interval of the mean log ratio, exponentiated. The loss against "
            "each cost, with the Pareto front, is among the plots.</p>",
            _model_tables(*cost_model(costs, labels), "costs")]


def _runs_problems(runs: pd.DataFrame, labels: Labels = _no_labels) -> str:
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


def _figure(png: str, caption: str, key: str) -> str:
    return (f'<figure id="plot-{html.escape(key)}"><img alt="{html.escape(caption)}" '
            f'src="data:image/png;base64,{png}"><figcaption>{html.escape(caption)}</figcaption></figure>')


def ladder_section(ladder: LadderResult | None, labels: Labels = _no_labels) -> list[str]:
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


def contrast_section(contrasts: pd.DataFrame | None, labels: Labels = _no_labels) -> list[str]:
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


_DECIDED_ON_CS = ("better", "worse")
_NOT_USED = "(a)"


def _tost_cell(r: dict[str, Any]) -> str:
    """A row's equivalence bounds against its ±bound; `-` without a bound (no equivalence verdict); marked
    `(a)` on a row the confidence sequence decided (better/worse), whose bounds are of another width."""
    bound = r["bound"]
    if bound is None or (isinstance(bound, float) and math.isnan(bound)):
        return "-"
    text = f"[{_num(r['tost_low'])}, {_num(r['tost_high'])}] vs ±{_num(bound)}"
    return f"{text} {_NOT_USED}" if r["decision"] in _DECIDED_ON_CS else text


def _sequential_note(table: pd.DataFrame) -> str:
    decided = [r for r in table.to_dict("records") if r["decision"] in _DECIDED_ON_CS and _tost_cell(r) != "-"]
    if not decided:
        return ""
    return (f'<ul class="legend"><li>{_NOT_USED} decided on its confidence sequence (the CS column, two-sided at '
            "the row's level), which lies past 0. The equivalence bounds beside it are another interval: the two "
            "one-sided sequences, each at the row's level (TOST), so narrower than the CS; they test equivalence "
            "within ±the bound (the MEI), shown for reference, and did not decide the row.</li></ul>")


def sequential_section(table: pd.DataFrame | None, plot: Plot | None = None,
                       labels: Labels = _no_labels) -> list[str]:
    """A sequential study's primary result: each row's decision, the seeds it took, its confidence sequence
    and e-value; the plot of the sequences narrowing seed by seed; the fixed-n table above marked descriptive."""
    if table is None or table.empty:
        return []
    head = ("comparison", "grid point", "treatment", "decision", "seeds", "looks", "mean delta", "CS",
            "equivalence bounds", "e-value")
    rows = []
    for r in table.to_dict("records"):
        cells = [r["comparison"], labels(r["grid_key"]) if r["grid_key"] else "-",
                 f"{r['treatment']} vs {r['control']}", r["decision"]]
        tost = _tost_cell(r)
        numbers = [str(r["n"]), ", ".join(map(str, r["looks"])), _num(r["mean_delta"]),
                   f"[{_num(r['cs_low'])}, {_num(r['cs_high'])}]", tost, _num(r["e_value"], "{:.3g}")]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells)
                    + "".join(f'<td class="num">{html.escape(c)}</td>' for c in numbers) + "</tr>")
    out = ["<h2>Sequential test: the primary result</h2>",
           "<p>Seeds were added in batches and the anytime-valid test ("
           + html.escape(TEST_WORDS.get(table.attrs.get("test", "sign"), "")) + "; each row at alpha over its "
           "family's rows) read after each batch; a row stopped at the look that decided it. "
           "The confidence sequences cover at every look at once; the equivalence bounds are the two one-sided "
           "sequences (each at the row's level, as TOST) that an equivalence verdict needs within ±the bound; "
           "the fixed-n p-values of the paired table below are descriptive only.</p>",
           f'<table id="sequential"><thead><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr></thead>'
           f"<tbody>{''.join(rows)}</tbody></table>", _sequential_note(table)]
    if plot is not None:
        out.append(_figure(plot.png_base64(), "The mean delta and its confidence sequence seed by seed; dots are the "
                                              "looks, the red line the look that decided.", "sequence"))
    return out


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
    return [_figure(png, caption, key) for png, (_, caption), key in zip(pngs, plots, _figure_ids(plots), strict=True)]


def render_report(*, study: str, description: str, facts: Sequence[tuple[str, str]], runs: pd.DataFrame,
                  sections: Sequence[str], figures: Sequence[str], reproduce: Sequence[str],
                  labels: PointLabels | None = None) -> str:
    """The HTML page: what was run (`facts`: label, value), the key of the grid points' short `labels`, the
    readouts' `sections` in the study's readout order (a sequential study's primary result, the paired table
    with its significant rows highlighted, a ladder, contrasts), the plots with their captions (`figures_html`),
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
