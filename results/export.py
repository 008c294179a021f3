"""Render and write comparison tables (the output of ``results.stats.compare``).

Every format names the metric, its units and direction, and the sign convention (delta =
treatment - control): text, Markdown and LaTeX in a caption line above each metric's block, CSV
and Parquet in the ``metric``, ``direction`` and ``delta`` columns of every row. Terminal,
Markdown, LaTeX and the HTML report render one model (`table_model`). A metric's numbers (the
arms' means, the mean delta and its CI) share one precision, the decimals that show two
significant digits of the narrowest CI half-width among its rows (so ``-5922 [-18113, 6270]``
tokens/s, ``-0.0137 [-0.0150, -0.0125]`` nats). Negative numbers use
one minus sign: ASCII ``-`` in text formats, math-mode ``$-$`` in LaTeX. Flags become short
note marks (a, b, ...) with a legend below the table. LaTeX needs ``\\usepackage{booktabs}`` (the
file says so in its first line); each table is a ``table*`` float whose ``tabular*`` spans
``\\linewidth`` (the text width of a two-column article), and the per-seed table gives each
run id and value its own column, the arms in its group rows. Files are written with
``common.io.write_atomic`` (a temporary sibling moved into place, mode 0644), so a failed export
never leaves a half-written table behind.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.common.io import write_atomic
from reslab.common.metrics import METRICS
from reslab.results.mechanisms import HEAD as MECHANISM_HEAD
from reslab.results.mechanisms import format_mechanisms, mechanism_caption, mechanism_cells
from reslab.results.stats import grid_parts

__all__ = ["CSV_NA_REP", "EXPORT_FORMATS", "PRINT_FORMATS", "TASK_HEAD", "cost_model", "cost_renderables",
           "export_table", "format_costs", "format_pairs", "format_table", "format_tasks", "latex_escape",
           "numeric_column", "rich_renderables", "table_model", "task_cells", "task_model"]

EXPORT_FORMATS: tuple[str, ...] = ("md", "csv", "parquet", "latex")
PRINT_FORMATS: tuple[str, ...] = ("md", "text")

_TINY_P = 1e-4
_TINY_P_TEXT = "<1e-4"
_NA_TEXT = "n/a"
_DELTA_SIG_DIGITS = 2
# Longer grid points go into the LaTeX table's group rows instead of a column.
_TEX_GRID_CHARS = 12
# CSV writes NaN as "NaN" so that an empty string (grid_key of an ungridded study) stays distinguishable.
CSV_NA_REP = "NaN"
_LATEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
}
_RIGHT = frozenset({"n", "p", "Holm p", "BH p", "adj. p", "d_z", "g_z", "W/L", "seed", "control value",
                    "treatment value", "delta", "control mean", "treatment mean", "control median",
                    "treatment median", "control geo. mean", "treatment geo. mean"})
# the arms' absolute means: in every format but LaTeX, whose table* is already at the text width
_TEX_LEFT_OUT = ("comparison", "control", "notes", "control mean", "treatment mean")


def _right(header: str) -> bool:
    return header in _RIGHT or header.startswith(("delta", "ratio"))


def _is_nan(x: object) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _decimals(half_width: float, value: float) -> int:
    """Decimals that show two significant digits of the CI half-width (3 of the value without a CI)."""
    ref, digits = (half_width, _DELTA_SIG_DIGITS) if math.isfinite(half_width) and half_width > 0 else (value, 3)
    if not math.isfinite(ref) or ref == 0:
        return 4
    return max(0, digits - 1 - math.floor(math.log10(abs(ref))))


def _num(x: float, decimals: int) -> str:
    if _is_nan(x):
        return _NA_TEXT
    text = f"{x:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.000"


def _fmt_p(p: float) -> str:
    if _is_nan(p):
        return _NA_TEXT
    if p < _TINY_P:
        return _TINY_P_TEXT
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def _fmt_es(x: float) -> str:
    return _NA_TEXT if _is_nan(x) else _num(x, 2)


def _ci_level(table: pd.DataFrame) -> str:
    alpha = float(table.attrs.get("alpha", 0.05))
    return f"{100.0 * (1.0 - alpha):g}%"


def _metric_caption(metric: str, direction: str) -> str:
    info = METRICS.get(metric)
    units = f" ({info.unit})" if info else ""
    better = "lower" if direction == "minimize" else "higher"
    favours = "negative" if direction == "minimize" else "positive"
    defined = f"; {metric} is {info.description}" if info else ""
    return (f"{metric}{units}, {better} is better; delta = treatment - control, so a {favours} delta favours "
            f"the treatment{defined}")


def _correction_label(block: pd.DataFrame) -> str:
    names = set(block["correction"])
    return {"holm": "Holm p", "bh": "BH p"}[names.pop()] if len(names) == 1 else "adj. p"


def _notes(table: pd.DataFrame) -> tuple[list[str], dict[str, str]]:
    """Per row, its note marks ("a,c"); and mark -> note text, in order of first use."""
    notes = []
    for r in table.to_dict("records"):
        texts = [f for f in str(r["flags"]).split(";") if f]
        if r["kind"] == "equivalence" and r["role"] != "stratum":
            texts.append(f"equivalence margin +-{r['threshold']:g}: TOST 90% CI [{_num(r['tost_ci_low'], 4)}, "
                         f"{_num(r['tost_ci_high'], 4)}], paired-t TOST p {_fmt_p(r['tost_p'])}")
        elif r["threshold"] > 0 and r["role"] != "stratum":
            texts.append(f"minimum effect of interest {r['threshold']:g}")
        if r["exploratory"] and r["role"] != "stratum":
            texts.append("exploratory: not sized to reach alpha")
        notes.append(texts)
    return _marked(notes)


def _marked(notes: list[list[str]]) -> tuple[list[str], dict[str, str]]:
    """Per row of note texts, its marks ("a,c"); and mark -> note text, in order of first use."""
    legend: dict[str, str] = {}
    marks = []
    for texts in notes:
        row_marks = []
        for text in texts:
            if text not in legend.values():
                legend[_mark(len(legend))] = text
            row_marks.append(next(k for k, v in legend.items() if v == text))
        marks.append(",".join(row_marks))
    return marks, legend


def _mark(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return letters[i] if i < len(letters) else letters[i // len(letters) - 1] + letters[i % len(letters)]


def _blocks(table: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(caption, rows) per (metric, direction), in order of first appearance."""
    out = []
    for (metric, direction), block in table.groupby(["metric", "direction"], sort=False):
        out.append((_metric_caption(str(metric), str(direction)), block))
    return out


