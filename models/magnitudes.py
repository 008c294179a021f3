"""Activation and gradient magnitudes across depth (issue 36): what a run records at every evaluation
with `train.magnitudes` (default on), and the run summaries made of them.

Per sublayer site s (0..2L-1; even: attention, odd: MLP), on the evaluation windows:

- `in_rms[s]`: the RMS of what the sublayer reads, `pathway.sublayer_input(state, s)`, before its
  pre-norm (prenorm: the residual stream after s sublayers; AttnRes: the routed read), over every
  token and channel of every eval window: sqrt(sum x^2 / count), the windows pooled;
- `out_rms[s]`: the same of the sublayer's output u (what `pathway.update` writes back);
- `layer_out_rms[l]`: Transformer layer l's output RMS, its two sublayers' outputs pooled,
  sqrt((sum u_attn^2 + sum u_mlp^2) / (2 count)).

From the last training step before the evaluation (the whole step's gradient: every micro-batch
accumulated and, with ranks, averaged; before clipping), per site the L2 norm of the gradient of the
sublayer's own parameters (`grad_norm[s]`, its pre-norm's weight excluded), and per layer
`layer_grad_norm[l]` = sqrt of the sum of squares over its two sublayers and their two pre-norms.
The residual pathway's own parameters (pseudo-queries, gates) are left out: they differ between
variants, the backbone does not.

Summaries (`common.metrics`), from the last evaluation:

- `growth` = layer_out_rms[L-1] / layer_out_rms[0]: the output magnitude of the last Transformer
  layer over the first's. This is the quantity of Kimi's "output magnitude" figure (AttnRes,
  arXiv 2603.15031, training dynamics: per block, the magnitude of what the layer writes; under
  PreNorm deeper layers must write ever larger outputs to keep their share of a growing stream,
  "dilution"), and MGR's "activation growth" is its cause: the stream each layer reads grows, which
  `in_rms` shows beside it. A ratio of outputs, not of streams: the stream's first value is the
  embedding (init std 0.02), so a ratio of streams would measure the embedding's scale.
- `stream_growth` = in_rms[2L-1] / in_rms[2]: what the last sublayer reads over what the second
  layer's attention reads (the state after one whole layer, past the embedding's scale); the
  magnitude of the hidden state across depth, the other half of "dilution" (prenorm: the stream;
  AttnRes: its routed read). NaN with one layer.
- `grad_cv` = SD / mean of the L per-layer gradient norms (population SD, ddof 0: the L layers are
  the whole population, not a sample): 0 when every layer's gradient is as large as every other's
  (Kimi's "more uniform gradient distribution"), larger when some layers get most of it.
- `route_max_late`: the mean per-token max depth weight (`RoutingRecorder`'s `max_weight`) over the
  multi-source routing sites in the last third of the depth, sites s >= 4L/3 of 0..2L (2L is the
  readout), every route; DAR's and Delta AttnRes's collapse (max weight near uniform, about 0.2)
  against sharp routing (about 0.6). Absent for a variant that does not route.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MagnitudeRecorder", "grad_square_sums", "magnitude_record", "route_max_late", "summary_of"]


def _sq(t: Tensor) -> Tensor:
    """sum t^2 in float32 (bf16 activations too) without a float32 copy of t."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32).square()


