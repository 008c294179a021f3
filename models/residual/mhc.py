"""Manifold-constrained Hyper-Connections, mHC (DeepSeek, https://arxiv.org/abs/2512.24880; variants.md 8.4).

RECONSTRUCTION. variants.md 8.4 is marked "from memory; verify". The equations below match the
paper's Eq. 3 and 7-9 and its Table 5 (n = 4, gating factor init 0.01, 20 Sinkhorn-Knopp
iterations) as read in a public transcription of the paper; the initial biases are not given
there, so they are this module's choice and are exposed as knobs. Treat the init as the
platform's design, not DeepSeek's.

The residual is x in R^{n x C} per token (the embedding replicated n times). Per sublayer:

    xt     = RMSNorm(vec(x))                                   parameter-free, over all nC
    H_pre  = sigmoid(a_pre  * xt phi_pre  + b_pre)             [n]
    H_post = 2 sigmoid(a_post * xt phi_post + b_post)          [n]
    H_res  = SinkhornKnopp(a_res * mat(xt phi_res) + b_res)    [n, n], doubly stochastic
    sublayer input = H_pre x,   x' = H_res x + H_post^T u      x'_i = sum_j H_res[i, j] x_j + H_post[i] u

phi = [phi_pre | phi_post | phi_res] is one bias-free nn.Linear(nC, n^2 + 2n) per sublayer
(decayed like every matrix); the paper absorbs the RMSNorm gain into phi, hence no gain here.
a_* are learnable scalars, b_* learnable biases. `sinkhorn(logits, iters)` follows the paper's
order M_t = T_row(T_col(M_{t-1})) from M_0 = exp(logits), computed in log space.

Variant "lite" (mHC-lite, https://arxiv.org/abs/2601.05732): H_res = sum_k w_k P_k, a convex
combination of all n! permutation matrices P_k with w = softmax(a_res * xt phi_res + b_res),
phi_res in R^{nC x n!}. It is exactly doubly stochastic with no iterations.

Init (the platform's choice): phi = 0 (as HC's dynamic weights), so the coefficients start
input-independent and a_* gets no gradient until phi has moved; a_* = `alpha_init`.
b_post = 0 gives H_post = 1 (HC's B = 1). b_res puts `res_init_diag` on the diagonal of H_res
and spreads the rest evenly (both variants give the same initial H_res). `pre_init="hc"` sets
b_pre = +pre_logit on stream k mod n and -pre_logit elsewhere, so H_pre ~ e_{k mod n} (HC's A_m);
`pre_init="uniform"` sets b_pre = 0 (equal weights). Either way every stream starts equal and
stays equal at init (H_res is doubly stochastic, H_post uniform), the sublayer reads a multiple
of the pre-norm stream, which `stream_scale` (below) removes: the model computes `prenorm`'s
function at init at the shipped eps. With "uniform" the streams are symmetric under permutation,
so gradient descent keeps them identical forever (an n-fold copy of one stream); "hc" breaks the
symmetry as HC does.

The read's scale (`stream_scale`, the platform's choice). The sublayer input H_pre x and the
readout feed only an RMSNorm, and RMSNorm(c x, eps) = RMSNorm(x, eps / c^2) per token. At init the
streams all equal the pre-norm stream h, the sublayer reads sum(H_pre) h (1.04 h with "hc", 2 h
with "uniform") and the sum readout n h: `prenorm`'s function only up to the eps. With
`stream_scale` (default) the sublayer reads the H_pre-weighted mean of the streams,
H_pre x / sum_i H_pre_i (a positive per-token scalar: H_pre is a sigmoid), and the readout is the
mean of the streams: both exactly h at init, so every RMSNorm acts as prenorm's at any eps; away
from init only how eps enters differs. False reads H_pre x and the sum (the literal equations).
`stream` is the sum of the n streams either way (the effective-depth CKA is scale-free).
Nothing is recorded for the routing diagnostics: H_pre, H_post and H_res mix parallel streams,
not depth sources.

Interventions (`models.interventions`): the read of site k (2L: the readout) weighs the n streams
("stream0", ...). "source" removes one stream from one read, "stream" from every read: "zero" sets
its H_pre weight to 0 (with `stream_scale` the read divides by the remaining weights' sum: the
H_pre-weighted mean of the rest, and the readout is the mean of the rest; without it, plain sums
lose the term), "mean" replaces the stream by its mean over the eval windows in the read. H_pre,
H_post and H_res are computed from the unmodified streams and the write is untouched: only what
the sublayers and the head read changes. A read left with no stream is zero.

`residual.impl: liger` (kernels/field/liger.py, the extra `kernels`): liger-kernel's fused mHC computes the
coefficients, the read H_pre x and the write H_res x + H_post^T u from this module's parameters (its own
`LigerMHC` module starts phi random, N(0, 0.02^2); here phi starts at zero as above). Mapping: phi = the
Linear's weight transposed, pre_eps = 0, post_mult = 2, rms_eps = norm_eps, tmax = sinkhorn_iters,
sinkhorn_eps = 0, and the residual logits handed over transposed (liger's Sinkhorn starts on rows and ends on
columns, the paper's on columns and rows), its H_res transposed back: the same function. `stream_scale`
divides outside. Refused in one line: variant "lite". Interventions need `impl="reference"`.

Parameters per sublayer: nC(n^2 + 2n) + (n^2 + 2n) + 3; "lite" has n! in place of n^2.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.common.errors import ConfigError
from reslab.models.layers import rms_norm, zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp on exp(logits) [..., n, n]: `iters` rounds of column then row
    normalisation (mHC Eq. 9), in log space. Rows sum to 1 up to rounding (the last step),
    columns to within the iteration's convergence."""
    log_m = logits
    for _ in range(iters):
        log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)
        log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)
    return log_m.exp()


