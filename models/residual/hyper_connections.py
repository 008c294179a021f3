"""Hyper-Connections (Zhu et al., https://arxiv.org/abs/2409.19606; variants.md section 8.3).

The residual is a hidden matrix H in R^{n x d} per token: the embedding replicated n times. For
sublayer k the sublayer reads h_in = A_m^T H and writes H' = B^T u + A_r^T H, where u is the
sublayer's output; stream j becomes sum_i A_r[i, j] H_i + B[j] u.

Static HC (SHC) learns A_m (n), A_r (n x n) and B (n) per sublayer. Dynamic HC (DHC) adds
input-dependent terms (the paper's Eq. 11-13):

    Hbar   = RMSNorm(H)                               per stream, parameter-free
    A_m(H) = A_m + s_a * tanh(Hbar W_m)               W_m in R^{d x 1}
    A_r(H) = A_r + s_a * tanh(Hbar W_r)               W_r in R^{d x n}
    B(H)   = B   + s_b * tanh(Hbar W_b)^T             W_b in R^{d x 1}

W = [W_m | W_r | W_b] is one zero-initialised bias-free nn.Linear(d, n+2) per sublayer (decayed
like every matrix), and s_a, s_b are learnable scalars per sublayer initialised to
`dynamic_scale_init` (0.01, as in public reimplementations of the paper's Algorithm 2). The
norm has no gain: a gain g would be absorbed by W (diag(g) W). Zero W means s_a
and s_b get no gradient until W has moved (one optimizer step).

Init "static" (the paper): A_m = e_{k mod n}, A_r = I, B = 1. Every stream then receives every
update, so all n streams equal the pre-norm stream h = e + sum_i f_i and the sublayer reads h
itself: the model computes `prenorm`'s function at init, and the readout n*h differs from h only
inside the final RMSNorm's epsilon. Init "mhar_baseline" (the n=4 HC baseline in the MHAR code,
8.3): A_m = softmax(a) with a = 0.02 randn (the dynamic term, if any, is added to a before the
softmax), A_r = I + 0.02 randn (the code applies its matrix as A H, we as A_r^T H: the same
distribution) and B = e_0 + 0.02 randn, so every sublayer writes mainly into
stream 0 and reads a near-uniform mix; this is not `prenorm` at init. Its random parts come from
a private generator seeded with a constant plus the site index, so the backbone's init (global
RNG) is the same as in every other arm with the same seed. The static coefficients are plain
parameters and so are not weight-decayed: decay would pull A_r = I and B = 1 away from the
residual.

Readout: the sum of the n streams (the paper) or, with `stream_scale` (default), their mean (the
MHAR code). Only the final RMSNorm reads it, and RMSNorm(n h, eps) = RMSNorm(h, eps / n^2): the two
are the same function up to its eps, but only the mean is `prenorm`'s readout at the shipped eps
(static init: n h has n^2 times the stream's mean square). `stream` is the sum either way (the
effective-depth CKA is scale-free). Nothing is recorded for the routing diagnostics: A_m, A_r
and B mix parallel streams, not depth sources, and are not normalised distributions, so they do
not fit the [N, B, T, H] depth-weight contract.

Interventions (`models.interventions`): the read of site k (2L: the readout) weighs the n streams
("stream0", ...). "source" removes one stream from one read, "stream" from every read: "zero" sets
its weight to 0, renormalising the others where the read normalises (A_m of "mhar_baseline" is a
softmax; the `stream_scale` readout is a mean: the mean of the rest), and "mean" replaces the
stream by its mean over the eval windows in the read. The coefficients (A_m, A_r, B, dynamic
included) are computed from the unmodified streams, and the write H' = A_r^T H + B^T u is untouched:
only what the sublayers and the head read changes.

Parameters per sublayer: n^2 + 2n (SHC); DHC adds d(n+2) + 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from reslab.models.layers import rms_norm, zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway, private_generator

# private generator seed for the "mhar_baseline" init: constant + site index
_MHAR_INIT_SEED = 0x4843_0000
_MHAR_INIT_STD = 0.02


@dataclass
class HCState:
    streams: Tensor                  # [B, T, n, D]
    site: int = -1                   # the site whose coefficients prepare computed below
    a_m: Tensor | None = None        # [n] or [B, T, n]
    a_r: Tensor | None = None        # [n, n] or [B, T, n, n]
    b: Tensor | None = None          # [n] or [B, T, n]


@register("hyper_connections")
class HyperConnections(ResidualPathway):
    """Knobs:
        streams: n, the number of parallel residual streams (expansion rate). Default: 4.
        init: "static" (paper: A_m = e_{k mod n}, A_r = I, B = 1; prenorm's function at init) or
            "mhar_baseline" (MHAR code: A_m = softmax(0.02 randn), A_r = I + 0.02 randn,
            B = e_0 + 0.02 randn, from a private per-site generator). Default: "static".
        dynamic: False is SHC; True is DHC (adds s * tanh(RMSNorm(H) W) with W zero-init).
            Default: False.
        dynamic_scale_init: initial value of the DHC scales s_a and s_b. Default: 0.01.
        stream_scale: read out the mean of the n streams (the MHAR code), which at static init is
            the pre-norm stream itself, so the final RMSNorm acts as prenorm's at any eps; False
            reads out their sum (the paper; n h at init). Default: True.
    """

    intervention_kinds = ("source", "stream")
    identities = (
        Identity("static init (A_m = e_k, A_r = I, B = 1): every stream is the pre-norm stream, and so is "
                 "the readout, their mean"),
        Identity("one stream is prenorm exactly", options={"streams": 1}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        streams: int = 4
        init: Literal["static", "mhar_baseline"] = "static"
        dynamic: bool = False
        dynamic_scale_init: float = 0.01
        stream_scale: bool = True

        def __post_init__(self):
            if self.streams < 1:
                raise ValueError(f"streams must be >= 1, got {self.streams}")

    def __init__(self, config: Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        n, sites, d = config.streams, shape.n_sites, shape.d_model
        read, mix, write = self._initial_coefficients(n, sites)
        self.read = nn.Parameter(read)     # A_m, or its softmax logits for "mhar_baseline"
        self.mix = nn.Parameter(mix)       # A_r
        self.write = nn.Parameter(write)   # B
        if config.dynamic:
            self.dynamic = nn.ModuleList(zero_linear(d, n + 2) for _ in range(sites))
            self.scale_a = nn.Parameter(torch.full((sites,), config.dynamic_scale_init))
            self.scale_b = nn.Parameter(torch.full((sites,), config.dynamic_scale_init))

    def _initial_coefficients(self, n: int, sites: int) -> tuple[Tensor, Tensor, Tensor]:
        dtype = torch.get_default_dtype()
        if self.config.init == "static":
            read = torch.zeros(sites, n)
            read[torch.arange(sites), torch.arange(sites) % n] = 1.0
            return read, torch.eye(n).repeat(sites, 1, 1), torch.ones(sites, n)
        reads, mixes, writes = [], [], []
        for site in range(sites):
            gen = private_generator(_MHAR_INIT_SEED + site)
            # drawn in float32 so the init does not depend on the default dtype
            noise = torch.randn(n + n * n + n, generator=gen, dtype=torch.float32).to(dtype) * _MHAR_INIT_STD
            reads.append(noise[:n])
            mixes.append(torch.eye(n) + noise[n:n + n * n].view(n, n))
            e0 = torch.zeros(n)
            e0[0] = 1.0
            writes.append(e0 + noise[n + n * n:])
        return torch.stack(reads), torch.stack(mixes), torch.stack(writes)

    def coefficients(self, streams: Tensor, site: int) -> tuple[Tensor, Tensor, Tensor]:
        """A_m [..., n], A_r [..., n, n] (rows: source stream) and B [..., n] at `site`."""
        n = self.config.streams
        read, mix, write = self.read[site], self.mix[site], self.write[site]
        if self.config.dynamic:
            hbar = rms_norm(streams, self.shape.norm_eps)                    # [B, T, n, D]
            dyn = torch.tanh(self.dynamic[site](hbar))                       # [B, T, n, n+2]
            read = read + self.scale_a[site] * dyn[..., 0]                   # [B, T, n]
            mix = mix + self.scale_a[site] * dyn[..., 1:n + 1]               # [B, T, n, n]
            write = write + self.scale_b[site] * dyn[..., n + 1]             # [B, T, n]
        if self.config.init == "mhar_baseline":
            read = torch.softmax(read, dim=-1)
        return read, mix, write

    def start(self, embedding: Tensor) -> HCState:
        n = self.config.streams
        return HCState(embedding.unsqueeze(-2).expand(*embedding.shape[:-1], n, embedding.shape[-1]))

    def prepare(self, state: HCState, site: int) -> HCState:
        return HCState(state.streams, site, *self.coefficients(state.streams, site))

    def _prepared(self, state: HCState, site: int, step: str) -> tuple[Tensor, Tensor, Tensor]:
        """(A_m, A_r, B) that `prepare(state, site)` computed."""
        if state.site != site or state.a_m is None or state.a_r is None or state.b is None:
            raise RuntimeError(f"hyper_connections: {step}({site}) before prepare({site}) on this state")
        return state.a_m, state.a_r, state.b

    def sublayer_input(self, state: HCState, site: int) -> Tensor:
        read, _, _ = self._prepared(state, site, "sublayer_input")
        streams = state.streams
        if self.intervention is not None:
            read, streams = self.weighted_sources(site, self.stream_labels(), read.expand(streams.shape[:-1]), streams,
                                                  normalised=self.config.init == "mhar_baseline")
        return torch.einsum("...i,...id->...d", read, streams)

    def source_labels(self, site: int) -> list[str]:
        return self.stream_labels()

    def stream_labels(self) -> list[str]:
        return [f"stream{i}" for i in range(self.config.streams)]

    def update(self, state: HCState, site: int, output: Tensor) -> HCState:
        _, mix, write = self._prepared(state, site, "update")
        carried = torch.einsum("...ij,...id->...jd", mix, state.streams)   # A_r^T H, [B, T, n, D]
        return HCState(carried + write.unsqueeze(-1) * output.unsqueeze(-2))

    def decode_state_elems(self) -> tuple[int, int]:
        """(n d, 0): the n streams."""
        return self.config.streams * self.shape.d_model, 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """(n d, 0): the n streams (the coefficients `prepare` computes belong to one site and are not kept)."""
        return self.config.streams * self.shape.d_model, 0

    def readout(self, state: HCState) -> Tensor:
        """The mean of the n streams with `stream_scale`, else their sum."""
        if self.intervention is not None:
            n, streams = self.config.streams, state.streams
            weights = streams.new_full(streams.shape[:-1], 1.0 / n if self.config.stream_scale else 1.0)
            weights, streams = self.weighted_sources(self.shape.n_sites, self.stream_labels(), weights, streams,
                                                     normalised=self.config.stream_scale)
            return torch.einsum("...i,...id->...d", weights, streams)
        total = self.stream(state)
        return total / self.config.streams if self.config.stream_scale else total

    def stream(self, state: HCState) -> Tensor:
        """The sum of the n streams."""
        return state.streams.sum(-2)
