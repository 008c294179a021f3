"""The one interface every residual pathway implements.

The backbone owns the sublayers (attention, MLP, each with its own pre-norm) and walks them
in order; the pathway owns everything between them. For sublayer `site` (0..2L-1; even sites
are attention, odd sites MLP):

    state = pathway.resume(pathway.start(embedding), carry, positions)
    for site in range(2L):
        state = pathway.prepare(state, site)                # computes the reads (most: unchanged)
        x  = pathway.sublayer_input(state, site)            # what the sublayer's pre-norm sees
        xv = pathway.value_input(state, site)               # None, or the value route (RD)
        u  = sublayer(norm(x), norm(xv))
        state = pathway.update(state, site, u)
    h = pathway.readout(state)                              # into the final norm and LM head

`state` is whatever the variant needs (a tensor, a list of sources, several streams); the
backbone never looks inside and never branches on a variant's name. Only `start`, `resume`, `prepare`
and `update` make states, and each returns a new one: `sublayer_input`, `value_input`,
`readout` and `stream` only read, so a state kept from an earlier site stays valid.

Decoding (`models.decoding`): the state is per token. Every read and write above mixes only
across depth for one token, so when tokens arrive one at a time (prefill, then one decode step
per token) `start` rebuilds the state of each new token from its own embedding, and the depth
history, the streams of multi-stream variants and every cached read are that token's alone;
only the attention, through its KV cache, sees earlier tokens. A variant that mixes across the
sequence (`seq_swa`'s window over tokens) declares what it carries from one call to the next with
two hooks: `resume(state, carry, positions)` hands the fresh state what the earlier tokens left
(`carry`, None in a full forward and at prefill) and each new token's position [B, T] (counted
from its row's first real token, negative on left padding, which it must not read), and
`carry(final_state)` returns what later tokens will need. The defaults carry nothing. A carry is
never None after the first call, so a variant with a decode path of its own (the AttnRes family:
the reference's depth cache and Block AttnRes's two-phase read on it, the kernels' history buffer
kept across steps) returns a carry without tensors (`DECODING`) to tell `resume` that the next calls
are decode steps.

Each variant declares what decoding keeps (`decode_state_elems`): the elements of one token's
final state and of one row's carry, closed forms that tests/models/test_decoding.py holds to the
measurement (`models.decoding.tensor_bytes` of the real state and carry).

Pipeline stages (`models.pipeline`, issue 38): the backbone splits at layer boundaries, and the state
before the first site of a stage crosses from the stage before as a tuple of tensors (what
`torch.distributed.pipelining` passes): `stage_send(state, site)` flattens it, `stage_receive(tensors,
site)` rebuilds it, and `stage_state_elems(site, held)` declares its elements per token (and per
micro-batch), closed forms that tests/models/test_pipeline.py holds to the bytes counted at the send calls.
The defaults send every distinct tensor of the state once and rebuild the structure from a one-token walk
of the pathway to that site (`boundary_template`); a variant whose state holds what the next stage can
rebuild overrides both (`seq_swa`: the stream, its window rebuilt from the positions). A variant whose state
cannot cross with some knobs says which and why (`stage_errors`, one line each).

A variant is a subclass registered with `@register("name")` with a nested frozen `Config`
dataclass of knobs (every field has a default and a docstring entry). Its own parameters are
created and initialised in `__init__`; the backbone's init never touches them. Routing
variants report depth weights through `self.record(...)` for diagnostics, and a variant with a
measure of its own (DAR's streams, RD's two routes) returns it from `diagnostics(...)`.

Interventions (`models.interventions`, issue 36): while `pathway.intervention` holds an
`InterventionHook` (set and cleared by `models.interventions.effects`, as `recorder` is by
`Decoder.recorded_pass`), a variant removes one source it reads (a depth source, a stream, a
block summary) or pins a gate, where it reads that source, through the helpers `softmax_sources`,
`linear_sources`, `weighted_sources` and `gate_pin`. A variant declares what it supports with
`intervention_kinds`, `source_labels(site)`, `stream_labels()` and `gate_sites()`. With no hook set
(training, decoding) every helper returns its input untouched after one attribute check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from reslab.common.errors import ConfigError
from reslab.kernels.field import FIELD_IMPLS
from reslab.models.presets import ModelShape


@dataclass
class SiteStats:
    """Routing statistics of one site, accumulated over recorded forward passes."""

    weight_sum: Tensor      # [N] token-summed depth weights (averaged over heads)
    head_weight_sum: Tensor  # [H, N]
    entropy_sum: float      # sum over tokens of the per-token entropy (nats), head-averaged
    max_sum: float          # sum over tokens of the per-token max weight, head-averaged
    tokens: int

    @property
    def weights(self) -> Tensor:
        return self.weight_sum / self.tokens

    @property
    def head_weights(self) -> Tensor:
        return self.head_weight_sum / self.tokens

    @property
    def entropy(self) -> float:
        return self.entropy_sum / self.tokens

    @property
    def max_weight(self) -> float:
        return self.max_sum / self.tokens


class RoutingRecorder:
    """Collects token-averaged depth weights per routing site while it is the pathway's `recorder`."""

    def __init__(self) -> None:
        self.sites: dict[tuple[int, str], SiteStats] = {}

    @torch.no_grad()
    def add(self, site: int, route: str, weights: Tensor) -> None:
        w = weights.detach().float()                                 # [N, B, T, H]
        n, h = w.shape[0], w.shape[-1]
        w = w.reshape(n, -1, h)                                      # [N, BT, H]
        tokens = w.shape[1]
        ent = -(w * w.clamp_min(1e-30).log()).sum(0)                 # [BT, H]
        stats = SiteStats(
            weight_sum=w.mean(-1).sum(1).cpu(),
            head_weight_sum=w.sum(1).transpose(0, 1).cpu(),
            entropy_sum=float(ent.mean(-1).sum()),
            max_sum=float(w.max(0).values.mean(-1).sum()),
            tokens=tokens,
        )
        key = (site, route)
        if key in self.sites:
            old = self.sites[key]
            stats = SiteStats(
                old.weight_sum + stats.weight_sum, old.head_weight_sum + stats.head_weight_sum,
                old.entropy_sum + stats.entropy_sum, old.max_sum + stats.max_sum, old.tokens + tokens,
            )
        self.sites[key] = stats


