"""Block Attention Residuals (Kimi Team, arXiv 2603.15031; variants.md section 1.2).

The 2L sublayers are cut into blocks of `block_size` consecutive sublayers. Sources are the
embedding `b_0 = e`, every completed block's plain sum of sublayer outputs `b_n`, and the current
block's partial sum when it is non-empty. Routing, keys, queries and the readout are as in Full
AttnRes; `block_size=1` is Full AttnRes exactly. Kimi's code counts `block_size` in sublayers
(boundaries fall at `layer % (block_size/2) == 0`); any size >= 1 is accepted here, an odd one
simply puts boundaries between an attention and its MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes


@dataclass
class BlockState:
    blocks: list[Tensor]            # [b_0 = e, b_1, ..., b_{n-1}], each [B, T, D]
    partial: Tensor | None = None   # the current block's running sum, None right after a boundary
    filled: int = 0                 # sublayers already summed into `partial`

    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


@register("block_attnres")
class BlockAttnRes(AttnRes):
    """Knobs (plus those of `attnres`):
        block_size: sublayers per block (Kimi: 2L/N for N~8 blocks; 6 at 48B). Default: 4.
    """

    @dataclass(frozen=True, kw_only=True)
    class Config(AttnRes.Config):
        block_size: int = 4

        def __post_init__(self):
            if self.block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def start(self, embedding: Tensor) -> BlockState:
        return BlockState(blocks=[self.as_source(embedding)])

    def sublayer_input(self, state: BlockState, site: int) -> Tensor:
        return self.route(state.sources(), site)

    def update(self, state: BlockState, site: int, output: Tensor) -> BlockState:
        partial = output if state.partial is None else state.partial + output
        if state.filled + 1 == self.config.block_size:
            return BlockState(blocks=state.blocks + [partial])
        return BlockState(blocks=state.blocks, partial=partial, filled=state.filled + 1)

    def readout(self, state: BlockState) -> Tensor:
        if self.config.readout:
            return self.route(state.sources(), self.shape.n_sites)
        return self.stream(state)

    def stream(self, state: BlockState) -> Tensor:
        return torch.stack(state.sources()).sum(0)
