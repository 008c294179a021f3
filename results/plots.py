"""Plots of a study's results, each a pure function of plain tables (matplotlib, Agg, no pyplot).

Every function returns a `Plot`: the figure (saved as PNG or SVG by suffix) and `data`, the arrays
it drew, so tests check what was plotted rather than pixels.

Inputs:
    table        `results.compare` rows (forest plot, sweep curve)
    evals        one row per evaluation: ``arm``, ``grid_key``, ``seed``, ``tokens``, ``val_loss``
                 (loss curves, delta curve)
    routing      ``{arm: (matrix [sites, sources], row labels)}`` (heatmaps, shared colour scale)
    profiles     ``{arm: [concentration per layer (then readout), None where undefined]}``
    depths       one row per run: ``arm``, ``seed``, ``d_eff``, ``f_l`` (D_eff against F_L)
    ladders      `results.ladder`'s arms and multipliers of one comparison (loss and k against compute)
    points       one row per run: ``arm``, ``seed``, ``cost``, ``loss`` (loss against a cost, Pareto front)
"""

from __future__ import annotations

import base64
import io
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
from scipy import stats as sps

from reslab.common.forks import fork_map
from reslab.common.metrics import METRICS
from reslab.results.costs import pareto_front
from reslab.results.stats import grid_parts

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Plot",
    "concentration_profile",
    "cost_plot",
    "deff_plot",
    "delta_curve",
    "forest_plot",
    "gates_plot",
    "loss_curves",
    "pngs_base64",
    "routing_heatmaps",
    "scaling_plot",
    "sweep_curve",
]

DPI = 100
SIGNIFICANT = ("better", "worse")
LOG_SPAN = 3.0  # a cost axis whose largest value is more than this times its smallest is drawn on a log scale
Band = Literal["minmax", "ci"]
Labels = Callable[[str], str]  # grid key -> its short label (`results.labels.PointLabels`)


@dataclass
class Plot:
    name: str
    figure: Figure
    data: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | Path) -> Path:
        """Write PNG or SVG, chosen by the suffix."""
        path = Path(path)
        if path.suffix not in (".png", ".svg"):
            raise ValueError(f"plot {self.name}: suffix {path.suffix!r} is not allowed; allowed: .png, .svg")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.figure.savefig(path, format=path.suffix[1:], dpi=DPI)
        return path

    def png_base64(self) -> str:
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=DPI)
        return base64.b64encode(buf.getvalue()).decode("ascii")


FIGURES_PER_WORKER = 8  # fewer a worker: drawn here (a forked worker's start costs about a figure)


def pngs_base64(plots: Sequence[Plot], workers: int = 1) -> list[str]:
    """Each plot's PNG as base64 text, in order, drawn by up to `workers` forked copies of this process
    (`common.forks.fork_map`), two figures at a time to whichever is free: a report of a 50-point grid draws
    ~100 figures, 11 s on one core and 6.3 s on two at 10^5 runs (issue 39). The bytes are the same as this
    process's (Agg draws deterministically). Only a caller whose process may fork passes `workers` > 1."""
    workers = min(workers, len(plots) // FIGURES_PER_WORKER)
    if workers < 2:
        return [plot.png_base64() for plot in plots]
    return fork_map(lambda i: plots[i].png_base64(), len(plots), workers, chunksize=2)


NO_DIFFERENCE = "no difference (delta = 0)"  # the zero line of a delta plot: equal to the control, not the control


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure  # on first plot: `compare` draws none (issue 39)

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _point(grid_key: str, labels: Labels | None) -> str:
    """A grid point as a plot names it: its short label, or `axis=value, ...` by each axis's last path part."""
    if labels is not None:
        return labels(grid_key) if grid_key else ""
    return ", ".join(f"{axis.rsplit('.', 1)[-1]}={value}" for axis, value in grid_parts(grid_key or ""))


def _row_label(row: dict, labels: Labels | None = None) -> str:
    """`comparison: treatment - control [grid point]` (`_point`)."""
    point = _point(row.get("grid_key") or "", labels)
    return f"{row['comparison']}: {row['treatment']} - {row['control']}" + (f" [{point}]" if point else "")


def _legend_below(fig: Figure, ax: Any) -> None:
    """The axes' legend outside them, centred below the figure's axes (constrained layout makes room), so it
    covers no line and stays inside the figure."""
    handles, names = ax.get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside lower center", ncol=1 if max(map(len, names)) > 40 else 2,
                   fontsize="small", frameon=False)