Labels = Callable[[str], str]  # grid key -> its short label (`results.labels.PointLabels`)


def _grid_column(keys: list[str], labels: Labels | None = None) -> tuple[str, list[str]]:
    """Header and cells of the grid column: each point's short label under `grid point` when `labels`
    is given (the HTML report, whose key table spells them out); else the axis names once in the header
    when every row has the same axes (``model.preset`` / ``small``), else whole grid keys; ``-`` for no
    grid, and ``pooled`` for an axis a pooled row pools over."""
    if labels is not None and any(keys):
        return "grid point", [labels(k) if k else "-" for k in keys]
    parts = [grid_parts(k) for k in keys]
    axes = {tuple(a for a, _ in p) for p in parts}
    if len(axes) == 1 and (names := axes.pop()):
        return ", ".join(names), [", ".join("pooled" if v == "*" else v for _, v in p) for p in parts]
    return "grid point", [k.replace("=*", "=pooled") or "-" for k in keys]


def _block_decimals(block: pd.DataFrame) -> int:
    """The decimals of one metric's numbers (its column): two significant digits of the narrowest CI
    half-width in it, so every row shows at least two of its own and the column lines up."""
    return max(_decimals((r["ci_high"] - r["ci_low"]) / 2.0, r["mean_delta"]) for r in block.to_dict("records"))


def _display_rows(block: pd.DataFrame, marks: list[str], labels: Labels | None = None
                  ) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells of one metric's rows; numbers use ASCII minus."""
    level = _ci_level(block)
    grid_head, grid_cells = _grid_column(list(block["grid_key"]), labels)
    header = ["comparison", grid_head, "control", "treatment", "n", "control mean", "treatment mean",
              f"delta [{level} CI]", "p", _correction_label(block), "d_z", "g_z", "W/L", "verdict", "notes"]
    uniform = len(set(block["correction"])) == 1
    dec = _block_decimals(block)
    rows = []
    for r, note, grid in zip(block.to_dict("records"), marks, grid_cells, strict=True):
        delta = _num(r["mean_delta"], dec)
        if not _is_nan(r["ci_low"]):
            delta += f" [{_num(r['ci_low'], dec)}, {_num(r['ci_high'], dec)}]"
        p_adj = _fmt_p(r["p_adj"])
        if not uniform and p_adj != _NA_TEXT:
            p_adj += " " + {"holm": "(Holm)", "bh": "(BH)"}[r["correction"]]
        rows.append([
            str(r["comparison"]), grid, str(r["control"]), str(r["treatment"]), str(int(r["n"])),
            _num(r["control_mean"], dec), _num(r["treatment_mean"], dec), delta, _fmt_p(r["p_primary"]), p_adj,
            _fmt_es(r["d_z"]), _fmt_es(r["g_z"]),
            f"{int(r['wins'])}/{int(r['losses'])}", str(r["verdict"]), note,
        ])
    return header, rows


