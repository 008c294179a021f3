"""Delta Attention Residuals, per sublayer (Luo, Cai, Hu, https://arxiv.org/abs/2605.18855; variants.md 5).

Sources are deltas: the embedding and every earlier sublayer's raw output, `[e, f_0, ..., f_{s-1}]`
for sublayer `s`. Routing is additive: the sublayer's pre-norm reads

    h_hat_s = h + sum_i alpha_i v_i,    alpha = softmax_i(w_s . RMSNorm_{g_s}(v_i))

while the stream `h` itself is updated exactly as in `prenorm`, `h <- h + f_s(Norm(h_hat_s))`, and
is read out directly (no final route). With zero queries `h_hat = (1 + 1/N) h`, so the literal
read is `prenorm`'s function at init only up to the RMSNorm eps (variants.md 0.1).

The read's scale (`stream_scale`, a choice the paper leaves open). h_hat feeds only the
sublayer's RMSNorm, and RMSNorm(c x, eps) = RMSNorm(x, eps / c^2). With `stream_scale` (default)
the read is h_hat / c_s, with c_s = 1 + g0 p0 / N_s the constant that a zero query multiplies the
stream by at site s: N_s sources (the null source included), g0 the gate's initial value (1 for
"bias", sigmoid(sigmoid_gate_init) for the sigmoid gates, gate_init for "learnable_alpha"), p0 the
pre-gate's initial value (1/2 with `pre_gated`, else 1), and c_s = 1 at a site without real
sources. At init the sublayer then reads the pre-norm stream h itself (prenorm's function at any
eps); away from init it is the paper's h_hat with the site's eps divided by c_s^2 (c_s <= 2 with
the default gate). A c_s <= 0 (a gate_init <= -N_s) leaves the read unscaled.
`stream_scale=False` is the literal h_hat (the behaviour before issue 20).

Choices that follow the released code (wdlctc/delta-attention-residuals-code, fc11c3e570f4):
- Layer 0's attention has no sources (its input is the stream) unless `route_first`; with a null
  source it reads `h + null` (the softmax over the single null source is 1). The code allocates a
  query and key gain there that can never get a gradient; we do not, so the pathway has
  4dL - 2d parameters (4dL with `route_first`) where the paper counts 4d per layer.
- Gates: every gate is written as `h + g * sum_i alpha_i v_i`, which is the code's
  `(1 - g) h + g h_hat` exactly (h_hat - h is the routed sum).
- `pre_gated`: the code's `pre_gated` mode also drops the embedding source and ignores the
  gate and null knobs; here it is an orthogonal knob over the same sources (null included).
- The entropy bonus averages the per-site entropy over all 2L sites (unrouted and single-source
  sites count 0, as the code's zero entries do) and over tokens and heads.

Interventions (`models.interventions`): a source of a site's routed sum ("null", "emb", "s3" = what
site 3 wrote: its output, or with cumulative sources the stream after it) is removed from that
site's read only: "zero" drops it from the softmax (the other weights renormalise; a routed sum left
with nothing adds nothing to h, and `stream_scale` counts the values read), "mean" replaces it by its
mean over the eval windows (before the pre-gate, which then applies as usual) and its weight is
computed from that mean. The stream h itself, which the read adds to, is untouched; the readout
reads h and has no source to remove.

A variant with random inits (`query_init="normal"`) draws from private generators seeded with
`QUERY_SEED + site`, never the global RNG, so every arm with the same seed gets the same
backbone weights. All other parameters start at constants.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read
from reslab.models.layers import zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import Identity, ResidualPathway, entropy_of, full_sources, private_generator

QUERY_SEED = 2605_18855


@dataclass
class DeltaState:
    stream: Tensor                   # [B, T, D] the ordinary pre-norm stream h
    sources: list[Tensor]            # the depth history, each [B, T, D]
    mark: Tensor | None = None       # delta_block: the stream at the last block boundary
    # one scalar per routed site, added by prepare (only when entropy_bonus > 0)
    entropies: tuple[Tensor, ...] = ()
    read: Tensor | None = None       # [B, T, D] the pending site's routed input h_hat, set by prepare


@register("delta_attnres")
class DeltaAttnRes(ResidualPathway):
    """Knobs:
        query_init: "zero" (the paper; identity with prenorm at init) or "normal" (the released
            train_scratch.py: N(0, query_init_std^2), HF's nn.Linear init). Default: "zero".
        query_init_std: std of the "normal" init. Default: 0.02.
        heads: H, the query split into H contiguous slices each with its own softmax over depth
            (MHAR, variants.md 2.1); H=1 is the paper. Default: 1.
        route_first: let layer 0's attention route over [e] (only the null source otherwise, or
            nothing: the released code gives it no routing). Default: False.
        null_source: a learnable zero-initialised vector prepended as source 0 at every site,
            so the softmax can attend to "nothing"; +2d per layer. Default: False.
        gate: how the routed sum meets the stream, `h + g * sum_i alpha_i v_i` with
            "bias": g = 1 (no gate, the code's default);
            "sigmoid_scalar": g = sigmoid(c), one c per site, init `sigmoid_gate_init`;
            "sigmoid_vector": g = sigmoid(W h + b) per dimension, W = 0, b = `sigmoid_gate_init`;
            "learnable_alpha": g = a, one a per site, init `gate_init` (0: exact identity).
            Default: "bias".
        gate_init: the initial `a` of "learnable_alpha". At a = 0, dL/dw ~ a = 0, so the router
            learns only once the gate opens (variants.md 5.4); a small nonzero value lets it
            learn from step 0 at the cost of exact identity. Default: 0.0.
        sigmoid_gate_init: the initial logit of the sigmoid gates (sigmoid(-2) ~ 0.12).
            Default: -2.0.
        entropy_bonus: lambda >= 0; adds -lambda * H(alpha) (site-, token- and head-averaged)
            to the loss through `aux_loss`. Default: 0.0.
        sources: "delta" (the paper: e and the sublayer outputs f_i = h_{i+1} - h_i) or
            "cumulative" (the states h_0 = e, h_1, ..., h_s themselves, the last being the
            current stream; additive routing unchanged). The paper's routing contrast: max
            weight ~0.6 over deltas vs ~0.2 over cumulative states (variants.md 5.5).
            "cumulative" does not start at the pre-norm function (h + mean_i h_i is not
            proportional to h). Default: "delta".
        pre_gated: gate the sources before routing, V' = sigmoid(W_g h) * V with W_g = 0 and
            bias 0 (d^2 + d per site, decayed like any nn.Linear); keys are RMSNorm(V').
            Default: False.
        stream_scale: divide h_hat by the constant c_s that a zero query multiplies the stream by
            (see the module docstring), so that the sublayer's RMSNorm sees prenorm's input at init
            at any eps; False feeds the literal h_hat = (1 + 1/N) h at init. Default: True.
    """

    intervention_kinds: ClassVar[tuple[str, ...]] = ("source",)
    identities: ClassVar[tuple[Identity, ...]] = (
        Identity("zero queries: h_hat = (1 + 1/N) h, which stream_scale divides by 1 + 1/N: the pre-norm stream"),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        query_init: Literal["zero", "normal"] = "zero"
        query_init_std: float = 0.02
        heads: int = 1
        route_first: bool = False
        null_source: bool = False
        gate: Literal["bias", "sigmoid_scalar", "sigmoid_vector", "learnable_alpha"] = "bias"
        gate_init: float = 0.0
        sigmoid_gate_init: float = -2.0
        entropy_bonus: float = 0.0
        pre_gated: bool = False
        sources: Literal["delta", "cumulative"] = "delta"
        stream_scale: bool = True

        def __post_init__(self):
            if self.heads < 1:
                raise ValueError(f"heads must be >= 1, got {self.heads}")
            if self.query_init_std <= 0:
                raise ValueError(f"query_init_std must be > 0, got {self.query_init_std}")
            if not (self.entropy_bonus >= 0 and math.isfinite(self.entropy_bonus)):
                raise ValueError(f"entropy_bonus must be a finite number >= 0, got {self.entropy_bonus}")

    @classmethod
    def check_shape(cls, config: Any, shape: ModelShape) -> list[str]:  # a cls.Config: delta_block re-types it
        from reslab.models.residual.mhar import heads_errors

        return super().check_shape(config, shape) + heads_errors(config.heads, shape)

    def __init__(self, config: DeltaAttnRes.Config, shape: ModelShape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d, n_sites = shape.d_model, shape.n_sites
        # sites with real sources get a query and a key gain; routed sites (sources or a null) get gates
        self.first_query_site = 0 if config.route_first else 1
        self.first_routed_site = 0 if (config.route_first or config.null_source) else 1
        n_query, n_routed = n_sites - self.first_query_site, n_sites - self.first_routed_site

        self.queries = nn.Parameter(self._initial_queries(n_query, d))        # [S_q, D]
        self.key_gains = nn.Parameter(torch.ones(n_query, d))                 # [S_q, D]
        self.null_sources = nn.Parameter(torch.zeros(n_sites, d)) if config.null_source else None
        self.gate_logits = self.gate_alphas = self.gate_projs = self.pre_gates = None
        if config.gate == "sigmoid_scalar":
            self.gate_logits = nn.Parameter(torch.full((n_routed,), config.sigmoid_gate_init))
        elif config.gate == "learnable_alpha":
            self.gate_alphas = nn.Parameter(torch.full((n_routed,), config.gate_init))
        elif config.gate == "sigmoid_vector":
            self.gate_projs = nn.ModuleList(zero_linear(d, d, bias=config.sigmoid_gate_init) for _ in range(n_routed))
        if config.pre_gated:
            self.pre_gates = nn.ModuleList(zero_linear(d, d, bias=0.0) for _ in range(n_routed))

    def _initial_queries(self, n_query: int, d: int) -> Tensor:
        if self.config.query_init == "zero":
            return torch.zeros(n_query, d)
        rows = []
        for i in range(n_query):
            gen = private_generator(QUERY_SEED + self.first_query_site + i)
            rows.append(torch.randn(d, generator=gen) * self.config.query_init_std)
        return torch.stack(rows)

    # --- sources ---------------------------------------------------------------------------
    def site_sources(self, state: DeltaState, site: int) -> list[Tensor]:
        """The real (non-null) sources sublayer `site` routes over."""
        return state.sources if site >= self.first_query_site else []

    def start(self, embedding: Tensor) -> DeltaState:
        return DeltaState(stream=embedding, sources=[self.as_source(embedding)])

    def source_labels(self, site: int) -> list[str]:
        """The values of the routed sum of `site` ("null" first, when present); none at the readout."""
        if site >= self.shape.n_sites or site < self.first_routed_site:
            return []
        return (["null"] if self.null_sources is not None else []) + self.real_labels(site)

    def real_labels(self, site: int) -> list[str]:
        """The labels of `site_sources(state, site)`: the embedding and what sites 0..site-1 wrote."""
        return ["emb"] + [f"s{i}" for i in range(site)] if site >= self.first_query_site else []

    def update(self, state: DeltaState, site: int, output: Tensor) -> DeltaState:
        stream = state.stream + output
        new_source = output if self.config.sources == "delta" else self.as_source(stream)
        return DeltaState(stream, state.sources + [new_source], entropies=state.entropies)

    # --- the read --------------------------------------------------------------------------
    def _gate(self, index: int, h: Tensor) -> Tensor | None:
        if self.gate_logits is not None:
            return torch.sigmoid(self.gate_logits[index])
        if self.gate_alphas is not None:
            return self.gate_alphas[index]
        if self.gate_projs is not None:
            return torch.sigmoid(self.gate_projs[index](h))                   # [B, T, D]
        return None

    def prepare(self, state: DeltaState, site: int) -> DeltaState:
        read, entropy = self._route(state, site)
        entropies = state.entropies if entropy is None else (*state.entropies, entropy)
        return dataclasses.replace(state, read=read, entropies=entropies)

    def sublayer_input(self, state: DeltaState, site: int) -> Tensor:
        if state.read is None:
            raise RuntimeError(f"{self.name}: sublayer_input({site}) before prepare({site}) on this state")
        return state.read

    def initial_gain(self) -> float:
        """g0 p0: what the gate and the pre-gate multiply the routed sum by at init."""
        c = self.config
        if c.gate == "bias":
            gate = 1.0
        elif c.gate == "learnable_alpha":
            gate = c.gate_init
        else:  # the sigmoid gates: sigmoid(W h + b) with W = 0, or sigmoid(c), start at sigmoid(init)
            gate = float(torch.sigmoid(torch.tensor(c.sigmoid_gate_init, dtype=torch.float64)))
        return gate * (0.5 if c.pre_gated else 1.0)

    def read_scale(self, n_values: int, has_sources: bool) -> float:
        """c_s of the module docstring for a site routing over `n_values` values (the null source
        included); 1.0 without `stream_scale`, without real sources or when c_s <= 0."""
        if not self.config.stream_scale or not has_sources:
            return 1.0
        scale = 1.0 + self.initial_gain() / n_values
        return scale if scale > 0 else 1.0

    def _route(self, state: DeltaState, site: int) -> tuple[Tensor, Tensor | None]:
        """h_hat of sublayer `site` (divided by `read_scale`) and, with an entropy bonus, the
        entropy of its routing weights."""
        h = state.stream                                                      # [B, T, D]
        sources = self.site_sources(state, site)
        if site < self.first_routed_site:
            return h, None
        values = list(sources)
        if self.null_sources is not None:
            values.insert(0, self.null_sources[site].expand_as(h))
        if self.intervention is not None:
            _, values, _ = self.softmax_sources(site, self.source_labels(site), values)
            if not values:  # the routed sum of nothing
                return h, None
        routed = site - self.first_routed_site
        if self.pre_gates is not None:
            pre = torch.sigmoid(self.pre_gates[routed](h))                    # [B, T, D]
            values = [pre * v for v in values]
        gate = self._gate(routed, h)
        entropy = None
        if not sources:
            # only the null source: the softmax over one source is 1
            weights = h.new_ones(1, *h.shape[:2], self.config.heads, dtype=torch.float32)
            out = h + (values[0] if gate is None else gate * values[0])
        else:
            q = site - self.first_query_site
            read = dict(heads=self.config.heads, eps=self.shape.norm_eps, impl=self.impl)
            if gate is None:
                out, weights = depth_read(values, self.queries[q], self.key_gains[q], residual=h, **read)
            else:
                selected, weights = depth_read(values, self.queries[q], self.key_gains[q], **read)
                out = h + gate * selected
            if self.config.entropy_bonus > 0:
                entropy = entropy_of(weights)
        self.record(site, weights)                                            # [N, B, T, H]
        scale = self.read_scale(len(values), bool(sources))
        return (out if scale == 1.0 else out / scale), entropy

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """One read of the full history of deltas at every site (no readout route)."""
        return [(n, 1) for n in full_sources(2 * n_layers)]

    def decode_state_elems(self) -> tuple[int, int]:
        """(elements of the final state, 0): the stream h and the sources, `n_state_tensors` of d each, plus
        with an entropy bonus one scalar per site with real sources (the entropies `aux_loss` sums)."""
        n = self.shape.n_sites
        return self.n_state_tensors(n) * self.shape.d_model + self.n_entropies(n), 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """(`n_state_tensors(s)` d, the entropies so far) before site s: the state after s sublayers; the
        entropy bonus's scalars are one per micro-batch, not per token."""
        return self.n_state_tensors(site) * self.shape.d_model, self.n_entropies(site)

    def n_entropies(self, sites: int) -> int:
        """With an entropy bonus, one scalar per site among the first `sites` that has real sources."""
        return max(sites - self.first_query_site, 0) if self.config.entropy_bonus > 0 else 0

    def n_state_tensors(self, sites: int) -> int:
        """[B, T, D] tensors of the state after `sites` sublayers: e, f_1, ..., f_s and the stream h (s + 2; the
        stream is the sum of the others, kept to save the sum); with cumulative sources h is the last source
        (s + 1)."""
        return sites + (2 if self.config.sources == "delta" else 1)

    def readout(self, state: DeltaState) -> Tensor:
        return state.stream

    def stream(self, state: DeltaState) -> Tensor:
        """The ordinary pre-norm stream h (what the final norm reads)."""
        return state.stream

    def aux_loss(self, state: DeltaState) -> Tensor | None:
        if self.config.entropy_bonus == 0 or not state.entropies:
            return None
        mean_entropy = torch.stack(state.entropies).sum() / self.shape.n_sites
        return -self.config.entropy_bonus * mean_entropy