def _legend_rows(n: int, names: list[str]) -> float:
    """Inches a `_legend_below` legend of `n` entries needs below the axes."""
    per_row = 1 if max(map(len, names), default=0) > 40 else 2
    return 0.22 * math.ceil(n / per_row) + 0.2


def forest_plot(table: pd.DataFrame, labels: Labels | None = None) -> Plot:
    """One row per comparison row (and grid point): mean paired delta with its CI; the MEI or
    equivalence margin shaded as +-threshold around 0 when declared; a filled marker when the
    verdict is significant after the family correction (better/worse), hollow otherwise. `labels`: the grid
    points' short labels (default: each axis=value)."""
    rows = table.to_dict("records")
    n = len(rows)
    labels_ = [_row_label(r, labels) for r in rows]
    # the labels sit left of the axes: the figure widens with the longest (about 0.07 inch a character)
    fig = _figure(5.5 + 0.07 * max((len(label) for label in labels_), default=0), max(2.2, 0.45 * n + 1.2))
    ax = fig.add_subplot()
    y = np.arange(n)[::-1].astype(float)
    mean = np.array([r["mean_delta"] for r in rows], dtype=float)
    low = np.array([r["ci_low"] for r in rows], dtype=float)
    high = np.array([r["ci_high"] for r in rows], dtype=float)
    threshold = np.array([r["threshold"] for r in rows], dtype=float)
    significant = np.array([r["verdict"] in SIGNIFICANT for r in rows], dtype=bool)
    for yi, t in zip(y, threshold, strict=True):
        if t > 0:
            ax.fill_betweenx([yi - 0.4, yi + 0.4], -t, t, color="tab:green", alpha=0.15, linewidth=0)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.hlines(y, low, high, color="tab:blue", linewidth=2)
    ax.scatter(mean[significant], y[significant], color="tab:red", zorder=3, label="significant (corrected)")
    ax.scatter(mean[~significant], y[~significant], facecolors="white", edgecolors="tab:blue", zorder=3,
               label="not significant")
    ax.set_yticks(y, labels_)
    metric = rows[0]["metric"] if rows else ""
    ax.set_xlabel(f"paired delta of {metric} (treatment - control), CI")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # outside: never over a row
    return Plot("forest", fig, {"labels": labels_, "mean": mean, "ci_low": low, "ci_high": high,
                                "threshold": threshold, "significant": significant})


def _axis_value(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def sweep_curve(table: pd.DataFrame, axis: str) -> Plot:
    """Mean paired delta against one grid axis per (comparison, treatment), CI band, control at 0.

    Pooled rows are left out (they have no single axis value); a non-numeric axis is placed at
    0, 1, ... in its grid order."""
    rows = [r for r in table.to_dict("records") if r["role"] != "pooled"]
    series: dict[str, dict[str, list[Any]]] = {}
    for r in rows:
        parts = dict(grid_parts(r["grid_key"] or ""))
        if axis not in parts:
            continue
        key = f"{r['comparison']}: {r['treatment']}"
        s = series.setdefault(key, {"x": [], "mean": [], "ci_low": [], "ci_high": []})
        s["x"].append(_axis_value(parts[axis]))
        s["mean"].append(r["mean_delta"])
        s["ci_low"].append(r["ci_low"])
        s["ci_high"].append(r["ci_high"])
    if not series:
        raise ValueError(f"sweep_curve: no comparison row has grid axis {axis!r}")
    fig = _figure(6.5, 4.0)
    ax = fig.add_subplot()
    ax.axhline(0.0, color="black", linewidth=0.8, label=NO_DIFFERENCE)
    data: dict[str, Any] = {}
    for key, s in series.items():
        numeric = all(isinstance(v, float) for v in s["x"])
        order = sorted(range(len(s["x"])), key=lambda i: s["x"][i]) if numeric else list(range(len(s["x"])))
        x = np.array([s["x"][i] if numeric else i for i in order], dtype=float)
        arrays = {k: np.array([s[k][i] for i in order], dtype=float) for k in ("mean", "ci_low", "ci_high")}
        line = ax.plot(x, arrays["mean"], marker="o", label=key)[0]
        ax.fill_between(x, arrays["ci_low"], arrays["ci_high"], color=line.get_color(), alpha=0.2)
        if not numeric:
            ax.set_xticks(x, [str(s["x"][i]) for i in order])
        data[key] = {"x": x, **arrays}
    ax.set_xlabel(axis)
    ax.set_ylabel(f"paired delta of {rows[0]['metric']}")
    ax.legend(fontsize="small")
    return Plot("sweep", fig, data)


def _tokens_axis(ax: Any) -> None:
    """Tokens on the x axis in engineering notation (200k, 1.5M), not raw counts."""
    from matplotlib.ticker import EngFormatter

    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_xlabel("training tokens")


def _log_cost_axis(ax: Any, low: float, high: float) -> None:
    """A log cost axis with labels that cannot collide: ticks at 1, 2 and 5 per decade (1 alone past two
    decades) in engineering notation (2k, 50k, 1M), and no minor-tick labels, which matplotlib writes as
    `3x10^0`, `4x10^0` side by side when the axis spans about a decade."""
    from matplotlib.ticker import EngFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    decades = math.log10(high / low)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if decades <= 2 else (1.0,)))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _ci_halfwidth(values: np.ndarray, alpha: float) -> float:
    n = values.size
    if n < 2:
        return math.nan
    return float(sps.t.ppf(1 - alpha / 2, n - 1) * values.std(ddof=1) / math.sqrt(n))


