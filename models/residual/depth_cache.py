"""The decode path of the AttnRes family's static softmax read on the reference implementation: a depth cache.

A decode step runs the new token of every row through the 2L sublayers. With static pseudo-queries (Full
AttnRes, MHAR, Block AttnRes and Block MHAR at their default knobs) a source's score for a route,
`q_r[h] g_r[h] . v[h] / rms(v)` per depth head h (the RMS over the full width, variants.md 1.1 and 2.1),
depends on the source alone. So the cache scores each source once, when it is written, for every route at
once (one batched product with every route's query times key gain, times the source's inverse RMS), and a
route's read is a softmax over its row of scores and one batched product with the sources. Block AttnRes
reads in two phases on top of it (`lead` and `merge`, Kimi's decoding: the reads of a block's sites over the
completed blocks in one step, then each site's partial block merged in by log-sum-exp).

The buffers (`DepthBuffers`) persist from step to step, one set per batch shape, dtype and device (like the
kernels' history buffer): each step first fills the scores with -inf, so a slot not yet written weighs
exactly zero and every read covers all N slots without slicing, and every slot a read weighs was written
earlier in the same step. A state that holds the cache stays valid through its step; the next step
overwrites the buffers. Per-slot and per-route views are made once with the buffers: on the CPU a decode
step at batch 1 costs what its tensor operations cost to dispatch, so the cache keeps them few.

Shape legend: B batch, T tokens, H depth heads, E = D / H, N slots (sources), R routes, S a block's sites.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the depth reads compute in: float64 for float64 sources, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class StepConstants:
    """What a decode step's writes and reads multiply by, from the parameters (static within the step), in
    the compute dtype, detached (decoding never trains): `qg` [H, R, E] every route's query times key gain
    per head, `route_qg` its R rows [H, E], `eps` (0-d) the key RMSNorm's eps, `zero` (0-d) the ignored
    addend of `baddbmm`."""

    qg: Tensor
    route_qg: tuple[Tensor, ...]
    eps: Tensor
    zero: Tensor

    @classmethod
    def of(cls, queries: Tensor, key_gains: Tensor, heads: int, eps: float, like: Tensor) -> StepConstants:
        """From `queries` and `key_gains` [R, D], for sources like `like` [B, T, D]."""
        routes, d = queries.shape
        compute = compute_dtype(like.dtype)
        qg = (queries * key_gains).detach().to(compute).view(routes, heads, d // heads).transpose(0, 1).contiguous()
        scalars = torch.tensor([eps, 0.0], dtype=compute, device=like.device)
        return cls(qg, tuple(qg.unbind(1)), scalars[0], scalars[1])


class DepthBuffers:
    """A decode step's sources and scores, kept for the next steps of the same shape (see the module
    docstring). `values` [B T H, N, E]: the sources in slot order, in their own dtype; `logits` [R, B T H, N]:
    every written source's score for every route, in the compute dtype, -inf where no source is written yet.
    `shape` is (B, T, D). The views: `value_slots[i]` [B, T, H, E] and `score_slots[i]` [R, B T, H] write
    slot i, `route_rows[r]` [B T H, N] is route r's scores."""

    def __init__(self, like: Tensor, heads: int, slots: int, routes: int):
        b, t, d = like.shape
        self.shape = (b, t, d)
        self.key = (b, t, heads, slots, routes, like.dtype, like.device)
        bth, e = b * t * heads, d // heads
        self.values = torch.zeros(bth, slots, e, dtype=like.dtype, device=like.device)
        self.logits = torch.empty(routes, bth, slots, dtype=compute_dtype(like.dtype), device=like.device)
        self.value_slots = [self.values[:, i].view(b, t, heads, e) for i in range(slots)]
        self.score_slots = [self.logits[:, :, i].view(routes, b * t, heads) for i in range(slots)]
        self.route_rows = list(self.logits.unbind(0))

    def fits(self, like: Tensor, heads: int, slots: int, routes: int) -> bool:
        b, t, _ = like.shape
        return self.key == (b, t, heads, slots, routes, like.dtype, like.device)


@dataclass
class DepthCache:
    """One decode step's view of its `DepthBuffers`: the first `count` slots are written (a state that
    holds it reads only those, so states kept from earlier sites of the step stay valid)."""

    buffers: DepthBuffers
    count: int = 0

    def values(self) -> Tensor:
        """[B T H, N, E] the sources in the compute dtype (a copy only when their own dtype differs)."""
        return self.buffers.values.to(self.buffers.logits.dtype)


