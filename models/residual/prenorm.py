"""The standard pre-norm residual, the control in every study:
`u = h + Attn(Norm(h))`, `h' = u + MLP(Norm(u))`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway


@register("prenorm")
class PreNorm(ResidualPathway):
    identities = ()  # the control the others are measured against

    @dataclass(frozen=True, kw_only=True)
    class Config:
        pass

    def start(self, embedding: Tensor) -> Tensor:
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        return h + output

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, 0): one stream per token, nothing carried."""
        return self.shape.d_model, 0

    def readout(self, h: Tensor) -> Tensor:
        return h