SOURCE_MODES = ("zero", "mean")   # a source or a stream: removed, or replaced by its mean over the eval windows
GATE_MODES = ("open", "closed")   # a gate pinned to 1 or 0
KEY = "#key"                      # the suffix of a source's key when it is read apart from its value (DAR)


class InterventionHook:
    """One intervention while it is a pathway's `intervention` (`models.interventions`, issue 36).

    `kind` "source" removes `source` from the read of `site` only; "stream" removes `source` from
    every read of that stream (`site` None); "gate" pins the gate of `site` (None: every site) to 1
    ("open") or 0 ("closed"). A source is removed by `mode`: "zero" (the term is gone; a normalised
    read renormalises over the rest) or "mean" (its value is replaced by `means[(site, label)]`, its
    mean over every token of the eval windows, as that site read it). A hook made by `collecting()`
    changes nothing and sums every source a read sees per (site, label), in float64, for the means.
    """

    def __init__(self, kind: str = "", site: int | None = None, source: str = "", mode: str = "",
                 means: dict[tuple[int, str], Tensor] | None = None):
        self.kind, self.site, self.source, self.mode = kind, site, source, mode
        self.means = means if means is not None else {}
        self.collect = False
        self.sums: dict[tuple[int, str], tuple[Tensor, int]] = {}
        self.terms: dict[str, Tensor] = {}  # this forward's terms of a running sum (`note_term`)

    @classmethod
    def collecting(cls) -> InterventionHook:
        hook = cls()
        hook.collect = True
        return hook

    def collected_means(self) -> dict[tuple[int, str], Tensor]:
        return {key: total / count for key, (total, count) in self.sums.items()}

    def hits(self, site: int, label: str) -> bool:
        """Whether the read of `site` must remove its source `label`."""
        if self.kind == "stream":
            return label == self.source
        return self.kind == "source" and self.site == site and label == self.source

    def observe(self, site: int, label: str, value: Tensor) -> None:
        if not self.collect:
            return
        flat = value.detach().reshape(-1, value.shape[-1]).to(torch.float64)
        total, count = self.sums.get((site, label), (0, 0))
        self.sums[(site, label)] = (flat.sum(0) + total, count + flat.shape[0])

    def mean_like(self, site: int, label: str, like: Tensor) -> Tensor:
        if (site, label) not in self.means:
            raise RuntimeError(f"intervention: no mean of source {label!r} at site {site} (collect the means "
                               "first: models.interventions.effects does)")
        return self.means[(site, label)].to(device=like.device, dtype=like.dtype).expand_as(like)

    def gate(self, site: int) -> float | None:
        if self.kind != "gate" or (self.site is not None and self.site != site):
            return None
        return 1.0 if self.mode == "open" else 0.0


