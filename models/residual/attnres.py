"""Full Attention Residuals (Kimi Team, arXiv 2603.15031; variants.md section 1.1).

Sources are the embedding and every earlier sublayer's raw output, `v_0 = e, v_i = f_i`.
Sublayer `l` reads `h_l = sum_i softmax_i(w_l . RMSNorm_l(v_i)) v_i` (replacement routing: the
running stream is discarded), with a static pseudo-query `w_l` and a key RMSNorm gain per site,
and no 1/sqrt(d) temperature. A final readout route (its own query and gain) over all 2L+1
sources feeds the final norm, as in the released delta/MHAR code. Zero-initialised queries make
every read a uniform mean, which equals the pre-norm stream / N (variants.md 0.1).

The read's scale (`stream_scale`, a choice the paper leaves open). Every read feeds only an
RMSNorm (the sublayer's pre-norm, or the final norm for the readout), which removes a positive
per-token scale only when its eps is negligible against the mean square: RMSNorm(c x, eps) =
RMSNorm(x, eps / c^2). At init the uniform mean's mean square is the stream's / N^2; on the
`tiny` preset (N = 9 at the readout, embedding std 0.02) it is ~6e-6 against eps 1e-6, so the
literal read is NOT prenorm's function at the shipped eps (issue 20: on the quickstart's seeds
the initial loss is +0.02 nats and backbone gradients are off by up to ~45%). With
`stream_scale` (default) each read is multiplied by 1 / w0, where w0 is the weight a zero score
gives every source (1/N for the softmax over N sources, 1/2 for the sigmoid ablation): the read
is `sum_i (N alpha_i) v_i`, at zero queries exactly the pre-norm stream e + sum_i f_i, so the
sublayer's RMSNorm sees what prenorm's sees at any eps. Away from init this is the paper's read
except that the site's RMSNorm acts with eps / N^2 (eps / 4 for sigmoid). The constant is applied
outside the depth-read kernels, which are unchanged. `stream_scale=False` is the literal convex
combination (the behaviour before issue 20).

Parameters: a query (d) and a key gain (d) per site, 4d per layer, +2d for the readout.

Kimi's routing ablations (variants.md 1.5, the 436M model, baseline 1.766, Full AttnRes 1.737,
Block 1.746) are knobs, each starting at the pre-norm function like the default (zero queries,
zero maps and zero mixing logits read every source equally, and `stream_scale` doubles a sigmoid
read, whose zero scores weigh every source 1/2):
    key_norm=False       no RMSNorm on keys: logits q . v_i                     Full 1.743, Block 1.750
    score="sigmoid"      alpha_i = sigmoid(q . k_i), not normalised over sources      1.741
    query_form="input"   input-dependent query q_l = w_l + W_l RMSNorm(s_last), W_l zero-init,
                         +d^2 per site ("W h; extra d x d per layer"; Kimi's sublayer is a layer)  1.731
    query_form="scalar"  input-independent scalar mixing alpha_i = softmax_i(c_{l,i}), static
                         logits per site and source, zero-init; no query, no key norm       1.749
Kimi does not say which hidden state feeds the input-dependent query. AttnRes keeps no running
stream, so it reads the latest source s_last (the preceding sublayer's output, the embedding at
site 0), the depth entry the Residual Stream Duality reading (variants.md 9) queries with. The
ablations run in PyTorch (`ablated_read`), never in the fused kernel.

Interventions (`models.interventions`; `impl="reference"` only, the kernels' history buffer is
refused by `check`): a source ("emb", "s3" = the output of site 3) is removed from one site's read.
"zero" drops it from the softmax (its logit -> -inf: the other weights renormalise); a sigmoid read
simply loses its term. "mean" replaces its value by its mean over the eval windows, and its logit
is computed from that value (key RMSNorm and all) as the read computes every logit. `stream_scale`
counts the sources read: a zero-query read without source j is then e + sum_i f_i - f_j, prenorm's
knock-out exactly. Removing the only source (the embedding at site 0) reads zeros. The scalar
mixing logits stay those of the remaining sources; the input-dependent query reads the unmodified
latest source.

The field's kernels (`residual.impl: fla | liger | flash_attn_res`, `kernels/field`, the extra `kernels`)
compute the static softmax read of `route`, each mapped exactly: the site's pseudo-query and key gain as the
library's query and RMSNorm weight (flash-attn-res, whose key norm has no gain, gets q * g), eps = the model's
`norm_eps`, no logit scale (fla's `scale=1.0`), no fused output norm, the sources in order; `stream_scale`
multiplies their read outside, as it does the reference's. The pseudo-queries are this module's, zero at init
(`query_init`), whatever the library's own modules do (torchtitan#4780: random). fla and liger compute in
float32 and flash-attn-res writes its read in bfloat16 whatever the dtype (held to the reference at those
tolerances by tests/kernels/test_field_impls.py and `bench/bench_impls.py`). Refused in one line: the
ablation knobs (key_norm, score, query_form: the libraries read a static query over RMSNorm keys with a
softmax) and, on subclasses with another read (MHAR's heads, depth-SWA, RD), every field kernel. Decode steps
read through the reference's depth cache below; interventions need `impl="reference"`.

Decoding (`impl="reference"`, the static softmax read): a decode step reads through a depth cache
(`models/residual/depth_cache.py`, `cached_reads`): each source is scored once, when it is written, for
every later route, and each site's read is one softmax and one batched product over the cached scores
and sources. Prefill, the training forward and the ablations read per site (`route`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from reslab.common.errors import ConfigError
from reslab.kernels.depth_read import depth_read
from reslab.kernels.field import FIELD_IMPLS
from reslab.models.layers import rms_norm
from reslab.models.presets import ModelShape
from reslab.models.residual import depth_cache, register
from reslab.models.residual.base import DECODING, Identity, ResidualPathway, full_sources, zero_or_normal
from reslab.models.residual.depth_cache import DepthBuffers, DepthCache, StepConstants, compute_dtype

if TYPE_CHECKING:
    # imported where used: it imports torch._dynamo, which imports triton, which must come after
    # a caller's TRITON_INTERPRET=1
    from reslab.kernels.depth_history import DepthHistory

ABLATION_DEFAULTS = {"key_norm": True, "score": "softmax", "query_form": "static"}


@register("attnres")
class AttnRes(ResidualPathway):
    """Knobs:
        query_init: "zero" (Kimi, MHAR v2; identity with prenorm at init) or "normal" (released
            Delta code and MHAR v1: N(0, query_init_std^2)). Default: "zero".
        query_init_std: std of the "normal" init. Default: 0.02.
        readout: route once more over every source for the final hidden state (released code);
            False feeds the plain sum of sources (the pre-norm stream). Default: True.
        key_norm: RMSNorm (with its gain) on the keys; False is Kimi's "no RMSNorm on keys"
            ablation. Default: True.
        score: "softmax" over sources, or "sigmoid" per source (Kimi's ablation). Default: "softmax".
        query_form: "static" (the pseudo-query), "input" (plus W_l RMSNorm(latest source), W_l zero-init,
            Kimi's input-dependent query) or "scalar" (static per-source mixing logits, Kimi's
            input-independent scalar mixing). Default: "static".
        stream_scale: multiply every read (sites and readout) by 1 / w0, the inverse of the weight
            a zero score gives each source (N for softmax over N sources, 2 for sigmoid), so that a
            zero query reads the pre-norm stream itself and the following RMSNorm sees prenorm's
            input at any eps (see the module docstring); False reads the paper's literal weighted
            mean, prenorm's function only up to the RMSNorm eps. Default: True.
    """

    identities: ClassVar[tuple[Identity, ...]] = (
        Identity("zero pseudo-queries read the uniform mean of the sources, the stream / N, which stream_scale "
                 "multiplies by N: the pre-norm stream itself (Kimi's recipe)"),
        Identity("the same without the readout route", options={"readout": False}),
        Identity("without key RMSNorm a zero query still reads the uniform mean", options={"key_norm": False}),
        Identity("sigmoid scores of a zero query weigh every source 1/2: the stream / 2, scaled by 2",
                 options={"score": "sigmoid"}),
        Identity("a zero query map adds nothing to the zero query", options={"query_form": "input"}),
        Identity("zero scalar mixing logits read the uniform mean", options={"query_form": "scalar"}),
    )

    heads: int = 1  # MHAR overrides this from its knob
    field_impls: ClassVar[tuple[str, ...]] = FIELD_IMPLS  # the static softmax read (module docstring)
    intervention_kinds: ClassVar[tuple[str, ...]] = ("source",)
    # subclasses whose reads do not go through `route` (RD, depth_swa) refuse the ablation knobs
    supports_ablations: ClassVar[bool] = True

    @dataclass(frozen=True, kw_only=True)
    class Config:
        query_init: Literal["zero", "normal"] = "zero"
        query_init_std: float = 0.02
        readout: bool = True
        key_norm: bool = True
        score: Literal["softmax", "sigmoid"] = "softmax"
        query_form: Literal["static", "input", "scalar"] = "static"
        stream_scale: bool = True

    # `config` is an instance of `cls.Config` and the state is whatever `cls.start` builds, so the
    # methods subclasses re-type (check_shape and the forward contract) keep the base's `Any`:
    # AttnRes's own state is the list of sources, block_attnres's a BlockState, rd_attnres's an RDState
    @classmethod
    def check_shape(cls, config: Any, shape: ModelShape) -> list[str]:
        errors = super().check_shape(config, shape)
        if not cls.supports_ablations:
            for knob, default in ABLATION_DEFAULTS.items():
                if getattr(config, knob) != default:
                    errors.append(f"{knob}: {getattr(config, knob)!r} is not supported by {cls.name} (its reads "
                                  f"bypass the AttnRes route); allowed: {default!r}")
        return errors

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        n_routes = self.n_routes()
        d = shape.d_model
        self.queries = nn.Parameter(zero_or_normal((n_routes, d), config.query_init, config.query_init_std))
        self.key_gains = nn.Parameter(torch.ones(n_routes, d))
        self.ablated = any(getattr(config, k) != v for k, v in ABLATION_DEFAULTS.items())
        if impl in FIELD_IMPLS and self.ablated:
            knob = next(k for k, v in ABLATION_DEFAULTS.items() if getattr(config, k) != v)
            raise ConfigError(f"residual.options.{knob}: {getattr(config, knob)!r} is not supported by "
                              f"residual.impl {impl} (it reads a static query over RMSNorm keys with a softmax); "
                              f"allowed: {ABLATION_DEFAULTS[knob]!r}, or impl reference or triton")
        if not config.key_norm:
            self.register_parameter("key_gains", None)  # the gain belongs to the key norm
        self.query_maps: nn.Parameter | None = None
        self.mix_logits: nn.Parameter | None = None
        if config.query_form == "input":
            # one [R, D, D] tensor, not R Linears: site 0 reads one source, so its map gets no gradient
            self.query_maps = nn.Parameter(torch.zeros(n_routes, d, d))
        elif config.query_form == "scalar":
            self.register_parameter("queries", None)
            self.register_parameter("key_gains", None)
            self.mix_logits = nn.Parameter(torch.zeros(n_routes, shape.n_sites + 1))         # [R, max sources]
        # the kernels read a depth-history buffer (kernels/depth_history) when they run the plain
        # static-query read with a readout route; a subclass with its own read keeps the list
        self.uses_history = (impl == "triton" and not self.ablated and config.readout
                             and type(self).route is AttnRes.route)
        self.history: DepthHistory | None = None
        self.decode_history: DepthHistory | None = None  # the decode steps' buffer, kept across steps
        # the reference decodes the static softmax read through a depth cache (`cached_reads`,
        # models/residual/depth_cache.py); a subclass with its own read keeps the list
        self.cached_reads = not self.ablated and not self.uses_history and type(self).route is AttnRes.route
        self.step_constants: StepConstants | None = None  # set by each decode step (`open_cache`)
        self.decode_buffers: DepthBuffers | None = None   # the decode steps' buffers, kept across steps

    def n_routes(self) -> int:
        return self.shape.n_sites + (1 if self.config.readout else 0)

    def read_scale(self, n_sources: int) -> float:
        """The factor a read over `n_sources` sources is multiplied by (`stream_scale`): 1 / w0, with
        w0 the weight a zero score gives each source; 1.0 without `stream_scale`."""
        if not self.config.stream_scale:
            return 1.0
        return 2.0 if self.config.score == "sigmoid" else float(n_sources)

    def scaled(self, out: Tensor, n_sources: int) -> Tensor:
        """`out` times `read_scale(n_sources)`; the read itself (and its kernel) is unchanged."""
        scale = self.read_scale(n_sources)
        return out if scale == 1.0 else out * scale

    def source_labels(self, site: int) -> list[str]:
        """Site k reads the embedding and the outputs of sites 0..k-1; the readout (2L) reads them all."""
        if site == self.shape.n_sites and not self.config.readout:
            return []
        return ["emb"] + [f"s{i}" for i in range(site)]

    def route(self, sources: list[Tensor], site: int) -> Tensor:
        kept, latest = None, sources[-1]
        if self.intervention is not None:
            kept, sources, _ = self.softmax_sources(site, self.source_labels(site), sources)
            if not sources:  # the only source removed: the read of nothing
                return torch.zeros_like(latest)
        if self.ablated:
            out, weights = self.ablated_read(sources, site, kept, latest)
        else:
            out, weights = depth_read(
                sources, self.queries[site], self.key_gains[site],
                heads=self.heads, eps=self.shape.norm_eps, impl=self.impl, need_weights=self.recorder is not None,
            )
        self.record(site, weights)
        return self.scaled(out, len(sources))

    def ablated_read(self, sources: list[Tensor], site: int, kept: list[int] | None = None,
                     latest: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The read under Kimi's ablation knobs (see the module docstring): out [B, T, D] and
        weights [N, B, T, H], in PyTorch. Under an intervention `kept` are the indices of `sources`
        among the site's sources (the scalar mixing logits are per source) and `latest` the site's
        unmodified latest source (what the input-dependent query reads)."""
        values = torch.stack(sources)                                                 # [N, B, T, D]
        compute = torch.float64 if values.dtype == torch.float64 else torch.float32
        v = values.to(compute)
        n, d, heads = v.shape[0], v.shape[-1], self.heads
        if self.mix_logits is not None:
            mix = self.mix_logits[site, :n] if kept is None else self.mix_logits[site, kept]
            logits = mix.to(compute).view(n, 1, 1, 1).expand(*v.shape[:-1], heads)
        else:
            keys = rms_norm(v, self.shape.norm_eps, self.key_gains[site].to(compute)) if self.config.key_norm else v
            query = self.queries[site].to(compute)                                    # [D]
            if self.query_maps is not None:
                latest = rms_norm(sources[-1] if latest is None else latest, self.shape.norm_eps)
                query = query + latest.to(compute) @ self.query_maps[site].to(compute).T  # [B, T, D]
            logits = (keys * query).unflatten(-1, (heads, d // heads)).sum(-1)       # [N, B, T, H]
        weights = torch.softmax(logits, 0) if self.config.score == "softmax" else torch.sigmoid(logits)
        out = (weights.repeat_interleave(d // heads, -1) * v).sum(0)
        return out.to(values.dtype), weights

    def open_history(self, source: Tensor, decoding: bool) -> DepthHistory:
        """This forward pass's history, `source` (the embedding) in slot 0; the list of sources
        the state keeps then holds views of the buffer, read only without gradient (stream).
        A decode step (`decoding`: `resume` got a carry) reuses the buffer of the step before when
        it fits (`DepthHistory.reset`): one buffer per generation and batch, not one per step. It
        is its own, never a forward pass's, whose states a caller may still hold."""
        from reslab.kernels.depth_history import DepthHistory

        kept = self.decode_history if decoding else None
        if kept is not None and kept.fits(source):
            kept.reset()
            history = kept
        else:
            self.history = None  # the last pass's buffer goes before the next one is allocated
            history = DepthHistory(self.shape.n_sites + 1, self.n_routes(), source, heads=self.heads,
                                   eps=self.shape.norm_eps)
            if decoding:
                self.decode_history = history
        history.write(0, source, (0, self.shape.n_sites))
        self.history = history
        return history

    def history_read(self, site: int, n_prefix: int, extra: int = -1) -> Tensor:
        assert self.history is not None
        out, weights = self.history.read(site, n_prefix, self.queries[site], self.key_gains[site], extra=extra,
                                         need_weights=self.recorder is not None)
        if weights is not None:
            self.record(site, weights)
        return self.scaled(out, n_prefix + (1 if extra >= 0 else 0))

    def start(self, embedding: Tensor) -> Any:  # list[Tensor]: the sources
        return [self.as_source(embedding)]

    def resume(self, state: Any, carry: Any, positions: Tensor) -> Any:
        if self.uses_history:  # the sources live in this pass's history buffer
            return [self.open_history(state[0], carry is not None).source(0)]
        if carry is not None and self.cached_reads:  # a decode step
            return self.open_cache(state[0], self.shape.n_sites + 1)
        return state

    def carry(self, state: Any) -> Any:
        """Nothing from earlier tokens; DECODING when the next calls are decode steps on a path of their
        own: the reference's cached reads, or the kernels' history buffer kept from step to step."""
        return DECODING if self.uses_history or self.cached_reads else None

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """One read of the full history at every site (and the readout's, with `readout`)."""
        return [(n, 1) for n in full_sources(2 * n_layers + int(config.readout))]

    def decode_state_elems(self) -> tuple[int, int]:
        """((2L + 1) d + c, 0): the sources e, f_1, ..., f_2L (with the kernels, the history buffer that
        holds them) and, on the reference's cached reads, c = `cache_score_elems(2L + 1)`, their scores for
        every route. Subclasses that read fewer (depth_swa's window) keep them all as well: the stream,
        e + sum_i f_i, is their sum."""
        sources = self.shape.n_sites + 1
        scores = self.cache_score_elems(sources) if self.cached_reads else 0
        return sources * self.shape.d_model + scores, 0

    @classmethod
    def stage_errors(cls, config: Any, shape: ModelShape, impl: str) -> list[str]:
        if impl == "triton":
            return ["impl: 'triton' keeps the depth history in one buffer that every site writes in place, which "
                    "cannot be split between stages; allowed: 'reference'"]
        return []

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """((s + 1) d, 0) before site s: every source so far, e, f_0, ..., f_{s-1} (each a later site reads);
        with caching, when the receiving rank holds the sources before site `held`, only f_held, ..., f_{s-1}."""
        return (site + 1 if held is None else site - held) * self.shape.d_model, 0

    # --- the reference's decode path: a DepthCache ------------------------------------------------------
    def cache_score_elems(self, slots: int) -> int:
        """The elements of a DepthCache's scores over `slots` sources, R H slots of the compute dtype,
        counted in elements of the parameters' dtype (two per score for a bfloat16 model)."""
        assert self.queries is not None
        size = self.queries.element_size()
        per = torch.empty(0, dtype=compute_dtype(self.queries.dtype)).element_size() // size
        return self.n_routes() * self.heads * slots * per

    def open_cache(self, first: Tensor, slots: int) -> DepthCache:
        """A decode step's depth cache of `slots` sources with `first` [B, T, D] in slot 0, in the buffers
        of the step before when they fit; sets `step_constants` from the parameters."""
        assert self.queries is not None and self.key_gains is not None
        self.step_constants = StepConstants.of(self.queries, self.key_gains, self.heads, self.shape.norm_eps,
                                               first)
        cache = depth_cache.open_cache(self.decode_buffers, first, self.step_constants, slots)
        self.decode_buffers = cache.buffers
        return cache

    def cache_write(self, cache: DepthCache, source: Tensor) -> DepthCache:
        """`cache` with `source` [B, T, D] in its next slot, scored once for every route."""
        assert self.step_constants is not None
        return depth_cache.write(cache, source, self.step_constants)

    def cache_read(self, cache: DepthCache, site: int) -> Tensor:
        """Route `site`'s read over the cache's sources: `route`'s result, from the cached scores."""
        assert self.step_constants is not None
        out, weights = depth_cache.read(cache, site, self.read_scale(cache.count), self.step_constants)
        if self.recorder is not None:
            self.record(site, depth_cache.depth_weights(weights, cache.count, *cache.buffers.shape[:2]))
        return out.to(cache.buffers.values.dtype)

    def sublayer_input(self, sources: Any, site: int) -> Tensor:
        if self.uses_history:
            return self.history_read(site, len(sources))
        if isinstance(sources, DepthCache):
            return self.cache_read(sources, site)
        return self.route(sources, site)

    def update(self, sources: Any, site: int, output: Tensor) -> Any:
        if isinstance(sources, DepthCache):
            return self.cache_write(sources, output)
        if self.uses_history:
            assert self.history is not None
            self.history.write(len(sources), output, (site + 1, self.shape.n_sites))
            return sources + [self.history.source(len(sources))]
        return sources + [output]

    def readout(self, sources: Any) -> Tensor:
        if self.uses_history:
            return self.history_read(self.shape.n_sites, len(sources))
        if isinstance(sources, DepthCache) and self.config.readout:
            return self.cache_read(sources, self.shape.n_sites)
        if self.config.readout:
            return self.route(sources, self.shape.n_sites)
        return self.stream(sources)

    def stream(self, sources: Any) -> Tensor:
        """The equivalent pre-norm stream e + sum_i f_i (AttnRes keeps no running stream)."""
        if isinstance(sources, DepthCache):
            values = sources.buffers.values[:, :sources.count].sum(1)                     # [B T H, E]
            return values.view(sources.buffers.shape)
        return torch.stack(sources).sum(0)
