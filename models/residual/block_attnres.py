"""Block Attention Residuals (Kimi Team, arXiv 2603.15031; variants.md section 1.2).

The 2L sublayers are cut into blocks of `block_size` consecutive sublayers. Sources are the
embedding `b_0 = e`, every completed block's plain sum of sublayer outputs `b_n`, and the current
block's partial sum when it is non-empty. Routing, keys, queries and the readout are as in Full
AttnRes; `block_size=1` is Full AttnRes exactly. Kimi's code counts `block_size` in sublayers
(boundaries fall at `layer % (block_size/2) == 0`); any size >= 1 is accepted here, an odd one
simply puts boundaries between an attention and its MLP.

Decoding reads in two phases, as Kimi serves it (variants.md 1.4): the queries are static, so
at the first site of a block the reads of all its sites over the completed blocks are one
batched step (phase 1, `lead_reads`: the block's queries times key gains [S, D] against the
completed blocks' RMS-normalised keys, one product, giving each site its read and its
log-sum-exp); then site by site the partial block is merged in by the online-softmax
(log-sum-exp) merge (phase 2, `merged_read`). It is the same function as the per-site read
(tests/models/test_decoding.py holds it to the full forward in float64). It is the decode path
of `impl="reference"`: it runs when `resume` gets a carry (a decode step; prefill and the
training forward keep the per-site read), for the static softmax read only (Kimi's ablations
read per site). With `impl="triton"` a decode step reads through the history kernel instead,
keeping its buffer from step to step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import DECODING, Identity


def block_size_errors(block_size: int, shape: ModelShape) -> list[str]:
    """A block longer than the 2L sublayers never closes: the same function as block_size = 2L."""
    if block_size <= shape.n_sites:
        return []
    return [f"block_size: {block_size} exceeds the model's 2L={shape.n_sites} sublayers (n_layers="
            f"{shape.n_layers}); allowed: 1..{shape.n_sites}"]


@dataclass
class Lead:
    """Phase 1 of the two-phase read: every site of the current block read over the completed blocks."""

    first: int        # the block's first site; site s is row s - first
    out: Tensor       # [S, B, T, D] each site's read over the N completed blocks (compute dtype)
    logits: Tensor    # [S, N, B, T, H] its logits
    lse: Tensor       # [S, B, T, H] their log-sum-exp over the N blocks


@dataclass
class BlockState:
    blocks: list[Tensor]            # [b_0 = e, b_1, ..., b_{n-1}], each [B, T, D]
    partial: Tensor | None = None   # the current block's running sum, None right after a boundary
    filled: int = 0                 # sublayers already summed into `partial`
    partial_slot: int = -1          # the depth-history slot of `partial` (kernels only), -1 for none
    decoding: bool = False          # a decode step: reads in two phases
    lead: Lead | None = None        # decoding: phase 1 of the current block, until its last site

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

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        # the two-phase decode read needs static queries and the plain softmax read of `route`
        self.two_phase = not self.ablated and not self.uses_history and type(self).route is AttnRes.route

    def start(self, embedding: Tensor) -> BlockState:
        return BlockState(blocks=[self.as_source(embedding)])

    def resume(self, state: Any, carry: Any, positions: Tensor) -> Any:  # a BlockState, or a subclass's
        decoding = carry is not None
        if self.uses_history:  # the sources live in this pass's history buffer
            return BlockState(blocks=[self.open_history(state.blocks[0], decoding).source(0)])
        return dataclasses.replace(state, decoding=decoding and self.two_phase)

    def carry(self, state: Any) -> Any:
        """Nothing from earlier tokens; DECODING when the next calls decode on a path of their own
        (two phases, or the kernels' history kept from step to step)."""
        return DECODING if self.two_phase or self.uses_history else None

    def decode_state_elems(self) -> tuple[int, int]:
        """((1 + 2L // S + p) d, 0) for blocks of S sublayers: e, the completed blocks and, when the last
        is partly filled (p = 1), its partial sum. With the kernels the history buffer holds 2L + 1
        slots (the completed blocks and every partial-block state), the partial sum besides: (2L + 1 + p) d."""
        sites, size = self.shape.n_sites, self.config.block_size
        partial = int(sites % size > 0)
        slots = sites + 1 if self.uses_history else 1 + sites // size
        return (slots + partial) * self.shape.d_model, 0

    def prepare(self, state: Any, site: int) -> Any:
        if not state.decoding or state.partial is not None:
            return state
        # a block's first site: phase 1 for the block's sites
        sites = range(site, min(site + self.config.block_size, self.shape.n_sites))
        return dataclasses.replace(state, lead=self.lead_reads(state.blocks, sites))

    def sublayer_input(self, state: Any, site: int) -> Tensor:  # a BlockState, or a subclass's (see AttnRes)
        if self.uses_history:
            return self.history_read(site, len(state.blocks), state.partial_slot)
        if state.decoding:
            return self.merged_read(state, site)
        return self.route(state.sources(), site)

    def update(self, state: Any, site: int, output: Tensor) -> BlockState:  # state: as sublayer_input's
        partial = output if state.partial is None else state.partial + output
        closed = state.filled + 1 == self.config.block_size
        if self.uses_history:
            return self.write_history(state, site, partial, closed)
        if closed:
            return BlockState(blocks=state.blocks + [partial], decoding=state.decoding)
        # the lead serves the block's later sites; the final state keeps none
        lead = state.lead if site + 1 < self.shape.n_sites else None
        return BlockState(blocks=state.blocks, partial=partial, filled=state.filled + 1, decoding=state.decoding,
                          lead=lead)

    def lead_reads(self, blocks: list[Tensor], sites: range) -> Lead:
        """Phase 1: the reads of `sites` over the completed `blocks` at once. Their queries times key
        gains [S, D] against the blocks' keys in one product; the keys' RMS is applied after it."""
        values = torch.stack(blocks)                                                   # [N, B, T, D]
        compute = torch.float64 if values.dtype == torch.float64 else torch.float32
        n, b, t, d = values.shape
        v = values.to(compute).view(n, b, t, self.heads, d // self.heads)              # [N, B, T, H, D/H]
        inv_rms = torch.rsqrt(v.pow(2).mean((-2, -1)) + self.shape.norm_eps)           # [N, B, T]
        qg = (self.queries[sites.start:sites.stop] * self.key_gains[sites.start:sites.stop]).to(compute)
        qg = qg.view(len(sites), self.heads, d // self.heads)                         # [S, H, D/H]
        logits = torch.einsum("nbthe,she->snbth", v, qg) * inv_rms.unsqueeze(-1)       # [S, N, B, T, H]
        lse = torch.logsumexp(logits, 1)                                               # [S, B, T, H]
        out = torch.einsum("snbth,nbthe->sbthe", torch.exp(logits - lse.unsqueeze(1)), v)
        return Lead(sites.start, out.flatten(-2), logits, lse)

    def merged_read(self, state: BlockState, site: int) -> Tensor:
        """Phase 2: the site's read over the completed blocks, from the lead, with the partial block
        merged in by log-sum-exp: w_p = exp(l_p - lse'), the blocks' read rescaled by exp(lse - lse'),
        lse' = log(exp(lse) + exp(l_p)). The per-site read of `route` over state.sources()."""
        lead = state.lead
        if lead is None or not lead.first <= site < lead.first + lead.out.shape[0]:
            raise RuntimeError(f"{self.name}: the two-phase read of site {site} before its block's phase 1")
        row = site - lead.first
        out, logits, lse = lead.out[row], lead.logits[row], lead.lse[row]             # [B,T,D], [N,B,T,H], [B,T,H]
        n_src = len(state.blocks)
        if state.partial is not None:
            h, d = self.heads, out.shape[-1]
            p = state.partial.to(out.dtype)                                            # [B, T, D]
            ph = p.unflatten(-1, (h, d // h))                                          # [B, T, H, D/H]
            qg = (self.queries[site] * self.key_gains[site]).to(out.dtype).view(h, d // h)
            l_p = (ph * qg).sum(-1) * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + self.shape.norm_eps)  # [B,T,H]
            merged = torch.logaddexp(lse, l_p)
            old, new = torch.exp(lse - merged), torch.exp(l_p - merged)                # [B, T, H]
            out = (out.unflatten(-1, (h, d // h)) * old.unsqueeze(-1) + ph * new.unsqueeze(-1)).flatten(-2)
            logits, lse, n_src = torch.cat([logits, l_p.unsqueeze(0)]), merged, n_src + 1
        if self.recorder is not None:
            self.record(site, torch.exp(logits - lse.unsqueeze(0)))
        return self.scaled(out.to(state.blocks[0].dtype), n_src)

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
        if self.config.readout and state.decoding:
            readout = range(self.shape.n_sites, self.shape.n_sites + 1)
            return self.merged_read(dataclasses.replace(state, lead=self.lead_reads(state.blocks, readout)),
                                    self.shape.n_sites)
        if self.config.readout:
            return self.route(state.sources(), self.shape.n_sites)
        return self.stream(state)

    def stream(self, state: BlockState) -> Tensor:
        return torch.stack(state.sources()).sum(0)
