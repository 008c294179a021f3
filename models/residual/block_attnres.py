"""Block Attention Residuals (Kimi Team, arXiv 2603.15031; variants.md section 1.2).

The 2L sublayers are cut into blocks of `block_size` consecutive sublayers. Sources are the
embedding `b_0 = e`, every completed block's plain sum of sublayer outputs `b_n`, and the current
block's partial sum when it is non-empty. Routing, keys, queries and the readout are as in Full
AttnRes; `block_size=1` is Full AttnRes exactly. Kimi's code counts `block_size` in sublayers
(boundaries fall at `layer % (block_size/2) == 0`); any size >= 1 is accepted here, an odd one
simply puts boundaries between an attention and its MLP.

Decoding reads in two phases, as Kimi serves it (variants.md 1.4), on the depth cache of
`models/residual/depth_cache.py`: the queries are static, so each completed block is scored for
every route once, when it closes, and at the first site of a block the reads of all its sites over
the completed blocks are one batched step (phase 1, `lead_reads`: one softmax over the cached
scores and one batched product, giving each site its read and its log-sum-exp); then site by site
the partial block is merged in by the online-softmax (log-sum-exp) merge (phase 2, `merged_read`).
It is the same function as the per-site read (tests/models/test_decoding.py holds it to the full
forward in float64). It is the decode path of `impl="reference"`: it runs when `resume` gets a
carry (a decode step; prefill and the training forward keep the per-site read), for the static
softmax read only (Kimi's ablations read per site). With `impl="triton"` a decode step reads
through the history kernel instead, keeping its buffer from step to step.

The field's kernels (`residual.impl: fla | liger | flash_attn_res`): as `attnres`'s, over the block sources
(the mapping is in its docstring); flash-attn-res reads the completed blocks in its phase 1 and merges the
partial block in its phase 2, Kimi's two-phase read.

Interventions: as `attnres`'s, over the block sources "emb", "block1", ... (completed block sums)
and "partial" (the current block's partial sum, whose mean is taken per site).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from reslab.kernels.field import FIELD_IMPLS
from reslab.models.presets import ModelShape
from reslab.models.residual import depth_cache, register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import DECODING, Identity, block_sources
from reslab.models.residual.depth_cache import DepthCache, Lead


def block_size_errors(block_size: int, shape: ModelShape) -> list[str]:
    """A block longer than the 2L sublayers never closes: the same function as block_size = 2L."""
    if block_size <= shape.n_sites:
        return []
    return [f"block_size: {block_size} exceeds the model's 2L={shape.n_sites} sublayers (n_layers="
            f"{shape.n_layers}); allowed: 1..{shape.n_sites}"]


@dataclass
class BlockState:
    blocks: list[Tensor]            # [b_0 = e, b_1, ..., b_{n-1}], each [B, T, D]; [] when `cache` holds them
    partial: Tensor | None = None   # the current block's running sum, None right after a boundary
    filled: int = 0                 # sublayers already summed into `partial`
    partial_slot: int = -1          # the depth-history slot of `partial` (kernels only), -1 for none
    cache: DepthCache | None = None  # a decode step: the blocks and their scores; reads in two phases
    lead: Lead | None = None        # decoding: phase 1 of the current block, until its last site

    def sources(self) -> list[Tensor]:
        return self.blocks + ([self.partial] if self.partial is not None else [])


@register("block_attnres")
class BlockAttnRes(AttnRes):
    """Knobs (plus those of `attnres`):
        block_size: sublayers per block (Kimi: 2L/N for N~8 blocks; 6 at 48B). Default: 4.
    """

    field_impls: ClassVar[tuple[str, ...]] = FIELD_IMPLS  # the read of `attnres` over the block sources
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

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        # the two-phase decode read is the cached read's (static queries, the plain softmax read of `route`)
        self.two_phase = self.cached_reads

    def source_labels(self, site: int) -> list[str]:
        """Site k reads the embedding, the k // S completed blocks and the partial block when k % S > 0;
        the readout (2L) reads them all."""
        if site == self.shape.n_sites and not self.config.readout:
            return []
        size = self.config.block_size
        return ["emb"] + [f"block{n}" for n in range(1, site // size + 1)] + (["partial"] if site % size else [])

    def start(self, embedding: Tensor) -> BlockState:
        return BlockState(blocks=[self.as_source(embedding)])

    def resume(self, state: Any, carry: Any, positions: Tensor) -> Any:  # a BlockState, or a subclass's
        decoding = carry is not None
        if self.uses_history:  # the sources live in this pass's history buffer
            return BlockState(blocks=[self.open_history(state.blocks[0], decoding).source(0)])
        if decoding and self.two_phase:  # the blocks live in this step's DepthCache
            cache = self.open_cache(state.blocks[0], 1 + self.shape.n_sites // self.config.block_size)
            return BlockState(blocks=[], cache=cache)
        return state

    def carry(self, state: Any) -> Any:
        """Nothing from earlier tokens; DECODING when the next calls decode on a path of their own
        (two phases, or the kernels' history kept from step to step)."""
        return DECODING if self.two_phase or self.uses_history else None

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """One read of the completed blocks and the partial one at every site (and the readout's)."""
        return [(n, 1) for n in block_sources(2 * n_layers + int(config.readout), config.block_size)]

    def decode_state_elems(self) -> tuple[int, int]:
        """((1 + 2L // S + p) d + c, 0) for blocks of S sublayers: e, the completed blocks and, when the last
        is partly filled (p = 1), its partial sum; on the two-phase read c = `cache_score_elems(1 + 2L // S)`,
        the blocks' scores for every route. With the kernels the history buffer holds 2L + 1 slots (the
        completed blocks and every partial-block state), the partial sum besides: (2L + 1 + p) d."""
        sites, size = self.shape.n_sites, self.config.block_size
        partial = int(sites % size > 0)
        slots = sites + 1 if self.uses_history else 1 + sites // size
        scores = self.cache_score_elems(slots) if self.two_phase else 0
        return (slots + partial) * self.shape.d_model + scores, 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """((1 + s // S + p) d, 0) before site s, blocks of S sublayers: e, the s // S completed block sums and,
        when a block is partly filled (p = 1), its partial sum. With Kimi's cross-stage caching, when the
        receiving rank holds the state before site `held`: the blocks completed since, s // S - held // S,
        and the partial sum (which changes with every sublayer, so it always crosses)."""
        size = self.config.block_size
        blocks = 1 + site // size if held is None else site // size - held // size
        return (blocks + int(site % size > 0)) * self.shape.d_model, 0

    def prepare(self, state: Any, site: int) -> Any:
        if state.cache is None or state.partial is not None:
            return state
        # a block's first site: phase 1 for the block's sites
        sites = range(site, min(site + self.config.block_size, self.shape.n_sites))
        return dataclasses.replace(state, lead=self.lead_reads(state.cache, sites))

    def sublayer_input(self, state: Any, site: int) -> Tensor:  # a BlockState, or a subclass's (see AttnRes)
        if self.uses_history:
            return self.history_read(site, len(state.blocks), state.partial_slot)
        if state.cache is not None:
            return self.merged_read(state, site)
        return self.route(state.sources(), site)

    def update(self, state: Any, site: int, output: Tensor) -> BlockState:  # state: as sublayer_input's
        partial = output if state.partial is None else state.partial + output
        closed = state.filled + 1 == self.config.block_size
        if self.uses_history:
            return self.write_history(state, site, partial, closed)
        if closed and state.cache is not None:
            cache = self.cache_write(state.cache, partial)
            return BlockState(blocks=[], cache=cache)
        if closed:
            return BlockState(blocks=state.blocks + [partial])
        # the lead serves the block's later sites; the final state keeps none
        lead = state.lead if site + 1 < self.shape.n_sites else None
        return BlockState(blocks=state.blocks, partial=partial, filled=state.filled + 1, cache=state.cache, lead=lead)

    def lead_reads(self, cache: DepthCache, sites: range) -> Lead:
        """Phase 1: the reads of `sites` over the cache's completed blocks at once, from their cached
        scores (each block met every route's query when it was written)."""
        return depth_cache.lead(cache, sites)

    def merged_read(self, state: BlockState, site: int) -> Tensor:
        """Phase 2: the site's read over the completed blocks, from the lead, with the partial block
        merged in by log-sum-exp (`depth_cache.merge`). The per-site read of `route` over state.sources()."""
        lead, cache, constants = state.lead, state.cache, self.step_constants
        if cache is None or lead is None or not lead.first <= site < lead.first + lead.out.shape[1]:
            raise RuntimeError(f"{self.name}: the two-phase read of site {site} before its block's phase 1")
        assert constants is not None
        compute = cache.buffers.logits.dtype
        partial = None if state.partial is None else state.partial.to(compute)
        n_src = cache.count + (partial is not None)
        out, partial_weight = depth_cache.merge(lead, cache, site, partial, constants, self.read_scale(n_src))
        if self.recorder is not None:
            self.record(site, self.merged_weights(cache, site, partial_weight))
        return out.to(cache.buffers.values.dtype)

    def merged_weights(self, cache: DepthCache, site: int, partial_weight: Tensor | None) -> Tensor:
        """The depth weights [N, B, T, H] of a two-phase read (for the recorder): the completed blocks'
        softmax over their cached scores, times 1 - w_p, and the partial block's w_p, if any."""
        b, t, _ = cache.buffers.shape
        blocks = depth_cache.depth_weights(torch.softmax(cache.buffers.route_rows[site], -1), cache.count, b, t)
        if partial_weight is None:
            return blocks
        w_p = partial_weight.view(b, t, -1)
        return torch.cat([blocks * (1 - w_p), w_p.unsqueeze(0)])

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
        if self.config.readout and state.cache is not None:
            readout = range(self.shape.n_sites, self.shape.n_sites + 1)
            return self.merged_read(dataclasses.replace(state, lead=self.lead_reads(state.cache, readout)),
                                    self.shape.n_sites)
        if self.config.readout:
            return self.route(state.sources(), self.shape.n_sites)
        return self.stream(state)

    def stream(self, state: BlockState) -> Tensor:
        if state.cache is not None:
            blocks = state.cache.buffers.values[:, :state.cache.count].sum(1).view(state.cache.buffers.shape)
            return blocks if state.partial is None else blocks + state.partial
        return torch.stack(state.sources()).sum(0)