def open_cache(kept: DepthBuffers | None, first: Tensor, constants: StepConstants, slots: int) -> DepthCache:
    """A step's cache with `first` [B, T, D] (the embedding) in slot 0: in `kept` when it fits, else in new
    buffers (the caller keeps `cache.buffers` for the next step)."""
    heads, routes = constants.qg.shape[0], constants.qg.shape[1]
    buffers = kept if kept is not None and kept.fits(first, heads, slots, routes) else None
    if buffers is None:
        buffers = DepthBuffers(first, heads, slots, routes)
    buffers.logits.fill_(float("-inf"))
    return write(DepthCache(buffers), first, constants)


def inverse_rms(x: Tensor, eps: Tensor) -> Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim of `x` [..., D], keeping it: [..., 1]."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1]).rsqrt_()


def write(cache: DepthCache, source: Tensor, constants: StepConstants) -> DepthCache:
    """`cache` with `source` [B, T, D] in its next slot and that source's score for every route."""
    buffers, slot = cache.buffers, cache.count
    (b, t, _), (heads, _, e) = source.shape, constants.qg.shape
    buffers.value_slots[slot].copy_(source.view(b, t, heads, e))
    x = source.to(buffers.logits.dtype)
    scores = torch.bmm(constants.qg, x.view(b * t, heads, e).permute(1, 2, 0))              # [H, R, B T]
    torch.mul(scores.permute(1, 2, 0), inverse_rms(x, constants.eps).view(1, b * t, 1),
              out=buffers.score_slots[slot])
    return DepthCache(buffers, slot + 1)


def read(cache: DepthCache, route: int, scale: float, constants: StepConstants) -> tuple[Tensor, Tensor]:
    """Route `route`'s read over the written sources, times `scale`: out [B, T, D] in the compute dtype,
    and the softmax weights [B T H, N] (zero on the slots not written)."""
    weights = torch.softmax(cache.buffers.route_rows[route], -1)                          # [B T H, N]
    out = torch.baddbmm(constants.zero, weights.unsqueeze(1), cache.values(), beta=0, alpha=scale)
    return out.view(cache.buffers.shape), weights


def depth_weights(weights: Tensor, count: int, b: int, t: int) -> Tensor:
    """Read weights [B T H, N] as the recorder takes them, [n, B, T, H] over the `count` written slots."""
    return weights.view(b, t, -1, weights.shape[-1])[..., :count].permute(3, 0, 1, 2)


@dataclass
class Lead:
    """Phase 1 of Block AttnRes's two-phase read: sites first..first+S-1 read over the completed blocks."""

    first: int        # the block's first site; site s is row s - first
    out: Tensor       # [B T H, S, E] each site's read over the completed blocks (compute dtype, unscaled)
    neg_lse: Tensor   # [S, B T H] minus the log-sum-exp of its scores over the completed blocks


def lead(cache: DepthCache, sites: range) -> Lead:
    """Phase 1: the reads of `sites` over the cache's blocks at once (one softmax, one batched product)."""
    logits = cache.buffers.logits[sites.start:sites.stop]                                 # [S, B T H, N]
    weights = torch.softmax(logits, -1)
    # log-sum-exp = max logit - log(its weight), the weight of the largest logit is at least 1 / N
    neg_lse = weights.amax(-1).log_().sub_(logits.amax(-1))                              # [S, B T H]
    return Lead(sites.start, torch.bmm(weights.transpose(0, 1), cache.values()), neg_lse)


def merge(lead_: Lead, cache: DepthCache, site: int, partial: Tensor | None, constants: StepConstants,
          scale: float) -> tuple[Tensor, Tensor | None]:
    """Phase 2: site `site`'s read from its lead row with the partial block `partial` [B, T, D] (compute
    dtype; None right after a boundary) merged in: its weight w_p = exp(l_p - lse') = sigmoid(l_p - lse),
    lse' = log(exp(lse) + exp(l_p)), the blocks' read times 1 - w_p; times `scale`. Returns out [B, T, D]
    and w_p [B T, H] (None without a partial block)."""
    row = site - lead_.first
    out = lead_.out[:, row]                                                               # [B T H, E]
    if partial is None:
        return (out * scale).view(cache.buffers.shape), None
    b, t, d = cache.buffers.shape
    heads, e = constants.qg.shape[0], constants.qg.shape[2]
    ph = partial.view(b * t, heads, e)
    scores = (ph * constants.route_qg[site]).sum(-1)                                     # [B T, H]
    inv = inverse_rms(partial, constants.eps).view(b * t, 1)
    weight = torch.addcmul(lead_.neg_lse[row].view(b * t, heads), scores, inv).sigmoid_()
    merged = torch.lerp(out, ph.view(b * t * heads, e), weight.view(-1, 1)).mul_(scale)
    return merged.view(b, t, d), weight