def _legend_lines(table: pd.DataFrame, legend: dict[str, str]) -> list[str]:
    alpha = float(table.attrs.get("alpha", 0.05))
    lines = [
        f"p: two-sided exact sign-flip p (equivalence rows: sign-flip TOST p); adjusted within each family; "
        f"verdict at alpha={alpha:g} from paired quantities only: equivalent = the family-adjusted sign-flip "
        "TOST p and the paired-t TOST p <= alpha within +-MEI (or +-margin); better/worse = adjusted p <= alpha "
        "and the CI excludes 0, tested against 0, not the MEI (equivalence rows: the CI lies beyond the margin); "
        "else inconclusive; a pooled row's CI (and TOST CI) is the set of common shifts its stratified sign flip "
        "does not reject",
        "d_z = mean delta / SD of the deltas (standardised mean paired difference); g_z = d_z x Hedges' J(n-1); "
        "W/L = seeds where the treatment won/lost",
    ]
    lines += [f"{k}: {v}" for k, v in legend.items()]
    return lines


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    sep = "|" + "|".join("---:" if _right(h) else "---" for h in header) + "|"
    return [line(header), sep, *(line(r) for r in rows)]


def _text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if _right(h) else c.ljust(w)
                         for c, w, h in zip(cells, widths, header, strict=True)).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def table_model(table: pd.DataFrame, labels: Labels | None = None
                ) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[str]]:
    """The one table model every format renders (terminal, Markdown, LaTeX, the HTML report): per
    metric a (caption, header, rows of cells) block, and the legend lines below the blocks. Cells are
    plain text with ASCII minus; `numeric_column(header)` says which columns are numbers. `labels`: the
    grid points' short labels for the grid column (the HTML report's)."""
    marks, legend = _notes(table)
    mark_of = dict(zip(table.index, marks, strict=True))
    blocks = [(caption, *_display_rows(block, [mark_of[i] for i in block.index], labels))
              for caption, block in _blocks(table)]
    return blocks, _legend_lines(table, legend)


def numeric_column(header: str) -> bool:
    """Whether a column of `table_model`'s blocks holds numbers (right-aligned in every format)."""
    return _right(header)


def _render(table: pd.DataFrame, fmt: str) -> str:
    if table.empty:
        return "no comparison rows\n"
    return _render_model(*table_model(table), fmt)


def _render_model(blocks: list[tuple[str, list[str], list[list[str]]]], legend_lines: list[str], fmt: str) -> str:
    out: list[str] = []
    for caption, header, rows in blocks:
        if fmt == "md":
            out += [f"**{caption}**", "", *_markdown_table(header, rows), ""]
        else:
            out += [caption, *_text_table(header, rows), ""]
    if fmt == "md":
        out += [f"- {line}" for line in legend_lines]
    else:
        out += legend_lines
    return "\n".join(out) + "\n"


_VERDICT_STYLES = {"better": "bold green", "worse": "bold red", "equivalent": "cyan"}


def rich_renderables(table: pd.DataFrame) -> list[Any]:
    """The ``"text"`` table for a terminal, as `rich` renderables: the same captions, cells and
    legend, numbers right-aligned, rows with a significant verdict coloured (green better, red
    worse, cyan equivalent) and the notes column in yellow. Piped output uses `format_table`."""
    from rich.text import Text

    if table.empty:
        return [Text("no comparison rows")]
    return _rich_model(*table_model(table), _VERDICT_STYLES)


def _rich_model(blocks: list[tuple[str, list[str], list[list[str]]]], legend_lines: list[str],
                styles: dict[str, str]) -> list[Any]:
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    for caption, header, rows in blocks:
        grid = Table(title=caption, title_justify="left", header_style="bold")
        for h in header:
            grid.add_column(h, justify="right" if _right(h) else "left", style="yellow" if h == "notes" else None)
        verdict = header.index("verdict")
        for r in rows:
            grid.add_row(*r, style=styles.get(r[verdict]))
        out.append(grid)
    out += [Text(line) for line in legend_lines]
    return out


# ----------------------------------------------------------------------------- cost ratio rows

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
    if _is_nan(x):
        return _NA_TEXT
    return format(x, METRICS[metric].fmt) if metric in METRICS else f"{x:.4g}"


