"""Evaluation-time diagnostics: effective depth, cross-stream similarity, routing heatmaps.

Effective depth (variants.md section 10; Gahtan, Galil, Bronstein, arXiv 2609.31098): mean-pool the
residual stream after each Transformer layer over positions (embedding excluded) for a fixed set of
N validation passages, H_l in R^{N x d}; compare the layers with column-centred linear CKA in
float64,
    C_ij = ||H_i^T H_j||_F^2 / (||H_i^T H_i||_F ||H_j^T H_j||_F);
read the lag profile rho(k) = mean_i C_{i,i+k} and treat depth as a time series:
    D_eff = L / (1 + 2 sum_{k=1}^{K} (1 - k/L) rho(k)),  Bartlett taper, K = L - 1 by default,
which with K = L - 1 is the participation ratio L^2 / sum_ij C_ij. The reference for mutually
orthogonal, equal-norm, isotropic updates without a persistent h_0 is C_ij = min(i,j)/max(i,j),
F_L = 2L/(L+1); the logged gap is 1 - D_eff/F_L (positive: updates more correlated than that).
The paper's plug-in CKA needs N >> d (it used 10,000 passages); at the logged sample size
(`train.deff_passages`, 64 by default) it reads nearly every layer pair as similar, so D_eff is
logged from the debiased CKA (unbiased HSIC, `models.cka.linear_cka_matrix`), and the plug-in
estimator is `train.deff_cka: biased`.

Routing concentration (`routing_diagnostics`): per site, 1 - H/ln N of the depth weights over its
N sources, None at one-source sites; summaries and the per-layer profile cover multi-source sites.

`collect_diagnostics` bundles everything logged at an evaluation: the routing summary, effective
depth and what the pathway reports through its `diagnostics` hook (DAR's cross-stream similarity,
RD-AttnRes's QK/V Jensen-Shannon divergence), plus the flat scalars for the metrics log.
Everything it returns is JSON-serialisable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from reslab.models.cka import linear_cka_matrix
from reslab.models.residual.base import RoutingRecorder

DPI = 100


# ----------------------------------------------------------------------------- D_eff


def effective_depth(cka: Tensor, lag: int | None = None) -> dict[str, Any]:
    """D_eff of an [L, L] layer-similarity matrix with a Bartlett taper up to lag K (L-1 if None)."""
    if cka.ndim != 2 or cka.shape[0] != cka.shape[1]:
        raise ValueError(f"effective_depth: expected a square [L, L] matrix, got {tuple(cka.shape)}")
    c = cka.to(torch.float64)
    num_layers = c.shape[0]
    max_lag = num_layers - 1 if lag is None else lag
    if max_lag < 0:
        raise ValueError(f"effective_depth: lag must be >= 0, got {lag}")
    max_lag = min(max_lag, num_layers - 1)
    profile = [float(c.diagonal(k).mean()) for k in range(num_layers)]              # rho(0..L-1)
    tail = sum((1 - k / num_layers) * profile[k] for k in range(1, max_lag + 1))
    d_eff = num_layers / (1 + 2 * tail)
    f_l = 2 * num_layers / (num_layers + 1)
    return {"d_eff": d_eff, "f_l": f_l, "gap": 1 - d_eff / f_l, "lag_profile": profile,
            "layers": num_layers, "lag": max_lag}


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def pooled_layer_streams(model, passages: Sequence[Tensor]) -> list[Tensor]:
    """Per layer, the stream mean-pooled over positions for every passage: L tensors [N, D], float64."""
    was_training = model.training
    model.eval()
    device = _model_device(model)
    chunks: list[list[Tensor]] = []
    try:
        for idx in passages:
            streams = model.layer_streams(idx.to(device))                            # L x [B, T, D]
            chunks.append([s.to(torch.float64).mean(1) for s in streams])            # L x [B, D]
    finally:
        model.train(was_training)
    return [torch.cat(per_layer).cpu() for per_layer in zip(*chunks, strict=True)]


def effective_depth_of_model(
    model, passages: Sequence[Tensor], *, lag: int | None = None, debiased: bool = True,
) -> dict[str, Any]:
    """Effective depth of `model` on token batches `passages` ([B, T] each; keep them fixed across
    checkpoints), from `linear_cka_matrix(..., debiased=debiased)`. Adds the CKA matrix ("cka"),
    the passage count ("passages") and the estimator ("cka_estimator": "debiased" or "biased")."""
    if not passages:
        raise ValueError("effective_depth_of_model: no passages")
    pooled = pooled_layer_streams(model, passages)                                   # L x [N, D]
    cka = linear_cka_matrix(pooled, debiased=debiased)
    return {**effective_depth(cka, lag), "cka": cka.tolist(), "passages": pooled[0].shape[0],
            "cka_estimator": "debiased" if debiased else "biased"}


# ----------------------------------------------------------------------------- routing matrices and plots


def _routing_part(diagnostics: dict[str, Any]) -> dict[str, Any]:
    """Accept either a `routing_diagnostics` dict or a `collect_diagnostics` dict."""
    if "sites" not in diagnostics and isinstance(diagnostics.get("routing"), dict):
        return diagnostics["routing"]
    return diagnostics


def _infer_layers(sites: list[dict[str, Any]]) -> int:
    """L from the recorded site numbers (all routes together)."""
    top = max(s["site"] for s in sites)
    # the last sublayer (MLP of layer L) is the odd site 2L-1; an even top site is the readout 2L
    return (top + 1) // 2 if top % 2 else top // 2


def site_label(site: int, n_layers: int) -> str:
    if site >= 2 * n_layers:
        return "readout"
    return f"{'attn' if site % 2 == 0 else 'mlp'} {site // 2 + 1}"


def source_labels(n: int) -> list[str]:
    """Depth sources: the embedding, then one per sublayer or block, numbered from 1."""
    return ["emb"] + [str(i) for i in range(1, n)]


def routes_of(diagnostics: dict[str, Any]) -> list[str]:
    return sorted({s["route"] for s in _routing_part(diagnostics).get("sites", [])})


def routing_matrix(
    diagnostics: dict[str, Any], route: str = "", n_layers: int | None = None,
) -> tuple[np.ndarray, list[str]]:
    """The depth x depth matrix of one route: [sites, max_sources], NaN where a site has fewer
    sources, and the row labels ("attn l" / "mlp l" / "readout").

    L comes from `n_layers`, else the dict's "n_layers", else the recorded site numbers.
    """
    routing = _routing_part(diagnostics)
    all_sites = routing.get("sites", [])
    rows = sorted((s for s in all_sites if s["route"] == route), key=lambda s: s["site"])
    if not rows:
        raise ValueError(f"routing_matrix: no sites for route {route!r}; recorded routes: {routes_of(routing)}")
    layers = n_layers or routing.get("n_layers") or _infer_layers(all_sites)
    width = max(len(s["weights"]) for s in rows)
    matrix = np.full((len(rows), width), np.nan)
    for r, s in enumerate(rows):
        matrix[r, : len(s["weights"])] = s["weights"]
    return matrix, [site_label(s["site"], layers) for s in rows]


def heatmap_figsize(n_rows: int, n_cols: int) -> tuple[float, float]:
    """Figure size in inches of a routing heatmap (pixels: times `DPI`)."""
    return max(4.5, 0.45 * n_cols + 2.5), max(3.0, 0.32 * n_rows + 1.6)


def _figure(figsize: tuple[float, float]):
    # a bare Figure renders PNGs through Agg without pyplot: no global backend switch, no
    # figure registry to leak in long-running workers
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, dpi=DPI, layout="constrained")


def _route_path(path: Path, route: str) -> Path:
    return path if not route else path.with_name(f"{path.stem}_{route}{path.suffix or '.png'}")


def render_routing_heatmap(diagnostics: dict[str, Any], path: str | Path, title: str) -> list[Path]:
    """One PNG per recorded route: `path` for the unnamed route, `<stem>_<route>.png` for others.
    Returns the written paths (none when nothing was recorded)."""
    routing = _routing_part(diagnostics)
    if not routing.get("sites"):
        return []
    from matplotlib import colormaps

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmap = colormaps["viridis"].with_extremes(bad="#dddddd")
    written = []
    for route in routes_of(routing):
        matrix, rows = routing_matrix(routing, route)
        n_rows, n_cols = matrix.shape
        fig = _figure(heatmap_figsize(n_rows, n_cols))
        ax = fig.subplots()
        top = float(np.nanmax(matrix)) if np.isfinite(matrix).any() else 1.0
        image = ax.imshow(np.ma.masked_invalid(matrix), cmap=cmap, vmin=0.0, vmax=max(top, 1e-6), aspect="auto")
        ax.set_xticks(range(n_cols), source_labels(n_cols), fontsize=7)
        ax.set_yticks(range(n_rows), rows, fontsize=7)
        ax.set_xlabel("source")
        ax.set_ylabel("routing site")
        ax.set_title(title if not route else f"{title} [{route}]", fontsize=9)
        fig.colorbar(image, ax=ax, label="depth weight (token mean)")
        if n_rows * n_cols <= 400:
            for r in range(n_rows):
                for c in range(n_cols):
                    if np.isfinite(matrix[r, c]):
                        ax.text(c, r, f"{matrix[r, c]:.2f}", ha="center", va="center", fontsize=6,
                                color="black" if matrix[r, c] > 0.6 * top else "white")
        out = _route_path(path, route)
        fig.savefig(out, dpi=DPI)
        written.append(out)
    return written


def plot_entropy(diagnostics: dict[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Per-site bars of the routing entropy (with the uniform bound ln n) and the max weight."""
    routing = _routing_part(diagnostics)
    sites = routing.get("sites")
    if not sites:
        return None
    layers = routing.get("n_layers") or _infer_layers(sites)
    ordered = sorted(sites, key=lambda s: (s["site"], s["route"]))
    labels = [site_label(s["site"], layers) + (f" [{s['route']}]" if s["route"] else "") for s in ordered]
    x = np.arange(len(ordered))
    fig = _figure((max(5.0, 0.3 * len(ordered) + 2), 5.0))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(x, [s["entropy"] for s in ordered], color="tab:blue")
    top.scatter(x, [math.log(len(s["weights"])) for s in ordered], marker="_", s=120, color="black",
                label="ln(sources)", zorder=3)
    top.set_ylabel("entropy (nats)")
    top.legend(fontsize=7, loc="upper left")
    bottom.bar(x, [s["max_weight"] for s in ordered], color="tab:orange")
    bottom.set_ylabel("max weight")
    bottom.set_ylim(0, 1)
    bottom.set_xticks(x, labels, rotation=90, fontsize=7)
    if title:
        top.set_title(title, fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    return path


# ----------------------------------------------------------------------------- everything at one evaluation


def concentration(entropy: float, n_sources: int) -> float | None:
    """Routing concentration of a site, 1 - H / ln N in [0, 1]: 0 is the uniform read over its N
    sources, 1 a single source per token. H is the mean per-token entropy (head-averaged), so the
    value compares sites with different source counts. None for one-source sites, where every
    read is that source and the concentration says nothing about the router."""
    return None if n_sources < 2 else 1.0 - entropy / math.log(n_sources)


def routing_diagnostics(model, idx: Tensor) -> dict[str, Any]:
    """Depth x depth routing matrix (rows: sites, 2L is the readout), per-site entropy, max weight
    and concentration (`concentration`), from one recorded forward pass on `idx`; {} for variants
    that do not route.

    The summaries cover only multi-source sites (site 0 of AttnRes reads the embedding alone with
    weight 1, which would pull a mean towards 1 by source count, not by routing):
    "concentration_mean", "entropy_mean" (nats) and "max_weight_mean" over them, and the depth
    profile "concentration_by_layer": per Transformer layer (then the readout), the mean
    concentration of its multi-source sites and routes, None where it has none.
    """
    return routing_summary(model.routing_stats(idx), model.shape.n_layers)


def routing_summary(recorder: RoutingRecorder, n_layers: int) -> dict[str, Any]:
    """`routing_diagnostics` of a recorded pass (`Decoder.routing_stats`, `Decoder.recorded_pass`)."""
    if not recorder.sites:
        return {}
    sites: list[dict[str, Any]] = []
    for (site, route), stats in sorted(recorder.sites.items()):
        n_sources = int(stats.weight_sum.shape[0])
        sites.append({
            "site": site, "route": route, "weights": stats.weights.tolist(),
            "head_weights": stats.head_weights.tolist(), "sources": n_sources,
            "entropy": stats.entropy, "max_weight": stats.max_weight,
            "concentration": concentration(stats.entropy, n_sources),
        })
    multi = [s for s in sites if s["concentration"] is not None]
    by_layer: list[list[float]] = [[] for _ in range(n_layers + 1)]
    for s in multi:
        by_layer[min(s["site"] // 2, n_layers)].append(s["concentration"])
    out: dict[str, Any] = {
        "sites": sites, "n_layers": n_layers,
        "concentration_by_layer": [sum(v) / len(v) if v else None for v in by_layer],
    }
    if multi:
        out["concentration_mean"] = sum(s["concentration"] for s in multi) / len(multi)
        out["entropy_mean"] = sum(s["entropy"] for s in multi) / len(multi)
        out["max_weight_mean"] = sum(s["max_weight"] for s in multi) / len(multi)
    return out


def _batch_tokens(batch: Any) -> Tensor:
    """Token ids of one validation batch: an (x, y) pair or x itself, [B, T]."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def fixed_passages(val_batches: Sequence[Any], count: int) -> list[Tensor]:
    """The first `count` passages of the validation batches (batch dim flattened), re-chunked to
    the first batch's size so memory stays that of one evaluation batch."""
    first = _batch_tokens(val_batches[0])
    rows = torch.cat([_batch_tokens(b) for b in val_batches])[:count]              # [N, T]
    return list(rows.split(first.shape[0]))


def collect_diagnostics(
    model, val_batches: Sequence[Any], *, deff_passages: int = 64, deff_debiased: bool = True,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Diagnostics of one evaluation: (structured dict, flat scalar metrics).

    Runs in eval mode (restored afterwards) and without gradients; uses no RNG.
    Structured: "routing" (`routing_diagnostics` on the first batch; {} for variants that do
    not route), "effective_depth" (`effective_depth_of_model` on the first `deff_passages`
    validation passages with the debiased or plug-in CKA; None with fewer than 4 (2 plug-in)),
    and whatever the pathway's own `diagnostics` hook reports on the first batch (DAR:
    "cross_stream_similarity" and its per-layer "cross_stream_similarity_layers"; RD-AttnRes:
    "js_divergence" {site: nats} and "rd_js_mean").
    Scalars: d_eff, d_eff_gap, routing_concentration, routing_entropy, routing_max_weight (the
    last three over multi-source sites, see `routing_diagnostics`), and every float the
    pathway's hook reports, each only when defined.
    """
    was_training = model.training
    model.eval()
    try:
        return _collect(model, val_batches, deff_passages, deff_debiased)
    finally:
        model.train(was_training)


def _collect(
    model, val_batches: Sequence[Any], deff_passages: int, deff_debiased: bool,
) -> tuple[dict[str, Any], dict[str, float]]:
    idx = _batch_tokens(val_batches[0]).to(_model_device(model))
    diagnostics: dict[str, Any] = {}
    scalars: dict[str, float] = {}

    states, recorder = model.recorded_pass(idx)
    routing = routing_summary(recorder, model.shape.n_layers)
    if "concentration_mean" in routing:
        scalars["routing_concentration"] = routing["concentration_mean"]
        scalars["routing_entropy"] = routing["entropy_mean"]
        scalars["routing_max_weight"] = routing["max_weight_mean"]
    diagnostics["routing"] = routing

    passages = fixed_passages(val_batches, deff_passages)
    depth = None
    if sum(p.shape[0] for p in passages) >= (4 if deff_debiased else 2):
        depth = effective_depth_of_model(model, passages, debiased=deff_debiased)
        scalars["d_eff"] = depth["d_eff"]
        scalars["d_eff_gap"] = depth["gap"]
    diagnostics["effective_depth"] = depth

    for name, value in model.pathway.diagnostics(states, recorder).items():
        diagnostics[name] = value
        if isinstance(value, float):
            scalars[name] = value
    return diagnostics, scalars