def permutation_matrices(n: int) -> Tensor:
    """All n! permutation matrices [n!, n, n], the identity first."""
    perms = torch.tensor(list(itertools.permutations(range(n))))                 # [n!, n]
    return torch.eye(n)[perms]


@dataclass
class MHCState:
    streams: Tensor                  # [B, T, n, C]
    site: int = -1                   # the site whose coefficients prepare computed below
    h_pre: Tensor | None = None      # [B, T, n]
    h_post: Tensor | None = None     # [B, T, n]
    h_res: Tensor | None = None      # [B, T, n, n]


@register("mhc")
class MHC(ResidualPathway):
    """Knobs:
        streams: n, the number of parallel residual streams (DeepSeek: 4). Default: 4.
        variant: "mhc" (Sinkhorn-Knopp H_res) or "lite" (mHC-lite: softmax mixture of the n!
            permutation matrices; streams <= 6). Default: "mhc".
        sinkhorn_iters: Sinkhorn-Knopp iterations t_max ("mhc" only). Default: 20.
        alpha_init: initial gating factors a_pre, a_post, a_res (paper Table 5). Default: 0.01.
        res_init_diag: diagonal of H_res at init; off-diagonals are (1 - diag)/(n - 1);
            1/n <= value < 1. Default: 0.95.
        pre_init: "hc" (H_pre ~ e_{k mod n}, HC's A_m; breaks the stream symmetry) or "uniform"
            (b_pre = 0: equal weights; streams stay identical). Default: "hc".
        pre_logit: |b_pre| for pre_init="hc": sigmoid(+-4) = 0.982 / 0.018. Default: 4.0.
        stream_scale: the sublayer reads H_pre x / sum(H_pre) and the readout is the streams' mean,
            the pre-norm stream itself at init (see the module docstring); False reads H_pre x and
            the streams' sum, `prenorm`'s function only up to the RMSNorm eps. Default: True.
    """

    intervention_kinds = ("source", "stream")
    field_impls = ("liger",)  # liger-kernel's fused mHC (module docstring)
    identities = (
        Identity("init: equal streams stay equal (rows of H_res sum to 1, H_post = 1); the sublayer reads "
                 "their H_pre-weighted mean and the readout their mean, the pre-norm stream"),
        Identity("the same for mHC-lite", options={"variant": "lite"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        streams: int = 4
        variant: Literal["mhc", "lite"] = "mhc"
        sinkhorn_iters: int = 20
        alpha_init: float = 0.01
        res_init_diag: float = 0.95
        pre_init: Literal["hc", "uniform"] = "hc"
        pre_logit: float = 4.0
        stream_scale: bool = True

        def __post_init__(self):
            if self.streams < 1:
                raise ValueError(f"streams must be >= 1, got {self.streams}")
            if self.variant == "lite" and self.streams > 6:
                raise ValueError(f"variant='lite' needs streams! permutations; streams <= 6, got {self.streams}")
            if self.sinkhorn_iters < 1:
                raise ValueError(f"sinkhorn_iters must be >= 1, got {self.sinkhorn_iters}")
            if self.streams > 1 and not 1 / self.streams <= self.res_init_diag < 1:
                raise ValueError(f"res_init_diag must be in [1/streams, 1), got {self.res_init_diag}")

    def __init__(self, config: Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        if impl == "liger" and config.variant == "lite":
            raise ConfigError("residual.options.variant: 'lite' is not supported by residual.impl liger "
                              "(liger-kernel's mHC computes a Sinkhorn H_res); allowed: 'mhc', or impl reference")
        n, sites = config.streams, shape.n_sites
        self.n_res = math.factorial(n) if config.variant == "lite" else n * n
        if config.variant == "lite":
            self.register_buffer("perms", permutation_matrices(n), persistent=False)
        self.phi = nn.ModuleList(zero_linear(n * shape.d_model, 2 * n + self.n_res) for _ in range(sites))
        self.alpha = nn.Parameter(torch.full((sites, 3), config.alpha_init))  # [a_pre, a_post, a_res]
        self.bias = nn.Parameter(torch.stack([self._initial_bias(site) for site in range(sites)]))

    def _initial_bias(self, site: int) -> Tensor:
        c, n = self.config, self.config.streams
        if c.pre_init == "hc":
            b_pre = torch.full((n,), -c.pre_logit)
            b_pre[site % n] = c.pre_logit
        else:
            b_pre = torch.zeros(n)
        b_post = torch.zeros(n)
        b_res = torch.zeros(self.n_res)
        if n > 1:
            # the logit that puts `res_init_diag` on every diagonal entry of H_res
            if c.variant == "lite":
                n_perms, fixing = math.factorial(n), math.factorial(n - 1)
                b_res[0] = math.log((c.res_init_diag * (n_perms - 1) - fixing + 1) / (1 - c.res_init_diag))
            else:
                b_res.view(n, n).diagonal().fill_(math.log(c.res_init_diag * (n - 1) / (1 - c.res_init_diag)))
        return torch.cat([b_pre, b_post, b_res])

    def coefficients(self, streams: Tensor, site: int) -> tuple[Tensor, Tensor, Tensor]:
        """H_pre [B, T, n], H_post [B, T, n] and H_res [B, T, n, n] from the streams at `site`."""
        n = self.config.streams
        if self.impl == "liger":
            from reslab.kernels.field.liger import mhc_coefficients

            linear = self.phi[site]
            assert isinstance(linear, nn.Linear)
            return mhc_coefficients(streams, linear.weight, self.alpha[site], self.bias[site],
                                    self.config.sinkhorn_iters, self.shape.norm_eps)
        xt = rms_norm(streams.flatten(-2), self.shape.norm_eps)                 # [B, T, nC]
        proj = self.phi[site](xt)                                               # [B, T, 2n + R]
        alpha, bias = self.alpha[site], self.bias[site]
        pre = alpha[0] * proj[..., :n] + bias[:n]
        post = alpha[1] * proj[..., n:2 * n] + bias[n:2 * n]
        res = alpha[2] * proj[..., 2 * n:] + bias[2 * n:]                       # [B, T, R]
        if self.config.variant == "lite":
            h_res = torch.einsum("...k,kij->...ij", torch.softmax(res, dim=-1), self.perms.to(res.dtype))
        else:
            h_res = sinkhorn(res.unflatten(-1, (n, n)), self.config.sinkhorn_iters)
        return torch.sigmoid(pre), 2 * torch.sigmoid(post), h_res

    def start(self, embedding: Tensor) -> MHCState:
        n = self.config.streams
        return MHCState(embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, embedding.shape[-1]))

    def prepare(self, state: MHCState, site: int) -> MHCState:
        return MHCState(state.streams, site, *self.coefficients(state.streams, site))

    def _prepared(self, state: MHCState, site: int, step: str) -> tuple[Tensor, Tensor, Tensor]:
        """(H_pre, H_post, H_res) that `prepare(state, site)` computed."""
        if state.site != site or state.h_pre is None or state.h_post is None or state.h_res is None:
            raise RuntimeError(f"mhc: {step}({site}) before prepare({site}) on this state")
        return state.h_pre, state.h_post, state.h_res

    def sublayer_input(self, state: MHCState, site: int) -> Tensor:
        h_pre, _, _ = self._prepared(state, site, "sublayer_input")
        if self.intervention is not None:
            return self.weighted_read(site, h_pre, state.streams, self.config.stream_scale)
        if self.impl == "liger":
            from reslab.kernels.field.liger import mhc_read

            read = mhc_read(state.streams, h_pre)
        else:
            read = torch.einsum("...i,...ic->...c", h_pre, state.streams)
        return read / h_pre.sum(-1, keepdim=True) if self.config.stream_scale else read

    def weighted_read(self, site: int, weights: Tensor, streams: Tensor, mean: bool) -> Tensor:
        """sum_i w_i x_i (divided by sum_i w_i when `mean`) under the intervention; 0 when no weight is left."""
        weights, streams = self.weighted_sources(site, self.stream_labels(), weights, streams, normalised=False)
        read = torch.einsum("...i,...ic->...c", weights, streams)
        if not mean:
            return read
        total = weights.sum(-1, keepdim=True)
        return torch.where(total > 0, read / total.where(total > 0, 1.0), read)

    def source_labels(self, site: int) -> list[str]:
        return self.stream_labels()

    def stream_labels(self) -> list[str]:
        return [f"stream{i}" for i in range(self.config.streams)]

    def update(self, state: MHCState, site: int, output: Tensor) -> MHCState:
        _, h_post, h_res = self._prepared(state, site, "update")
        if self.impl == "liger":
            from reslab.kernels.field.liger import mhc_write

            return MHCState(mhc_write(state.streams, output, h_post, h_res))
        mixed = torch.einsum("...ij,...jc->...ic", h_res, state.streams)       # [B, T, n, C]
        return MHCState(mixed + h_post.unsqueeze(-1) * output.unsqueeze(-2))

    def decode_state_elems(self) -> tuple[int, int]:
        """(n d, 0): the n streams."""
        return self.config.streams * self.shape.d_model, 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """(n d, 0): the n streams (the coefficients `prepare` computes belong to one site and are not kept)."""
        return self.config.streams * self.shape.d_model, 0

    def readout(self, state: MHCState) -> Tensor:
        """The mean of the n streams with `stream_scale`, else their sum."""
        if self.intervention is not None:
            ones = state.streams.new_ones(state.streams.shape[:-1])
            return self.weighted_read(self.shape.n_sites, ones, state.streams, self.config.stream_scale)
        total = self.stream(state)
        return total / self.config.streams if self.config.stream_scale else total

    def stream(self, state: MHCState) -> Tensor:
        """The sum of the n streams."""
        return state.streams.sum(-2)
