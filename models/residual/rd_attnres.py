"""Role-Decoupled Attention Residuals (arXiv 2608.01075; variants.md section 4).

Parent: Block AttnRes (or Full AttnRes with `parent="full"`). The attention site of every layer
routes twice over the SAME sources: the QK route (the parent's query and key gain) feeds the
query/key projections, a second value route (own pseudo-query) feeds the value projection through
`value_input`, and the backbone passes it through the same pre-norm. MLP sites and the readout
keep the parent's single route. With zero queries (Kimi's recipe, also used for the V query) the
V route starts equal to the QK route, so RD starts as its parent. The paper counts one extra
d-vector per layer, so the default V route reuses the QK route's key gain ("shared"); the
matching released code (wdlctc/delta-attention-residuals-code, `v_res_norm`) has its own gain
("separate", 2d per layer).

Every read, the V route's included, is multiplied by `read_scale` (the parent's `stream_scale`:
N for a softmax over N sources), so both routes start as the pre-norm stream and the shared
pre-norm sees prenorm's input at init at any eps.

Interventions (`models.interventions`): as the parent's (`attnres` labels with parent="full",
`block_attnres`'s otherwise); a source removed at an attention site leaves both routes, QK and V,
which read the same sources ("zero": dropped from both softmaxes, or from the "fixed" V route's
uniform mean; "mean": replaced in both). A read left with nothing is zero.

Routing records: attention sites report route "qk" and route "v"; MLP sites and the readout
(site 2L) report the parent's unnamed route "". `js_divergence(recorder)` turns a recorded pass
into the per-site Jensen-Shannon divergence between the QK and V depth distributions, which
`diagnostics` reports at every evaluation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read, depth_read2
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.attnres import AttnRes
from reslab.models.residual.base import Identity, RoutingRecorder, block_sources, full_sources
from reslab.models.residual.block_attnres import BlockAttnRes, BlockState


@dataclass
class RDState(BlockState):
    # an attention site's two reads, [B, T, D] each, set by prepare (learned and tied V routes)
    qk_read: Tensor | None = None
    value_read: Tensor | None = None


@register("rd_attnres")
class RDAttnRes(BlockAttnRes):
    """Knobs (plus those of `block_attnres`: query_init, query_init_std, readout, block_size, stream_scale):
        parent: "block" (the paper's parent, Block AttnRes over `block_size` sublayers) or
            "full" (Full AttnRes: one source per sublayer; `block_size` is then ignored).
            Default: "block".
        value_route: "learned" (the paper: the V route has its own pseudo-query, initialised
            like the QK query so both routes start equal), "tied" (the V route reuses the QK
            route's query and key gain and runs a second time: the parent's function exactly,
            and the paper's "duplicated routing execution" control), or "fixed" (a non-learned
            V route with uniform weights, i.e. the mean of the sources, which is the learned
            route's zero-query starting point frozen; the paper's "fixed value route" control),
            or "merged" (the parameter-count control: the learned V route's parameters and both
            reads, averaged into the one input that feeds Q, K and V alike, so nothing is
            decoupled; the paper: the gain, -0.0301 nats at 120M and -0.0247 at 343M over Block
            AttnRes, "is not reproduced by the extra parameter count"). Default: "learned".
        value_key_norm: key RMSNorm gain of the learned V route: "shared" (the QK route's gain;
            +1d per layer, the paper's count) or "separate" (its own gain, initialised to ones;
            +2d per layer, the released code). Ignored unless value_route is "learned" or "merged".
            Default: "shared".
    """

    identities = (
        Identity("the learned V query starts as a copy of the QK query: RD starts as its parent",
                 options={"query_init": "normal"}, equals="block_attnres", equals_options={"query_init": "normal"}),
        Identity("a tied V route runs the parent's route twice: the parent's function",
                 options={"value_route": "tied", "query_init": "normal"}, equals="block_attnres",
                 equals_options={"query_init": "normal"}),
        Identity("the same with Full AttnRes as the parent",
                 options={"value_route": "tied", "parent": "full", "query_init": "normal"}, equals="attnres",
                 equals_options={"query_init": "normal"}),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config(BlockAttnRes.Config):
        parent: Literal["block", "full"] = "block"
        value_route: Literal["learned", "tied", "fixed", "merged"] = "learned"
        value_key_norm: Literal["shared", "separate"] = "shared"

    @classmethod
    def check_shape(cls, config: RDAttnRes.Config, shape: ModelShape) -> list[str]:
        if config.parent == "full":  # block_size is ignored
            return []
        return super().check_shape(config, shape)

    supports_ablations = False

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        n_layers, d = shape.n_layers, shape.d_model
        self.value_queries: nn.Parameter | None = None
        self.value_key_gains: nn.Parameter | None = None
        if config.value_route in ("learned", "merged"):
            # a copy of the attention sites' QK queries: zeros under Kimi's recipe, and with
            # query_init="normal" the routes still start equal without drawing more RNG
            self.value_queries = nn.Parameter(self.queries.detach()[0 : shape.n_sites : 2].clone())
            if config.value_key_norm == "separate":
                self.value_key_gains = nn.Parameter(torch.ones(n_layers, d))

    def start(self, embedding: Tensor) -> RDState:
        return RDState(blocks=[self.as_source(embedding)])

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """The parent's reads, plus the V route's second read at every attention site."""
        reads, sites = 2 * n_layers + int(config.readout), 2 * n_layers
        ns = full_sources(reads) if config.parent == "full" else block_sources(reads, config.block_size)
        return [(n, 1) for n in ns] + [(ns[s], 1) for s in range(0, sites, 2)]

    def decode_state_elems(self) -> tuple[int, int]:
        """The parent's: Block AttnRes's blocks, or with parent="full" the 2L + 1 sources."""
        if self.config.parent == "full":
            return (self.shape.n_sites + 1) * self.shape.d_model, 0
        return super().decode_state_elems()

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """The parent's: Block AttnRes's blocks, or with parent="full" the s + 1 sources before site s."""
        if self.config.parent == "full":
            return (site + 1 if held is None else site - held) * self.shape.d_model, 0
        return super().stage_state_elems(site, held)

    def source_labels(self, site: int) -> list[str]:
        if self.config.parent == "full":
            return AttnRes.source_labels(self, site)
        return super().source_labels(site)

    def read_sources(self, sources: list[Tensor], site: int) -> list[Tensor]:
        """`sources` under the intervention (one dropped, or one replaced by its mean); unchanged without one."""
        if self.intervention is None:
            return sources
        return self.softmax_sources(site, self.source_labels(site), sources)[1]

    def route(self, sources: list[Tensor], site: int) -> Tensor:
        like, sources = sources[0], self.read_sources(sources, site)
        if not sources:  # the only source removed: the read of nothing
            return torch.zeros_like(like)
        out, weights = depth_read(
            sources, self.queries[site], self.key_gains[site],
            heads=self.heads, eps=self.shape.norm_eps, impl=self.impl,
        )
        is_attention = site < self.shape.n_sites and site % 2 == 0
        self.record(site, weights, route="qk" if is_attention else "")
        return self.scaled(out, len(sources))

    def prepare(self, state: RDState, site: int) -> RDState:
        if site % 2 or self.config.value_route == "fixed":
            return state
        if self.config.value_route == "tied":
            query_v, gain_v = self.queries[site], self.key_gains[site]
        else:
            layer = site // 2
            if self.value_queries is None:
                raise RuntimeError(f"rd_attnres: value_route={self.config.value_route!r} has no value queries")
            query_v = self.value_queries[layer]
            gain_v = self.key_gains[site] if self.value_key_gains is None else self.value_key_gains[layer]
        # both routes in one pass over the sources
        sources = self.read_sources(state.sources(), site)
        if not sources:  # the only source removed: both routes read nothing
            nothing = torch.zeros_like(state.sources()[0])
            return dataclasses.replace(state, qk_read=nothing, value_read=nothing)
        qk_read, value_read, weights, weights_v = depth_read2(
            sources, self.queries[site], self.key_gains[site], query_v, gain_v,
            heads=self.heads, eps=self.shape.norm_eps, impl=self.impl,
        )
        self.record(site, weights, route="qk")
        self.record(site, weights_v, route="v")
        n_src = len(sources)
        return dataclasses.replace(state, qk_read=self.scaled(qk_read, n_src),
                                   value_read=self.scaled(value_read, n_src))

    def sublayer_input(self, state: RDState, site: int) -> Tensor:
        if site % 2 or self.config.value_route == "fixed":
            return self.route(state.sources(), site)
        if state.qk_read is None or state.value_read is None:
            raise RuntimeError(f"rd_attnres: sublayer_input({site}) before prepare({site}) on this state")
        if self.config.value_route == "merged":
            return 0.5 * (state.qk_read + state.value_read)
        return state.qk_read

    def value_input(self, state: RDState, site: int) -> Tensor | None:
        if site % 2 or self.config.value_route == "merged":
            return None
        if self.config.value_route == "fixed":
            sources = self.read_sources(state.sources(), site)
            if not sources:  # the only source removed: the read of nothing
                return torch.zeros_like(state.sources()[0])
            n_src = len(sources)
            out = torch.stack(sources).mean(0)                                              # [B, T, D]
            if self.recorder is not None:
                self.record(site, torch.full((n_src, *out.shape[:-1], 1), 1.0 / n_src), route="v")
            return self.scaled(out, n_src)
        if state.value_read is None:
            raise RuntimeError(f"rd_attnres: value_input({site}) before prepare({site}) on this state")
        return state.value_read

    def diagnostics(self, layer_states: list[RDState], routing: RoutingRecorder) -> dict[str, Any]:
        """"js_divergence" per attention site ({str(site): nats}, `js_divergence`) and its mean
        "rd_js_mean"."""
        js = js_divergence(routing)
        if not js:
            return {}
        return {"js_divergence": {str(site): value for site, value in js.items()},
                "rd_js_mean": sum(js.values()) / len(js)}

    def update(self, state: RDState, site: int, output: Tensor) -> RDState:
        partial = output if state.partial is None else state.partial + output
        if self.config.parent == "full" or state.filled + 1 == self.config.block_size:
            return RDState(blocks=state.blocks + [partial])
        return RDState(blocks=state.blocks, partial=partial, filled=state.filled + 1)


def jensen_shannon(p: Tensor, q: Tensor, dim: int = 0) -> Tensor:
    """JS divergence (nats, in [0, ln 2]) between distributions along `dim`."""
    m = 0.5 * (p + q)

    def kl(a: Tensor) -> Tensor:
        return (a * (a.clamp_min(1e-30).log() - m.clamp_min(1e-30).log())).sum(dim)

    return 0.5 * kl(p) + 0.5 * kl(q)


def js_divergence(recorder: RoutingRecorder) -> dict[int, float]:
    """Per attention site, the JS divergence (nats) between the QK and V depth distributions.

    The recorder keeps token-averaged (head-averaged) weights, so this is the divergence of the
    mean routes; by joint convexity it is a lower bound on the mean per-token divergence, which
    `jensen_shannon` gives when applied to raw [N, ...] weights.
    """
    out = {}
    for (site, route), stats in sorted(recorder.sites.items()):
        if route == "qk" and (site, "v") in recorder.sites:
            out[site] = float(jensen_shannon(stats.weights, recorder.sites[(site, "v")].weights))
    return out
