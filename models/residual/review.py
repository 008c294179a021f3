"""Review Residuals (Kramer, arXiv 2606.31859; variants.md sections 7.1-7.2), checked against
SixSigmaEngineer/review-residuals `src/train.py` (commit fbe83f79).

Review, per sublayer with `u = f(Norm(h))` (the paper's sublayer input RMSNorm(h) is the
backbone's own pre-norm, so the sublayer reads h):

    r  = sigma(W_r [RMSNorm(h); RMSNorm(u)] + b_r)      W_r in R^{d x 2d}, per-channel gate
    h' = h + r * u                                      form="additive" (identity path kept)
    h' = (1 - r) * h + r * u                            form="convex" (Highway; fails past ~20 layers)

with parameter-free norms and `W_r = 0, b_r = 0`, so r = 0.5 everywhere at step 0: the model
starts as pre-norm with every sublayer output halved (not the pre-norm function). `2d^2 + d`
per sublayer, `4d^2 + 2d` per layer. Its parameter-matched control is `highway`. The released
code matches parameter counts by widening the baselines (a study-level choice, not done here).

Weight decay: `W_r` is an `nn.Linear` weight, so decayed; `b_r` is not. (The released code decays
every parameter with AdamW(0.1).)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.models.layers import rms_norm
from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway

def zero_linear(d_in: int, d_out: int) -> nn.Linear:
    """An nn.Linear with zero weight and bias, built without drawing from the global RNG."""
    layer = nn.utils.skip_init(nn.Linear, d_in, d_out)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


@register("review")
class ReviewResiduals(ResidualPathway):
    """Knobs:
        form: "additive" (h + r u, the paper's method) or "convex" (the Highway form
            (1 - r) h + r u). Default: "additive".
    """

    @dataclass(frozen=True, kw_only=True)
    class Config:
        form: Literal["additive", "convex"] = "additive"

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d = shape.d_model
        self.gates = nn.ModuleList(zero_linear(2 * d, d) for _ in range(shape.n_sites))

    def start(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        eps = self.shape.norm_eps
        r = torch.sigmoid(self.gates[site](torch.cat([rms_norm(h, eps), rms_norm(output, eps)], dim=-1)))
        if self.config.form == "additive":
            return h + r * output
        return h + r * (output - h)

    def readout(self, h: Tensor) -> Tensor:
        return h
