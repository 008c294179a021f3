"""delta_block (arXiv 2605.18855, variants.md 5.2, 5.4): the block bookkeeping (intended and
released), NOT identity at init but exactly identity behind a zero learnable_alpha gate, the math
against a naive re-derivation from the streams, causality, gradients, counts, a smoke run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from variant_testing import SMALL, assert_every_parameter_has_grad, tokens, train_on
from variant_testing import make_model as make

from reslab.models.config import ConfigError

D, L = SMALL["d_model"], SMALL["n_layers"]


def final_hidden(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model.final_norm(model.pathway.readout(model.layer_states(idx)[-1]))


def test_worked_example_intended_and_released():
    # L=8, num_blocks=4: boundaries at layers 0, 2, 4, 6; block b = layers 2(b-1), 2(b-1)+1
    model = make("delta_block", n_layers=8)
    e = torch.randn(1, 1, D)
    outputs = [torch.randn(1, 1, D) for _ in range(16)]
    d1, d2, d3 = (sum(outputs[4 * b: 4 * b + 4]) for b in range(3))
    for mode, expected in (("intended", [e, d1, d2, d3]), ("released", [e, d1, e + d2, d1 + d3])):
        pathway = make("delta_block", {"block_delta": mode}, n_layers=8).pathway
        state = pathway.start(e)
        for site in range(13):  # up to and including layer 6's attention
            state = pathway.update(state, site, outputs[site])
        assert len(state.sources) == 4
        for got, want in zip(state.sources, expected, strict=True):
            torch.testing.assert_close(got, want)
    assert model.pathway.layers_per_block == 2


def test_boundary_attention_does_not_see_the_new_delta():
    # L=6, num_blocks=3: boundaries at layers 0, 2, 4; sources per site as the released code routes
    stats = make("delta_block", {"num_blocks": 3}, n_layers=6).routing_stats(tokens()).sites
    counts = {site: len(s.weights) for (site, _), s in stats.items()}
    assert counts == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 2, 9: 3, 10: 3, 11: 3}
    first = make("delta_block", {"route_first": True, "null_source": True}).routing_stats(tokens()).sites
    assert {site: len(s.weights) for (site, _), s in first.items()}[0] == 2


def block_sources(p, route_first: bool, released: bool):
    """Sources from the streams at the start of each layer: D_b = streams[b_j] - streams[b_{j-1}]."""
    def sources_at(site, e, outputs, streams):
        layer = site // 2
        if site == 0:
            return [e] if route_first else []
        seen = [b for b in range(0, layer + 1, p.layers_per_block) if b < layer or site % 2 == 1]
        out = []
        for j, b in enumerate(seen):
            prev = streams[seen[j - 1]] if j else 0
            out.append(streams[b] - (out[-1] if released and j else prev))
        return out

    return sources_at


def naive_logits(model, idx, sources_at) -> torch.Tensor:
    p, cfg, eps = model.pathway, model.pathway.config, model.shape.norm_eps
    heads, dh = cfg.heads, D // cfg.heads
    h = e = model.embed(idx)
    outputs, streams = [], []
    for site in range(2 * model.shape.n_layers):
        if site % 2 == 0:
            streams.append(h)
        srcs = sources_at(site, e, outputs, streams)
        values = ([p.null_sources[site].expand_as(h)] if cfg.null_source else []) + srcs
        x = h
        if values:
            r = site - p.first_routed_site
            if srcs:
                q = p.queries[site - p.first_query_site].view(heads, dh)
                v = torch.stack(values)                                        # [N, B, T, D]
                k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * p.key_gains[site - p.first_query_site]
                alpha = torch.softmax((k.unflatten(-1, (heads, dh)) * q).sum(-1), dim=0)
                selected = (alpha.unsqueeze(-1) * v.unflatten(-1, (heads, dh))).sum(0).flatten(-2)
            else:
                selected = values[0]
            gate = p.gate_alphas[r] if cfg.gate == "learnable_alpha" else 1.0
            x = (1 - gate) * h + gate * (h + selected)
            if srcs and cfg.stream_scale:
                # stream_scale's constant 1 + g0 / N (g0: the gate at init; N values, null included)
                x = x / (1 + (cfg.gate_init if cfg.gate == "learnable_alpha" else 1.0) / len(values))
        out = model.sublayers[site](model.norms[site](x))
        outputs.append(out)
        h = h + out
    return F.linear(model.final_norm(h), model.embed.weight)


@pytest.mark.parametrize("options", [
    {"block_delta": "intended", "num_blocks": 2},
    {"block_delta": "released", "num_blocks": 2},
    {"block_delta": "released", "num_blocks": 8, "heads": 2, "null_source": True},
    {"block_delta": "intended", "num_blocks": 3, "route_first": True, "gate": "learnable_alpha", "gate_init": 0.7},
], ids=str)
def test_matches_the_equations(float64, options):
    model = make("delta_block", options, n_layers=5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, prm in model.pathway.named_parameters():
            noise = torch.randn(prm.shape, generator=g, dtype=prm.dtype)
            prm.copy_(1 + 0.2 * noise if name == "key_gains" else (0.05 if name == "null_sources" else 0.5) * noise)
    idx = tokens()
    sources = block_sources(model.pathway, options.get("route_first", False), options["block_delta"] == "released")
    torch.testing.assert_close(model(idx).logits, naive_logits(model, idx, sources), rtol=1e-10, atol=1e-12)


def test_not_identity_at_init(float64):
    # the sources omit the current partial block, so h + mean(sources) is not proportional to h
    idx = tokens()
    base = make("prenorm", norm_eps=1e-12)
    attnres = make("delta_attnres", norm_eps=1e-12)
    block = make("delta_block", norm_eps=1e-12)
    for m in (attnres, block):
        m.load_state_dict(base.state_dict(), strict=False)
    ref = final_hidden(base, idx)
    assert (final_hidden(attnres, idx) - ref).abs().max() < 1e-9
    assert (final_hidden(block, idx) - ref).abs().max() > 0.05
    assert (block(idx).logits - base(idx).logits).abs().max() > 1e-3


@pytest.mark.parametrize("options", [
    {"gate": "learnable_alpha"},
    {"gate": "learnable_alpha", "null_source": True, "heads": 8, "num_blocks": 2, "block_delta": "released"},
], ids=str)
def test_zero_learnable_alpha_is_exactly_prenorm(options):
    # the MHAR 8B conversion: max logit deviation 0 in float32
    idx = tokens()
    base = make("prenorm")
    model = make("delta_block", options)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("pathway.") for k in missing)
    assert model(idx).logits.dtype == torch.float32
    assert torch.equal(model(idx).logits, base(idx).logits)


@pytest.mark.parametrize("options", [
    {"num_blocks": 2, "gate": "sigmoid_vector", "pre_gated": True},
    {"gate": "learnable_alpha", "null_source": True, "heads": 2},
], ids=str)
def test_gradients_reach_every_parameter(options):
    model = make("delta_block", options)
    idx = tokens()
    model(idx, idx).loss.backward()
    if options.get("gate") == "learnable_alpha":
        # dL/dw ~ a = 0 at step 0 (variants.md 5.4): the router is shut until the gate opens
        assert model.pathway.queries.grad.abs().max() == 0
        assert model.pathway.null_sources.grad.abs().max() == 0
        # layer 0's attention reads only the null source, zero at init: its alpha waits too
        assert model.pathway.gate_alphas.grad[0] == 0
        assert model.pathway.gate_alphas.grad[1:].abs().min() > 0
    train_on(model, idx, idx, 3, lr=1e-2)
    model.zero_grad()
    model(idx, idx).loss.backward()
    assert_every_parameter_has_grad(model)


def test_parameter_counts_match_delta_attnres():
    for options in ({}, {"null_source": True}, {"route_first": True}, {"gate": "learnable_alpha", "null_source": True}):
        got = make("delta_block", options).pathway.extra_params()
        assert got == make("delta_attnres", options).pathway.extra_params()
    assert make("delta_block", {"route_first": True}).pathway.extra_params() == 4 * D * L
    assert make("delta_block").pathway.layers_per_block == math.ceil(L / 4)


def test_entropy_bonus_changes_the_objective():
    idx = tokens()
    options = {"query_init": "normal", "query_init_std": 0.1, "num_blocks": 4}
    plain = make("delta_block", options, n_layers=4)
    bonus = make("delta_block", {**options, "entropy_bonus": 0.5}, n_layers=4)
    assert plain(idx, idx).aux_loss is None
    out = bonus(idx, idx)
    stats = bonus.routing_stats(idx).sites
    assert out.aux_loss.item() == pytest.approx(-0.5 * sum(s.entropy for s in stats.values()) / 8, rel=1e-5)
    assert out.aux_loss.item() < 0


def test_smoke_training_lowers_the_loss():
    idx = tokens(b=4)
    model = make("delta_block", {"gate": "learnable_alpha", "null_source": True, "block_delta": "released"})
    losses = train_on(model, idx, idx, 30, lr=3e-3)
    assert losses[-1] < losses[0] - 1.0, (losses[0], losses[-1])


def test_knob_errors():
    with pytest.raises(ConfigError, match="num_blocks must be >= 1"):
        make("delta_block", {"num_blocks": 0})
    with pytest.raises(ConfigError, match="block_delta"):
        make("delta_block", {"block_delta": "kimi"})
