"""delta_attnres (arXiv 2605.18855, variants.md 5): identity at init, the math against a naive
re-derivation, causality, gradients, parameter counts, the entropy bonus, a smoke run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from variant_testing import SMALL, tokens, train_on
from variant_testing import make_model as make

from reslab.models.config import ConfigError, ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

D, L = SMALL["d_model"], SMALL["n_layers"]


@torch.no_grad()
def randomize_pathway(model: torch.nn.Module, seed: int = 3) -> None:
    """Move every pathway parameter off its init so no term of the math hides behind a zero."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.pathway.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if name == "key_gains":
            p.copy_(1 + 0.2 * noise)
        elif name == "queries":
            p.copy_(0.5 * noise)
        elif name == "null_sources":
            p.copy_(0.05 * noise)
        elif name.endswith("weight"):
            p.copy_(0.2 * noise)
        else:
            p.copy_(noise)


def initial_read_scale(cfg, n_values: int) -> float:
    """`stream_scale`'s constant c = 1 + g0 p0 / N: what a zero query multiplies the stream by
    when the sources sum to it (g0, p0: the gate and pre-gate at init; N values, null included)."""
    if not cfg.stream_scale:
        return 1.0
    g0 = {"bias": 1.0, "learnable_alpha": cfg.gate_init}.get(cfg.gate, 1 / (1 + math.exp(-cfg.sigmoid_gate_init)))
    return 1 + g0 * (0.5 if cfg.pre_gated else 1.0) / n_values


def naive_logits(model: torch.nn.Module, idx: torch.Tensor, sources_at) -> torch.Tensor:
    """The paper's equations written out directly, with gates in the code's (1-g) h + g h_hat form,
    and h_hat divided by `initial_read_scale` at sites with real sources (`stream_scale`).

    `sources_at(site, e, outputs, streams)` gives the real sources of `site`; `streams[l]` is the
    stream at the start of layer l.
    """
    p, cfg, eps = model.pathway, model.pathway.config, model.shape.norm_eps
    heads, dh = cfg.heads, D // cfg.heads
    h = e = model.embed(idx)
    outputs, streams = [], []
    for site in range(2 * L):
        if site % 2 == 0:
            streams.append(h)
        srcs = sources_at(site, e, outputs, streams)
        values = ([p.null_sources[site].expand_as(h)] if cfg.null_source else []) + srcs
        x = h
        if values:
            r = site - p.first_routed_site
            if cfg.pre_gated:
                pre = torch.sigmoid(h @ p.pre_gates[r].weight.T + p.pre_gates[r].bias)
                values = [pre * v for v in values]
            if srcs:
                q = p.queries[site - p.first_query_site].view(heads, dh)
                v = torch.stack(values)                                        # [N, B, T, D]
                k = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps) * p.key_gains[site - p.first_query_site]
                alpha = torch.softmax((k.unflatten(-1, (heads, dh)) * q).sum(-1), dim=0)  # [N, B, T, H]
                selected = (alpha.unsqueeze(-1) * v.unflatten(-1, (heads, dh))).sum(0).flatten(-2)
            else:
                selected = values[0]
            h_hat = h + selected
            if cfg.gate == "sigmoid_scalar":
                gate = torch.sigmoid(p.gate_logits[r])
            elif cfg.gate == "sigmoid_vector":
                gate = torch.sigmoid(h @ p.gate_projs[r].weight.T + p.gate_projs[r].bias)
            elif cfg.gate == "learnable_alpha":
                gate = p.gate_alphas[r]
            else:
                gate = 1.0
            x = (1 - gate) * h + gate * h_hat
            if srcs:
                x = x / initial_read_scale(cfg, len(values))
        out = model.sublayers[site](model.norms[site](x))
        outputs.append(out)
        h = h + out
    return F.linear(model.final_norm(h), model.embed.weight)


def delta_sources(route_first: bool):
    def sources_at(site, e, outputs, streams):
        if site == 0:
            return [e] if route_first else []
        return [e] + outputs[:site]

    return sources_at


OPTION_SETS = [
    {},
    {"null_source": True},
    {"heads": 4},
    {"route_first": True, "gate": "sigmoid_scalar"},
    {"gate": "sigmoid_vector", "null_source": True, "heads": 2},
    {"gate": "learnable_alpha", "gate_init": 0.3},
    {"pre_gated": True, "null_source": True},
    {"pre_gated": True, "gate": "sigmoid_vector", "route_first": True, "heads": 2},
]


@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_zero_queries_compute_prenorm(float64, options):
    # h_hat = h + mean(sources) (times a positive gate) = c h, and stream_scale divides by that c:
    # prenorm's function at the shipped eps (ModelConfig's 1e-6), not only as eps -> 0
    idx = tokens()
    base = make("prenorm")
    model = make("delta_attnres", options)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("pathway.") for k in missing)
    diff = (model(idx).logits - base(idx).logits).abs().max().item()
    assert diff < 1e-9, diff
    for a, b in zip(model.layer_streams(idx), base.layer_streams(idx), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-10)


