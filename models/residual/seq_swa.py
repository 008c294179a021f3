"""Sequence-axis ShortSWA (Residual Stream Duality, https://arxiv.org/abs/2603.16039; variants.md 9).

The note's recommended block, per Transformer layer l, with H the residual stream entering it:

    S  = H + ShortSWA_l(RMSNorm_l(H); w)
    A  = S + Attn(Norm(S))
    H' = A + MLP(Norm(A))

ShortSWA_l is causal sliding-window attention over tokens: token t reads itself and the w - 1
tokens before it in its own row, never left padding (a token at position p, counted from its
row's first real token, reads the min(w, p + 1) latest real tokens), with bias-free d x d maps
W_Q, W_K, W_V, W_O and its own RMSNorm (with a gain), per head h of d_h = d / heads channels:

    x_j = RMSNorm_l(H_j),   q_t = W_Q x_t,   k_j = W_K x_j,   v_j = W_V x_j
    z_t = W_O concat_h sum_{j = t-w+1..t} softmax_j(q_t[h] . k_j[h] / sqrt(d_h)) v_j[h]

The backbone's sublayers are untouched: the pathway runs ShortSWA_l in `prepare` at the
attention site of layer l (site 2l) and hands the attention S; both updates are pre-norm's.

Choices the note leaves open, each a knob:
- `heads` (default 1): the note's read is one softmax, `softmax(q K^T / sqrt(d_k)) V` with the
  whole width as d_k (its depth form is the same read, and `depth_swa`'s projected mode keeps
  one head too); heads=H splits q, k and v into H heads of d/H, as the backbone's attention does,
  one softmax over the window per head.
- `window` (default 8): the note gives no w; 8 is `depth_swa`'s default window over depth
  (Kimi's "W=8"), so the two placements of the same read compare at the same window.
- `rope` (default True): the note does not say how a token sees order inside the window; with
  RoPE (the backbone's theta, each token rotated by its position) the scores depend on the
  offset as in the backbone's attention; False makes the window an unordered set.

Init: W_Q, W_K and W_V are N(0, init_std^2), drawn in float32 from private generators (seeded
from the run seed and the layer) so the backbone's init and the global RNG are untouched; W_O is
zero and the gain one. Every ShortSWA then adds exactly zero: the model is `prenorm`'s function
exactly (a declared identity; no read is rescaled, so there is no `stream_scale` knob). As with
any zero-initialised output map, only W_O gets a gradient at the first step.

Decoding: a new token's ShortSWA needs, per layer, the keys and values (after RoPE) of the w - 1
slots before it. `carry` hands them on from the final state ([B, heads, w - 1, d_h] each, per
layer, the slots of padding or before the row included: they are never read), `resume` gives
them to the next tokens with their positions; nothing is carried when w = 1. Keys and values are
carried rather than the normed inputs: twice the bytes (2 d per slot and layer, L (w - 1) 2 d per
row in all) but no projection recomputed per step.

Parameters: L (4 d^2 + d).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reslab.models.layers import RMSNorm, Rotary, zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway, private_generator
from reslab.models.residual.mhar import heads_errors

# private generator seed of layer l's W_Q, W_K, W_V: constant + l
_INIT_SEED = 0x5E05_0000

KeysValues = tuple[Tensor, Tensor]  # keys and values [B, heads, slots, d_h]


class ShortSWA(nn.Module):
    """One layer's ShortSWA: its RMSNorm, W_Q, W_K, W_V, W_O and the causal window read."""

    def __init__(self, shape: ModelShape, window: int, heads: int, rope: bool, layer: int):
        super().__init__()
        d = shape.d_model
        self.window, self.heads, self.head_dim = window, heads, d // heads
        self.norm = RMSNorm(d, shape.norm_eps)
        maps: list[nn.Linear] = [nn.utils.skip_init(nn.Linear, d, d, bias=False) for _ in range(3)]
        gen = private_generator(_INIT_SEED + layer)
        with torch.no_grad():
            for linear in maps:
                linear.weight.copy_(torch.randn(d, d, generator=gen, dtype=torch.float32) * shape.init_std)
        self.q_proj, self.k_proj, self.v_proj = maps
        self.o_proj = zero_linear(d, d)
        self.rotary = Rotary(self.head_dim, shape.rope_theta) if rope else None

    def forward(self, h: Tensor, positions: Tensor, earlier: KeysValues | None) -> tuple[Tensor, KeysValues | None]:
        """ShortSWA of the stream h [B, T, D] at `positions` [B, T]: z [B, T, D], and the keys and
        values of the last w - 1 slots for the tokens after these (None when w = 1). `earlier` holds
        those of the w - 1 slots before these tokens (None: there are none)."""
        b, t, _ = h.shape
        w, heads, e = self.window, self.heads, self.head_dim
        x = self.norm(h)
        q, k, v = (m(x).view(b, t, heads, e).transpose(1, 2) for m in (self.q_proj, self.k_proj, self.v_proj))
        if self.rotary is not None:                                              # [B, heads, T, e] each
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if earlier is None:
            earlier = (k.new_zeros(b, heads, w - 1, e), v.new_zeros(b, heads, w - 1, e))
        keys = torch.cat([earlier[0], k], 2)                                     # [B, heads, w-1+T, e]
        values = torch.cat([earlier[1], v], 2)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        qc = q.to(compute)

        def lagged(x: Tensor, lag: int) -> Tensor:
            """Each token's slot `lag` tokens back: [B, heads, T, e]."""
            return x[:, :, w - 1 - lag: w - 1 - lag + t].to(compute)

        scores = torch.stack([(qc * lagged(keys, lag)).sum(-1) for lag in range(w)], -1) / math.sqrt(e)
        lags = torch.arange(w, device=h.device)
        # a token at position p reads lags 0..min(p, w-1); a padding token (p < 0) reads only itself,
        # which keeps its softmax finite (its output is never read)
        seen = (lags <= positions.unsqueeze(-1)) | (lags == 0)                   # [B, T, w]
        weights = torch.softmax(scores.masked_fill(~seen.unsqueeze(1), float("-inf")), -1)  # [B, heads, T, w]
        read = weights[..., 0, None] * lagged(values, 0)                         # [B, heads, T, e]
        for lag in range(1, w):
            read = read + weights[..., lag, None] * lagged(values, lag)
        z = self.o_proj(read.to(h.dtype).transpose(1, 2).reshape(b, t, -1))
        if w == 1:
            return z, None
        # copies: the next tokens keep w - 1 slots, not the whole chunk's keys and values
        return z, (keys[:, :, t:].clone(), values[:, :, t:].clone())