@dataclass(frozen=True)
class Identity:
    """A claim of a variant's paper: built from the same seed, this variant with `options`
    computes the same function at init as variant `equals` with `equals_options`, at the shipped
    RMSNorm eps: a variant whose read is a positive multiple of the other's input (RMSNorm is
    scale-invariant only while its eps is negligible against the mean square) rescales it to
    that input (the `stream_scale` knobs, issue 20). tests/models/test_variant_contract.py checks
    every one in float64 at the shipped eps: logits, loss and backbone gradients."""

    why: str
    options: dict[str, Any] = field(default_factory=dict)
    equals: str = "prenorm"
    equals_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Decoding:
    """The carry of a variant that mixes only across depth but decodes on a path of its own: no tensors,
    only the fact that the calls after the first are decode steps (see the module docstring)."""


DECODING = Decoding()


def _check_field_impl(cls: type[ResidualPathway], impl: str) -> None:
    """A field kernel (`kernels/field`) only where the class itself declares it (`field_impls`)."""
    mapped = vars(cls).get("field_impls", ())
    if impl in FIELD_IMPLS and impl not in mapped:
        raise ConfigError(f"residual.impl: {impl} does not compute {cls.name}'s read (it maps "
                          f"{', '.join(mapped) or 'none of the field kernels'}); allowed: auto, reference, "
                          f"triton{''.join(', ' + m for m in mapped)}")