def test_seed_matched_backbone_is_the_same_for_every_arm():
    # the variant never draws from the global RNG, even with random queries
    base = make("prenorm").state_dict()
    model = make("delta_attnres", {"query_init": "normal", "gate": "sigmoid_vector", "pre_gated": True})
    for key, value in base.items():
        assert torch.equal(model.state_dict()[key], value), key
    again = make("delta_attnres", {"query_init": "normal"})
    torch.testing.assert_close(again.pathway.queries, model.pathway.queries)
    other_seed = make("delta_attnres", {"query_init": "normal"}, seed=7)
    assert not torch.equal(other_seed.pathway.queries, model.pathway.queries)
    assert 0.01 < model.pathway.queries.std().item() < 0.03


@pytest.mark.parametrize("options", OPTION_SETS, ids=str)
def test_matches_the_equations(float64, options):
    model = make("delta_attnres", options)
    randomize_pathway(model)
    idx = tokens()
    expected = naive_logits(model, idx, delta_sources(options.get("route_first", False)))
    torch.testing.assert_close(model(idx).logits, expected, rtol=1e-10, atol=1e-12)


def test_sources_per_site():
    idx = tokens()
    for options, first in (({}, None), ({"route_first": True}, 1), ({"null_source": True}, 1)):
        stats = make("delta_attnres", options).routing_stats(idx).sites
        null = 1 if options.get("null_source") else 0
        counts = {site: len(s.weights) for (site, _), s in stats.items()}
        expected = {site: site + 1 + null for site in range(1, 2 * L)}
        if first is not None:
            expected[0] = first
        assert counts == expected, options


def test_learnable_alpha_router_learns_after_the_gate_opens():
    model = make("delta_attnres", {"gate": "learnable_alpha"})
    idx = tokens()
    model(idx, idx).loss.backward()
    assert model.pathway.queries.grad.abs().max() == 0
    assert model.pathway.gate_alphas.grad.abs().min() > 0
    train_on(model, idx, idx, 3, lr=1e-2)
    model.zero_grad()
    model(idx, idx).loss.backward()
    assert model.pathway.gate_alphas.abs().min() > 0
    assert (model.pathway.queries.grad.abs().sum(-1) > 0).all()


def test_parameter_counts_match_the_paper():
    # paper: a query and a key gain per sublayer, 4d per layer; the released code allocates them
    # at layer 0's attention too, where they are never used: without route_first we skip them
    def extra(**options) -> int:
        return make("delta_attnres", options).pathway.extra_params()

    assert extra(route_first=True) == 4 * D * L
    assert extra() == 4 * D * L - 2 * D
    assert extra(heads=4) == extra()
    assert extra(null_source=True) == 4 * D * L - 2 * D + 2 * D * L
    assert extra(route_first=True, null_source=True) == 4 * D * L + 2 * D * L
    assert extra(gate="sigmoid_scalar") == extra() + 2 * L - 1
    assert extra(gate="learnable_alpha", null_source=True) == 6 * D * L - 2 * D + 2 * L
    assert extra(gate="sigmoid_vector") == extra() + (2 * L - 1) * (D * D + D)
    assert extra(pre_gated=True, route_first=True) == 4 * D * L + 2 * L * (D * D + D)
    assert make("delta_attnres").param_counts()["residual"] == extra()


def test_gpt2_124m_extra_params():
    cls = get_variant("delta_attnres")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    d, layers = 768, 12
    assert cls(cls.Config(), shape).extra_params() == 4 * d * layers - 2 * d
    assert cls(cls.Config(route_first=True), shape).extra_params() == 4 * d * layers
    assert cls(cls.Config(null_source=True), shape).extra_params() == 6 * d * layers - 2 * d


def test_entropy_bonus():
    idx = tokens()
    lam = 0.1
    options = {"query_init": "normal", "query_init_std": 0.1, "null_source": True}
    plain = make("delta_attnres", options)
    bonus = make("delta_attnres", {**options, "entropy_bonus": lam})
    assert plain(idx, idx).aux_loss is None
    out, ref = bonus(idx, idx), plain(idx, idx)
    torch.testing.assert_close(out.loss, ref.loss)
    # -lambda * entropy averaged over tokens, heads and all 2L sites (the single-source ones count 0)
    stats = bonus.routing_stats(idx).sites
    mean_entropy = sum(s.entropy for s in stats.values()) / (2 * L)
    assert out.aux_loss.item() == pytest.approx(-lam * mean_entropy, rel=1e-5)
    assert out.aux_loss.item() < 0

    # descending the bonus raises the routing entropy
    queries = bonus.pathway.queries
    (grad,) = torch.autograd.grad(out.aux_loss, queries)
    with torch.no_grad():
        queries -= 0.5 * grad
    after = sum(s.entropy for s in bonus.routing_stats(idx).sites.values()) / (2 * L)
    assert after > mean_entropy


def test_smoke_training_lowers_the_loss():
    idx = tokens(b=4)
    for options in ({}, {"gate": "learnable_alpha", "null_source": True, "entropy_bonus": 0.01}):
        model = make("delta_attnres", options)
        losses = train_on(model, idx, idx, 30, lr=3e-3)
        assert losses[-1] < losses[0] - 1.0, (options, losses[0], losses[-1])


def test_knob_errors():
    with pytest.raises(ValueError, match="heads: 3 does not divide d_model=32"):
        make("delta_attnres", {"heads": 3})
    with pytest.raises(ConfigError, match="entropy_bonus must be"):
        make("delta_attnres", {"entropy_bonus": -1.0})
    with pytest.raises(ConfigError, match="gate"):
        make("delta_attnres", {"gate": "tanh"})