def _cost_rows(block: pd.DataFrame, marks: list[str], labels: Labels | None = None
               ) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells of one cost metric's ratio rows; the ratios share the decimals that
    show two significant digits of the narrowest interval's half-width (three of a point ratio)."""
    grid_head, grid_cells = _grid_column(list(block["grid_key"]), labels)
    header = ["comparison", grid_head, "control", "treatment", "n", "control geo. mean", "treatment geo. mean",
              f"ratio [{_ci_level(block)} CI]", "W/L", "verdict", "notes"]
    records = block.to_dict("records")
    dec = min(_MAX_RATIO_DECIMALS, max(_decimals((r["ratio_high"] - r["ratio_low"]) / 2.0, r["ratio"])
                                       for r in records))
    rows = []
    for r, note, grid in zip(records, marks, grid_cells, strict=True):
        ratio = _num(r["ratio"], dec)
        if not _is_nan(r["ratio_low"]):
            ratio += f" [{_num(r['ratio_low'], dec)}, {_num(r['ratio_high'], dec)}]"
        rows.append([str(r["comparison"]), grid, str(r["control"]), str(r["treatment"]), str(int(r["n"])),
                     _cost_value(r["metric"], r["control_geomean"]), _cost_value(r["metric"], r["treatment_geomean"]),
                     ratio, f"{int(r['wins'])}/{int(r['losses'])}", str(r["verdict"]), note])
    return header, rows


def _cost_parts(costs: pd.DataFrame, labels: Labels | None = None
                ) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[str], dict[str, str]]:
    """The cost rows' blocks, the lines that explain them, and their notes (mark -> text)."""
    marks, legend = _marked([[f for f in str(r["flags"]).split(";") if f] for r in costs.to_dict("records")])
    mark_of = dict(zip(costs.index, marks, strict=True))
    blocks = []
    for (metric, direction), block in costs.groupby(["metric", "direction"], sort=False):
        blocks.append((_cost_caption(str(metric), str(direction)),
                       *_cost_rows(block, [mark_of[i] for i in block.index], labels)))
    level = _ci_level(costs)
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


def cost_model(costs: pd.DataFrame, labels: Labels | None = None
               ) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[str]]:
    """`table_model` of the cost ratio rows (`results.costs.cost_table`): per cost metric a (caption, header,
    rows) block, then the legend lines; `labels` as `table_model`'s."""
    blocks, lines, legend = _cost_parts(costs, labels)
    return blocks, lines + [f"{k}: {v}" for k, v in legend.items()]


def format_costs(costs: pd.DataFrame, fmt: str = "md") -> str:
    """The cost ratio rows as Markdown (``"md"``) or aligned plain text (``"text"``), like `format_table`."""
    if fmt not in PRINT_FORMATS:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return _render_model(*cost_model(costs), fmt) if len(costs) else "no cost rows\n"


def cost_renderables(costs: pd.DataFrame) -> list[Any]:
    """The cost rows for a terminal (`rich`), like `rich_renderables`: the better side green, the worse red."""
    from rich.text import Text

    return _rich_model(*cost_model(costs), _COST_STYLES) if len(costs) else [Text("no cost rows")]


def latex_escape(text: str) -> str:
    """Escape LaTeX special characters in plain text."""
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


_TEX_MINUS = re.compile(r"(?<![A-Za-z0-9_.])-(?=\.?\d)")
# plain-text notation set in math mode: (text, a placeholder latex_escape leaves alone) and the math
_TEX_SYMBOLS = ((_TINY_P_TEXT, "\x02"), ("+-", "\x00"), (" - ", " \x01 "), ("<=", "\x03"), (">=", "\x04"),
                (" x ", " \x05 "))
_TEX_SYMBOL_MATH = ("$<10^{-4}$", "$\\pm$", " $-$ ", "$\\le$", "$\\ge$", " $\\times$ ")


def _tex_text(text: str) -> str:
    """Escaped text whose minus signs (a hyphen before a digit, not inside a name such as
    ``gpt2-124m``), ``+-``, spaced `` - `` and ``<1e-4`` are set in math mode."""
    for plain, placeholder in _TEX_SYMBOLS:
        text = text.replace(plain, placeholder)
    out = _TEX_MINUS.sub("$-$", latex_escape(text))
    for (_, placeholder), tex in zip(_TEX_SYMBOLS, _TEX_SYMBOL_MATH, strict=True):
        out = out.replace(placeholder, tex)
    return out


def _tex_num(text: str) -> str:
    """A formatted number in math mode, so its minus is a minus; n/a and "<1e-4" as text."""
    if text == _TINY_P_TEXT:
        return "$<10^{-4}$"
    if text == _NA_TEXT:
        return text
    return f"${text}$"


