"""The standard pre-norm residual, the control in every study:
`u = h + Attn(Norm(h))`, `h' = u + MLP(Norm(u))`.

Interventions (`models.interventions`): the read of site k (2L: the final readout) is the running
sum e + f_0 + ... + f_{k-1}; removing a source ("emb", "s3") subtracts that term from what site k
reads ("zero") or swaps it for its mean over the eval windows ("mean"); the stream itself, and so
every other site's read, is unchanged. The sum is not normalised: nothing renormalises."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from reslab.models.residual import register
from reslab.models.residual.base import ResidualPathway


@register("prenorm")
class PreNorm(ResidualPathway):
    identities = ()
    control = True  # the control the others are measured against
    intervention_kinds = ("source",)

    @dataclass(frozen=True, kw_only=True)
    class Config:
        pass

    def start(self, embedding: Tensor) -> Tensor:
        self.note_term("emb", embedding)
        return embedding

    def sublayer_input(self, h: Tensor, site: int) -> Tensor:
        return h if self.intervention is None else self.remove_terms(site, h)

    def update(self, h: Tensor, site: int, output: Tensor) -> Tensor:
        self.note_term(f"s{site}", output)
        return h + output

    def source_labels(self, site: int) -> list[str]:
        return ["emb"] + [f"s{i}" for i in range(site)]

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, 0): one stream per token, nothing carried."""
        return self.shape.d_model, 0

    def readout(self, h: Tensor) -> Tensor:
        return h if self.intervention is None else self.remove_terms(self.shape.n_sites, h)
