"""Depth sliding-window read (`depth_swa`): the window over depth sources, `attnres` exactly when
the window covers the depth, the projected depth attention (uniform and equal to the static read
at init, its equations), recorded weights, parameter counts, causality, gradients, training."""

from __future__ import annotations

import math

import pytest
import torch
from variant_testing import assert_every_parameter_has_grad, maker, perturb_pathway, tokens, trace, train_steps

from reslab.kernels.depth_read import depth_read
from reslab.models.config import ConfigError, ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

D, SITES = 32, 6


make = maker("depth_swa")


def test_window_indices():
    p = make({"window": 3}).pathway
    assert [p.window_indices(n) for n in (1, 3, 4, 7)] == [[0], [0, 1, 2], [0, 1, 2, 3], [0, 4, 5, 6]]
    p = make({"window": 3, "include_embedding": False}).pathway
    assert [p.window_indices(n) for n in (1, 3, 4, 7)] == [[0], [0, 1, 2], [1, 2, 3], [4, 5, 6]]
    kimi = make().pathway
    assert kimi.config.window == 8 and kimi.config.include_embedding and kimi.config.query == "static"
    assert kimi.window_indices(25) == [0] + list(range(17, 25))


@pytest.mark.parametrize("options", [
    {"window": 7}, {"window": 100}, {"window": 7, "include_embedding": False}, {"window": 7, "readout": False},
])
def test_full_window_is_attnres(options):
    # 2L+1 = 7 sources at the readout: every read covers every source, with the same queries
    attn = make({"readout": options.get("readout", True)}, name="attnres")
    perturb_pathway(attn, 1.0)
    swa = make(options)
    swa.load_state_dict(attn.state_dict())
    idx = tokens()
    assert torch.equal(swa(idx).logits, attn(idx).logits)


def test_window_reads_only_its_sources():
    model = make({"window": 3})
    perturb_pathway(model, 1.0)
    p, idx = model.pathway, tokens()
    sources = trace(model, idx)[-1][-1]  # [e, f_1, ..., f_2L]
    for site in range(len(sources)):
        got = p.route(sources[: site + 1], site)
        window = [sources[i] for i in p.window_indices(site + 1)]
        ref, _ = depth_read(window, p.queries[site], p.key_gains[site], eps=model.shape.norm_eps)
        assert torch.equal(got, ref * len(window)), site  # stream_scale: times the window's size
    # an old source outside every later window changes no later read
    moved = list(sources)
    moved[1] = moved[1] + 5.0
    for site in range(4, 7):
        assert torch.equal(p.route(moved[: site + 1], site), p.route(sources[: site + 1], site)), site


def test_recorded_weights_line_up_with_depth():
    model = make({"window": 3})
    perturb_pathway(model, 1.0)
    stats = model.routing_stats(tokens()).sites
    assert sorted(site for site, _ in stats) == list(range(SITES + 1))
    for (site, _), s in stats.items():
        w = s.weights
        assert w.shape == (site + 1,)
        assert math.isclose(w.sum().item(), 1.0, rel_tol=1e-5)
        outside = [i for i in range(site + 1) if i not in model.pathway.window_indices(site + 1)]
        assert all(w[i] == 0 for i in outside), (site, w)


@pytest.mark.parametrize("window", [7, 3])
def test_projected_starts_as_the_static_zero_query_read(float64, window):
    # W_Q = 0: uniform weights; W_V = I: the uniform mean of the window, as the static read
    static = make({"window": window})
    projected = make({"window": window, "query": "projected"})
    idx = tokens()
    assert (projected(idx).logits - static(idx).logits).abs().max().item() < 1e-12
    stats = projected.routing_stats(idx).sites
    for (site, _), s in stats.items():
        inside = projected.pathway.window_indices(site + 1)
        assert torch.allclose(s.weights[inside].double(), torch.full((len(inside),), 1 / len(inside)))


def test_full_window_projected_at_init_is_prenorm(float64):
    # the uniform mean over all sources is h / N, which stream_scale multiplies by N: h itself, so
    # the sublayer's RMSNorm sees prenorm's input at the shipped eps
    idx = tokens()
    projected = make({"window": 7, "query": "projected", "readout": False})(idx).logits
    base = make(name="prenorm")(idx).logits
    assert ((projected - base).abs().max() / base.abs().max()).item() < 1e-8


