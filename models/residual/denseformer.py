"""DenseFormer (Pagliardini et al., arXiv 2402.02622; variants.md section 8.2), checked against
epfml/DenseFormer `denseformer/denseformer.py` (`DWAModules`, commit ff4aee83).

Blocks (attention + MLP with the standard residual inside) are numbered i = 1..L; `x_0 = e` and
`x_i` is block i's output. After block i, when `i % period == 0`, a depth-weighted average

    y_i = sum_{j <= i, (i - j) % dilation == 0} a_{i,j} x_j

becomes the next block's input (otherwise the next block reads `x_i`). Every block output is
kept as a source, whether or not a DWA follows it (as in `DWAModules`; the repository's
experiments model with `increase_T_every` keeps only the outputs at DWA points, which is the
same thing when dilation == period). The weights are static scalars, `a_{i,i} = 1` and the rest
0, so the model is exactly pre-norm at init. The DWA after the last block feeds the final norm;
if `L % period != 0` the last block has none.

Parameters: `sum over DWA blocks i of (i // dilation + 1)`; for 1x1 that is
`sum_{i=1}^{L} (i + 1) = L (L + 3) / 2`.

Interventions (`models.interventions`): a source of the DWA after block i ("emb" = x_0, "x3" = block
3's output) is removed from that average, named by the site that reads it, 2i (2L: the readout):
"zero" drops its term (the weights are static and not normalised: nothing renormalises), "mean"
replaces x_j by its mean over the eval windows. The DWA's output is the stream the next block adds
to, so the change reaches every later site (as the DWA's does), not only block i + 1's attention.

Diagnostics: the DWA after block i is recorded at site 2i (the input of block i+1's attention;
2L is the readout) with route "dwa", as |a_{i,j}| / sum_j |a_{i,j}| over ALL sources x_0..x_i
(zeros for the ones the dilation skips), so the depth axis is the block index. The weights are
static and signed, so this is a normalised magnitude, not a softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn

from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway


@dataclass
class DenseState:
    outputs: list[Tensor]   # [x_0 = e, x_1, ..., x_i], each [B, T, D]
    h: Tensor               # [B, T, D] the running stream inside the current block


class _Scalars(nn.Module):
    """DWA weights as a plain (never decayed) parameter, shaped like nn.Linear(n, 1).weight."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, n))