def _grow_for_legend(fig: Figure, ax: Any) -> None:
    """Taller by what `_legend_below` needs, so the axes keep their height; then the legend."""
    _, names = ax.get_legend_handles_labels()
    width, height = fig.get_size_inches()
    fig.set_size_inches(width, height + _legend_rows(len(names), names))
    _legend_below(fig, ax)


def loss_curves(evals: pd.DataFrame, *, band: Band = "minmax", alpha: float = 0.05,
                metric: str = "val_loss", labels: Labels | None = None) -> Plot:
    """Validation loss against tokens per arm (and grid point, by its short label when `labels` is given):
    the mean over seeds with a band, min-max over seeds (``band="minmax"``) or the 1 - alpha t interval of
    the mean (``"ci"``); the legend below the axes, over no curve."""
    if band not in ("minmax", "ci"):
        raise ValueError(f"loss_curves: band {band!r} is not allowed; allowed: minmax, ci")
    fig = _figure(6.5, 4.0)
    ax = fig.add_subplot()
    data: dict[str, Any] = {}
    for (arm, grid_key), group in evals.groupby(["arm", "grid_key"], sort=True):
        by_tokens = group.groupby("tokens")[metric]
        x = np.array(sorted(by_tokens.groups), dtype=float)
        per = [by_tokens.get_group(t).to_numpy(dtype=float) for t in x]
        mean = np.array([v.mean() for v in per])
        if band == "minmax":
            low, high = np.array([v.min() for v in per]), np.array([v.max() for v in per])
        else:
            half = np.array([_ci_halfwidth(v, alpha) for v in per])
            low, high = mean - half, mean + half
        point = labels(str(grid_key)) if labels is not None and grid_key else grid_key
        label = f"{arm} [{point}]" if point else str(arm)
        line = ax.plot(x, mean, label=label)[0]
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2)
        data[label] = {"tokens": x, "mean": mean, "low": low, "high": high,
                       "seeds": np.array([v.size for v in per])}
    _tokens_axis(ax)
    ax.set_ylabel(metric)
    _grow_for_legend(fig, ax)
    return Plot("loss_curves", fig, data)


def delta_curve(evals: pd.DataFrame, control: str, treatment: str, *, alpha: float = 0.05,
                metric: str = "val_loss", labels: Labels | None = None) -> Plot:
    """The paired delta (treatment - control, same grid point and seed) at every evaluation, its
    mean over seeds and the paired-t 1 - alpha CI, per grid point (by its short label when `labels` is
    given); the legend below the axes, inside the figure."""
    ctrl = evals[evals["arm"] == control].set_index(["grid_key", "seed", "tokens"])[metric]
    trt = evals[evals["arm"] == treatment].set_index(["grid_key", "seed", "tokens"])[metric]
    deltas = (trt - ctrl).dropna().rename("delta").reset_index()
    if deltas.empty:
        raise ValueError(f"delta_curve: no evaluation pairs {treatment} vs {control} on the same seed and tokens")
    fig = _figure(6.5, 4.0)
    ax = fig.add_subplot()
    ax.axhline(0.0, color="black", linewidth=0.8, label=NO_DIFFERENCE)
    data: dict[str, Any] = {}
    for grid_key, group in deltas.groupby("grid_key", sort=True):
        by_tokens = group.groupby("tokens")["delta"]
        x = np.array(sorted(by_tokens.groups), dtype=float)
        per = [by_tokens.get_group(t).to_numpy(dtype=float) for t in x]
        mean = np.array([v.mean() for v in per])
        half = np.array([_ci_halfwidth(v, alpha) for v in per])
        point = labels(str(grid_key)) if labels is not None and grid_key else grid_key
        label = f"{treatment} - {control}" + (f" [{point}]" if point else "")
        line = ax.plot(x, mean, label=label)[0]
        ax.fill_between(x, mean - half, mean + half, color=line.get_color(), alpha=0.2)
        data[label] = {"tokens": x, "mean": mean, "ci_low": mean - half, "ci_high": mean + half,
                       "pairs": np.array([v.size for v in per])}
    _tokens_axis(ax)
    # the pair in the title: in the y label it ran past the axes' height and the figure's edge cut it
    ax.set_ylabel(f"paired delta of {metric}")
    ax.set_title(f"{treatment} - {control}", fontsize="small")
    _grow_for_legend(fig, ax)
    return Plot("delta_curve", fig, data)


