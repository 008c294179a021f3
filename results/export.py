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
from collections.abc import Callable, Sequence
from functools import reduce
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.common.io import write_atomic
from reslab.common.metrics import METRICS
from reslab.results.stats import grid_parts

__all__ = ["CSV_NA_REP", "EXPORT_FORMATS", "NA_TEXT", "PRINT_FORMATS", "TEXT_EXPORTS", "Model", "append_rows",
           "ci_decimals", "ci_level", "export_table", "fmt_number", "format_pairs", "format_table", "is_missing",
           "latex_escape", "note_marks", "numeric_column", "point_column", "render_model", "rich_model",
           "rich_renderables", "table_latex", "table_model", "tex_body", "tex_float", "tex_head", "tex_text",
           "write_export"]

EXPORT_FORMATS: tuple[str, ...] = ("md", "csv", "parquet", "latex")
PRINT_FORMATS: tuple[str, ...] = ("md", "text")
TEXT_EXPORTS: tuple[str, ...] = ("md", "latex")  # the formats whose files are tables; CSV and Parquet hold rows

_TINY_P = 1e-4
TINY_P_TEXT = "<1e-4"
NA_TEXT = "n/a"
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


def is_missing(x: object) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def ci_decimals(half_width: float, value: float) -> int:
    """Decimals that show two significant digits of the CI half-width (3 of the value without a CI)."""
    ref, digits = (half_width, _DELTA_SIG_DIGITS) if math.isfinite(half_width) and half_width > 0 else (value, 3)
    if not math.isfinite(ref) or ref == 0:
        return 4
    return max(0, digits - 1 - math.floor(math.log10(abs(ref))))


def fmt_number(x: float, decimals: int) -> str:
    if is_missing(x):
        return NA_TEXT
    text = f"{x:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.000"


def _fmt_p(p: float) -> str:
    if is_missing(p):
        return NA_TEXT
    if p < _TINY_P:
        return TINY_P_TEXT
    return f"{p:.2g}" if p < 0.001 else f"{p:.3f}" if p < 0.1 else f"{p:.2f}"


def _fmt_es(x: float) -> str:
    return NA_TEXT if is_missing(x) else fmt_number(x, 2)


def ci_level(table: pd.DataFrame) -> str:
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
            texts.append(f"equivalence margin +-{r['threshold']:g}: TOST 90% CI [{fmt_number(r['tost_ci_low'], 4)}, "
                         f"{fmt_number(r['tost_ci_high'], 4)}], paired-t TOST p {_fmt_p(r['tost_p'])}")
        elif r["threshold"] > 0 and r["role"] != "stratum":
            texts.append(f"minimum effect of interest {r['threshold']:g}")
        if r["exploratory"] and r["role"] != "stratum":
            texts.append("exploratory: not sized to reach alpha")
        notes.append(texts)
    return note_marks(notes)


def note_marks(notes: list[list[str]]) -> tuple[list[str], dict[str, str]]:
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
Model = list[tuple[str, list[str], list[list[str]]]]  # the table model's blocks: (caption, header, rows of cells)


def point_column(keys: list[str], labels: Labels | None = None) -> tuple[str, list[str]]:
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
    return max(ci_decimals((r["ci_high"] - r["ci_low"]) / 2.0, r["mean_delta"]) for r in block.to_dict("records"))


