"""Dual Attention Residuals (arXiv 2607.18730; variants.md section 3, a RECONSTRUCTION).

The full text was not available; this implements the "[RECONSTRUCTION] A default the platform
can implement" bullets of variants.md section 3 and exposes every open choice as a knob.

Two streams s in {a, b}, each with a value history and a state history; s' is the other one.
    values v^s_i:  v^s_0 = e; after sublayer l the written per-stream delta
                   v^s_l = x^s_l - r^s_l (the stream's state after the write minus its read).
    states x^s_i:  x^s_0 = e; after sublayer l the stream after the write, x^s_l = r^s_l + v^s_l.
Sublayer l (one unchanged Transformer branch F_l per sublayer):
    keys   k^a_i = RMSNorm_{a,l}(x^b_i)                 (cross addressing; `key_source`, `addressing`)
    read   r^a_l = sum_i softmax_i(q^a_l . k^a_i) v^a_i, likewise r^b_l
    branch u_l = F_l(Norm(x_l)),  x_l = 1/2 (r^a_l + r^b_l)                     (`mix`)
    write  y^s = r^s_l + beta^s_l u_l,  [x^a_l; x^b_l] = P_l [y^a; y^b],
           P_l = [[p, 1-p], [1-p, p]], p = sigma(theta_l)                      (`cross_mix`)
so v^a_l = (1-p)(r^b_l - r^a_l) + (p beta^a + (1-p) beta^b) u_l, computed in this closed form.
Every 2x2 doubly stochastic matrix is such a P, so the write is exact without Sinkhorn. With
p = 1 and beta = 1 the values are AttnRes's sources (e, f_1, f_2, ...) and the state after a
write is the read plus the branch output; the mixing moves (1-p) of the difference between the
two reads into each stream's history. Block form (`block_size` > 0): the value history holds
block sums of the deltas plus the current partial sum (section 1.2) and the state history the
state at the end of each block plus the latest state, so keys and values stay paired.

Readout: each stream routes once more over its full history (own query and key gain, same
addressing) and the two reads are averaged. With `stream_scale` (default) the branch input and
the readout, which only an RMSNorm reads, are multiplied by the number of sources read (as in
`attnres`: at zero queries the literal mean is the stream / N, whose mean square the shipped
RMSNorm eps distorts); the reads written into the streams stay unscaled. `stream(state)` is the
mean of the two current states; `cross_stream_similarity(state)` is their mean per-token
cosine similarity, reported after every layer by `diagnostics`. `prepare` computes both streams'
reads once per site; the branch input and the write both use them.

Symmetry: with zero-initialised queries (the reconstruction's bullet) everything is symmetric
under swapping a and b (same v_0, same keys, P symmetric, same gate inits), so the streams stay
identical under any gradient step and cross addressing equals self addressing. The default
therefore draws the pseudo-queries from N(0, query_init_std^2) with a private generator seeded
from a fixed constant plus the route index (a and b get different draws), which breaks the
symmetry without touching the global RNG: every arm built from the same seed gets the same
backbone. `query_init="zero"` gives the literal bullet (a one-stream model in disguise).

Interventions (`models.interventions`). "source": one entry of one stream's value history, removed
from that stream's read at one site: "a.emb", "a.s3" (the delta written at site 3), or in block
form "a.block1", "a.partial"; likewise "b.*". "zero" drops it from the softmax (its logit -> -inf:
the other weights renormalise; a read left with nothing is zero); "mean" replaces its value and its
key (the paired entry of the history the stream scores) by their means over the eval windows, so
its logit is computed from the mean key. The modified read is the site's read wherever it is used:
the branch input and the write (the stream's next state is read + delta). "stream": stream "a" or
"b" removed from every read the sublayers and the head take, the branch input x = mix(r^a, r^b)
and the readout: "zero" gives the other stream the whole mix (x = r^b; the mix normalises), "mean"
replaces r^a by its mean over the eval windows at each site. The streams' own histories, reads and
writes are untouched by a stream drop: it measures what the model reads from each stream.

Controls (the paper's claims that the gain is not from an extra stream or a value projection):
    DAR-SelfKV:                          addressing="self"
    an extra stream, no cross addressing: addressing="independent"
    a value projection alone:             addressing="self", query_init="zero",
                                          key_source="value", write_gate="fixed", value_proj=...
                                          (exchangeable streams stay identical: one AttnRes stream
                                          with a learned value projection)

Extra parameters, R = 2L + (1 if readout) routes, 2L sites:
    4d per route (query and key gain per stream)
    + per site: write gates (sigmoid: 2 scalar / 2d channel; fixed: 0)
                + cross mix (scalar: 1, channel: d; addressing="independent": 0)
                + branch mix (learned: 1; half: 0)
    + per route: value projection (channel: 2d, matrix: 2d^2, none: 0)
Default (per-sublayer, scalar gates and mix, no value projection, readout): L(8d + 6) + 4d.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reslab.kernels.depth_read import depth_read
from reslab.models.cka import linear_cka_matrix
from reslab.models.layers import zero_linear
from reslab.models.presets import ModelShape
from reslab.models.residual import register
from reslab.models.residual.base import (
    Identity,
    ResidualPathway,
    RoutingRecorder,
    block_sources,
    full_sources,
    private_generator,
)

QUERY_SEED = 0xDA2  # private generator seed base for query_init="normal"; + route index


@dataclass
class StreamHistory:
    values: list[Tensor]            # completed sources [v_0 = e, ...], each [B, T, D]
    states: list[Tensor]            # the stream's state paired with each completed source (state keys only)
    state: Tensor                   # [B, T, D] the stream after the latest write
    partial: Tensor | None = None   # [B, T, D] the current block's sum of deltas (block form)

    def sources(self) -> list[Tensor]:
        return self.values + ([self.partial] if self.partial is not None else [])

    def key_states(self) -> list[Tensor]:
        return self.states + ([self.state] if self.partial is not None else [])


@dataclass
class DARState:
    streams: tuple[StreamHistory, StreamHistory]  # (a, b)
    filled: int = 0                               # sublayers already summed into the partial block
    reads: tuple[Tensor, Tensor] | None = None    # (r^a, r^b) of the pending site, set by prepare


def mixing_matrix(theta: Tensor) -> Tensor:
    """P = [[p, 1-p], [1-p, p]] with p = sigmoid(theta): doubly stochastic for every theta. [..., 2, 2]"""
    p = torch.sigmoid(theta)
    q = torch.sigmoid(-theta)  # 1 - p without cancellation
    return torch.stack([torch.stack([p, q], -1), torch.stack([q, p], -1)], -2)


def _init_queries(config: DAR.Config, n_routes: int, d: int) -> Tensor:
    """The routes' queries, [R, 2, D]: zero, or normal draws from the variant's private generator."""
    if config.query_init == "zero":
        return torch.zeros(n_routes, 2, d)
    rows = []
    for route in range(n_routes):
        gen = private_generator(QUERY_SEED + route)
        rows.append(torch.randn(2, d, generator=gen, dtype=torch.float32) * config.query_init_std)
    return torch.stack(rows).to(torch.get_default_dtype())


@register("dar")
class DAR(ResidualPathway):
    """Knobs:
        block_size: 0 = per-sublayer histories (one value per sublayer, section 3); > 0 = block
            form over block sums plus the partial block, `block_size` sublayers per block
            (section 1.2); 1 is the same function as 0. Default: 0.
        key_source: what the opposite stream contributes as keys: "state" (x^b_i, the
            reconstruction's reading of "normalised states") or "value" (v^b_i). Default: "state".
        addressing: "cross" (the paper: stream a scores stream b's keys and vice versa), "self"
            (DAR-SelfKV: each stream scores its own keys; the cross mix still couples the
            streams), or "independent" (each stream scores its own keys and P is the identity:
            two retrievers with their own queries and histories that share only the branch
            input and output; the "extra stream without cross addressing" control). Default: "cross".
        mix: branch input from the two reads: "half" (x = (r^a + r^b)/2) or "learned" (a convex
            mix m r^a + (1 - m) r^b, m = sigmoid(mu_l), mu_l = 0 so m = 1/2 at init). Default: "half".
        write_gate: beta^s_l: "sigmoid" (beta = sigmoid(c^s_l), c initialised to
            `write_gate_logit`) or "fixed" (beta = 1). Default: "sigmoid".
        write_gate_shape: "scalar" (one gate per stream and site) or "channel" (one per channel).
            Default: "scalar".
        write_gate_logit: initial c; ln 19 = 2.944 gives beta = 0.95 ("beta at about 1").
            Default: ln 19.
        cross_mix: p = sigmoid(theta_l): "scalar" or "channel" (a [d] theta per site).
            Default: "scalar".
        cross_mix_logit: initial theta; 4.0 gives p = 0.982 ("p ~ 1", little cross-talk).
            Default: 4.0.
        value_proj: a learned map on each stream's read, applied per route: "none", "channel"
            (r <- c * r, c = 1 at init, not decayed) or "matrix" (r <- r + W r, W an nn.Linear
            initialised to zero, so weight decay pulls it to the identity map). Default: "none".
        query_init: "normal" (N(0, query_init_std^2) from a private generator, breaking the
            a/b symmetry; see the module docstring) or "zero" (the reconstruction's bullet;
            the streams then stay identical). Default: "normal".
        query_init_std: std of the "normal" query init. Default: 0.02.
        readout: route both streams once more over their histories and average the two reads
            for the final norm; False feeds `stream(state)`. Default: True.
        stream_scale: multiply the branch input and the readout (what only an RMSNorm reads) by
            the number of sources each stream read, as `attnres`'s knob does; the reads that
            enter the streams' states are never scaled. At zero queries the branch then sees the
            pre-norm stream itself, so the sublayer's RMSNorm acts as prenorm's at any eps;
            False feeds the literal mean of the reads (the stream / N at init). Default: True.
    """

    intervention_kinds = ("source", "stream")
    identities = (
        Identity("exchangeable streams (zero queries, value keys, fixed gates) stay one AttnRes stream",
                 options={"query_init": "zero", "key_source": "value", "write_gate": "fixed"}, equals="attnres"),
    )

    @dataclass(frozen=True, kw_only=True)
    class Config:
        block_size: int = 0
        key_source: Literal["state", "value"] = "state"
        addressing: Literal["cross", "self", "independent"] = "cross"
        mix: Literal["half", "learned"] = "half"
        write_gate: Literal["sigmoid", "fixed"] = "sigmoid"
        write_gate_shape: Literal["scalar", "channel"] = "scalar"
        write_gate_logit: float = math.log(19.0)
        cross_mix: Literal["scalar", "channel"] = "scalar"
        cross_mix_logit: float = 4.0
        value_proj: Literal["none", "channel", "matrix"] = "none"
        query_init: Literal["normal", "zero"] = "normal"
        query_init_std: float = 0.02
        readout: bool = True
        stream_scale: bool = True

        def __post_init__(self):
            if self.block_size < 0:
                raise ValueError(f"block_size must be >= 0, got {self.block_size}")
            if self.query_init_std < 0:
                raise ValueError(f"query_init_std must be >= 0, got {self.query_init_std}")

    @classmethod
    def check_shape(cls, config: DAR.Config, shape: ModelShape) -> list[str]:
        from reslab.models.residual.block_attnres import block_size_errors

        return super().check_shape(config, shape) + block_size_errors(config.block_size, shape)

    def __init__(self, config, shape, impl: str = "reference"):
        super().__init__(config, shape, impl)
        d, n_sites = shape.d_model, shape.n_sites
        n_routes = n_sites + (1 if config.readout else 0)
        self.queries = nn.Parameter(_init_queries(config, n_routes, d))                     # [R, 2, D]
        self.key_gains = nn.Parameter(torch.ones(n_routes, 2, d))                         # [R, 2, D]
        self.gate_logits: nn.Parameter | None = None
        if config.write_gate == "sigmoid":
            gate_shape = (n_sites, 2) if config.write_gate_shape == "scalar" else (n_sites, 2, d)
            self.gate_logits = nn.Parameter(torch.full(gate_shape, config.write_gate_logit))
        self.cross_logits: nn.Parameter | None = None
        if config.addressing != "independent":
            cross_shape = (n_sites,) if config.cross_mix == "scalar" else (n_sites, d)
            self.cross_logits = nn.Parameter(torch.full(cross_shape, config.cross_mix_logit))
        self.mix_logits = nn.Parameter(torch.zeros(n_sites)) if config.mix == "learned" else None
        self.value_scales: nn.Parameter | None = None
        self.value_maps: nn.ModuleList | None = None
        if config.value_proj == "channel":
            self.value_scales = nn.Parameter(torch.ones(n_routes, 2, d))
        elif config.value_proj == "matrix":
            self.value_maps = nn.ModuleList(zero_linear(d, d) for _ in range(2 * n_routes))

    @property
    def block_size(self) -> int:
        return max(self.config.block_size, 1)

    # --- routing ---------------------------------------------------------------------------
    def _keys(self, state: DARState, s: int) -> list[Tensor] | None:
        """Keys that stream s scores; None means its own values (depth_read's default)."""
        owner = 1 - s if self.config.addressing == "cross" else s
        hist = state.streams[owner]
        if self.config.key_source == "state":
            return hist.key_states()
        return None if owner == s else hist.sources()

    def _project(self, read: Tensor, site: int, s: int) -> Tensor:
        if self.value_scales is not None:
            return read * self.value_scales[site, s]
        if self.value_maps is not None:
            return read + self.value_maps[2 * site + s](read)
        return read

    def _read(self, state: DARState, site: int) -> tuple[Tensor, Tensor]:
        reads = []
        for s, label in ((0, "a"), (1, "b")):
            sources, keys = state.streams[s].sources(), self._keys(state, s)
            if self.intervention is not None:
                labels = [f"{label}.{name}" for name in self.history_labels(site)]
                _, sources, keys = self.softmax_sources(site, labels, sources, keys)
                if not sources:  # the only source removed: the read of nothing
                    reads.append(torch.zeros_like(state.streams[s].state))
                    continue
            out, weights = depth_read(
                sources, self.queries[site, s], self.key_gains[site, s],
                keys=keys, eps=self.shape.norm_eps, impl=self.impl,
            )
            self.record(site, weights, route=label)
            reads.append(self._project(out, site, s))
        return reads[0], reads[1]

    # --- interventions (models.interventions) -------------------------------------------------
    def history_labels(self, site: int) -> list[str]:
        """The entries of one stream's value history that site k reads (2L: the readout): "emb" and
        "s<i>" per sublayer, or "emb", "block<n>" and "partial" in block form."""
        if self.config.block_size == 0:
            return ["emb"] + [f"s{i}" for i in range(site)]
        size = self.config.block_size
        return ["emb"] + [f"block{n}" for n in range(1, site // size + 1)] + (["partial"] if site % size else [])

    def source_labels(self, site: int) -> list[str]:
        if site == self.shape.n_sites and not self.config.readout:
            return []
        return [f"{s}.{name}" for s in ("a", "b") for name in self.history_labels(site)]

    def stream_labels(self) -> list[str]:
        return ["a", "b"]

    def _mixed(self, site: int, m: Tensor | float, r_a: Tensor, r_b: Tensor) -> Tensor:
        """m r^a + (1 - m) r^b, the mix of what the branch (or the head) reads, under a stream intervention."""
        if self.intervention is None:
            return m * r_a + (1 - m) * r_b
        weights = torch.stack([torch.as_tensor(m, dtype=r_a.dtype, device=r_a.device).expand(r_a.shape[:-1]),
                               1 - torch.as_tensor(m, dtype=r_a.dtype, device=r_a.device).expand(r_a.shape[:-1])], -1)
        weights, reads = self.weighted_sources(site, ["a", "b"], weights, torch.stack([r_a, r_b], -2), normalised=True)
        return torch.einsum("...i,...id->...d", weights, reads)

    # --- the forward contract ----------------------------------------------------------------
    def start(self, embedding: Tensor) -> DARState:
        return DARState(streams=(
            StreamHistory(values=[embedding], states=[embedding], state=embedding),
            StreamHistory(values=[embedding], states=[embedding], state=embedding),
        ))

    def prepare(self, state: DARState, site: int) -> DARState:
        return dataclasses.replace(state, reads=self._read(state, site))

    def sublayer_input(self, state: DARState, site: int) -> Tensor:
        if state.reads is None:
            raise RuntimeError(f"dar: sublayer_input({site}) before prepare({site}) on this state")
        r_a, r_b = state.reads
        if self.mix_logits is None:
            if self.intervention is not None:
                return self._scaled(self._mixed(site, 0.5, r_a, r_b), state)
            return self._scaled(0.5 * (r_a + r_b), state)
        m = torch.sigmoid(self.mix_logits[site])
        return self._scaled(self._mixed(site, m, r_a, r_b), state)

    def _scaled(self, branch_input: Tensor, state: DARState) -> Tensor:
        """With `stream_scale`, `branch_input` times the number of sources each stream reads (both
        read the same number): what feeds an RMSNorm only, never the streams' states."""
        if not self.config.stream_scale:
            return branch_input
        return branch_input * float(len(state.streams[0].sources()))

    def update(self, state: DARState, site: int, output: Tensor) -> DARState:
        if state.reads is None:
            raise RuntimeError(f"dar: update({site}) before prepare({site}) on this state")
        r_a, r_b = state.reads
        if self.gate_logits is None:
            beta_a = beta_b = None
        else:
            beta_a, beta_b = torch.sigmoid(self.gate_logits[site]).unbind(0)
        if self.cross_logits is None:
            delta_a = output if beta_a is None else beta_a * output
            delta_b = output if beta_b is None else beta_b * output
        else:
            mixing = mixing_matrix(self.cross_logits[site])                             # [(D,) 2, 2]
            p, q = mixing[..., 0, 0], mixing[..., 0, 1]
            if beta_a is None or beta_b is None:  # both or neither (gate_logits)
                write_a = write_b = output
            else:
                write_a = (p * beta_a + q * beta_b) * output
                write_b = (p * beta_b + q * beta_a) * output
            delta_a = q * (r_b - r_a) + write_a                                         # [B, T, D]
            delta_b = q * (r_a - r_b) + write_b
        next_streams = []
        closes = state.filled + 1 == self.block_size
        # value keys read no state history: only the current state is kept (the stream, diagnostics)
        keep_states = self.config.key_source == "state"
        for hist, read, delta in zip(state.streams, (r_a, r_b), (delta_a, delta_b), strict=True):
            new_state = read + delta
            partial = delta if hist.partial is None else hist.partial + delta
            if closes:
                next_streams.append(StreamHistory(
                    values=hist.values + [partial], states=hist.states + [new_state] if keep_states else hist.states,
                    state=new_state,
                ))
            else:
                next_streams.append(StreamHistory(
                    values=hist.values, states=hist.states, state=new_state, partial=partial,
                ))
        stream_a, stream_b = next_streams
        return DARState(streams=(stream_a, stream_b), filled=0 if closes else state.filled + 1)

    @classmethod
    def depth_reads(cls, config: Any, n_layers: int) -> list[tuple[int, int]] | None:
        """Two streams, one read each per site; two tensors per source where the keys are not the values."""
        reads = 2 * n_layers + int(config.readout)
        ns = full_sources(reads) if config.block_size == 0 else block_sources(reads, config.block_size)
        per_source = 2 if config.addressing == "cross" or config.key_source == "state" else 1
        return [(n, per_source) for n in ns for _ in range(2)]

    def decode_state_elems(self) -> tuple[int, int]:
        """(elements of the final state, 0), in d: the embedding (every history's first entry, one tensor),
        then per stream the completed sources and the partial one (nb + p, with nb = 2L // k closed blocks
        of k sublayers and p = 1 when one is partly filled) and its states: with state keys, one per source
        (the current state is the last); with value keys, the current state only. Fixed gates without
        cross mixing write the same delta into both streams: one tensor where a source is that delta."""
        return self.state_elems(self.shape.n_sites), 0

    def stage_state_elems(self, site: int, held: int | None = None) -> tuple[int, int]:
        """(`state_elems(s)`, 0) before site s: the state of `decode_state_elems` after s sublayers."""
        return self.state_elems(site), 0

    def state_elems(self, sites: int) -> int:
        """The elements per token of the state after `sites` sublayers (see `decode_state_elems`)."""
        k = self.block_size
        closed, partial = sites // k, int(sites % k > 0)
        values = 2 * (closed + partial)
        if self.config.addressing == "independent" and self.config.write_gate == "fixed":
            # a source that is one sublayer's delta: every source with k = 1, else a partial of one sublayer
            values -= closed if k == 1 else int(sites % k == 1)
        states = 2 * (closed + partial) if self.config.key_source == "state" else 2
        return (1 + values + states) * self.shape.d_model

    def readout(self, state: DARState) -> Tensor:
        if not self.config.readout:
            return self.stream(state)
        r_a, r_b = self._read(state, self.shape.n_sites)
        if self.intervention is not None:
            return self._scaled(self._mixed(self.shape.n_sites, 0.5, r_a, r_b), state)
        return self._scaled(0.5 * (r_a + r_b), state)

    def stream(self, state: DARState) -> Tensor:
        """The mean of the two streams' current states (the embedding before any write)."""
        return 0.5 * (state.streams[0].state + state.streams[1].state)

    @torch.no_grad()
    def cross_stream_similarity(self, state: DARState) -> float:
        """Mean per-token cosine similarity between the two streams' current states."""
        a, b = state.streams[0].state, state.streams[1].state
        return float(F.cosine_similarity(a.float(), b.float(), dim=-1).mean())

    @torch.no_grad()
    def cross_stream_cka(self, state: DARState) -> float:
        """Debiased linear CKA between the two streams' current states over the batch's tokens
        (rows: B*T tokens, columns: channels; `models.cka.linear_cka_matrix`). The paper's
        evidence that the streams stay distinct is a cross-stream CKA; unlike the per-token cosine
        it ignores per-channel offsets and scales shared by every token. NaN with under 4 tokens."""
        a, b = (s.state.reshape(-1, s.state.shape[-1]) for s in state.streams)          # [B*T, D]
        if a.shape[0] < 4:
            return math.nan
        return float(linear_cka_matrix([a, b])[0, 1])

    def diagnostics(self, layer_states: list[DARState], routing: RoutingRecorder) -> dict[str, Any]:
        """"cross_stream_similarity" (per-token cosine) and "cross_stream_cka" (debiased linear CKA
        over tokens) after the last layer (what feeds the readout), and their per-layer profiles
        "cross_stream_similarity_layers" and "cross_stream_cka_layers"."""
        profile = [self.cross_stream_similarity(state) for state in layer_states]
        cka = [self.cross_stream_cka(state) for state in layer_states]
        return {"cross_stream_similarity": profile[-1], "cross_stream_similarity_layers": profile,
                "cross_stream_cka": cka[-1], "cross_stream_cka_layers": cka}