def routing_heatmaps(routing: dict[str, tuple[np.ndarray, list[str]]], vmax: float | None = None) -> Plot:
    """Depth x depth routing weights of several arms side by side on one colour scale, 0 to `vmax`
    (default: the largest weight of any arm; pass one to share the scale between figures); NaN
    cells (a site with fewer sources) stay blank."""
    if not routing:
        raise ValueError("routing_heatmaps: no arm has routing weights")
    vmax = max(float(np.nanmax(m)) for m, _ in routing.values()) if vmax is None else float(vmax)
    n = len(routing)
    height = max(3.0, 0.3 * max(m.shape[0] for m, _ in routing.values()) + 1.6)
    fig = _figure(3.6 * n + 1.0, height)
    axes = fig.subplots(1, n, squeeze=False)[0]
    images = []
    for ax, (arm, (matrix, labels)) in zip(axes, routing.items(), strict=True):
        image = ax.imshow(matrix, vmin=0.0, vmax=vmax, cmap="viridis", aspect="auto")
        ax.set_title(arm)
        ax.set_yticks(range(len(labels)), labels, fontsize="small")
        ax.set_xticks(range(matrix.shape[1]), ["emb"] + [str(i) for i in range(1, matrix.shape[1])],
                      fontsize="x-small")
        ax.set_xlabel("depth source")
        images.append(image)
    fig.colorbar(images[0], ax=list(axes), label="routing weight")
    return Plot("routing", fig, {"vmin": 0.0, "vmax": vmax, "matrices": {a: m for a, (m, _) in routing.items()}})


def concentration_profile(profiles: dict[str, list[float | None]]) -> Plot:
    """Routing concentration (1 - H / ln N) per Transformer layer, then the readout, per arm."""
    fig = _figure(6.0, 3.8)
    ax = fig.add_subplot()
    data: dict[str, Any] = {}
    for arm, values in profiles.items():
        y = np.array([np.nan if v is None else v for v in values], dtype=float)
        x = np.arange(1, y.size + 1, dtype=float)
        ax.plot(x, y, marker="o", label=arm)
        data[arm] = {"layer": x, "concentration": y}
    width = max((len(v) for v in profiles.values()), default=0)
    ax.set_xticks(range(1, width + 1), [str(i) for i in range(1, width)] + ["readout"] if width else [])
    ax.set_ylim(bottom=0.0)  # 0: uniform routing; the top follows the data (1 would be one source only)
    ax.set_xlabel("layer")
    ax.set_ylabel("routing concentration 1 - H / ln N")
    ax.legend(fontsize="small")
    return Plot("concentration", fig, data)


def deff_plot(depths: pd.DataFrame, labels: Labels | None = None) -> Plot:
    """D_eff per arm (each seed a dot, the mean a bar) against its F_L = 2L / (L + 1) (a tick); one bar
    per arm and grid point, since F_L changes with depth (a model-size ladder), keyed `arm [grid point]`
    when the study has a grid (the point by its short label when `labels` is given). The legend sits
    below the axes, over no bar or tick."""
    grid = depths["grid_key"].fillna("") if "grid_key" in depths else pd.Series("", index=depths.index)
    bars = sorted(set(zip(grid, depths["arm"], strict=True)))
    fig = _figure(max(6.0, 1.2 * len(bars) + 2.0), 3.8)
    ax = fig.add_subplot()
    data: dict[str, Any] = {}
    for i, (point, arm) in enumerate(bars):
        group = depths[(grid == point) & (depths["arm"] == arm)]
        values = group["d_eff"].to_numpy(dtype=float)
        f_l = float(group["f_l"].iloc[0])
        ax.bar(i, values.mean(), color="tab:blue", alpha=0.5)
        ax.scatter(np.full(values.size, i), values, color="tab:blue", zorder=3)
        ax.hlines(f_l, i - 0.4, i + 0.4, color="tab:red", linewidth=2, label="F_L" if i == 0 else "_nolegend_")
        data[f"{arm} [{point}]" if point else arm] = {"d_eff": values, "mean": float(values.mean()), "f_l": f_l}
    names = [_point(point, labels) for point, _ in bars] if labels is not None else [p for p, _ in bars]
    ax.set_xticks(range(len(bars)), [f"{arm}\n{name}" if name else arm for name, (_, arm) in zip(names, bars,
                                                                                                  strict=True)],
                  fontsize="small" if any(point for point, _ in bars) else None)
    ax.set_ylabel("effective depth D_eff")
    ax.set_title("bars: mean over seeds; dots: seeds; red: F_L = 2L/(L+1),\nthe D_eff of L orthogonal "
                 "equal-norm updates", fontsize="small")
    _grow_for_legend(fig, ax)
    return Plot("deff", fig, data)