@register("denseformer")
class DenseFormer(ResidualPathway):
    """Knobs:
        dilation: k of DenseFormer k x p; the DWA after block i reads x_j only for (i - j) % k == 0.
            Default: 1.
        period: p of DenseFormer k x p; a DWA follows block i only when i % p == 0. Default: 1.
        decay_weights: store each DWA's weights as an nn.Linear(n, 1, bias=False) weight, which the
            platform decays (as the released code, whose optimizer decays every nn.Linear weight);
            False makes them plain, undecayed parameters. Default: True.
    """

    intervention_kinds = ("source",)
    identities = (
        Identity("the DWA weights start at (0, ..., 0, 1): each block's output passes through unchanged"),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        dilation: int = 1
        period: int = 1
        decay_weights: bool = True

        def __post_init__(self):
            if self.dilation < 1 or self.period < 1:
                raise ValueError(f"dilation and period must be >= 1, got {self.dilation}, {self.period}")

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        self.dwa = nn.ModuleDict()
        for i in self.dwa_blocks():
            n = len(self.sources(i))
            module = nn.utils.skip_init(nn.Linear, n, 1, bias=False) if config.decay_weights else _Scalars(n)
            with torch.no_grad():
                module.weight.zero_()
                module.weight[0, -1] = 1.0
            self.dwa[str(i)] = module

    def dwa_blocks(self) -> list[int]:
        """Blocks (1-indexed) followed by a DWA."""
        return [i for i in range(1, self.shape.n_layers + 1) if i % self.config.period == 0]

    def sources(self, i: int) -> list[int]:
        """Indices j of the outputs x_j the DWA after block i reads, ascending (x_i last)."""
        return [j for j in range(i + 1) if (i - j) % self.config.dilation == 0]

    def start(self, embedding: Tensor) -> DenseState:
        return DenseState(outputs=[embedding], h=embedding)

    def sublayer_input(self, state: DenseState, site: int) -> Tensor:
        return state.h

    def update(self, state: DenseState, site: int, output: Tensor) -> DenseState:
        x = state.h + output
        if site % 2 == 0:
            return DenseState(outputs=state.outputs, h=x)
        outputs = state.outputs + [x]
        i = site // 2 + 1
        if str(i) not in self.dwa:
            return DenseState(outputs=outputs, h=x)
        idx = self.sources(i)
        a = cast(Tensor, self.dwa[str(i)].weight).view(-1)                    # [n], an nn.Linear's or _Scalars' weight
        if self.intervention is not None:
            return self.intervened_dwa(state, outputs, i, a)
        stacked = torch.stack([outputs[j] for j in idx])                      # [n, B, T, D]
        # elementwise, not a matmul: autocast would round the stream to bf16
        y = (a.view(-1, 1, 1, 1).to(stacked.dtype) * stacked).sum(0)          # [B, T, D]
        if self.recorder is not None:
            self.record(2 * i, self.route_weights(i, a, x), route="dwa")
        return DenseState(outputs=outputs, h=y)

    def intervened_dwa(self, state: DenseState, outputs: list[Tensor], i: int, a: Tensor) -> DenseState:
        """The DWA after block i with the intervention's source dropped or swapped for its mean."""
        idx = self.sources(i)
        terms = self.linear_sources(2 * i, self.source_labels(2 * i), [outputs[j] for j in idx])
        stacked = torch.stack([torch.zeros_like(outputs[j]) if t is None else t
                               for j, t in zip(idx, terms, strict=True)])
        y = (a.view(-1, 1, 1, 1).to(stacked.dtype) * stacked).sum(0)          # the forward's sum, a zero term dropped
        return DenseState(outputs=outputs, h=y)

    def source_labels(self, site: int) -> list[str]:
        """The block outputs the DWA read at `site` averages (site 2i reads the DWA after block i, if any)."""
        i = site // 2
        if site % 2 or i < 1 or str(i) not in self.dwa:
            return []
        return ["emb" if j == 0 else f"x{j}" for j in self.sources(i)]

    def route_weights(self, i: int, a: Tensor, like: Tensor) -> Tensor:
        """|a_i| normalised to sum 1 over all sources x_0..x_i, as [i + 1, B, T, 1]."""
        full = torch.zeros(i + 1, device=a.device, dtype=torch.float32)
        full[self.sources(i)] = a.detach().float().abs()
        full = full / full.sum().clamp_min(1e-30)
        return full.view(-1, 1, 1, 1).expand(-1, like.shape[0], like.shape[1], 1)

    def decode_state_elems(self) -> tuple[int, int]:
        """((L + 1) d, 0), + d when a DWA follows the last block: the block outputs e, x_1, ..., x_L, and
        the last DWA's output y_L beside them (without that DWA the stream is x_L itself)."""
        last_dwa = self.shape.n_layers % self.config.period == 0
        return (self.shape.n_layers + 1 + int(last_dwa)) * self.shape.d_model, 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """((k + 1) d, 0) before site s = 2k (after block k): the block outputs e, x_1, ..., x_k, + d when a DWA
        follows block k (its output y_k is the stream; without it the stream is x_k itself)."""
        k = site // 2
        return (k + 1 + int(k % self.config.period == 0)) * self.shape.d_model, 0

    def readout(self, state: DenseState) -> Tensor:
        return state.h

    def stream(self, state: DenseState) -> Tensor:
        """The stream the next block reads: y_i after a DWA, else x_i."""
        return state.h