def _tex_delta(cell: str) -> str:
    if "[" not in cell:
        return _tex_num(cell)
    mean, ci = cell.split(" [", 1)
    low, high = ci.rstrip("]").split(", ")
    return f"{_tex_num(mean)} [{_tex_num(low)}, {_tex_num(high)}]"


def _tex_head(h: str) -> str:
    if h.startswith("delta"):
        return "$\\Delta$ " + latex_escape(h.removeprefix("delta "))
    return {"d_z": "$d_z$", "g_z": "$g_z$", "n": "$n$"}.get(h, latex_escape(h))


def _tex_cell(h: str, c: str, note: str) -> str:
    if h.startswith(("delta", "ratio")):
        return _tex_delta(c)
    if h in ("n", "p", "d_z", "g_z") or h.endswith(" p"):
        number, _, label = c.partition(" ")
        return _tex_num(number) + (f" {latex_escape(label)}" if label else "")
    if h == "verdict":
        return latex_escape(c) + (f"\\textsuperscript{{{note}}}" if note else "")
    return latex_escape(c)


def _tex_float(size: str, caption: str, spec: str, head: list[str], body: list[str], after: str = "") -> list[str]:
    return [
        "\\begin{table*}[t]",
        f"\\centering{size}\\setlength{{\\tabcolsep}}{{4pt}}",
        f"\\caption{{{caption}}}",
        f"\\begin{{tabular*}}{{\\linewidth}}{{@{{\\extracolsep{{\\fill}}}}{spec}@{{}}}}",
        "\\toprule",
        " & ".join(head) + " \\\\",
        "\\midrule",
        *body,
        "\\bottomrule",
        "\\end{tabular*}",
        *([after] if after else []),
        "\\end{table*}",
        "",
    ]


def _tex_group(body: list[str], ncols: int, title: str) -> None:
    if body:
        body.append("\\addlinespace")
    body.append(f"\\multicolumn{{{ncols}}}{{@{{}}l}}{{{title}}} \\\\")