def scaling_plot(arms: dict[str, Any], multipliers: dict[str, tuple[Any, Any]], metric: str) -> Plot:
    """A ladder read out (`results.ladder`): left, the loss against training FLOPs per arm (each
    seed a dot, the seed mean a marker with its min-max band, the fitted law L(C) = E + A C^-alpha
    dashed); right, each treatment's compute-equivalent multiplier k against FLOPs with its
    interval, FLOPs (solid) and wall-clock (dotted), k = 1 the control.

    `arms`: arm -> `results.ladder.ArmLadder`; `multipliers`: treatment -> (FLOP multiplier,
    wall-clock multiplier or None) at the rungs (`results.scaling.Multiplier`)."""
    fig = _figure(11.0, 4.2)
    left, right = fig.subplots(1, 2)
    data: dict[str, Any] = {}
    colours: dict[str, Any] = {}
    for arm, ladder in arms.items():
        x, loss = ladder.flops, ladder.loss
        mean = loss.mean(axis=0) if loss.size else np.full(x.size, np.nan)
        line = left.plot(x, mean, marker="o", linestyle="none", label=arm)[0]
        colours[arm] = line.get_color()
        if loss.size:
            left.fill_between(x, loss.min(axis=0), loss.max(axis=0), color=line.get_color(), alpha=0.15)
            left.scatter(np.tile(x, loss.shape[0]), loss.ravel(), s=8, color=line.get_color(), alpha=0.5)
        fitted = None
        if ladder.law is not None:
            grid = np.geomspace(x.min(), x.max(), 64)
            fitted = ladder.law.loss(grid)
            left.plot(grid, fitted, linestyle="--", color=line.get_color(), linewidth=1)
        data[arm] = {"flops": x, "mean": mean, "loss": loss, "fitted": fitted}
    left.set_xscale("log")
    left.set_xlabel("training FLOPs per run")
    left.set_ylabel(metric)
    left.legend(fontsize="small")
    right.axhline(1.0, color="black", linewidth=0.8, label="control (k = 1)")
    for treatment, (flop_k, wall_k) in multipliers.items():
        colour = colours.get(treatment)
        right.plot(flop_k.compute, flop_k.k, marker="o", color=colour, label=f"{treatment}, FLOPs")
        right.fill_between(flop_k.compute, flop_k.low, flop_k.high, color=colour, alpha=0.2)
        data[f"k {treatment}"] = {"flops": flop_k.compute, "k": flop_k.k, "low": flop_k.low, "high": flop_k.high}
        if wall_k is not None:  # drawn at the rungs' FLOPs: one x axis for both multipliers
            shown = np.isfinite(wall_k.k) & np.isfinite(wall_k.low) & np.isfinite(wall_k.high)
            right.errorbar(flop_k.compute[shown], wall_k.k[shown],
                           yerr=[(wall_k.k - wall_k.low)[shown], (wall_k.high - wall_k.k)[shown]],
                           color=colour, linestyle=":", marker="s", capsize=3, label=f"{treatment}, wall-clock")
            data[f"k wall {treatment}"] = {"k": wall_k.k, "low": wall_k.low, "high": wall_k.high}
    right.set_xscale("log")
    right.set_xlabel("training FLOPs per run (the treatment's, at each rung)")
    right.set_ylabel("compute-equivalent multiplier k")
    right.legend(fontsize="small")
    return Plot("scaling", fig, data)


GATE_MARKS = {"promote": ("^", "promoted"), "drop": ("v", "dropped"), "undecided": ("s", "undecided"),
              "continue": ("o", "in progress")}


