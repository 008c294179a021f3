"""Render and write comparison tables (the output of ``results.stats.compare``).

Markdown, LaTeX and text show a paper-style subset; CSV and Parquet keep every column.
Files are written to a temporary sibling and moved into place, so a failed export never
leaves a half-written table behind.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pandas as pd

__all__ = ["CSV_NA_REP", "EXPORT_FORMATS", "PRINT_FORMATS", "export_table", "format_table", "latex_escape"]

EXPORT_FORMATS: tuple[str, ...] = ("md", "csv", "parquet", "latex")
PRINT_FORMATS: tuple[str, ...] = ("md", "text")

_TINY_P = 1e-4
_TINY_P_TEXT = "<1e-4"
_NA_TEXT = "n/a"
_RIGHT_ALIGNED = frozenset({"n", "perm p", "Holm p", "BH p", "d_z", "W/L"})
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


def _is_nan(x: object) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _fmt_delta(x: float) -> str:
    return _NA_TEXT if _is_nan(x) else f"{x:.4f}"


def _fmt_p(p: float) -> str:
    if _is_nan(p):
        return _NA_TEXT
    if p < _TINY_P:
        return _TINY_P_TEXT
    return f"{p:.3g}"


def _fmt_dz(x: float) -> str:
    return _NA_TEXT if _is_nan(x) else f"{x:.2f}"


def _ci_level(table: pd.DataFrame) -> str:
    alpha = float(table.attrs.get("alpha", 0.05))
    return f"{100.0 * (1.0 - alpha):g}%"


def _display_rows(table: pd.DataFrame) -> tuple[list[str], list[list[str]]]:
    """Header and string cells of the paper-style subset, before any format-specific escaping."""
    with_comparison = table["comparison"].nunique() > 1 if len(table) else False
    header = ["grid point", "control", "treatment", "n", f"mean delta ({_ci_level(table)} CI)",
              "perm p", "Holm p", "BH p", "d_z", "W/L", "flags"]
    if with_comparison:
        header = ["comparison", *header]
    rows: list[list[str]] = []
    for r in table.to_dict("records"):
        if _is_nan(r["mean_delta"]):
            delta = _NA_TEXT
        elif _is_nan(r["ci_low"]):
            delta = _fmt_delta(r["mean_delta"])
        else:
            delta = f"{_fmt_delta(r['mean_delta'])} [{_fmt_delta(r['ci_low'])}, {_fmt_delta(r['ci_high'])}]"
        flags = "; ".join(f for f in str(r["flags"]).split(";") if f)
        cells = [
            r["grid_key"] or "-",
            str(r["control"]),
            str(r["treatment"]),
            str(int(r["n"])),
            delta,
            _fmt_p(r["perm_p"]),
            _fmt_p(r["p_holm"]),
            _fmt_p(r["p_bh"]),
            _fmt_dz(r["d_z"]),
            f"{int(r['wins'])}/{int(r['losses'])}",
            flags,
        ]
        rows.append([str(r["comparison"]), *cells] if with_comparison else cells)
    return header, rows


def _to_markdown(table: pd.DataFrame) -> str:
    header, rows = _display_rows(table)

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    sep = "|" + "|".join("---:" if h in _RIGHT_ALIGNED else "---" for h in header) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)]) + "\n"


def _to_text(table: pd.DataFrame) -> str:
    header, rows = _display_rows(table)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    out.extend("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    return "\n".join(out) + "\n"


def latex_escape(text: str) -> str:
    """Escape LaTeX special characters in plain text."""
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in text)


def _latex_cell(text: str) -> str:
    if text == _TINY_P_TEXT:
        return "$<10^{-4}$"
    escaped = latex_escape(text)
    out = []
    for i, ch in enumerate(escaped):
        nxt = escaped[i + 1] if i + 1 < len(escaped) else ""
        prev = escaped[i - 1] if i > 0 else " "
        # A hyphen that starts a number is a minus sign; "attnres-v2" keeps its hyphen.
        out.append("$-$" if ch == "-" and nxt.isdigit() and not prev.isalnum() else ch)
    return "".join(out)


def _latex_header(h: str, level: str) -> str:
    if h.startswith("mean delta"):
        return f"$\\Delta$ ({latex_escape(level)} CI)"
    if h == "d_z":
        return "$d_z$"
    return latex_escape(h)


def _to_latex(table: pd.DataFrame) -> str:
    header, rows = _display_rows(table)
    spec = "".join("r" if h in _RIGHT_ALIGNED else "l" for h in header)
    level = _ci_level(table)
    lines = [
        f"\\begin{{tabular}}{{{spec}}}",
        "\\toprule",
        " & ".join(_latex_header(h, level) for h in header) + " \\\\",
        "\\midrule",
        *(" & ".join(_latex_cell(c) for c in r) + " \\\\" for r in rows),
        "\\bottomrule",
        "\\end{tabular}",
    ]
    return "\n".join(lines) + "\n"


def format_table(table: pd.DataFrame, fmt: str = "md") -> str:
    """Render a comparison table as Markdown (``"md"``) or aligned plain text (``"text"``)."""
    renderers = {"md": _to_markdown, "text": _to_text}
    if fmt not in renderers:
        raise ValueError(f"unknown print format {fmt!r}; allowed: {list(PRINT_FORMATS)}")
    return renderers[fmt](table)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_table(table: pd.DataFrame, path: str | os.PathLike, fmt: str) -> Path:
    """Write a comparison table to ``path`` as ``md``, ``csv``, ``parquet`` or ``latex``; returns the path.

    CSV and Parquet hold every column (run ids included); CSV writes NaN as ``"NaN"``, so read it
    back with ``keep_default_na=False, na_values=["NaN"]`` to keep empty strings empty.
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; allowed: {list(EXPORT_FORMATS)}")
    path = Path(path)

    if fmt in ("md", "latex"):
        # Render before touching the file system so a rendering error leaves nothing behind.
        text = _to_markdown(table) if fmt == "md" else _to_latex(table)
        _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    elif fmt == "csv":
        _atomic_write(path, lambda tmp: table.to_csv(tmp, index=False, na_rep=CSV_NA_REP))
    else:
        _atomic_write(path, lambda tmp: table.to_parquet(tmp, index=False))
    return path