def _display_rows(block: pd.DataFrame, marks: list[str], labels: Labels | None = None
                  ) -> tuple[list[str], list[list[str]]]:
    """Header and plain-text cells of one metric's rows; numbers use ASCII minus."""
    level = ci_level(block)
    grid_head, grid_cells = point_column(list(block["grid_key"]), labels)
    header = ["comparison", grid_head, "control", "treatment", "n", "control mean", "treatment mean",
              f"delta [{level} CI]", "p", _correction_label(block), "d_z", "g_z", "W/L", "verdict", "notes"]
    uniform = len(set(block["correction"])) == 1
    dec = _block_decimals(block)
    rows = []
    for r, note, grid in zip(block.to_dict("records"), marks, grid_cells, strict=True):
        delta = fmt_number(r["mean_delta"], dec)
        if not is_missing(r["ci_low"]):
            delta += f" [{fmt_number(r['ci_low'], dec)}, {fmt_number(r['ci_high'], dec)}]"
        p_adj = _fmt_p(r["p_adj"])
        if not uniform and p_adj != NA_TEXT:
            p_adj += " " + {"holm": "(Holm)", "bh": "(BH)"}[r["correction"]]
        rows.append([
            str(r["comparison"]), grid, str(r["control"]), str(r["treatment"]), str(int(r["n"])),
            fmt_number(r["control_mean"], dec), fmt_number(r["treatment_mean"], dec), delta, _fmt_p(r["p_primary"]),
            p_adj,
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
    return render_model(*table_model(table), fmt)


def render_model(blocks: list[tuple[str, list[str], list[list[str]]]], legend_lines: list[str], fmt: str) -> str:
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
    return rich_model(*table_model(table), _VERDICT_STYLES)


def rich_model(blocks: list[tuple[str, list[str], list[list[str]]]], legend_lines: list[str],
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


def latex_escape(text: str) -> str:
    """Escape LaTeX special characters in plain text."""
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


_TEX_MINUS = re.compile(r"(?<![A-Za-z0-9_.])-(?=\.?\d)")
# plain-text notation set in math mode: (text, a placeholder latex_escape leaves alone) and the math
_TEX_SYMBOLS = ((TINY_P_TEXT, "\x02"), ("+-", "\x00"), (" - ", " \x01 "), ("<=", "\x03"), (">=", "\x04"),
                (" x ", " \x05 "))
_TEX_SYMBOL_MATH = ("$<10^{-4}$", "$\\pm$", " $-$ ", "$\\le$", "$\\ge$", " $\\times$ ")


def tex_text(text: str) -> str:
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
    if text == TINY_P_TEXT:
        return "$<10^{-4}$"
    if text == NA_TEXT:
        return text
    return f"${text}$"


def _tex_delta(cell: str) -> str:
    if "[" not in cell:
        return _tex_num(cell)
    mean, ci = cell.split(" [", 1)
    low, high = ci.rstrip("]").split(", ")
    return f"{_tex_num(mean)} [{_tex_num(low)}, {_tex_num(high)}]"


def tex_head(h: str) -> str:
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


def tex_float(size: str, caption: str, spec: str, head: list[str], body: list[str], after: str = "") -> list[str]:
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


def tex_body(header: list[str], rows: list[list[str]], left_out: tuple[str, ...]) -> tuple[list[str], list[str]]:
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


def table_latex(table: pd.DataFrame) -> str:
    """The comparison table as booktabs floats, one per metric (`table_model` in LaTeX)."""
    marks, legend = _notes(table)
    mark_of = dict(zip(table.index, marks, strict=True))
    out = ["% requires \\usepackage{booktabs}"]
    for caption, block in _blocks(table):
        header, rows = _display_rows(block, [mark_of[i] for i in block.index])
        keep, body = tex_body(header, rows, _TEX_LEFT_OUT)
        used = {m for r in rows for m in r[-1].split(",") if m}
        legend_tex = " ".join(f"\\textsuperscript{{{k}}}\\,{tex_text(v)}." for k, v in legend.items() if k in used)
        explain = " ".join(tex_text(line) + "." for line in _legend_lines(table, {}))
        explain = explain.replace("d\\_z", "$d_z$").replace("g\\_z", "$g_z$")
        spec = "".join("r" if _right(h) else "l" for h in keep)
        metric = latex_escape(str(block["metric"].iloc[0]))
        caption_tex = tex_text(caption).replace(metric, f"\\texttt{{{metric}}}")
        out += tex_float("\\footnotesize", f"{caption_tex}. {latex_escape(ci_level(table))} paired-$t$ CI.",
                          spec, [tex_head(h) for h in keep], body,
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
    return empty if is_missing(value) or value == "" else str(value)


def _pair_rows(pairs: pd.DataFrame) -> list[list[str]]:
    """One row per seed; each (comparison, grid point, treatment) group shares the decimals that
    show two significant digits of the SD of its deltas."""
    rows = []
    for _, group in pairs.groupby(["comparison", "grid_key", "treatment"], sort=False):
        deltas = group["delta"].dropna()
        spread = float(deltas.std(ddof=1)) if len(deltas) >= 2 else math.nan
        dec = ci_decimals(spread, float(deltas.abs().max()) if len(deltas) else math.nan)
        for r in group.to_dict("records"):
            rows.append([str(r["comparison"]), _text(r["grid_key"], "-"), str(r["seed"]), str(r["control"]),
                         _text(r["control_run_id"], "missing"), str(r["treatment"]),
                         _text(r["treatment_run_id"], "missing"),
                         *(fmt_number(r[k], dec) for k in ("control_value", "treatment_value", "delta"))])
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
        title = tex_text(_pairs_caption(mine))
        for metric in dict.fromkeys(mine["metric"]):
            name = latex_escape(str(metric))
            title = title.replace(name, f"\\texttt{{{name}}}")
        out += tex_float("\\scriptsize", f"{title}: \\textit{{{latex_escape(comparison)}}}.", "rllrrr",
                          [latex_escape(h) if "$" not in h else h for h in head], body)
    return "\n".join(out)


def append_rows(rows: pd.DataFrame, more: pd.DataFrame) -> pd.DataFrame:
    """`rows`, then `more`, in one table: `rows`' columns, then the ones only `more` has; a column one kind of
    row lacks is NaN there."""
    extra = [c for c in more.columns if c not in rows.columns]
    return pd.concat([rows, more], ignore_index=True)[[*rows.columns, *extra]]


def write_export(path: str | os.PathLike, fmt: str, tables: Sequence[str] = (),
                 rows: Sequence[pd.DataFrame] = ()) -> Path:
    """Write an export file: in Markdown or LaTeX (`TEXT_EXPORTS`) the `tables` one after the other (each ends
    with a newline; a blank line between two), in CSV or Parquet the `rows` as one tidy table (`append_rows`:
    the first frame's columns, then each later frame's own). Written atomically with mode 0644; returns the path.
    CSV writes NaN as ``"NaN"``, so read it back with ``keep_default_na=False, na_values=["NaN"]`` to keep
    empty strings empty."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {list(EXPORT_FORMATS)}")
    data: str | bytes
    if fmt in TEXT_EXPORTS:
        data = "\n".join(tables)
    else:
        frame = reduce(append_rows, rows)
        data = frame.to_csv(index=False, na_rep=CSV_NA_REP) if fmt == "csv" else frame.to_parquet(index=False)
    return write_atomic(path, data)


def export_table(table: pd.DataFrame, path: str | os.PathLike, fmt: str, pairs: pd.DataFrame | None = None) -> Path:
    """Write a comparison table to ``path`` as ``md``, ``csv``, ``parquet`` or ``latex``; returns the path.

    CSV and Parquet hold every column (run ids included); CSV writes NaN as ``"NaN"``, so read it
    back with ``keep_default_na=False, na_values=["NaN"]`` to keep empty strings empty. Markdown and
    LaTeX add, below the table, one row per seed with both arms' run ids when ``pairs`` (from
    ``results.collect.pairs_table``) is given. A study's export (`results.readout.StudyReadout.export`) adds each
    readout's own tables and rows (`Readout.tables`, `Readout.rows`) through `write_export`. Every format is
    written atomically with mode 0644.
    """
    if fmt not in TEXT_EXPORTS:
        return write_export(path, fmt, rows=[table])
    main = format_table(table, "md") if fmt == "md" else table_latex(table)
    return write_export(path, fmt, [main, *([] if pairs is None else [format_pairs(pairs, fmt)])])
