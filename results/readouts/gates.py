"""The gates readout (issue 54): a gates study's primary result. Per gate and treatment the decision (promoted,
dropped for futility, undecided, not reached) with the seeds and FLOPs it used and k with its interval at the
gate's points; each treatment's projection to the study's target computes (the loss gap, k and the
throughput-adjusted k_wall, each with its interval, a row flagged past `max_decades`), the backtest, and the FLOPs
saved against a full ladder (`results.gate_results`)."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd

from reslab.results.export import latex_escape, numeric_column, render_model, tex_float, tex_text
from reslab.results.gate_results import DECISION_WORDS, GatesDesign, GatesResult, gates_readout
from reslab.results.plots import Plot, gates_plot
from reslab.results.readouts.base import Headline, Readout, Series, StudyData, Style, TableFormat

__all__ = ["GatesReadout", "gates_model", "gates_series"]

Block = tuple[str, list[str], list[list[str]]]


def _num(value: Any, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return "inf" if isinstance(value, float) and math.isinf(value) else format(value, spec)


def _ci(value: Any, low: Any, high: Any, spec: str = ".2f") -> str:
    return "-" if _num(value) == "-" else f"{_num(value, spec)} [{_num(low, spec)}, {_num(high, spec)}]"


def _decisions(result: GatesResult) -> Block:
    header = ["gate", "treatment", "decision", "seeds", "looks", "FLOPs", "threshold", "at FLOPs", "k [CI]",
              "levels"]
    rows = [[r["name"], r["treatment"], DECISION_WORDS[r["decision"]], str(r["seeds"]), r["looks"] or "-",
             _num(r["flops"]), _num(r["threshold"], "g"), _num(r["point"]), _ci(r["k"], r["k_low"], r["k_high"]),
             f"{r['level_low']:.4f}/{r['level_high']:.4f}"] for r in result.decisions.to_dict("records")]
    return "gates: the decision at each gate (k's lower bound at its level promotes, the upper at its level drops)", \
        header, rows


def _projection(result: GatesResult) -> Block:
    header = ["treatment", "target FLOPs", "decades past", "seeds", "rungs", "loss control", "loss treatment",
              "gap [CI]", "k [CI]", "k wall-clock [CI]", "notes"]
    rows = [[r["treatment"], _num(r["target"]), _num(r["decades_past"], "+.2f"), str(r["seeds"]), str(r["rungs"]),
             _num(r["loss_control"], ".4f"), _num(r["loss_treatment"], ".4f"),
             _ci(r["gap"], r["gap_low"], r["gap_high"], "+.4f"), _ci(r["k"], r["k_low"], r["k_high"]),
             _ci(r["k_wall"], r["k_wall_low"], r["k_wall_high"]), r["note"] or ""]
            for r in result.projection.to_dict("records")]
    level = f"{result.projection['level'].iloc[0]:.0%} " if len(result.projection) else ""
    return (f"projection to the target compute ({level}paired seed-bootstrap intervals; k wall-clock: k times the "
            "arms' measured FLOP-rate ratio)", header, rows)


def _backtest(result: GatesResult) -> Block:
    header = ["treatment", "predicted FLOPs", "gap projected", "gap observed", "gap error [CI]", "covered",
              "k projected / observed [CI]", "k covered"]
    rows = [[r["treatment"], _num(r["compute"]), _num(r["gap_projected"], "+.4f"), _num(r["gap_observed"], "+.4f"),
             _ci(r["gap_error"], r["gap_error_low"], r["gap_error_high"], "+.4f"), "yes" if r["gap_covered"] else "no",
             _ci(r["k_ratio"], r["k_ratio_low"], r["k_ratio_high"], ".3f"), "yes" if r["k_covered"] else "no"]
            for r in result.backtest.to_dict("records")]
    return "backtest: fitted without the largest rung, projected to it", header, rows


def _saving(result: GatesResult, design: GatesDesign) -> Block:
    header = ["arm", "runs", "FLOPs used", "FLOPs full ladder", "saved"]
    rows = [[r["arm"], str(r["runs"]), _num(r["flops_used"]), _num(r["flops_full"]), f"{r['saved']:.0%}"]
            for r in result.saving.to_dict("records")]
    return (f"what the gates saved: the FLOPs of the runs recorded against a full ladder ({len(design.rungs)} rungs, "
            f"{design.plan.looks[-1]} seeds, every arm)", header, rows)


def gates_model(result: GatesResult, design: GatesDesign) -> tuple[list[Block], list[str]]:
    """The readout's tables as `results.export`'s table model: the decisions, the projection, the backtest (when
    there is one) and the saving, and the legend lines."""
    blocks = [_decisions(result), _projection(result)]
    if len(result.backtest):
        blocks.append(_backtest(result))
    blocks.append(_saving(result, design))
    plan = design.plan
    legend = [f"plan: looks at {', '.join(map(str, plan.looks))} seeds, alpha {plan.alpha:g} in all "
              f"({plan.gate_alpha():.3g} per gate and treatment), errors '{plan.errors}'; law "
              + ("L = E + A C^-alpha, E fitted" if plan.form.floor is None else
                 f"L = {plan.form.floor:g} + A C^-alpha"),
              "k: the compute the control needs to reach the treatment's loss, over the treatment's (k > 1 favours "
              "the treatment); levels: the two-sided levels whose lower / upper bounds the gate reads",
              f"a target more than {design.max_decades:g} decades past the largest rung is flagged: its interval "
              "assumes the law holds out there"]
    return blocks, legend


def gates_series(result: GatesResult) -> Series:
    """One series per gate and treatment on the parent MLflow run, stepped by seeds at each look:
    `gates/<gate>/<treatment>/` + `k`, `k_low`, `k_high` (at the gate's point where k is least)."""
    out: Series = {}
    for (name, treatment), looks in result.looks.groupby(["name", "treatment"], sort=False):
        key = re.sub(r"[^\w./ -]", "_", f"gates/{name}/{treatment}")
        for column in ("k", "k_low", "k_high"):
            points = [(int(n), float(v)) for n, v in zip(looks["seeds"], looks[column], strict=True)
                      if math.isfinite(v)]
            if points:
                out[f"{key}/{column}"] = points
    return out


def _answer(result: GatesResult) -> str:
    """The study's answer in one line: each treatment's furthest decision, its projected k and wall-clock k at the
    first target, and the saving."""
    parts = []
    for treatment, rows in result.decisions.groupby("treatment", sort=False):
        reached = rows[rows["decision"] != "not reached"]
        last = reached.iloc[-1] if len(reached) else rows.iloc[0]
        said = f"{treatment} {DECISION_WORDS[last['decision']]} at {last['name']}"
        proj = result.projection[(result.projection["treatment"] == treatment) & result.projection["k"].notna()]
        if len(proj):
            p = proj.iloc[0]
            said += (f", k {_ci(p['k'], p['k_low'], p['k_high'])} at {_num(p['target'])} FLOPs (wall-clock "
                     f"{_ci(p['k_wall'], p['k_wall_low'], p['k_wall_high'])})")
        parts.append(said)
    saved = result.saving.iloc[-1]["saved"]
    return "; ".join(parts) + f"; {saved:.0%} of a full ladder's FLOPs saved"


def _html_table(block: Block, key: str) -> str:
    caption, header, rows = block
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    num = ' class="num"'
    body = "".join("<tr>" + "".join(f"<td{num if numeric_column(h) else ''}>{html.escape(c)}</td>"
                                    for h, c in zip(header, r, strict=True)) + "</tr>" for r in rows)
    return (f'<table id="{key}"><caption>{html.escape(caption)}</caption><thead><tr>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table>")


def _latex(blocks: list[Block], legend: list[str]) -> str:
    out = ["% requires \\usepackage{booktabs}"]
    explain = " ".join(tex_text(line) + "." for line in legend)
    for i, (caption, header, rows) in enumerate(blocks):
        body = [" & ".join(tex_text(c) for c in r) + " \\\\" for r in rows]
        after = f"\\par\\smallskip\\parbox{{\\linewidth}}{{\\scriptsize {explain}}}" if i == len(blocks) - 1 else ""
        out += tex_float("\\footnotesize", tex_text(caption), "l" * len(header), [latex_escape(h) for h in header],
                         body, after)
    return "\n".join(out)


def _tidy(result: GatesResult) -> pd.DataFrame:
    parts = [frame.assign(role=role) for role, frame in (("gate", result.decisions), ("projection", result.projection),
                                                           ("backtest", result.backtest), ("saving", result.saving))
             if len(frame)]
    tidy = pd.concat(parts, ignore_index=True)
    return tidy[["role", *(c for c in tidy.columns if c != "role")]]


class GatesReadout(Readout):
    name = "gates"

    def compute(self, data: StudyData) -> GatesResult | None:
        if data.gates is None:
            return None
        # the study's FLOPs per run where the design has none (the ladder's rungs no look reached priced too)
        flops = {**{key: c.flops for key, c in data.costs.items()}, **data.gates.flops}
        return gates_readout(data.runs, data.gates, flops)

    def _design(self, data: StudyData) -> GatesDesign:
        assert data.gates is not None  # compute returned a result
        return data.gates

    def text(self, result: GatesResult, data: StudyData, style: Style) -> list[Any]:
        blocks, legend = gates_model(result, self._design(data))
        return [render_model(blocks, legend, "md" if style == "md" else "text")]

    def headline(self, result: GatesResult, data: StudyData) -> Headline:
        table = result.decisions.drop_duplicates(["gate", "treatment"])[
            ["name", "treatment", "decision", "seeds", "flops"]].reset_index(drop=True)
        block = _decisions(result)
        return Headline(table, render_model([block], [], "md"), _answer(result))

    def facts(self, data: StudyData) -> list[tuple[str, str]]:
        if data.gates is None:
            return []
        design = data.gates
        gates = "; ".join(
            f"{g.name or f'gate {i + 1}'}: rungs {', '.join(str(r) for r in g.rungs)}, k > {g.threshold:g} "
            + (f"at {g.target:.3g} FLOPs" if g.target is not None else "at each rung")
            for i, g in enumerate(design.plan.gates))
        targets = ", ".join(f"{t:.3g}" for t in design.targets) or "-"
        return [("gates", f"{gates}; looks at {', '.join(map(str, design.plan.looks))} seeds, alpha "
                          f"{design.plan.alpha:g}; projected to {targets} FLOPs")]

    def section(self, result: GatesResult, data: StudyData) -> list[str]:
        blocks, legend = gates_model(result, self._design(data))
        keys = ("gates", "projection", "backtest", "saving") if len(result.backtest) else (
            "gates", "projection", "saving")
        return ["<h2>Gates</h2>", f'<p id="gates-answer">{html.escape(_answer(result))}</p>',
                *(_html_table(b, f"gates-{k}") for b, k in zip(blocks, keys, strict=True)),
                "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in legend) + "</ul>"]

    def plots(self, result: GatesResult, data: StudyData) -> list[tuple[Plot, str]]:
        return [(gates_plot(result, self._design(data).metric),
                 "Gates: loss against training FLOPs per arm (seeds as dots, the fitted law dashed to the targets, the "
                 "projected loss with its interval at each target), each gate's new rungs shaded, each treatment's "
                 "decision marked at the gate's largest rung (up: promoted, down: dropped, square: undecided); right, "
                 "k with its interval at each gate's points and projected to the targets, FLOPs and wall-clock.")]

    def tables(self, result: GatesResult, data: StudyData, fmt: TableFormat) -> list[str]:
        blocks, legend = gates_model(result, self._design(data))
        return [render_model(blocks, legend, "md") if fmt == "md" else _latex(blocks, legend)]

    def rows(self, result: GatesResult, data: StudyData) -> pd.DataFrame:
        """The decisions, the projection, the backtest and the saving, one `role` each."""
        return _tidy(result)

    def artifacts(self, result: GatesResult, data: StudyData, out: Path) -> dict[str, pd.DataFrame]:
        result.decisions.to_csv(out / "gates_decisions.csv", index=False)
        result.projection.to_csv(out / "gates_projection.csv", index=False)
        result.backtest.to_csv(out / "gates_backtest.csv", index=False)
        result.saving.to_csv(out / "gates_saving.csv", index=False)
        return {"gates_table.json": result.decisions, "gates_projection.json": result.projection}

    def series(self, result: GatesResult, data: StudyData) -> Series:
        return gates_series(result)