def gates_plot(result: Any, metric: str) -> Plot:
    """A gates study read out (`results.gate_results.GatesResult`): left, the loss against training FLOPs per arm
    (seeds as dots, seed means as markers, each arm's fitted law dashed out to the targets, the projected loss at
    each target with its interval as an error bar), each gate's rungs shaded and named, and each treatment's
    decision at a gate marked at its largest rung (up: promoted, down: dropped, square: undecided); right, k at each
    gate's points (its last look) and at the targets, FLOPs (solid) and wall-clock (dotted), with the threshold."""
    fig = _figure(11.0, 4.6)
    left, right = fig.subplots(1, 2)
    data: dict[str, Any] = {"decisions": {}, "gates": {}}
    colours: dict[str, Any] = {}
    targets = np.array(sorted(set(result.projection["target"])), dtype=np.float64) if len(result.projection) else \
        np.array([])
    for arm, runs in result.arms.items():
        x = runs.flops
        mean = _nanmean(runs.loss, x.size)
        line = left.plot(x, mean, marker="o", linestyle="none", label=arm)[0]
        colours[arm] = line.get_color()
        finite = np.isfinite(runs.loss)
        left.scatter(np.tile(x, runs.loss.shape[0])[finite.ravel()], runs.loss[finite], s=8, color=line.get_color(),
                     alpha=0.5)
        law = result.laws.get(arm)
        if law is not None:
            grid = np.geomspace(x.min(), max(x.max(), targets.max() if targets.size else x.max()), 96)
            left.plot(grid, law.loss(grid), linestyle="--", color=line.get_color(), linewidth=1)
        data[arm] = {"flops": x, "mean": mean, "loss": runs.loss}
    for treatment, got in result.projections.items():
        for i, arm in enumerate((None, treatment)):
            name = arm or next(iter(result.arms))
            value, low, high = got.losses[i]
            left.errorbar(got.compute, value, yerr=[value - low, high - value], color=colours.get(name),
                          marker="D", linestyle="none", capsize=3)
            data[f"projected {name}"] = {"target": got.compute, "loss": value, "low": low, "high": high}
    shades = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    for i, (gate, rows) in enumerate(result.decisions.groupby("gate", sort=True)):
        name = str(rows["name"].iloc[0])
        span = _gate_span(result, int(gate))
        left.axvspan(span[0] / 1.25, span[1] * 1.25, color=shades[i % len(shades)], alpha=0.07 + 0.05 * i)
        left.annotate(name, (math.sqrt(span[0] * span[1]), 1.0), xycoords=("data", "axes fraction"), ha="center",
                      va="top", fontsize="x-small")
        data["gates"][name] = span
        for r in rows.drop_duplicates("treatment").to_dict("records"):
            data["decisions"][name, r["treatment"]] = r["decision"]
            mark = GATE_MARKS.get(r["decision"])
            runs = result.arms[r["treatment"]]
            j = int(np.argmin(np.abs(np.log(runs.flops) - np.log(span[1]))))
            if mark is not None and np.isfinite(runs.loss[:, j]).any():
                left.scatter([runs.flops[j]], [_nanmean(runs.loss[:, [j]], 1)[0]], marker=mark[0], s=90,
                             facecolor="none", edgecolor=colours.get(r["treatment"]), linewidth=1.5, zorder=4,
                             label=f"{r['treatment']}: {name} {mark[1]}")
    for target in targets:
        left.axvline(target, color="grey", linestyle=":", linewidth=0.8)
    left.set_xscale("log")
    left.set_xlabel("training FLOPs per run (dotted: the projection's targets)")
    left.set_ylabel(metric)
    left.legend(fontsize="x-small")
    _gates_k_panel(right, result, colours, data)
    return Plot("gates", fig, data)


def _gates_k_panel(right: Any, result: Any, colours: dict[str, Any], data: dict[str, Any]) -> None:
    """`gates_plot`'s right panel: k at each gate's points and at the targets, with the threshold."""
    threshold = float(result.decisions["threshold"].min()) if len(result.decisions) else 1.0
    right.axhline(threshold, color="black", linewidth=0.8, label=f"threshold (k = {threshold:g})")
    for treatment in result.decisions["treatment"].unique():
        looked = result.decisions[(result.decisions["treatment"] == treatment) & result.decisions["point"].notna()]
        colour = colours.get(treatment)
        if len(looked):
            k = looked["k"].to_numpy()
            right.errorbar(looked["point"], k, yerr=[k - looked["k_low"].to_numpy(), looked["k_high"].to_numpy() - k],
                           color=colour, marker="o", linestyle="none", capsize=3, label=f"{treatment}, gates")
        got = result.projections.get(treatment)
        if got is not None:
            right.errorbar(got.compute, got.k, yerr=[got.k - got.k_low, got.k_high - got.k], color=colour,
                           marker="D", linestyle="-", capsize=3, label=f"{treatment}, projected (FLOPs)")
            shown = np.isfinite(got.k_wall)
            if shown.any():
                right.errorbar(got.compute[shown], got.k_wall[shown],
                               yerr=[(got.k_wall - got.k_wall_low)[shown], (got.k_wall_high - got.k_wall)[shown]],
                               color=colour, marker="s", linestyle=":", capsize=3,
                               label=f"{treatment}, projected (wall-clock)")
            data[f"k {treatment}"] = {"target": got.compute, "k": got.k, "low": got.k_low, "high": got.k_high,
                                      "k_wall": got.k_wall, "wall_low": got.k_wall_low, "wall_high": got.k_wall_high}
    right.set_xscale("log")
    right.set_xlabel("training FLOPs per run (the treatment's)")
    right.set_ylabel("compute-equivalent multiplier k")
    right.legend(fontsize="x-small")


