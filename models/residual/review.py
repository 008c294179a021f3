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
code matches parameter counts by widening the baselines: a study gives the pre-norm (or highway)
arm `model.ffn_hidden: widened_ffn_hidden(shape, extra)`, the SwiGLU width whose 3 d x ffn
matrices add the same parameters per layer (experiments/review_vs_widened.yaml).

The claims the knobs test (variants.md 7.4, TinyStories, validation loss): additive Review beats
the widened standard residual only from 590M up (1.4795 vs 1.4901, p<0.05; at 60M the standard
residual wins, 1.6805 vs 1.6891); `form="convex"` halves the identity Jacobian per sublayer at
r = 0.5 and fails to train beyond ~20 layers (experiments/review_convex_depth.yaml).

Interventions (`models.interventions`): "gate" pins r at a site (or every site) to 1 ("open":
h + u, or u with the convex form) or 0 ("closed": h' = h, the sublayer's output is ignored).

Weight decay: `W_r` is an `nn.Linear` weight, so decayed; `b_r` is not. (The released code decays
every parameter with AdamW(0.1).)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.models.layers import rms_norm, zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway


def widened_ffn_hidden(shape: ModelShape, extra_per_layer: float) -> int:
    """The SwiGLU width at which a plain layer gains `extra_per_layer` parameters (3 d x ffn
    matrices per layer), rounded to the nearest integer: Review's `4d^2 + 2d` gives
    ffn_hidden + (4d + 2) / 3."""
    return shape.ffn_hidden + round(extra_per_layer / (3 * shape.d_model))


@register("review")
class ReviewResiduals(ResidualPathway):
    """Knobs:
        form: "additive" (h + r u, the paper's method) or "convex" (the Highway form
            (1 - r) h + r u). Default: "additive".
    """
    throughput_note = "its extra work is matmuls, which the FLOP count includes"

    identities = ()  # h + u / 2 at init: prenorm with halved output projections, not a variant
    intervention_kinds = ("gate",)

    @dataclass(frozen=True, kw_only=True)
    class Config:
        form: Literal["additive", "convex"] = "additive"

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d = shape.d_model
        self.gates = nn.ModuleList(zero_linear(2 * d, d, bias=0.0) for _ in range(shape.n_sites))

    def start(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        eps = self.shape.norm_eps
        pin = self.gate_pin(site)
        if pin is None:
            r: Tensor | float = torch.sigmoid(self.gates[site](torch.cat([rms_norm(h, eps), rms_norm(output, eps)],
                                                                         dim=-1)))
        else:
            r = pin
        if self.config.form == "additive":
            return h + r * output
        return h + r * (output - h)

    def gate_sites(self) -> list[int]:
        return list(range(self.shape.n_sites))

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, 0): one stream per token, nothing carried."""
        return self.shape.d_model, 0

    def readout(self, h: Tensor) -> Tensor:
        return h
