"""The mechanisms readout: a study's declared mechanisms (`mechanisms:`) as paired delta rows treatment -
control per comparison, treatment, grid point and mechanism (`results.mechanisms`), beside the loss rows in
the terminal, the report, the export and the parent MLflow run; and the depth profiles the runs recorded
(`models.magnitudes`): per arm, the per-layer output RMS, the per-layer gradient norm and the per-site RMS of
what each sublayer reads and, for MoE models, each layer's most loaded expert's share x experts, at the last
evaluation every run of the grid point reached, mean over seeds with a min-max band."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.collect import usable
from reslab.results.export import latex_escape, tex_float, tex_text
from reslab.results.mechanisms import (
    HEAD,
    check_recorded,
    format_mechanisms,
    mechanism_caption,
    mechanism_cells,
    mechanism_table,
)
from reslab.results.plots import DPI, Plot
from reslab.results.readouts.base import Readout, Series, StudyData, Style, TableFormat

__all__ = ["PROFILES", "MechanismsReadout", "mechanism_series", "profile_plot"]

# quantity recorded per eval -> (axis label, x is per layer)
PROFILES: dict[str, tuple[str, bool]] = {
    "layer_out_rms": ("output RMS of the layer (both sublayers' outputs)", True),
    "layer_grad_norm": ("gradient norm of the layer's parameters", True),
    "in_rms": ("RMS of what the sublayer reads (before its norm)", False),
    "moe_max_load": ("MoE: most loaded expert's share x experts (1: balanced)", True),
}


def mechanism_series(table: pd.DataFrame) -> Series:
    """The rows as MLflow metrics of the parent run, stepped by their pairs:
    `mechanism/<comparison>/<treatment>[/<grid point>]/<metric>/` + `delta`, `ci_low`, `ci_high` (finite ones)."""
    out: Series = {}
    for r in table.to_dict("records"):
        where = f"/{r['grid_key']}" if r["grid_key"] else ""
        key = re.sub(r"[^\w./ -]", "_", f"mechanism/{r['comparison']}/{r['treatment']}{where}/{r['metric']}")
        for name, column in (("delta", "mean_delta"), ("ci_low", "ci_low"), ("ci_high", "ci_high")):
            if pd.notna(r[column]):
                out[f"{key}/{name}"] = [(int(r["n"]), float(r[column]))]
    return out


def profile_plot(frame: pd.DataFrame, quantity: str, title: str) -> Plot:
    """One quantity's depth profile (`PROFILES`): per arm the mean over seeds (a line) and the min-max band, from
    `TrainingRecords.depth_profiles` rows of one grid point."""
    label, per_layer = PROFILES[quantity]
    from matplotlib.figure import Figure  # on first plot (issue 39)
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.0, 3.8), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    data: dict[str, Any] = {}
    for arm, rows in frame[frame["quantity"] == quantity].groupby("arm", sort=False):
        rows = rows.sort_values("index")
        x = rows["index"].to_numpy(dtype=float)
        mean, low, high = (rows[c].to_numpy(dtype=float) for c in ("mean", "min", "max"))
        line = ax.plot(x + 1, mean, marker="o", ms=3, label=f"{arm} ({int(rows['seeds'].iloc[0])} seeds)")[0]
        ax.fill_between(x + 1, low, high, color=line.get_color(), alpha=0.2)
        data[str(arm)] = {"index": x + 1, "mean": mean, "low": low, "high": high}
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # layers and sites are whole numbers
    ax.set_xlabel("layer" if per_layer else "sublayer site (odd: attention, even: MLP)")
    ax.set_ylabel(label)
    if quantity != "in_rms":
        ax.set_ylim(bottom=0.0)
    else:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize="small")
    return Plot(f"profile_{quantity}", fig, data)


def _profiles(data: StudyData) -> list[tuple[Plot, str, str]]:
    """(plot, caption, grid key) per grid point and quantity the runs recorded, at the last step every run there
    reached."""
    out = []
    for key, here in sorted(data.records.depth_profiles.groupby("grid_key", sort=False), key=lambda item: item[0]):
        step = int(here["step"].iloc[0])
        point = f" at {data.labels(key)}" if key else ""
        for quantity, (label, _) in PROFILES.items():
            if (here["quantity"] == quantity).any():
                plot = profile_plot(here, quantity, f"{label}{point}, step {step}")
                out.append((plot, f"Depth profile{point}: {label} at step {step} (the last evaluation every run here "
                                  "reached), mean over seeds with the min-max band; eval windows for the RMS, the "
                                  "training step before the evaluation for the gradient norms.", key))
    return out


def _mechanisms_latex(mechanisms: pd.DataFrame) -> str:
    """The mechanism rows (`results.mechanisms.mechanism_cells`) as one booktabs float per comparison."""
    out: list[str] = []
    alpha = mechanisms.attrs.get("alpha", 0.05)
    for comparison, block in mechanisms.groupby("comparison", sort=False):
        body = [" & ".join(latex_escape(c) for c in mechanism_cells(r)) + " \\\\" for r in block.to_dict("records")]
        out += tex_float("\\footnotesize", tex_text(f"{mechanism_caption(alpha)}; {comparison}") + ".",
                         "lll" + "r" * (len(HEAD) - 4) + "l", [latex_escape(h) for h in HEAD],
                         body)
    return "\n".join(out)


class MechanismsReadout(Readout):
    name = "mechanisms"
    export_rank = 1  # an export's mechanism rows and tables come last, after the task rows

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        if not data.mechanism_metrics:
            return []
        return [("mechanisms", ", ".join(data.mechanism_metrics) + " (paired deltas treatment - control within each "
                                                                   "comparison)")]

    def compute(self, data: StudyData) -> pd.DataFrame | None:
        if not data.mechanism_metrics or not data.comparisons:
            return None
        values = data.mechanisms
        check_recorded(values, data.mechanism_metrics, data.name, int(usable(data.runs).sum()))
        return mechanism_table(data.runs, values, data.comparisons, data.mechanism_metrics, alpha=data.alpha)

    def text(self, result: pd.DataFrame, data: StudyData, style: Style) -> list[Any]:
        if style == "md":
            return ["\n" + format_mechanisms(result, "md")]
        return [format_mechanisms(result, "text")]

    def tables(self, result: pd.DataFrame, data: StudyData, fmt: TableFormat) -> list[str]:
        """The mechanism rows' own tables: one per comparison."""
        if not len(result):
            return []
        return [format_mechanisms(result, "md") if fmt == "md" else _mechanisms_latex(result)]

    def rows(self, result: pd.DataFrame, data: StudyData) -> pd.DataFrame | None:
        """The rows as they are (`role` mechanism; the paired delta in `mean_delta`, `ci_low`, `ci_high`, its
        sign-flip p in `perm_p`)."""
        return result if len(result) else None

    def section(self, result: pd.DataFrame, data: StudyData) -> list[str]:
        rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in mechanism_cells(r, data.labels))
                       + "</tr>" for r in result.to_dict("records"))
        head = "".join(f"<th>{html.escape(h)}</th>" for h in HEAD)
        return ["<h2>Mechanisms</h2>",
                f"<p>{html.escape(mechanism_caption(data.alpha)[0].upper() + mechanism_caption(data.alpha)[1:])}. "
                "growth: output RMS of the last layer over the first's; stream_growth: RMS of what the last sublayer "
                "reads over what the second layer reads; grad_cv: SD / mean of the per-layer gradient norms; "
                "route_max_late: mean max routing weight in the last third of the depth (models/magnitudes.py); "
                "imbalance and stream<k>_knockout: from the interventions (results/interventions.py)."
                " The depth profiles below show where along the depth the arms differ.</p>",
                f'<table id="mechanisms"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>']

    def plots(self, result: pd.DataFrame, data: StudyData) -> list[tuple[Plot, str]]:
        return [(plot, caption) for plot, caption, _ in _profiles(data)]

    def artifacts(self, result: pd.DataFrame, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.to_csv(out / "mechanisms.csv", index=False)
        for plot, _, key in _profiles(data):
            point = re.sub(r"[^\w.=-]", "_", key)
            plot.save(out / (f"{plot.name}_{point}.png" if point else f"{plot.name}.png"))
        return {"mechanisms_table.json": result}

    def series(self, result: pd.DataFrame, data: StudyData) -> Series:
        return mechanism_series(result)