def _gate_span(result: Any, gate: int) -> tuple[float, float]:
    """The smallest and largest FLOPs (the control's) of the rungs the gate adds to the earlier gates' (all its
    rungs where it adds none)."""
    earlier = {r for g in result.gate_rungs[:gate] for r in g}
    rungs = [r for r in result.gate_rungs[gate] if r not in earlier] or list(result.gate_rungs[gate])
    flops = next(iter(result.arms.values())).flops[rungs]
    return float(flops.min()), float(flops.max())


def _nanmean(loss: np.ndarray, width: int) -> np.ndarray:
    """Per column the mean of the finite values; NaN where a column has none."""
    finite = np.isfinite(loss)
    count = finite.sum(axis=0) if loss.size else np.zeros(width)
    total = np.where(finite, loss, 0.0).sum(axis=0) if loss.size else np.zeros(width)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def sequence_plot(table: pd.DataFrame, labels: Labels | None = None) -> Plot:
    """A sequential study (`results.sequential.sequential_table`): per row, the mean delta and its
    confidence sequence seed by seed (the band narrows as seeds come), the looks as dots, the stop (the
    look that decided) as a vertical line, 0 and the row's +-bound (margin or MEI) as horizontal lines."""
    rows = table.to_dict("records")
    fig = _figure(6.5, 2.6 * max(1, len(rows)) + 0.6)
    axes = fig.subplots(max(1, len(rows)), 1, squeeze=False)[:, 0]
    data: dict[str, Any] = {}
    for ax, r in zip(axes, rows, strict=False):
        label = _row_label(r, labels) if labels is not None else (
            f"{r['comparison']}: {r['treatment']} - {r['control']}" + (f" [{r['grid_key']}]" if r["grid_key"] else ""))
        seeds = np.array([b[0] for b in r["by_seed"]], dtype=float)
        mean, low, high = (np.array([b[i] for b in r["by_seed"]], dtype=float) for i in (1, 2, 3))
        finite = np.isfinite(low) & np.isfinite(high)
        ax.axhline(0.0, color="black", linewidth=0.8, label=NO_DIFFERENCE)
        if r["bound"]:
            for edge in (-r["bound"], r["bound"]):
                ax.axhline(edge, color="grey", linestyle=":", linewidth=0.8)
        line = ax.plot(seeds, mean, marker=".", label="mean delta")[0]
        ax.fill_between(seeds[finite], low[finite], high[finite], color=line.get_color(), alpha=0.2,
                        label="confidence sequence")
        looks = [p[0] for p in r["path"]]
        ax.scatter(looks, [p[1] for p in r["path"]], color="black", zorder=3, label="looks")
        if r["decision"] != "undecided" and looks:
            ax.axvline(looks[-1], color="tab:red", linewidth=1.0, label=f"stopped: {r['decision']}")
        ax.set_title(label, fontsize="small")
        ax.set_ylabel(f"delta of {r['metric']}")
        ax.legend(fontsize="x-small")
        data[label] = {"seeds": seeds, "mean": mean, "low": low, "high": high, "looks": looks,
                       "decision": r["decision"]}
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1].set_xlabel("seeds (pairs)")
    return Plot("sequence", fig, data)