@dataclass
class Window:
    """What the ShortSWAs of these tokens read besides the tokens themselves."""

    positions: Tensor                          # [B, T] each token's position in its row, negative on padding
    earlier: tuple[KeysValues, ...] | None     # per layer, the w - 1 slots before these tokens (decoding)


@dataclass
class SeqSWAState:
    h: Tensor                                  # [B, T, D] the residual stream
    window: Window | None = None               # set by resume; dropped once the last layer's ShortSWA read it
    tails: tuple[KeysValues, ...] = ()         # per layer so far, its last w - 1 slots (w > 1), for `carry`


@register("seq_swa")
class SeqSWA(ResidualPathway):
    """Knobs:
        window: w, the tokens each ShortSWA reads: the token itself and the w - 1 before it. w = 1
            is a per-token map (W_O W_V RMSNorm(H)). Default: 8.
        heads: softmax heads of ShortSWA; must divide d_model (and leave an even head width
            with rope). Default: 1 (the note's single read).
        rope: rotate queries and keys by their positions (the backbone's RoPE). Default: True.
    """
    throughput_note = "its extra work is matmuls, which the FLOP count includes"

    identities = (
        Identity("W_O starts at zero: every ShortSWA adds nothing, S = H, and the block is pre-norm's"),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        window: int = 8
        heads: int = 1
        rope: bool = True

        def __post_init__(self):
            if self.window < 1:
                raise ValueError(f"window: {self.window} is not allowed; allowed: an integer >= 1 (1: the token alone)")
            if self.heads < 1:
                raise ValueError(f"heads: {self.heads} is not allowed; allowed: an integer >= 1 dividing d_model")

    @classmethod
    def check_shape(cls, config: SeqSWA.Config, shape: ModelShape) -> list[str]:
        errors = super().check_shape(config, shape) + heads_errors(config.heads, shape)
        if not errors and config.rope and (shape.d_model // config.heads) % 2:
            errors.append(f"heads: {config.heads} leaves an odd head width d_model/heads="
                          f"{shape.d_model // config.heads}, which RoPE cannot rotate; allowed: heads leaving an "
                          "even width, or rope: false")
        return errors

    def __init__(self, config: SeqSWA.Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        self.swa = nn.ModuleList(ShortSWA(shape, config.window, config.heads, config.rope, layer)
                                 for layer in range(shape.n_layers))

    def start(self, embedding: Tensor) -> SeqSWAState:
        return SeqSWAState(h=embedding)

    def resume(self, state: SeqSWAState, carry: tuple[KeysValues, ...] | None, positions: Tensor) -> SeqSWAState:
        return dataclasses.replace(state, window=Window(positions, carry))

    def carry(self, state: SeqSWAState) -> tuple[KeysValues, ...] | None:
        return state.tails or None

    def prepare(self, state: SeqSWAState, site: int) -> SeqSWAState:
        if site % 2:
            return state
        window, layer = state.window, site // 2
        if window is None:
            raise RuntimeError(f"seq_swa: prepare({site}) on a state that `resume` has not given its positions")
        z, tail = self.swa[layer](state.h, window.positions, None if window.earlier is None else window.earlier[layer])
        last = layer == self.shape.n_layers - 1
        return SeqSWAState(h=state.h + z, window=None if last else window,
                           tails=state.tails if tail is None else (*state.tails, tail))

    def stage_send(self, state: SeqSWAState, site: int) -> tuple[Tensor, ...]:
        """The stream h alone: the next stage rebuilds the window from the tokens' positions (a training
        forward's, 0..T-1 in every row), and the tails are the carry of decoding, which never crosses stages."""
        return (state.h,)

    def stage_receive(self, tensors: Sequence[Tensor], site: int) -> SeqSWAState:
        (h,) = tensors
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        return SeqSWAState(h=h, window=Window(positions, None))

    def sublayer_input(self, state: SeqSWAState, site: int) -> Tensor:
        return state.h

    def update(self, state: SeqSWAState, site: int, output: Tensor) -> SeqSWAState:
        return dataclasses.replace(state, h=state.h + output)

    def readout(self, state: SeqSWAState) -> Tensor:
        return state.h

    def decode_state_elems(self) -> tuple[int, int]:
        """(d, L (w - 1) 2 d): the stream per token; per row, each layer's keys and values of w - 1 slots."""
        d = self.shape.d_model
        return d, self.shape.n_layers * (self.config.window - 1) * 2 * d
