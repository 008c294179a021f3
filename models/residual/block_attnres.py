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
from typing import Any, ClassVar

import torch
from torch import Tensor

from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import Identity


def block_size_errors(block_size: int, shape: ModelShape) -> list[str]:
    """A block longer than the 2L sublayers never closes: the same function as block_size = 2L."""
    if block_size <= shape.n_sites:
        return []
    return [f"block_size: {block_size} exceeds the model's 2L={shape.n_sites} sublayers (n_layers="
            f"{shape.n_layers}); allowed: 1..{shape.n_sites}"]


@dataclass
class BlockState:
    blocks: list[Tensor]            # [b_0 = e, b_1, ..., b_{n-1}], each [B, T, D]
    partial: Tensor | None = None   # the current block's running sum, None right after a boundary
    filled: int = 0                 # sublayers already summed into `partial`
    partial_slot: int = -1          # the depth-history slot of `partial` (kernels only), -1 for none

    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


@register("block_attnres")
class BlockAttnRes(AttnRes):
    """Knobs (plus those of `attnres`):
        block_size: sublayers per block (Kimi: 2L/N for N~8 blocks; 6 at 48B). Default: 4.
    """

    identities: ClassVar[tuple[Identity, ...]] = (
        Identity("zero pseudo-queries read the uniform mean of the block sums, the stream / N, which "
                 "stream_scale multiplies by N: the pre-norm stream itself"),
        Identity("one sublayer per block is Full AttnRes", options={"block_size": 1, "query_init": "normal"},
                 equals="attnres", equals_options={"query_init": "normal"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(AttnRes.Config):
        block_size: int = 4

        def __post_init__(self):
            if self.block_size < 1:
                raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @classmethod
    def check_shape(cls, config: Any, shape: ModelShape) -> list[str]:  # a cls.Config (see AttnRes)
        return super().check_shape(config, shape) + block_size_errors(config.block_size, shape)

    def start(self, embedding: Tensor) -> BlockState:
        if self.uses_history:
            return BlockState(blocks=[self.new_history(self.as_source(embedding)).source(0)])
        return BlockState(blocks=[self.as_source(embedding)])

    def decode_state_elems(self) -> tuple[int, int]:
        """((1 + 2L // S + p) d, 0) for blocks of S sublayers: e, the completed blocks and, when the last
        is partly filled (p = 1), its partial sum. With the kernels the history buffer holds 2L + 1
        slots (the completed blocks and every partial-block state), the partial sum besides: (2L + 1 + p) d."""
        sites, size = self.shape.n_sites, self.config.block_size
        partial = int(sites % size > 0)
        slots = sites + 1 if self.uses_history else 1 + sites // size
        return (slots + partial) * self.shape.d_model, 0

    def sublayer_input(self, state: Any, site: int) -> Tensor:  # a BlockState, or a subclass's (see AttnRes)
        if self.uses_history:
            return self.history_read(site, len(state.blocks), state.partial_slot)
        return self.route(state.sources(), site)

    def update(self, state: Any, site: int, output: Tensor) -> BlockState:  # state: as sublayer_input's
        partial = output if state.partial is None else state.partial + output
        closed = state.filled + 1 == self.config.block_size
        if self.uses_history:
            return self.write_history(state, site, partial, closed)
        if closed:
            return BlockState(blocks=state.blocks + [partial])
        return BlockState(blocks=state.blocks, partial=partial, filled=state.filled + 1)

    def write_history(self, state: BlockState, site: int, partial: Tensor, closed: bool) -> BlockState:
        """Completed blocks take the history's prefix slots 0..2L/block_size, every partial-block
        state one slot after them; the state keeps `partial` itself, which the next sum needs."""
        assert self.history is not None
        size, written = self.config.block_size, site + 1
        if closed:
            self.history.write(len(state.blocks), partial, (site + 1, self.shape.n_sites))
            return BlockState(blocks=state.blocks + [self.history.source(len(state.blocks))])
        slot = 1 + self.shape.n_sites // size + written - written // size - 1
        self.history.write(slot, partial, (site + 1, site + 1))
        return BlockState(blocks=state.blocks, partial=partial, filled=state.filled + 1, partial_slot=slot)

    def readout(self, state: BlockState) -> Tensor:
        if self.uses_history:
            return self.history_read(self.shape.n_sites, len(state.blocks), state.partial_slot)
        if self.config.readout:
            return self.route(state.sources(), self.shape.n_sites)
        return self.stream(state)

    def stream(self, state: BlockState) -> Tensor:
        return torch.stack(state.sources()).sum(0)