class ResidualPathway(nn.Module):
    """Base class of every residual variant; see the module docstring for the contract.

    Every registered variant declares its own `identities` (those its paper claims; () when it
    claims none), so a subclass never inherits its parent's by accident.
    """

    name: ClassVar[str] = ""
    identities: ClassVar[tuple[Identity, ...]] = ()
    # what `models.interventions` may do to this variant: a subset of ("source", "stream", "gate")
    intervention_kinds: ClassVar[tuple[str, ...]] = ()
    # the field's kernels (`kernels/field`) that compute this class's own read, declared on the class itself
    # (a subclass with another read inherits none): `residual.impl` fla, liger, flash_attn_res
    field_impls: ClassVar[tuple[str, ...]] = ()

    @dataclass(frozen=True, kw_only=True)
    class Config:
        pass

    def __init__(self, config: Any, shape: ModelShape, impl: str = "reference"):
        super().__init__()
        errors = type(self).check_shape(config, shape)
        if errors:
            raise ConfigError("; ".join(f"residual.options.{e}" for e in errors))
        _check_field_impl(type(self), impl)
        self.config = config
        self.shape = shape
        self.impl = impl
        self.recorder: RoutingRecorder | None = None
        self.intervention: InterventionHook | None = None

    @classmethod
    def check_shape(cls, config: Any, shape: ModelShape) -> list[str]:
        """Every way these knobs do not fit the resolved model shape, each "<knob>: <what is wrong>;
        <what is allowed>"; [] when they fit. Validation calls it before anything is dispatched
        (`models.residual.check_pathway_shape`) and `__init__` before any parameter exists."""
        return []

    # --- the forward contract -------------------------------------------------------------
    def start(self, embedding: Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement start()")

    def resume(self, state: Any, carry: Any, positions: Tensor) -> Any:
        """The state for these tokens given what earlier ones carried (see the module docstring):
        `state` from `start`, `carry` from the previous call's `carry` (None in a full forward and
        at prefill), `positions` [B, T] each token's position in its row (negative on left padding).
        The default returns `state` unchanged: a variant that mixes only across depth carries nothing."""
        return state

    def carry(self, state: Any) -> Any:
        """What the next tokens need from these, read from the final state (decoding); None by default."""
        return None

    def decode_state_elems(self) -> tuple[int, int]:
        """What incremental decoding keeps, in elements of the model's dtype: (the final state of one
        decoded token, after the last sublayer: every distinct tensor it holds (the depth history, the
        streams, the block sums) less what it shares with the carry; what one row carries from token to
        token, `carry`'s tensors). Closed forms of the knobs and the shape, as `Decoder.decode_state_bytes`
        reports them; `Decoder.measure_decode_state_bytes` measures the same on a decode step."""
        raise NotImplementedError(f"{type(self).__name__} must declare decode_state_elems()")

    # --- what the variant costs (experiments.budget) ---------------------------------------------
    # the baseline every study compares against (the pre-norm residual): the budget's throughput anchor
    # was measured on it, and `models.convert` starts from its checkpoints; exactly one variant sets it
    control: ClassVar[bool] = False
    # why a variant without depth reads trains at the anchor's throughput, as `experiments.budget` says it;
    # None: nothing measured or modelled, its hours a lower bound
    throughput_note: ClassVar[str | None] = None

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """(sources, tensors per source) of every depth read of one forward pass of `n_layers` layers with
        the knobs `config`: what `experiments.budget` scales a routing arm's throughput by (two tensors per
        source where the keys are other tensors than the values). None: no depth history is read."""
        return None

    # --- pipeline stages (models.pipeline, issue 38) ----------------------------------------------
    @classmethod
    def stage_errors(cls, config: Any, shape: ModelShape, impl: str) -> list[str]:
        """Why this variant's state cannot cross a stage boundary with these knobs, each "<knob>: <what is
        wrong>; <what is allowed>"; [] when it can. The default: every state of the reference crosses."""
        return []

    def stage_send(self, state: Any, site: int) -> tuple[Tensor, ...]:
        """What crosses the stage boundary before sublayer `site` (after `update(site - 1)`): the state's
        tensors, each distinct tensor once, in a fixed order (`flatten_state`). What comes back in the
        backward is the gradient of each, the same shapes. Override where the state holds what the next
        stage can rebuild itself (then `stage_receive` too)."""
        return flatten_state(state)

    def stage_receive(self, tensors: Sequence[Tensor], site: int) -> Any:
        """The state before sublayer `site` rebuilt from what `stage_send` sent: the structure (lists,
        dataclasses, ints, the sharing of one tensor by several fields) is that of the state this pathway
        makes at `site` from a one-token walk (`boundary_template`), the tensors those received."""
        return rebuild_state(self.boundary_template(site), tensors)

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """What crosses the boundary before sublayer `site` forward (and, as its gradient, backward): (elements
        per token, elements per micro-batch besides), in the model's dtype; a closed form that
        tests/models/test_pipeline.py holds to the bytes counted at the send calls. The default is one
        stream, d.

        `held`: with Kimi's cross-stage caching under virtual stages (several stages per rank), the site up to
        which the receiving rank already holds this micro-batch's state, the end of its previous virtual stage
        (None: no caching, or its first visit). A variant whose state only grows by appending tensors that
        never change (the AttnRes family's sources and completed blocks) then sends only what was appended
        since `held`; every other variant ignores it, its state must cross whole."""
        return self.shape.d_model, 0

    @torch.no_grad()
    def boundary_template(self, site: int) -> Any:
        """This pathway's state before sublayer `site` of a one-token forward with zero embedding and zero
        sublayer outputs, in the parameters' dtype: the structure `stage_receive` rebuilds."""
        like = next(iter(self.parameters()), None)
        dtype = torch.get_default_dtype() if like is None else like.dtype
        def zero() -> Tensor:  # a new tensor each time: which tensors a state shares is its structure
            return torch.zeros(1, 1, self.shape.d_model, dtype=dtype)

        state = self.resume(self.start(zero()), None, torch.zeros(1, 1, dtype=torch.long))
        for s in range(site):
            state = self.update(self.prepare(state, s), s, zero())
        return state

    def prepare(self, state: Any, site: int) -> Any:
        """The state sublayer `site` reads from: a variant whose read is costly or feeds `update`
        too (DAR's two stream reads, RD's V route) computes it here once and returns a new state
        that holds it. The default returns `state` unchanged."""
        return state

    def sublayer_input(self, state: Any, site: int) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement sublayer_input()")

    def value_input(self, state: Any, site: int) -> Tensor | None:
        """A separate input for the attention's value projection; None for almost every variant."""
        return None

    def update(self, state: Any, site: int, output: Tensor) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def readout(self, state: Any) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement readout()")

    def stream(self, state: Any) -> Tensor:
        """The residual stream's representation at the current depth (for effective-depth
        diagnostics). Variants without a running stream say what they use instead."""
        return self.readout(state)

    def aux_loss(self, state: Any) -> Tensor | None:
        """An auxiliary loss term added to the training objective (e.g. an entropy bonus)."""
        return None

    @staticmethod
    def as_source(x: Tensor) -> Tensor:
        """Store a depth-history entry in the autocast dtype when autocast is on.

        Sublayer outputs come out of autocast in bf16 while the embedding is float32; one dtype
        for the whole history is what the fused kernel reads, and bf16 halves its bytes.
        """
        if torch.is_autocast_enabled(x.device.type):
            return x.to(torch.get_autocast_dtype(x.device.type))
        return x

    # --- interventions (models.interventions) -------------------------------------------------
    def source_labels(self, site: int) -> list[str]:
        """The sources the read of `site` (0..2L-1, 2L the final readout) removes one at a time, in the
        order it reads them ("emb", "s3" = the output of site 3, "block1", ...); [] for none."""
        return []

    def stream_labels(self) -> list[str]:
        """The streams a "stream" intervention removes from every read ("stream0", ...); [] for none."""
        return []

    def gate_sites(self) -> list[int]:
        """The sites whose gate a "gate" intervention pins; [] for none."""
        return []

    def softmax_sources(self, site: int, labels: Sequence[str], values: Sequence[Tensor],
                        keys: Sequence[Tensor] | None = None) -> tuple[list[int], list[Tensor], list[Tensor] | None]:
        """The sources of a softmax read under the intervention: (the indices kept, their values, their
        keys). "zero" drops the source (its logit -> -inf: the others' weights renormalise); "mean"
        replaces its value (and its key, when read apart) by the mean, so its logit is computed from it."""
        hook = self.intervention
        kept, out_v = list(range(len(values))), list(values)
        if hook is not None and len(labels) != len(values):
            raise RuntimeError(f"{self.name}: site {site} reads {len(values)} sources but names {len(labels)}")
        out_k = None if keys is None else list(keys)
        if hook is None:
            return kept, out_v, out_k
        for i, label in enumerate(labels):
            hook.observe(site, label, values[i])
            if keys is not None:
                hook.observe(site, label + KEY, keys[i])
            if hook.hits(site, label) and hook.mode == "mean":
                out_v[i] = hook.mean_like(site, label, values[i])
                if out_k is not None and keys is not None:
                    out_k[i] = hook.mean_like(site, label + KEY, keys[i])
        drop = [i for i, label in enumerate(labels) if hook.hits(site, label) and hook.mode == "zero"]
        kept = [i for i in kept if i not in drop]
        return kept, [out_v[i] for i in kept], None if out_k is None else [out_k[i] for i in kept]

    def linear_sources(self, site: int, labels: Sequence[str], values: Sequence[Tensor]) -> list[Tensor | None]:
        """The terms of an unnormalised read under the intervention: None where "zero" removes a term,
        the mean where "mean" replaces it, the term itself elsewhere."""
        hook = self.intervention
        if hook is None:
            return list(values)
        out: list[Tensor | None] = []
        for label, value in zip(labels, values, strict=True):
            hook.observe(site, label, value)
            if not hook.hits(site, label):
                out.append(value)
            else:
                out.append(None if hook.mode == "zero" else hook.mean_like(site, label, value))
        return out

    def weighted_sources(self, site: int, labels: Sequence[str], weights: Tensor, values: Tensor,
                         normalised: bool) -> tuple[Tensor, Tensor]:
        """The weights [..., n] and values [..., n, D] of a read `sum_j weights_j values_j` (parallel streams)
        under the intervention: "zero" sets the source's weight to 0 (and, when the read is `normalised`,
        divides the rest by their sum), "mean" replaces its value by the mean and keeps its weight."""
        hook = self.intervention
        if hook is None:
            return weights, values
        hits = []
        for j, label in enumerate(labels):
            hook.observe(site, label, values[..., j, :])
            if hook.hits(site, label):
                hits.append(j)
        if not hits:
            return weights, values
        if hook.mode == "mean":
            values = values.clone()
            for j in hits:
                values[..., j, :] = hook.mean_like(site, labels[j], values[..., j, :])
            return weights, values
        keep = torch.ones(len(labels), dtype=weights.dtype, device=weights.device)
        keep[hits] = 0.0
        weights = weights * keep
        if normalised:
            total = weights.sum(-1, keepdim=True)
            weights = torch.where(total > 0, weights / total.where(total > 0, 1.0), weights)
        return weights, values

    def note_term(self, label: str, value: Tensor) -> None:
        """Keep `value`, a term of a running sum (prenorm's stream), for `remove_terms` (interventions only)."""
        if self.intervention is not None:
            self.intervention.terms[label] = value

    def remove_terms(self, site: int, stream: Tensor) -> Tensor:
        """`stream`, the running sum of the terms `source_labels(site)` noted by `note_term`, with the
        intervention's term subtracted ("zero") or swapped for its mean ("mean")."""
        hook = self.intervention
        if hook is None:
            return stream
        labels = self.source_labels(site)
        terms = [hook.terms[label] for label in labels]
        for term, new in zip(terms, self.linear_sources(site, labels, terms), strict=True):
            if new is not term:
                stream = stream - term if new is None else stream - term + new
        return stream

    def gate_pin(self, site: int) -> float | None:
        """1.0 or 0.0 when the intervention pins the gate of `site` open or closed, else None."""
        return None if self.intervention is None else self.intervention.gate(site)

    # --- parameters and diagnostics ---------------------------------------------------------
    def extra_params(self) -> int:
        """Parameters the pathway adds over the plain residual (the papers' "extra params")."""
        return sum(p.numel() for p in self.parameters())

    def extra_params_per_layer(self) -> float:
        return self.extra_params() / self.shape.n_layers

    def diagnostics(self, layer_states: list[Any], routing: RoutingRecorder) -> dict[str, Any]:
        """Variant-specific evaluation diagnostics; {} for most variants.

        `layer_states`: the state after each Transformer layer of one evaluation forward pass
        (`Decoder.layer_states`); `routing`: that batch's recorded routing weights. Returns
        JSON-ready values by name; every float among them is also logged as a scalar metric.
        """
        return {}

    def record(self, site: int, weights: Tensor, route: str = "") -> None:
        """Report depth weights [N, B, T, H] of one routing site (site 2L is the final readout)."""
        if self.recorder is not None:
            self.recorder.add(site, route, weights)

    @classmethod
    def knobs(cls) -> list[tuple[str, Any, str]]:
        """(name, default, type) of every knob of this variant."""
        out = []
        for f in dataclasses.fields(cls.Config):
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                raise TypeError(f"{cls.__name__}.Config.{f.name} has no default; every knob needs one")
            out.append((f.name, default, str(f.type)))
        return out


def _tensors(obj: Any, out: dict[int, Tensor]) -> None:
    """Every distinct tensor (by identity) of a state, in the order of its fields, into `out`."""
    if isinstance(obj, Tensor):
        out.setdefault(id(obj), obj)
    elif isinstance(obj, list | tuple):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _tensors(getattr(obj, f.name), out)


def flatten_state(state: Any) -> tuple[Tensor, ...]:
    """The distinct tensors of a state (a tensor, lists, tuples, dicts and dataclasses of them), each once,
    in the order of its fields: a tensor that two fields share is sent once (DAR's embedding)."""
    found: dict[int, Tensor] = {}
    _tensors(state, found)
    return tuple(found.values())


def _replaced(obj: Any, swap: dict[int, Tensor]) -> Any:
    if isinstance(obj, Tensor):
        return swap[id(obj)]
    if isinstance(obj, list | tuple):
        items = [_replaced(item, swap) for item in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # a NamedTuple, or a tuple
    if isinstance(obj, dict):
        return {k: _replaced(v, swap) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _replaced(getattr(obj, f.name), swap)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def rebuild_state(template: Any, tensors: Sequence[Tensor]) -> Any:
    """`template` (a state) with its distinct tensors replaced, in `flatten_state`'s order, by `tensors`."""
    old = flatten_state(template)
    if len(old) != len(tensors):
        raise RuntimeError(f"a stage boundary received {len(tensors)} tensors for a state of {len(old)}")
    return _replaced(template, {id(a): b for a, b in zip(old, tensors, strict=True)})


def full_sources(reads: int) -> list[int]:
    """Sources per read of a full depth history: the embedding and every earlier sublayer output."""
    return [s + 1 for s in range(reads)]


def block_sources(reads: int, block_size: int) -> list[int]:
    """Sources per read of Block AttnRes: the embedding, the completed blocks, the partial one when non-empty."""
    return [1 + s // block_size + (1 if s % block_size else 0) for s in range(reads)]


def private_generator(offset: int) -> torch.Generator:
    """A generator for a variant's random init that leaves the global RNG untouched.

    The pathway is built before the backbone, so drawing from the global RNG would shift every
    backbone weight of that arm and break seed pairing. Seeding from `torch.initial_seed()` (the
    run seed) keeps the draw a function of the run seed all the same.
    """
    return torch.Generator().manual_seed((torch.initial_seed() + 7919 * (offset + 1)) % 2**63)


def zero_or_normal(shape: tuple[int, ...], init: str, std: float, offset: int = 0) -> Tensor:
    """Pseudo-query init: zeros (Kimi's recipe: uniform weights at step 0) or N(0, std^2)."""
    if init == "zero":
        return torch.zeros(shape)
    if init == "normal":
        return torch.randn(shape, generator=private_generator(offset)) * std
    raise ValueError(f"query_init: {init!r} is not allowed; expected 'zero' or 'normal'")


def entropy_of(weights: Tensor) -> Tensor:
    """Mean per-token entropy of depth weights [N, ...] (nats)."""
    return -(weights * weights.clamp_min(1e-30).log()).sum(0).mean()
