"""A scaled residual: each sublayer's update enters the stream through a learned scalar gate,

    h' = h + g_site * u,

with one scalar per sublayer (`per_site`, the default) or one for the whole model, initialised to
`gate_init`. At `gate_init = 1` the model computes pre-norm at init (declared in `identities`, which
`reslab check gated_residual` holds to float64 rounding). A change of this file is a change of the
code version recorded with every run that uses it.

Registered through the `reslab.variants` entry point in this package's pyproject.toml, so a study
names it `residual: {name: gated_residual}`; without installing the package, a study on PYTHONPATH names
it by path: `residual: {name: "scaled_residual.gated:GatedResidual"}`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reslab.models.residual.base import Identity, ResidualPathway


class GatedResidual(ResidualPathway):
    """Knobs:
        gate_init: the gates' value at init (1.0: pre-norm's update). Default: 1.0.
        per_site: one gate per sublayer (True) or one for all of them (False). Default: True.
    """

    identities = (Identity("gates of 1 add each update whole: pre-norm at init"),)

    @dataclass(frozen=True, kw_only=True)
    class Config:
        gate_init: float = 1.0
        per_site: bool = True

    def __init__(self, config: Config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        count = shape.n_sites if config.per_site else 1
        # a constant init: the global RNG is not drawn from, so a seed gives every arm the same backbone
        self.gates = nn.Parameter(torch.full((count,), float(config.gate_init)))

    def start(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        gate = self.gates[site if self.config.per_site else 0]
        return h + gate.to(output.dtype) * output

    def readout(self, h: Tensor) -> Tensor:
        return h

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, 0): one stream per token, nothing carried."""
        return self.shape.d_model, 0
