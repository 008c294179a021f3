"""Oracles that see the math (issue 10 item 7): each paper's equation written out again here, with
explicit loops over depth sources and heads, in float64, and compared with the sublayer inputs the
model actually feeds its pre-norms.

The model runs its real sublayers; hooks record the embedding, every pre-norm input (the routed
sublayer input, and RD's value input) and every sublayer output. The oracle rebuilds the inputs
from the embedding and the recorded outputs only. Every routing parameter (pseudo-queries, key
gains, gates) is set to random non-zero values first, so a query-independent shortcut, a missing
gain or a stray temperature shows. Equations: variants.md 1.1 (AttnRes), 1.2 (Block), 2.1 (MHAR:
key RMS over the full width, then sliced per head), 3 (DAR reconstruction: cross-stream keys), 4.1
(RD: a separate value route), 5.1 (Delta: additive routing over deltas).

Every variant here runs with its default `stream_scale` (issue 20): a read over N sources is
multiplied by N (2 under sigmoid scores), and Delta's h_hat divided by c = 1 + 1/N, so that at zero
queries each pre-norm reads the pre-norm stream itself at the shipped eps. The oracles write the
papers' reads and apply that documented constant explicitly.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor
from variant_testing import make_model, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

D, L = 32, 3
EPS = 1e-6  # ModelConfig's default norm_eps, which the model uses for its key norms


def rms(x: Tensor) -> Tensor:
    return torch.sqrt(x.pow(2).mean(-1) + EPS)                                       # [B, T]


def oracle_read(values: list[Tensor], keys: list[Tensor], query: Tensor, gain: Tensor, heads: int = 1) -> Tensor:
    """sum_i softmax_i(q_h . RMSNorm_g(k_i)[h]) v_i[h] per head h; the RMS over the full width."""
    width = query.shape[0] // heads
    out = torch.zeros_like(values[0])
    for h in range(heads):
        part = slice(h * width, (h + 1) * width)
        logits = []
        for k in keys:
            normed = k / rms(k).unsqueeze(-1) * gain                                 # [B, T, D]
            logits.append((normed[..., part] * query[part]).sum(-1))                  # [B, T]
        top = torch.stack(logits).max(0).values
        exps = [torch.exp(z - top) for z in logits]
        total = sum(exps)
        for e, v in zip(exps, values, strict=True):
            out[..., part] += (e / total).unsqueeze(-1) * v[..., part]
    return out


def block_sources(embedding: Tensor, outputs: list[Tensor], block_size: int) -> list[Tensor]:
    """[e, b_1, ..., b_{n-1}] plus the partial block sum when it is non-empty (variants.md 1.2)."""
    sources = [embedding]
    for start in range(0, len(outputs), block_size):
        sources.append(sum(outputs[start:start + block_size]))
    return sources


class Recorded:
    """One float64 forward pass of `model` with hooks: the embedding, pre-norm inputs per site
    (a list: RD's attention sites call their norm twice), sublayer outputs, the final norm's input."""

    def __init__(self, model: torch.nn.Module, idx: Tensor):
        self.inputs: list[list[Tensor]] = [[] for _ in model.sublayers]
        self.outputs: list[Tensor] = []
        handles = [model.embed.register_forward_hook(lambda m, a, out: setattr(self, "embedding", out))]
        for site, norm in enumerate(model.norms):
            handles.append(norm.register_forward_pre_hook(lambda m, a, site=site: self.inputs[site].append(a[0])))
        for sub in model.sublayers:
            handles.append(sub.register_forward_hook(lambda m, a, out: self.outputs.append(out)))
        handles.append(model.final_norm.register_forward_pre_hook(lambda m, a: setattr(self, "final", a[0])))
        with torch.no_grad():
            model(idx)
        for h in handles:
            h.remove()


def randomised(name: str, options: dict | None = None) -> torch.nn.Module:
    """A float64 model whose routing parameters are random and far from their inits."""
    model = make_model(name, options).double()
    gen = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for pname, p in model.pathway.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "gain" in pname:
                p.copy_(1.0 + 0.5 * noise)
            elif "quer" in pname:
                p.copy_(noise * (3.0 / math.sqrt(D)))   # logits of order 1 to 3
            else:
                p.copy_(noise)                          # gate and mixing logits
    return model


def close(got: Tensor, want: Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("stream_scale", [True, False])
def test_full_attnres_and_mhar(heads, stream_scale):
    # stream_scale=False is the paper's literal read, the weighted mean itself
    options = {"stream_scale": stream_scale} | ({"heads": heads} if heads > 1 else {})
    model = randomised("attnres" if heads == 1 else "mhar", options)
    rec = Recorded(model, tokens())
    queries, gains = model.pathway.queries, model.pathway.key_gains
    sources = [rec.embedding]
    for site in range(2 * L):
        scale = len(sources) if stream_scale else 1
        close(rec.inputs[site][0], scale * oracle_read(sources, sources, queries[site], gains[site], heads))
        sources = sources + [rec.outputs[site]]
    scale = len(sources) if stream_scale else 1
    close(rec.final, scale * oracle_read(sources, sources, queries[2 * L], gains[2 * L], heads))


@pytest.mark.parametrize("name", ["block_attnres", "block_mhar"])
def test_block_attnres(name):
    heads = 4 if name == "block_mhar" else 1
    options = {"block_size": 4} | ({"heads": heads} if heads > 1 else {})
    model = randomised(name, options)
    rec = Recorded(model, tokens())
    queries, gains = model.pathway.queries, model.pathway.key_gains
    for site in range(2 * L):
        sources = block_sources(rec.embedding, rec.outputs[:site], 4)
        close(rec.inputs[site][0], len(sources) * oracle_read(sources, sources, queries[site], gains[site], heads))
    sources = block_sources(rec.embedding, rec.outputs, 4)
    close(rec.final, len(sources) * oracle_read(sources, sources, queries[2 * L], gains[2 * L], heads))


def test_rd_attnres_value_route():
    model = randomised("rd_attnres", {"block_size": 2})
    rec = Recorded(model, tokens())
    p = model.pathway
    for site in range(2 * L):
        sources = block_sources(rec.embedding, rec.outputs[:site], 2)
        close(rec.inputs[site][0], len(sources) * oracle_read(sources, sources, p.queries[site], p.key_gains[site]))
        if site % 2 == 0:
            # the V route: its own query, the QK route's key gain ("shared", the paper's +1d)
            want_v = len(sources) * oracle_read(sources, sources, p.value_queries[site // 2], p.key_gains[site])
            close(rec.inputs[site][1], want_v)
            if len(sources) > 1:
                assert (want_v - rec.inputs[site][0]).abs().max() > 1e-3
        else:
            assert len(rec.inputs[site]) == 1


def test_delta_attnres_additive_over_deltas():
    model = randomised("delta_attnres")
    rec = Recorded(model, tokens())
    p = model.pathway
    h, sources = rec.embedding, [rec.embedding]
    for site in range(2 * L):
        # layer 0's attention reads the stream itself (released code); then h + routed deltas, / (1 + 1/N)
        routed = h + oracle_read(sources, sources, p.queries[site - 1], p.key_gains[site - 1]) if site else h
        want = h if site == 0 else routed / (1 + 1 / len(sources))
        close(rec.inputs[site][0], want)
        h = h + rec.outputs[site]
        sources = sources + [rec.outputs[site]]
    close(rec.final, h)


def test_dar_cross_stream_keys():
    model = randomised("dar")
    rec = Recorded(model, tokens())
    p = model.pathway
    sig = torch.sigmoid
    values = {"a": [rec.embedding], "b": [rec.embedding]}
    states = {"a": [rec.embedding], "b": [rec.embedding]}
    for site in range(2 * L):
        # stream a scores stream b's normalised states and reads its own values, and vice versa
        r_a = oracle_read(values["a"], states["b"], p.queries[site, 0], p.key_gains[site, 0])
        r_b = oracle_read(values["b"], states["a"], p.queries[site, 1], p.key_gains[site, 1])
        # the branch input (only the pre-norm reads it) is scaled by N; the streams get the raw reads
        close(rec.inputs[site][0], len(values["a"]) * 0.5 * (r_a + r_b))
        u = rec.outputs[site]
        beta_a, beta_b = sig(p.gate_logits[site, 0]), sig(p.gate_logits[site, 1])
        mix = sig(p.cross_logits[site])
        y_a, y_b = r_a + beta_a * u, r_b + beta_b * u
        x_a, x_b = mix * y_a + (1 - mix) * y_b, (1 - mix) * y_a + mix * y_b        # P = [[p, 1-p], [1-p, p]]
        values["a"].append(x_a - r_a)
        values["b"].append(x_b - r_b)
        states["a"].append(x_a)
        states["b"].append(x_b)
    r_a = oracle_read(values["a"], states["b"], p.queries[2 * L, 0], p.key_gains[2 * L, 0])
    r_b = oracle_read(values["b"], states["a"], p.queries[2 * L, 1], p.key_gains[2 * L, 1])
    close(rec.final, len(values["a"]) * 0.5 * (r_a + r_b))


def oracle_ablated_read(values: list[Tensor], query: Tensor | list[Tensor], gain: Tensor | None, score: str,
                        mix: Tensor | None = None) -> Tensor:
    """Kimi's ablations (variants.md 1.5): keys without RMSNorm when `gain` is None, sigmoid or
    softmax scores, a per-token query (a list over sources' tokens is not needed: one [B, T, D]
    tensor or a [D] vector), or static scalar logits `mix` [N] instead of any query."""
    logits = []
    for i, v in enumerate(values):
        if mix is not None:
            logits.append(mix[i].expand(v.shape[:-1]))
            continue
        k = v if gain is None else v / rms(v).unsqueeze(-1) * gain
        logits.append((k * query).sum(-1))
    if score == "sigmoid":
        weights = [torch.sigmoid(z) for z in logits]
    else:
        total = sum(torch.exp(z) for z in logits)
        weights = [torch.exp(z) / total for z in logits]
    return sum(w.unsqueeze(-1) * v for w, v in zip(weights, values, strict=True))


@pytest.mark.parametrize("options", [
    {"key_norm": False}, {"score": "sigmoid"}, {"query_form": "input"}, {"query_form": "scalar"},
    {"key_norm": False, "block_size": 2},
], ids=["no-key-norm", "sigmoid", "input-query", "scalar-mix", "block-no-key-norm"])
def test_kimi_routing_ablations(options):
    name = "block_attnres" if "block_size" in options else "attnres"
    model = randomised(name, options)
    rec = Recorded(model, tokens())
    p = model.pathway
    for site in range(2 * L + 1):
        outputs = rec.outputs[:site]
        sources = block_sources(rec.embedding, outputs, 2) if name == "block_attnres" else [rec.embedding, *outputs]
        query = None if p.queries is None else p.queries[site]
        if options.get("query_form") == "input":
            latest = sources[-1]
            query = query + (latest / rms(latest).unsqueeze(-1)) @ p.query_maps[site].T
        gain = None if not options.get("key_norm", True) or p.key_gains is None else p.key_gains[site]
        mix = None if p.mix_logits is None else p.mix_logits[site]
        score = options.get("score", "softmax")
        want = (2 if score == "sigmoid" else len(sources)) * oracle_ablated_read(sources, query, gain, score, mix)
        got = rec.final if site == 2 * L else rec.inputs[site][0]
        close(got, want)


def test_delta_attnres_over_cumulative_states():
    model = randomised("delta_attnres", {"sources": "cumulative"})
    rec = Recorded(model, tokens())
    p = model.pathway
    h, states = rec.embedding, [rec.embedding]
    for site in range(2 * L):
        routed = h + oracle_read(states, states, p.queries[site - 1], p.key_gains[site - 1]) if site else h
        want = h if site == 0 else routed / (1 + 1 / len(states))
        close(rec.inputs[site][0], want)
        h = h + rec.outputs[site]
        states = states + [h]


def test_rd_attnres_merged_parameter_control():
    model = randomised("rd_attnres", {"block_size": 2, "value_route": "merged"})
    rec = Recorded(model, tokens())
    p = model.pathway
    for site in range(2 * L):
        sources = block_sources(rec.embedding, rec.outputs[:site], 2)
        qk = oracle_read(sources, sources, p.queries[site], p.key_gains[site])
        if site % 2 == 0:
            v = oracle_read(sources, sources, p.value_queries[site // 2], p.key_gains[site])
            qk = 0.5 * (qk + v)
        close(rec.inputs[site][0], len(sources) * qk)
        assert len(rec.inputs[site]) == 1   # one input feeds Q, K and V: nothing decoupled
