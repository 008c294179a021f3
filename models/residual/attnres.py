"""Full Attention Residuals (Kimi Team, arXiv 2603.15031; variants.md section 1.1).

Sources are the embedding and every earlier sublayer's raw output, `v_0 = e, v_i = f_i`.
Sublayer `l` reads `h_l = sum_i softmax_i(w_l . RMSNorm_l(v_i)) v_i` (replacement routing: the
running stream is discarded), with a static pseudo-query `w_l` and a key RMSNorm gain per site,
and no 1/sqrt(d) temperature. A final readout route (its own query and gain) over all 2L+1
sources feeds the final norm, as in the released delta/MHAR code. Zero-initialised queries make
every read a uniform mean, which equals the pre-norm stream / N: the same function as `prenorm`
at step 0 up to the RMSNorm epsilon (variants.md 0.1).

Parameters: a query (d) and a key gain (d) per site, 4d per layer, +2d for the readout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read
from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway, zero_or_normal


@register("attnres")
class AttnRes(ResidualPathway):
    """Knobs:
        query_init: "zero" (Kimi, MHAR v2; identity with prenorm at init) or "normal" (released
            Delta code and MHAR v1: N(0, query_init_std^2)). Default: "zero".
        query_init_std: std of the "normal" init. Default: 0.02.
        readout: route once more over every source for the final hidden state (released code);
            False feeds the plain sum of sources (the pre-norm stream). Default: True.
    """

    heads: int = 1  # MHAR overrides this from its knob

    @dataclass(frozen=True, kw_only=True)
    class Config:
        query_init: Literal["zero", "normal"] = "zero"
        query_init_std: float = 0.02
        readout: bool = True

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        n_routes = self.n_routes()
        d = shape.d_model
        self.queries = nn.Parameter(zero_or_normal((n_routes, d), config.query_init, config.query_init_std))
        self.key_gains = nn.Parameter(torch.ones(n_routes, d))

    def n_routes(self) -> int:
        return self.shape.n_sites + (1 if self.config.readout else 0)

    def route(self, sources: list[Tensor], site: int) -> Tensor:
        out, weights = depth_read(
            sources, self.queries[site], self.key_gains[site],
            heads=self.heads, eps=self.shape.norm_eps, impl=self.impl,
        )
        self.record(site, weights)
        return out

    def start(self, embedding: Tensor) -> list[Tensor]:
        return [self.as_source(embedding)]

    def sublayer_input(self, sources: list[Tensor], site: int) -> Tensor:
        return self.route(sources, site)

    def update(self, sources: list[Tensor], site: int, output: Tensor) -> list[Tensor]:
        return sources + [output]

    def readout(self, sources: list[Tensor]) -> Tensor:
        if self.config.readout:
            return self.route(sources, self.shape.n_sites)
        return self.stream(sources)

    def stream(self, sources: list[Tensor]) -> Tensor:
        """The equivalent pre-norm stream e + sum_i f_i (AttnRes keeps no running stream)."""
        return torch.stack(sources).sum(0)