def _tex_body(header: list[str], rows: list[list[str]], left_out: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The kept columns and the body rows of one block: comparison and control go into group rows, and
    so do grid points too long for a narrow column."""
    grid_column = any(r[1] != "-" for r in rows) and max(len(r[1]) for r in rows) <= _TEX_GRID_CHARS
    keep = [h for h in header if h not in left_out and (grid_column or h != header[1])]
    body: list[str] = []
    group = None
    for r in rows:
        key = (r[0], r[2], None if grid_column else r[1])
        if key != group:
            where = "" if grid_column or r[1] == "-" else f"; {latex_escape(header[1])}: {latex_escape(r[1])}"
            _tex_group(body, len(keep),
                       f"\\textit{{{latex_escape(r[0])}}}: treatments against {latex_escape(r[2])}{where}")
            group = key
        note = r[header.index("notes")]
        body.append(" & ".join(_tex_cell(h, r[header.index(h)], note) for h in keep) + " \\\\")
    return keep, body


def _to_latex(table: pd.DataFrame) -> str:
    marks, legend = _notes(table)
    mark_of = dict(zip(table.index, marks, strict=True))
    out = ["% requires \\usepackage{booktabs}"]
    for caption, block in _blocks(table):
        header, rows = _display_rows(block, [mark_of[i] for i in block.index])
        keep, body = _tex_body(header, rows, _TEX_LEFT_OUT)
        used = {m for r in rows for m in r[-1].split(",") if m}
        legend_tex = " ".join(f"\\textsuperscript{{{k}}}\\,{_tex_text(v)}." for k, v in legend.items() if k in used)
        explain = " ".join(_tex_text(line) + "." for line in _legend_lines(table, {}))
        explain = explain.replace("d\\_z", "$d_z$").replace("g\\_z", "$g_z$")
        spec = "".join("r" if _right(h) else "l" for h in keep)
        metric = latex_escape(str(block["metric"].iloc[0]))
        caption_tex = _tex_text(caption).replace(metric, f"\\texttt{{{metric}}}")
        out += _tex_float("\\footnotesize", f"{caption_tex}. {latex_escape(_ci_level(table))} paired-$t$ CI.",
                          spec, [_tex_head(h) for h in keep], body,
                          f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain} {legend_tex}}}")
    return "\n".join(out)


def _costs_latex(costs: pd.DataFrame) -> str:
    """The cost ratio rows (`cost_model`) as one booktabs float per cost metric, like `_to_latex`."""
    blocks, lines, legend = _cost_parts(costs)
    explain = " ".join(_tex_text(line) + "." for line in lines)
    out = []
    for (caption, header, rows), metric in zip(blocks, dict.fromkeys(costs["metric"]), strict=True):
        keep, body = _tex_body(header, rows, ("comparison", "control", "notes"))
        used = {m for r in rows for m in r[-1].split(",") if m}
        legend_tex = " ".join(f"\\textsuperscript{{{k}}}\\,{_tex_text(v)}." for k, v in legend.items() if k in used)
        name = latex_escape(str(metric))
        caption_tex = _tex_text(caption).replace(name, f"\\texttt{{{name}}}")
        out += _tex_float("\\footnotesize", f"{caption_tex}. Geometric mean ratio, {latex_escape(_ci_level(costs))} "
                          "seed-paired CI.", "".join("r" if _right(h) else "l" for h in keep),
                          [_tex_head(h) for h in keep], body,
                          f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain} {legend_tex}}}")
    return "\n".join(out)


def format_table(table: pd.DataFrame, fmt: str = "md") -> str:
    """Render a comparison table as Markdown (``"md"``) or aligned plain text (``"text"``)."""
    if fmt not in PRINT_FORMATS:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return _render(table, fmt)


_PAIRS_HEADER = ["comparison", "grid point", "seed", "control arm", "control run id", "treatment arm",
                 "treatment run id", "control value", "treatment value", "delta"]


def _text(value: object, empty: str) -> str:
    """A text cell; missing values (None, NaN, "") read ``empty``."""
    return empty if _is_nan(value) or value == "" else str(value)


def _pair_rows(pairs: pd.DataFrame) -> list[list[str]]:
    """One row per seed; each (comparison, grid point, treatment) group shares the decimals that
    show two significant digits of the SD of its deltas."""
    rows = []
    for _, group in pairs.groupby(["comparison", "grid_key", "treatment"], sort=False):
        deltas = group["delta"].dropna()
        spread = float(deltas.std(ddof=1)) if len(deltas) >= 2 else math.nan
        dec = _decimals(spread, float(deltas.abs().max()) if len(deltas) else math.nan)
        for r in group.to_dict("records"):
            rows.append([str(r["comparison"]), _text(r["grid_key"], "-"), str(r["seed"]), str(r["control"]),
                         _text(r["control_run_id"], "missing"), str(r["treatment"]),
                         _text(r["treatment_run_id"], "missing"),
                         *(_num(r[k], dec) for k in ("control_value", "treatment_value", "delta"))])
    return rows


def _pairs_caption(pairs: pd.DataFrame) -> str:
    metrics = list(dict.fromkeys(pairs["metric"])) if len(pairs) else []
    named = ", ".join(
        f"{m} ({METRICS[m].unit}, {'lower' if METRICS[m].direction == 'minimize' else 'higher'} is better)"
        if m in METRICS else str(m) for m in metrics)
    return f"Per-seed pairs of {named or 'no metric'}; delta = treatment - control"


def format_pairs(pairs: pd.DataFrame, fmt: str = "md") -> str:
    """The per-seed table (``results.collect.pairs_table``): each arm and run id in its own column.

    LaTeX holds the same numbers (both arms' values and the delta) and writes the arms once per group
    row (grid point, treatment against control) instead of in every row: the text width holds two
    name columns beside the numbers. It writes one float per comparison, so a long study does not make
    one float taller than a page, and sets the metric in the caption as the paired table's does.
    """
    rows = _pair_rows(pairs)
    caption = _pairs_caption(pairs)
    if fmt == "md":
        return "\n".join([f"**{caption}**", "", *_markdown_table(_PAIRS_HEADER, rows)]) + "\n"
    if fmt == "text":
        return "\n".join([caption, *_text_table(_PAIRS_HEADER, rows)]) + "\n"
    if fmt != "latex":
        raise ValueError(f"unknown per-seed format {fmt!r}; allowed: md, text, latex")
    return _pairs_latex(pairs, rows)


def _pairs_latex(pairs: pd.DataFrame, rows: list[list[str]]) -> str:
    """`format_pairs` in LaTeX: per comparison one float, a group row per grid point and treatment."""
    head = ["seed", "control run id", "treatment run id", "control value", "treatment value", "$\\Delta$"]
    out: list[str] = []
    for comparison in dict.fromkeys(r[0] for r in rows):
        body: list[str] = []
        group = None
        for r in (r for r in rows if r[0] == comparison):
            if (r[1], r[3], r[5]) != group:
                where = "" if r[1] == "-" else f"{latex_escape(r[1])}: "
                _tex_group(body, len(head), f"{where}{latex_escape(r[5])} against {latex_escape(r[3])}")
            group = (r[1], r[3], r[5])
            body.append(" & ".join([_tex_num(r[2]), f"\\texttt{{{latex_escape(r[4])}}}",
                                    f"\\texttt{{{latex_escape(r[6])}}}", *(_tex_num(c) for c in r[7:10])]) + " \\\\")
        mine = pairs[pairs["comparison"] == comparison]
        title = _tex_text(_pairs_caption(mine))
        for metric in dict.fromkeys(mine["metric"]):
            name = latex_escape(str(metric))
            title = title.replace(name, f"\\texttt{{{name}}}")
        out += _tex_float("\\scriptsize", f"{title}: \\textit{{{latex_escape(comparison)}}}.", "rllrrr",
                          [latex_escape(h) if "$" not in h else h for h in head], body)
    return "\n".join(out)


def _with_costs(table: pd.DataFrame, costs: pd.DataFrame) -> pd.DataFrame:
    """The paired rows, then the cost rows, in one table: the paired table's columns, then the cost rows' own
    (`ratio`, `ratio_low`, `ratio_high`, ...); a column one kind of row lacks is NaN there."""
    extra = [c for c in costs.columns if c not in table.columns]
    return pd.concat([table, costs], ignore_index=True)[[*table.columns, *extra]]


# ----------------------------------------------------------------------------- downstream task rows
TASK_HEAD = ("task", "treatment vs control", "control", "treatment", "delta [CI]", "p", "Holm p", "seeds/items share",
             "seeds x items", "method")


def _points(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _task_p(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3g}"


def task_cells(r: dict) -> list[str]:
    """One task row's cells (`TASK_HEAD`): accuracies and the delta in points (x100)."""
    share = "-" if math.isnan(r["share_seeds"]) else f"{r['share_seeds']:.0%}/{r['share_items']:.0%}"
    return [r["task"], f"{r['treatment']} vs {r['control']}", _points(r["control_mean"]),
            _points(r["treatment_mean"]),
            f"{100 * r['delta']:+.1f} [{_points(r['ci_low'])}, {_points(r['ci_high'])}]", _task_p(r["p"]),
            _task_p(r["p_holm"]), share, f"{r['n_seeds']} x {r['n_items']}", r["method"]]


def task_model(tasks: pd.DataFrame) -> tuple[list[tuple[str, list[str], list[list[str]]]], list[str]]:
    """The downstream task rows (`results.tasks.task_table`) as `table_model` gives the paired rows: one block
    per (comparison, grid point), and the lines that explain them."""
    blocks = []
    for (comparison, grid_key), block in tasks.groupby(["comparison", "grid_key"], sort=False):
        where = f" [{grid_key}]" if grid_key else ""
        blocks.append((f"downstream tasks, {comparison}{where}: treatment - control on the same items, in points",
                       list(TASK_HEAD), [task_cells(r) for r in block.to_dict("records")]))
    lines = ["intervals over seeds x items (variance components, Satterthwaite t): both the training seed and the "
             "benchmark's items vary; Holm over each comparison's tasks; the suite average weights every task "
             "equally; one seed pair: McNemar's exact test, its interval over items only"]
    return blocks, lines


def format_tasks(tasks: pd.DataFrame, fmt: str = "md") -> str:
    """The downstream task rows as Markdown (``"md"``) or aligned plain text (``"text"``), like `format_table`."""
    if fmt not in PRINT_FORMATS:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return _render_model(*task_model(tasks), fmt) if len(tasks) else "no task rows\n"


def _tasks_latex(tasks: pd.DataFrame) -> str:
    """The downstream task rows (`task_model`) as one booktabs float per block, like `_costs_latex`."""
    blocks, lines = task_model(tasks)
    explain = " ".join(_tex_text(line) + "." for line in lines)
    out: list[str] = []
    for caption, header, rows in blocks:
        body = [" & ".join(latex_escape(c) for c in row) + " \\\\" for row in rows]
        out += _tex_float("\\footnotesize", _tex_text(caption) + ".", "ll" + "r" * (len(header) - 3) + "l",
                          [latex_escape(h) for h in header], body,
                          f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain}}}")
    return "\n".join(out)