def cost_plot(points: pd.DataFrame, cost: str, metric: str, *, cost_direction: str, metric_direction: str,
              title: str = "") -> Plot:
    """The loss against a cost, one point per arm: each arm's seeds as small dots, its mean as a labelled
    marker (the cost's geometric mean over its seeds, the mean of the loss: the cost's centre matches the
    ratio rows, the geometric mean of per-seed ratios), and the Pareto front of the arms' means (arms no
    other arm matches or beats on both axes, by each axis's direction) circled and joined in cost order.
    The cost axis is logarithmic when its values span more than `LOG_SPAN` x."""
    if points.empty:
        raise ValueError(f"cost_plot: no run has both {cost} and {metric}")
    arms = list(dict.fromkeys(points["arm"]))
    fig = _figure(6.5, 4.2)
    ax = fig.add_subplot()
    means = {a: (float(np.exp(np.log(g["cost"]).mean())), float(g["loss"].mean()))
             for a, g in points.groupby("arm", sort=False)}
    x = np.array([means[a][0] for a in arms])
    y = np.array([means[a][1] for a in arms])
    front = pareto_front(x, y, cost_direction, metric_direction)
    data: dict[str, Any] = {"arms": {}, "front": [a for a, f in zip(arms, front, strict=True) if f]}
    for i, (arm, xi, yi) in enumerate(zip(arms, x, y, strict=True)):
        seeds = points[points["arm"] == arm]
        colour = f"C{i % 10}"  # matplotlib's default cycle
        ax.scatter(seeds["cost"], seeds["loss"], s=10, alpha=0.5, color=colour)
        ax.scatter([xi], [yi], s=60, color=colour, edgecolors="black", linewidths=0.6, zorder=3)
        ax.annotate(arm, (xi, yi), xytext=(6, 6), textcoords="offset points", fontsize="small")
        data["arms"][arm] = {"cost": seeds["cost"].to_numpy(dtype=float), "loss": seeds["loss"].to_numpy(dtype=float),
                             "mean_cost": xi, "mean_loss": yi}
    order = np.argsort(x[front], kind="stable")
    ax.plot(x[front][order], y[front][order], color="black", linestyle="--", linewidth=1, zorder=2)
    ax.margins(0.1)  # room for the labels beside the outermost arms
    ax.scatter(x[front], y[front], s=180, facecolors="none", edgecolors="tab:red", linewidths=1.5, zorder=4,
               label="Pareto front (not dominated)")
    low, high = float(points["cost"].min()), float(points["cost"].max())
    data["log_x"] = high / low > LOG_SPAN
    if data["log_x"]:
        _log_cost_axis(ax, low, high)
    better = {"minimize": "lower", "maximize": "higher"}
    unit = METRICS[cost].unit if cost in METRICS else ""
    ax.set_xlabel(f"{cost}{f' ({unit})' if unit else ''}, {better[cost_direction]} is better")
    ax.set_ylabel(f"{metric}, {better[metric_direction]} is better")
    if title:
        ax.set_title(title, fontsize="small")
    ax.legend(fontsize="small", loc="best")
    return Plot(f"cost_{cost}", fig, data)


def _drawn_tick_labels(axis: Any) -> list[Any]:
    """The tick labels an axis draws: those of ticks inside its view (matplotlib keeps labels for ticks just
    outside, which it does not draw)."""
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    return [t.label1 for t in ticks if low <= t.get_loc() <= high and t.label1.get_visible()
            and t.label1.get_text().strip()]


def layout_defects(plot: Plot) -> list[str]:
    """What a reader would find wrong with the drawn figure: a text (a label, title, tick label, annotation,
    legend entry) cut by the figure's edge, or two tick labels of one axis drawn over each other. Empty when
    none; the report's plots are held to it (`tests/results/test_plot_layout.py`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = plot.figure
    canvas = FigureCanvasAgg(fig)  # what `savefig` draws a PNG with
    canvas.draw()  # lays out (constrained layout) and places every text as the saved PNG has it
    renderer = canvas.get_renderer()
    page = fig.bbox
    ticks = {id(t): t for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
             for tick in (*axis.get_major_ticks(), *axis.get_minor_ticks()) for t in (tick.label1, tick.label2)}
    drawn = {ax: [_drawn_tick_labels(ax.xaxis), _drawn_tick_labels(ax.yaxis)] for ax in fig.axes}
    found: list[Any] = fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_window_extent"))
    texts = [t for t in found if id(t) not in ticks and t.get_visible() and str(t.get_text()).strip()]
    texts += [t for labels in drawn.values() for axis in labels for t in axis]
    defects = []
    for text in texts:
        box = text.get_window_extent(renderer)
        if box.x0 < page.x0 - 1 or box.x1 > page.x1 + 1 or box.y0 < page.y0 - 1 or box.y1 > page.y1 + 1:
            defects.append(f"{plot.name}: {text.get_text()!r} is cut by the figure's edge")
    for labels in (axis for per_ax in drawn.values() for axis in per_ax):
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i, j in itertools.combinations(range(len(labels)), 2):
            if boxes[i].overlaps(boxes[j]):
                defects.append(f"{plot.name}: tick labels {labels[i].get_text()!r} and {labels[j].get_text()!r} "
                               "overlap")
    return defects