@pytest.mark.parametrize("value_proj", [True, False])
def test_projected_matches_equations(float64, value_proj):
    model = make({"window": 4, "query": "projected", "key_dim": 8, "value_proj": value_proj})
    perturb_pathway(model, 0.3)
    p, eps = model.pathway, model.shape.norm_eps
    sources = trace(model, tokens())[-1][-1]
    for site in range(len(sources)):
        window = [sources[i] for i in p.window_indices(site + 1)]
        values = torch.stack(window)                                         # [N, B, T, D]
        normed = values / torch.sqrt(values.pow(2).mean(-1, keepdim=True) + eps)
        if site == 0:
            a = torch.ones(values.shape[:-1])
        else:
            q = normed[-1] @ p.q_proj[site - 1].weight.T                     # [B, T, dk]
            k = normed @ p.k_proj[site - 1].weight.T                         # [N, B, T, dk]
            a = torch.softmax((k * q).sum(-1) / math.sqrt(8), dim=0)
        v = values @ p.v_proj[site].weight.T if value_proj else values
        expected = len(window) * (a.unsqueeze(-1) * v).sum(0)                # stream_scale
        assert (p.route(sources[: site + 1], site) - expected).abs().max().item() < 1e-12, site


def test_projected_parameters_and_init():
    p = make({"query": "projected"}).pathway
    names = {name for name, _ in p.named_parameters()}
    assert not any(name.startswith(("queries", "key_gains")) for name in names)
    assert all(lin.weight.abs().sum() == 0 for lin in p.q_proj)
    assert all(torch.equal(lin.weight, torch.eye(D)) for lin in p.v_proj)
    assert abs(p.k_proj[0].weight.std().item() - 0.02) < 0.004
    # the private per-site generator follows the run seed without touching the global RNG
    other = make({"query": "projected"}, seed=11).pathway
    assert len(p.q_proj) == len(p.k_proj) == SITES and len(p.v_proj) == SITES + 1
    assert torch.equal(p.k_proj[3].weight, make({"query": "projected"}).pathway.k_proj[3].weight)
    assert not torch.equal(p.k_proj[3].weight, other.k_proj[3].weight)
    assert not torch.equal(p.k_proj[0].weight, p.k_proj[1].weight)
    with pytest.raises(ConfigError):
        make({"query": "projected", "query_init": "normal"})
    with pytest.raises(ConfigError):
        make({"window": 0})


def test_param_count():
    routes, dk = SITES + 1, 64
    assert make().pathway.extra_params() == routes * 2 * D
    assert make().pathway.extra_params() == make(name="attnres").pathway.extra_params()
    # W_Q, W_K from site 1 (site 0 reads the embedding alone), W_V at every route
    assert make({"query": "projected"}).pathway.extra_params() == SITES * 2 * D * dk + routes * D * D
    assert make({"query": "projected", "value_proj": False}).pathway.extra_params() == SITES * 2 * D * dk
    cls = get_variant("depth_swa")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params() == 25 * 2 * 768
    assert cls(cls.Config(query="projected"), shape).extra_params() == 24 * 2 * 768 * 64 + 25 * 768 * 768


@pytest.mark.parametrize("options", [{"window": 3}, {"window": 3, "query": "projected"}])
def test_gradients_reach_every_parameter(options):
    # at step 0 a zero query blocks the key side: the static key gains (dlogit/dg = q * k_hat)
    # and the projected W_K (dlogit/dW_K = q k_hat^T) get no gradient until one step moves the
    # query; the readout's key gain is blocked the same way
    model = make(options)
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    blocked = model.pathway.key_gains if options.get("query") != "projected" else model.pathway.k_proj[2].weight
    assert blocked.grad.abs().sum() == 0
    train_steps(model, 2)
    model.zero_grad()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    assert_every_parameter_has_grad(model)


@pytest.mark.parametrize("options", [{"window": 3}, {"window": 3, "query": "projected", "key_dim": 16}])
def test_training_lowers_loss(options):
    losses = train_steps(make(options), 30)
    assert losses[-1] < losses[0] - 0.5, losses