def _task_rows(tasks: pd.DataFrame) -> pd.DataFrame:
    """The task rows in the paired table's columns (CSV, Parquet): `role` task, `delta` treatment - control,
    its value in `mean_delta` and p in `p_primary`; the task's own columns after."""
    rows = tasks.rename(columns={"delta": "mean_delta", "p": "p_primary"})
    return rows.assign(role="task", delta="treatment - control")


def _mechanisms_latex(mechanisms: pd.DataFrame) -> str:
    """The mechanism rows (`results.mechanisms.mechanism_cells`) as one booktabs float per comparison."""
    out: list[str] = []
    alpha = mechanisms.attrs.get("alpha", 0.05)
    for comparison, block in mechanisms.groupby("comparison", sort=False):
        body = [" & ".join(latex_escape(c) for c in mechanism_cells(r)) + " \\\\" for r in block.to_dict("records")]
        out += _tex_float("\\footnotesize", _tex_text(f"{mechanism_caption(alpha)}; {comparison}") + ".",
                          "lll" + "r" * (len(MECHANISM_HEAD) - 4) + "l", [latex_escape(h) for h in MECHANISM_HEAD],
                          body)
    return "\n".join(out)


def _with_rows(table: pd.DataFrame, costs: pd.DataFrame | None, tasks: pd.DataFrame | None,
               mechanisms: pd.DataFrame | None = None) -> pd.DataFrame:
    """The paired rows, then the cost rows, then the task rows, then the mechanism rows (each kind's own columns
    after the paired ones)."""
    out = table if costs is None else _with_costs(table, costs)
    out = out if tasks is None else _with_costs(out, _task_rows(tasks))
    return out if mechanisms is None else _with_costs(out, mechanisms)


