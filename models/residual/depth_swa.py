"""Depth sliding-window read (Residual Stream Duality, https://arxiv.org/abs/2603.16039; variants.md 9 and 1.5).

An AttnRes read (replacement routing, sources e, f_1, ..., f_k) restricted to a causal window
over depth: the last `window` sources, plus the embedding pinned in front when
`include_embedding` and the window has slid past it. Kimi's ablation "Sliding window W=8 plus
embedding" (1.764 against Full AttnRes 1.737 and the baseline 1.766) is the default. The final
readout route (site 2L) reads the same window over all 2L+1 sources. With window >= 2L+1 every
read covers every source and the model is `attnres` exactly.

`query="static"`: Kimi's read over the window (zero-init pseudo-query per site, RMSNorm keys
with a learnable gain, no temperature), through `kernels.depth_read`. `query="projected"`: the
duality note's depth attention over the window W = [s_i]:

    q = W_Q RMSNorm(s_newest),  k_i = W_K RMSNorm(s_i),  a = softmax_i(q . k_i / sqrt(d_k)),
    out = W_V sum_i a_i s_i   (= sum_i a_i W_V s_i)

with bias-free nn.Linear projections per site (decayed like every matrix), parameter-free
RMSNorms (a gain would be absorbed by W_Q and W_K), and the query read from the newest depth
state in the window, the note's h^(l). W_Q is zero-initialised so the read starts uniform; W_V
starts as the identity so the projected read starts equal to the static zero-query read; W_K is
N(0, init_std^2) from a private generator seeded with a constant plus the site index (the
backbone's init is untouched). The logits are computed as RMSNorm(s_i) . (W_K^T q) / sqrt(d_k),
the same number without materialising the keys. The static queries and key gains of `attnres`
are unused in this mode and are registered as None (no parameters).

At init a zero query makes every read the mean of its window; with a window shorter than the
depth that mean is not proportional to the pre-norm stream, so `depth_swa` is `prenorm`'s
function at init only when window >= 2L+1. `stream_scale` (attnres's knob, default True)
multiplies both modes' reads by the number of sources in the window (W_V is linear, so before
or after it is the same): a full window then reads the pre-norm stream itself at init, at any
RMSNorm eps; a short one reads the sum of its window.

Interventions (`models.interventions`): as `attnres`'s, over the sources in a site's window only
("emb" when the window or `include_embedding` holds it, "s3", ...): "zero" drops one from the window's
softmax, "mean" replaces it by its mean; `stream_scale` counts the sources read. The projected query
reads the window's unmodified newest state.

Depth weights are recorded over the full source axis (zeros outside the window) so the
diagnostics' rows line up with `attnres`.

Parameters: "static" as `attnres` (2d per route, 2L+1 routes); "projected" 2L (2 d d_k) for
W_Q and W_K (site 0 reads the embedding alone and has none) plus (2L+1) d^2 for W_V
(`value_proj`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read
from reslab.models.layers import rms_norm, zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import Identity, private_generator

# private generator seed for the projected mode's W_K: constant + site index
_KEY_INIT_SEED = 0x5357_0000


@register("depth_swa")
class DepthSWA(AttnRes):
    """Knobs (plus those of `attnres`; `query_init` must stay "zero" with query="projected"):
        window: K, the number of most recent depth sources each read sees. Default: 8.
        include_embedding: always read the embedding too, even once the window has slid past
            it (Kimi's "W=8 plus embedding"). Default: True.
        query: "static" (AttnRes pseudo-query and RMSNorm keys) or "projected" (W_Q, W_K, W_V
            depth attention with 1/sqrt(d_k); W_Q zero-init, W_V identity-init). Default: "static".
        key_dim: d_k of the projected mode. Default: 64.
        value_proj: apply W_V (d x d) to the projected read; False keeps the raw sources as
            values. Default: True.
    """

    identities = (
        Identity("zero pseudo-queries read the window's uniform mean; at init every window is the whole "
                 "history, the stream / N"),
        Identity("a window over all 2L + 1 sources is AttnRes", options={"window": 64, "query_init": "normal"},
                 equals="attnres", equals_options={"query_init": "normal"}),
        Identity("the projected query starts at zero and W_V at I: the window's mean, scaled to the stream",
                 options={"window": 64, "query": "projected"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(AttnRes.Config):
        window: int = 8
        include_embedding: bool = True
        query: Literal["static", "projected"] = "static"
        key_dim: int = 64
        value_proj: bool = True

        def __post_init__(self):
            if self.window < 1:
                raise ValueError(f"window must be >= 1, got {self.window}")
            if self.key_dim < 1:
                raise ValueError(f"key_dim must be >= 1, got {self.key_dim}")
            if self.query == "projected" and self.query_init != "zero":
                raise ValueError("query='projected' zero-initialises W_Q; query_init applies to query='static' only")

    supports_ablations = False

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """The last `window` sources at every site (and the readout's), plus the embedding once it slid out."""
        window, emb = config.window, config.include_embedding
        return [(min(s + 1, window) + (1 if emb and s + 1 > window else 0), 1)
                for s in range(2 * n_layers + int(config.readout))]

    def __init__(self, config: Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        if config.query == "static":
            return
        self.register_parameter("queries", None)
        self.register_parameter("key_gains", None)
        d, dk, routes = shape.d_model, config.key_dim, self.n_routes()
        # site 0 reads the embedding alone (a softmax over one source), so W_Q and W_K start at
        # site 1: q_proj[site - 1]; nn.utils.skip_init keeps nn.Linear off the global RNG
        self.q_proj = nn.ModuleList(zero_linear(d, dk) for _ in range(1, routes))
        k_proj: list[nn.Linear] = [nn.utils.skip_init(nn.Linear, d, dk, bias=False) for _ in range(1, routes)]
        self.k_proj = nn.ModuleList(k_proj)
        for site in range(1, routes):
            gen = private_generator(_KEY_INIT_SEED + site)
            # drawn in float32 so the init does not depend on the default dtype
            w_k = torch.randn(dk, d, generator=gen, dtype=torch.float32) * shape.init_std
            with torch.no_grad():
                k_proj[site - 1].weight.copy_(w_k)
        if config.value_proj:
            v_proj: list[nn.Linear] = [nn.utils.skip_init(nn.Linear, d, d, bias=False) for _ in range(routes)]
            self.v_proj = nn.ModuleList(v_proj)
            for linear in v_proj:
                with torch.no_grad():
                    linear.weight.copy_(torch.eye(d))

    def window_indices(self, n_sources: int) -> list[int]:
        """Indices into [e, f_1, ..., f_k] that a read over `n_sources` sources sees."""
        first = max(0, n_sources - self.config.window)
        indices = list(range(first, n_sources))
        if self.config.include_embedding and first > 0:
            indices.insert(0, 0)
        return indices

    def source_labels(self, site: int) -> list[str]:
        labels = super().source_labels(site)
        return [labels[i] for i in self.window_indices(len(labels))] if labels else []

    def route(self, sources: list[Tensor], site: int) -> Tensor:
        indices = self.window_indices(len(sources))
        window = [sources[i] for i in indices]
        newest = window[-1]
        if self.intervention is not None:
            _, window, _ = self.softmax_sources(site, self.source_labels(site), window)
            if not window:  # the only source removed: the read of nothing
                return torch.zeros_like(newest)
        if self.config.query == "static":
            out, weights = depth_read(
                window, self.queries[site], self.key_gains[site],
                heads=self.heads, eps=self.shape.norm_eps, impl=self.impl,
            )
        else:
            out, weights = self.projected_read(window, site, None if self.intervention is None else newest)
        if self.recorder is not None and len(window) == len(indices):
            full = weights.new_zeros(len(sources), *weights.shape[1:])       # [N_all, B, T, H]
            full[indices] = weights
            self.record(site, full)
        return self.scaled(out, len(window))

    def projected_read(self, window: list[Tensor], site: int, newest: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Depth attention over the window; returns out [B, T, D] and weights [N, B, T, 1]. The query reads
        `newest` (the window's unmodified newest state under an intervention), else the window's last."""
        values = torch.stack(window)                                         # [N, B, T, D]
        compute = torch.float64 if values.dtype == torch.float64 else torch.float32
        if site == 0:
            weights = torch.ones(values.shape[:-1], dtype=compute, device=values.device)  # [1, B, T]
        else:
            keys = rms_norm(values, self.shape.norm_eps)                     # [N, B, T, D]
            query_in = keys[-1] if newest is None else rms_norm(newest, self.shape.norm_eps)
            q = self.q_proj[site - 1](query_in)                              # [B, T, dk]
            w_k = self.k_proj[site - 1].weight                               # [dk, D]
            q_in = (q.to(compute) @ w_k.to(compute)) / math.sqrt(self.config.key_dim)  # [B, T, D]
            weights = torch.softmax((keys.to(compute) * q_in).sum(-1), dim=0)          # [N, B, T]
        out = (weights.unsqueeze(-1) * values.to(compute)).sum(0).to(values.dtype)
        if self.config.value_proj:
            out = self.v_proj[site](out)
        return out, weights.unsqueeze(-1)
