"""Multi-Gate Residuals (MGR; Zheng et al., arXiv 2605.23259; variants.md section 6).

The equations are a THIRD-PARTY TRANSCRIPTION (swfsql/burn-mamba `src/modules/multi_gate.rs`,
commit 8224caf9, quoting the paper's "Our Architecture"); the paper's own text was not read.

`n` streams `s_1..s_n`, all seeded from the embedding. After each sublayer output `F` (or each
Transformer layer's summed update, knob `per`):

    mixer       beta_i = sigma(w_beta . RMSNorm(s_i) / sqrt(d) + b_beta_i)
                s_i'   = (1 - beta_i) s_i + beta_i F                    (convex)
    aggregator  alpha_i = softmax_i(w_alpha . RMSNorm(s_i') / sqrt(d))
                h      = sum_i alpha_i s_i'                             (the next sublayer's input)

with a parameter-free RMSNorm, `w_beta, w_alpha` zero-initialised and shared across streams, and
`b_beta` per stream. The aggregator is the AttnRes depth read over the streams (query
`w_alpha / sqrt(d)`, unit key gain), so it runs through `kernels.depth_read`.

Init (section 6.2 is garbled in transcription; this is its stated intent): base update rate
`sigma(b_base) * sqrt(L_base / M)` with `b_base = -3`, `L_base = 21` and `M` the number of MGR
modules in the model (2L per sublayer, L per layer; the transcription scales with the depth L
and the Rust port has one module per layer, so the module count is read as the depth).

Symmetry breaking: identical seeds, shared `w` and equal biases keep the streams identical
forever (their gradients are identical too), so the per-stream biases are spread
deterministically around the base logit, `b_beta_i = logit(rate) + bias_spread * o_i` with
`o = linspace(-1, 1, n)`: the streams become exponential averages of the updates at different
rates (a multi-timescale reading; how the paper breaks symmetry is unknown). No randomness is
used, so the backbone init of a seed is the same as in every other arm.

Interventions (`models.interventions`): the aggregator computed after site k is what site k + 1 reads
(2L: the final readout; with per="layer" the pool after layer l is read by layer l + 1's attention
and, plus that attention's output, its MLP, so it is named by the attention's site). "source"
removes stream "stream<i>" from one such read, "stream" from every one: "zero" drops it from the
softmax (the other alphas renormalise; without streams left the read is zero), "mean" replaces it
by its mean over the eval windows and computes its alpha from that mean. "gate" pins every
stream's beta of the module at a site (per="layer": the MLP's site; or every module) to 1 ("open":
every stream becomes F) or 0 ("closed": the streams ignore F).

Parameters: `w_beta` (d), `w_alpha` (d), `b_beta` (n) per module, plain vectors (not decayed);
`2d + n` per module, `4d + 2n` per layer with `per="sublayer"`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read
from reslab.models.layers import rms_norm
from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway

L_BASE = 21
B_BASE = -3.0


@dataclass
class MGRState:
    streams: Tensor               # [n, B, T, D]
    h: Tensor                     # [B, T, D] pooled streams: the next sublayer's input
    pending: Tensor | None = None  # per="layer": the attention output awaiting its MLP


@register("mgr")
class MultiGateResiduals(ResidualPathway):
    """Knobs:
        streams: number of parallel streams n. Default: 4.
        per: "sublayer" (one MGR module after every attention and every MLP, F = the sublayer
            output; the recommendation of variants.md 6.3) or "layer" (one per Transformer layer,
            F = attention output + MLP output, with the standard residual inside the layer: the
            MLP reads h + attention output). Default: "sublayer".
        gate_init: "depth_scaled" (base update rate sigma(-3) * sqrt(21 / M), M = number of MGR
            modules) or a float: the base update rate itself, in (0, 1). Default: "depth_scaled".
        bias_spread: per-stream offsets of the gate bias, bias_spread * linspace(-1, 1, n) in
            logit space (the symmetry breaking; 0 keeps the streams identical forever).
            Default: 0.5 (n=4, per="sublayer" at gpt2-124m: rates 0.027, 0.038, 0.052, 0.071
            around the base 0.044).
        gate_type: "sigmoid" (independent gates, the transcribed equations) or "softmax" (the
            paper's "competitive" gate as read here: beta = softmax over the streams of the same
            scores, so the rates sum to 1 and the streams compete for the update; the softmax is
            shift-invariant, so gate_init has no effect and the initial rates are
            softmax(bias_spread * o), 1/n each at bias_spread=0). Default: "sigmoid".
    """

    identities = ()  # the gates mix every update in from step 0; no paper identity at init
    intervention_kinds = ("source", "stream", "gate")

    unit_gain: Tensor  # a non-persistent buffer, registered in __init__

    @dataclass(frozen=True, kw_only=True)
    class Config:
        streams: int = 4
        per: Literal["sublayer", "layer"] = "sublayer"
        gate_init: Literal["depth_scaled"] | float = "depth_scaled"
        bias_spread: float = 0.5
        gate_type: Literal["sigmoid", "softmax"] = "sigmoid"

        def __post_init__(self):
            if self.streams < 1:
                raise ValueError(f"streams must be >= 1, got {self.streams}")
            if not isinstance(self.gate_init, str) and not 0.0 < self.gate_init < 1.0:
                raise ValueError(f"gate_init must be 'depth_scaled' or a rate in (0, 1), got {self.gate_init}")
            if self.bias_spread < 0:
                raise ValueError(f"bias_spread must be >= 0, got {self.bias_spread}")

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d, n = shape.d_model, config.streams
        self.n_modules = shape.n_sites if config.per == "sublayer" else shape.n_layers
        self.w_beta = nn.Parameter(torch.zeros(self.n_modules, d))
        self.w_alpha = nn.Parameter(torch.zeros(self.n_modules, d))
        self.b_beta = nn.Parameter(self.initial_bias().expand(self.n_modules, n).clone())
        # the aggregator's RMSNorm is parameter-free: a constant unit gain, not a parameter
        self.register_buffer("unit_gain", torch.ones(d), persistent=False)

    def base_rate(self) -> float:
        if self.config.gate_init == "depth_scaled":
            return 1.0 / (1.0 + math.exp(-B_BASE)) * math.sqrt(L_BASE / self.n_modules)
        return float(self.config.gate_init)

    def initial_bias(self) -> Tensor:
        rate = self.base_rate()
        offsets = torch.linspace(-1.0, 1.0, self.config.streams) if self.config.streams > 1 else torch.zeros(1)
        return math.log(rate / (1.0 - rate)) + self.config.bias_spread * offsets      # [n]

    def module_index(self, site: int) -> int:
        return site if self.config.per == "sublayer" else site // 2

    def start(self, embedding: Tensor) -> MGRState:
        n = self.config.streams
        return MGRState(streams=embedding.unsqueeze(0).expand(n, *embedding.shape), h=embedding)

    def sublayer_input(self, state: MGRState, site: int) -> Tensor:
        return state.h if state.pending is None else state.h + state.pending

    def update(self, state: MGRState, site: int, output: Tensor) -> MGRState:
        if self.config.per == "layer":
            if site % 2 == 0:
                return replace(state, pending=output)
            if state.pending is None:
                raise RuntimeError(f"mgr: update({site}) of an MLP with no attention output pending (per='layer')")
            output = state.pending + output
        m = self.module_index(site)
        d = self.shape.d_model
        s = state.streams                                                          # [n, B, T, D]
        score = (rms_norm(s, self.shape.norm_eps) * self.w_beta[m]).sum(-1, keepdim=True) / math.sqrt(d)
        score = score + self.b_beta[m].view(-1, 1, 1, 1)                           # [n, B, T, 1]
        beta = torch.sigmoid(score) if self.config.gate_type == "sigmoid" else torch.softmax(score, dim=0)
        pin = self.gate_pin(site)
        streams = s + (beta if pin is None else pin) * (output.unsqueeze(0) - s)   # [n, B, T, D]
        return MGRState(streams=streams, h=self.pool(streams, site))

    def pool(self, streams: Tensor, site: int) -> Tensor:
        """The aggregator after the module of `site`: h, the pooled read of the streams [n, B, T, D]."""
        m, d = self.module_index(site), self.shape.d_model
        values = list(streams.unbind(0))
        if self.intervention is not None:
            _, values, _ = self.softmax_sources(site + 1, self.stream_labels(), values)
            if not values:  # every stream removed: the read of nothing
                return torch.zeros_like(streams[0])
        h, alpha = depth_read(
            values, self.w_alpha[m] / math.sqrt(d), self.unit_gain,
            heads=1, eps=self.shape.norm_eps, impl=self.impl,
        )                                                                          # [B,T,D], [n,B,T,1]
        self.record(site, alpha, route="pool")
        return h

    def stage_send(self, state: MGRState, site: int) -> tuple[Tensor, ...]:
        """The n streams alone: the next stage pools them itself (`pool` of the module before `site`; its
        w_alpha row's gradient then comes from that stage). A boundary is a layer boundary: nothing pending."""
        return (state.streams,)

    def stage_receive(self, tensors: Sequence[Tensor], site: int) -> MGRState:
        (streams,) = tensors
        return MGRState(streams=streams, h=self.pool(streams, site - 1))

    def source_labels(self, site: int) -> list[str]:
        """The streams, at every site that reads a pool (the site after a module's; see the docstring)."""
        reads_pool = site >= 1 if self.config.per == "sublayer" else site >= 2 and site % 2 == 0
        return self.stream_labels() if reads_pool else []

    def stream_labels(self) -> list[str]:
        return [f"stream{i}" for i in range(self.config.streams)]

    def gate_sites(self) -> list[int]:
        """The sites whose update runs a module: every site per sublayer, the MLP sites per layer."""
        sites = self.shape.n_sites
        return list(range(sites)) if self.config.per == "sublayer" else list(range(1, sites, 2))

    def decode_state_elems(self) -> tuple[int, int]:
        """((n + 1) d, 0): the n streams and their pooled read h."""
        return (self.config.streams + 1) * self.shape.d_model, 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """(n d, 0): the n streams (`stage_send`; the next stage recomputes their pooled read h)."""
        return self.config.streams * self.shape.d_model, 0

    def readout(self, state: MGRState) -> Tensor:
        return state.h

    def stream(self, state: MGRState) -> Tensor:
        """The pooled streams h (what the next sublayer reads)."""
        return state.h