def export_table(table: pd.DataFrame, path: str | os.PathLike, fmt: str, pairs: pd.DataFrame | None = None,
                 costs: pd.DataFrame | None = None, tasks: pd.DataFrame | None = None,
                 mechanisms: pd.DataFrame | None = None) -> Path:
    """Write a comparison table to ``path`` as ``md``, ``csv``, ``parquet`` or ``latex``; returns the path.

    CSV and Parquet hold every column (run ids included); CSV writes NaN as ``"NaN"``, so read it
    back with ``keep_default_na=False, na_values=["NaN"]`` to keep empty strings empty. Markdown and
    LaTeX add, below the table, one row per seed with both arms' run ids when ``pairs`` (from
    ``results.collect.pairs_table``) is given. ``costs`` (`results.costs.cost_table`, a study that
    declares `costs:`) adds the cost ratio rows: in Markdown and LaTeX as their own tables after the
    paired one, in CSV and Parquet as rows after the paired rows (``role`` ``cost``, ``delta`` ``treatment
    / control``, the ratio and its interval in ``ratio``, ``ratio_low``, ``ratio_high``; the paired rows'
    own statistics NaN there, and theirs NaN on the paired rows). ``tasks`` (`results.tasks.task_table`, a study
    with evaluations) adds the downstream task rows the same way, after the cost rows: in Markdown and LaTeX as
    their own tables (`format_tasks`), in CSV and Parquet as rows with ``role`` ``task`` (`_task_rows`: the
    delta in ``mean_delta``, its p in ``p_primary``, the task's own columns after). ``mechanisms``
    (`results.mechanisms.mechanism_table`, a study that declares `mechanisms:`) adds the mechanism rows last:
    their own tables in Markdown and LaTeX, rows with ``role`` ``mechanism`` in CSV and Parquet (the paired delta in
    ``mean_delta``, ``ci_low``, ``ci_high``, its sign-flip p in ``perm_p``). Every format is written atomically
    with mode 0644.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {list(EXPORT_FORMATS)}")
    costs = costs if costs is not None and len(costs) else None
    tasks = tasks if tasks is not None and len(tasks) else None
    mechanisms = mechanisms if mechanisms is not None and len(mechanisms) else None
    data: str | bytes
    if fmt == "md":
        data = (_render(table, "md") + ("" if costs is None else "\n" + format_costs(costs, "md"))
                + ("" if tasks is None else "\n" + format_tasks(tasks, "md"))
                + ("" if mechanisms is None else "\n" + format_mechanisms(mechanisms, "md"))
                + ("" if pairs is None else "\n" + format_pairs(pairs, "md")))
    elif fmt == "latex":
        data = (_to_latex(table) + ("" if costs is None else "\n" + _costs_latex(costs))
                + ("" if tasks is None else "\n" + _tasks_latex(tasks))
                + ("" if mechanisms is None else "\n" + _mechanisms_latex(mechanisms))
                + ("" if pairs is None else "\n" + format_pairs(pairs, "latex")))
    elif fmt == "csv":
        data = _with_rows(table, costs, tasks, mechanisms).to_csv(index=False, na_rep=CSV_NA_REP)
    else:
        data = _with_rows(table, costs, tasks, mechanisms).to_parquet(index=False)
    return write_atomic(path, data)
