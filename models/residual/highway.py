"""Additive Highway control of Review Residuals (Kramer, arXiv 2606.31859; variants.md 7.3),
read in SixSigmaEngineer/review-residuals `src/train.py` (commit fbe83f79, variant "highway").

`h' = h + sigma(W h + b) * u`: the gate sees the raw state only (not the proposed update), so it
is Review's gate without the update half; `nn.Linear(d, d)`, `d^2 + d` per sublayer, `2d^2 + 2d`
per layer. The identity path is kept (additive). The released code widens this baseline to match
Review's parameter count (a study-level choice, not done here). `W` is decayed, `b` is not (the
released code decays every parameter).

Interventions (`models.interventions`): "gate" pins the gate at a site (or every site) to 1 ("open":
h + u, prenorm's update) or 0 ("closed": h' = h, the sublayer's output ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.models.layers import rms_norm, zero_linear
from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway, private_generator

# private generator seed (plus the site index): the random gate init never touches the global
# RNG, so a seed gives this arm the same backbone weights as every other arm
HIGHWAY_SEED = 0x4857


@register("highway")
class AdditiveHighway(ResidualPathway):
    """Knobs:
        gate_init: "normal" (the released code: GPT-2 init of the gate, W ~ N(0, 0.02^2), b = 0,
            drawn from a private generator seeded per site so the backbone init is untouched) or
            "zero" (W = 0, b = 0: r = 0.5 exactly, the same start as `review`). Default: "normal".
        norm_state: gate on RMSNorm(h) instead of the raw state h (the released code uses the raw
            state). Default: False.
    """
    throughput_note = "its extra work is matmuls, which the FLOP count includes"

    intervention_kinds = ("gate",)
    identities = (
        Identity("zero-initialised gates open at sigmoid(0) = 1/2, as review's do: the same function at init",
                 options={"gate_init": "zero"}, equals="review"),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        gate_init: Literal["normal", "zero"] = "normal"
        norm_state: bool = False

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d = shape.d_model
        gates = [zero_linear(d, d, bias=0.0) for _ in range(shape.n_sites)]
        self.gates = nn.ModuleList(gates)
        if config.gate_init == "normal":
            with torch.no_grad():
                for site, gate in enumerate(gates):
                    g = private_generator(HIGHWAY_SEED + site)
                    gate.weight.copy_(torch.randn(d, d, generator=g) * 0.02)

    def start(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        pin = self.gate_pin(site)
        if pin is not None:
            return h + pin * output
        state = rms_norm(h, self.shape.norm_eps) if self.config.norm_state else h
        return h + torch.sigmoid(self.gates[site](state)) * output

    def gate_sites(self) -> list[int]:
        return list(range(self.shape.n_sites))

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, 0): one stream per token, nothing carried."""
        return self.shape.d_model, 0

    def readout(self, h: Tensor) -> Tensor:
        return h