class MagnitudeRecorder:
    """Sums of squares of each site's read and output over the forward passes it sees, while it is a
    `Decoder`'s `magnitudes` (the backbone calls `add` after each sublayer). `sums` [3, sites]: input
    squares, output squares, element count, in float64 on the model's device, so ranks all-reduce it
    as one tensor and nothing syncs with the host while it records."""

    def __init__(self, sites: int, device: torch.device | str = "cpu") -> None:
        self.sums = torch.zeros(3, sites, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, site: int, x: Tensor, out: Tensor) -> None:
        self.sums[0, site] += _sq(x)
        self.sums[1, site] += _sq(out)
        self.sums[2, site] += x.numel()

    def rms(self) -> tuple[list[float], list[float], list[float]]:
        """(in_rms per site, out_rms per site, layer_out_rms per layer); NaN where nothing was recorded."""
        s = self.sums.detach().cpu().tolist()
        count = s[2]
        in_rms = [math.sqrt(a / c) if c else math.nan for a, c in zip(s[0], count, strict=True)]
        out_rms = [math.sqrt(a / c) if c else math.nan for a, c in zip(s[1], count, strict=True)]
        layers = []
        for layer in range(len(count) // 2):
            a, m = 2 * layer, 2 * layer + 1
            c = count[a] + count[m]
            layers.append(math.sqrt((s[1][a] + s[1][m]) / c) if c else math.nan)
        return in_rms, out_rms, layers


def grad_square_sums(sublayers: Sequence[nn.Module], norms: Sequence[nn.Module]) -> Tensor:
    """Per site, the sum of squares of the gradient of the sublayer's parameters, then of its pre-norm's:
    [2, sites] float64. Under FSDP a gradient is a DTensor shard: its local part is summed here, and the
    caller all-reduces the result over the ranks (DDP's gradients are whole and already averaged)."""
    device = next(iter(sublayers[0].parameters())).device
    sums = torch.zeros(2, len(sublayers), dtype=torch.float64, device=device)
    for row, group in enumerate((sublayers, norms)):
        for site, module in enumerate(group):
            for p in module.parameters():
                if p.grad is not None:
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    sums[row, site] += _sq(local)
    return sums


def _cv(values: Sequence[float]) -> float:
    """SD (ddof 0) / mean; NaN for no values or a zero mean."""
    if not values:
        return math.nan
    mean = sum(values) / len(values)
    if mean == 0:
        return math.nan
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / mean


def route_max_late(routing: dict[str, Any] | None, n_layers: int) -> float | None:
    """The mean max weight over the multi-source routing sites with site >= 4L/3 (module docstring), from a
    `models.diagnostics.routing_summary`; None without routing or without such a site."""
    sites = [s for s in (routing or {}).get("sites", []) if s["sources"] >= 2 and 3 * s["site"] >= 4 * n_layers]
    return sum(s["max_weight"] for s in sites) / len(sites) if sites else None


def _key(kind: str, prefix: str, i: int, n: int) -> str:
    return f"mag/{kind}/{prefix}{i:0{max(2, len(str(n - 1)))}d}"


def magnitude_record(recorder: MagnitudeRecorder,
                     grad_sums: Tensor | None) -> tuple[dict[str, Any], dict[str, float]]:
    """One evaluation's magnitudes: (the diagnostics record's "magnitudes" entry, flat scalars for the metrics
    log: `mag/in_rms/sNN`, `mag/out_rms/sNN`, `mag/out_rms/lNN`, `mag/grad_norm/sNN`, `mag/grad_norm/lNN`,
    `mag/growth`, `mag/stream_growth`, `mag/grad_cv`). `grad_sums`: `grad_square_sums` of the step before, summed
    over ranks."""
    in_rms, out_rms, layer_out = recorder.rms()
    record: dict[str, Any] = {"in_rms": in_rms, "out_rms": out_rms, "layer_out_rms": layer_out,
                              "grad_norm": None, "layer_grad_norm": None}
    if grad_sums is not None:
        sq = grad_sums.detach().cpu().tolist()
        record["grad_norm"] = [math.sqrt(v) for v in sq[0]]
        record["layer_grad_norm"] = [math.sqrt(sq[0][2 * i] + sq[0][2 * i + 1] + sq[1][2 * i] + sq[1][2 * i + 1])
                                     for i in range(len(sq[0]) // 2)]
    record["growth"] = layer_out[-1] / layer_out[0] if layer_out and layer_out[0] > 0 else math.nan
    record["stream_growth"] = in_rms[-1] / in_rms[2] if len(in_rms) > 2 and in_rms[2] > 0 else math.nan
    record["grad_cv"] = _cv(record["layer_grad_norm"]) if record["layer_grad_norm"] else math.nan
    scalars: dict[str, float] = {}
    series = (("in_rms", "s", in_rms), ("out_rms", "s", out_rms), ("out_rms", "l", layer_out),
              ("grad_norm", "s", record["grad_norm"] or []), ("grad_norm", "l", record["layer_grad_norm"] or []))
    for kind, prefix, values in series:
        scalars.update({_key(kind, prefix, i, len(values)): v for i, v in enumerate(values)})
    scalars.update({"mag/growth": record["growth"], "mag/stream_growth": record["stream_growth"],
                    "mag/grad_cv": record["grad_cv"]})
    return record, {k: v for k, v in scalars.items() if math.isfinite(v)}


# summary metric -> the last evaluation's metric it is read from
_SUMMARY_KEYS = {"growth": "mag/growth", "stream_growth": "mag/stream_growth",
                 "grad_cv": "mag/grad_cv", "route_max_late": "route_max_late"}


def summary_of(last_eval: dict[str, Any]) -> dict[str, float]:
    """The mechanism summaries (`common.metrics.MECHANISM_METRICS`) a run recorded at its last evaluation;
    a summary it could not compute (no magnitudes, no routing) is absent, so the runs table reads NaN."""
    out = {}
    for name, key in _SUMMARY_KEYS.items():
        value = last_eval.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = float(value)
    return out

