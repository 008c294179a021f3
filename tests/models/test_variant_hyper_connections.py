"""Hyper-Connections (`hyper_connections`): the static init is `prenorm` exactly (every stream is
the pre-norm stream), the paper's update equations (SHC and DHC), the MHAR-code init from a
private generator, parameter counts, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
from variant_testing import assert_every_parameter_has_grad, maker, perturb_pathway, tokens, trace, train_steps

from reslab.models.config import ModelConfig
from reslab.models.layers import rms_norm
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

D, SITES = 32, 6


make = maker("hyper_connections")


@pytest.mark.parametrize("options", [
    {"streams": 1}, {"streams": 4}, {"streams": 3}, {"streams": 4, "dynamic": True},
])
def test_static_init_is_prenorm(float64, options):
    # A_m = e_{k mod n}, A_r = I, B = 1: every stream gets every update, so each stream IS the
    # pre-norm stream (bitwise: the coefficients are exact 0s and 1s) and h_in = H[k mod n]
    hc, base = make(options), make(name="prenorm")
    idx = tokens()
    h = base.embed(idx)
    for site, (state, x, _, _) in enumerate(trace(hc, idx)):
        for i in range(options["streams"]):
            assert torch.equal(state.streams[..., i, :], h), (site, i)
        assert torch.equal(x, h), site
        h = h + base.sublayers[site](base.norms[site](h))
    # the readout is the streams' mean (stream_scale), h itself: prenorm's logits at the shipped eps
    ref = base(idx).logits
    rel = ((hc(idx).logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-14, rel
    if options["streams"] == 1:
        assert torch.equal(hc(idx).logits, base(idx).logits)
    # the paper's sum n h is prenorm's only up to the final RMSNorm's eps: a relative
    # eps * (1 - 1/n^2) / (2 mean(h^2)), ~1e-3 here at eps 1e-6
    summed = make({**options, "stream_scale": False})(idx).logits
    rel = ((summed - ref).abs().max() / ref.abs().max()).item()
    assert (rel > 1e-5) if options["streams"] > 1 else rel == 0, rel


def test_static_init_values():
    p = make({"streams": 4}).pathway
    for site in range(SITES):
        expected = torch.zeros(4)
        expected[site % 4] = 1.0
        assert torch.equal(p.read[site], expected)
        assert torch.equal(p.mix[site], torch.eye(4))
        assert torch.equal(p.write[site], torch.ones(4))


def test_mhar_baseline_init():
    p = make({"init": "mhar_baseline"}).pathway
    a_m, a_r, b = p.coefficients(torch.zeros(1, 1, 4, D), 0)
    assert torch.allclose(a_m, torch.full((4,), 0.25), atol=0.05) and torch.isclose(a_m.sum(), torch.tensor(1.0))
    assert (a_r - torch.eye(4)).abs().max() < 0.1 and (a_r - torch.eye(4)).abs().max() > 0
    e0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert (b - e0).abs().max() < 0.1 and (b - e0).abs().max() > 0
    # the private per-site generator follows the run seed without touching the global RNG
    same = make({"init": "mhar_baseline"}).pathway
    other = make({"init": "mhar_baseline"}, seed=11).pathway
    for name in ("read", "mix", "write"):
        assert torch.equal(getattr(p, name), getattr(same, name)), name
        assert not torch.equal(getattr(p, name), getattr(other, name)), name
    assert not torch.equal(p.mix[0], p.mix[1])


def test_mhar_baseline_is_not_prenorm(float64):
    idx = tokens()
    hc = make({"init": "mhar_baseline"}, norm_eps=1e-12)(idx).logits
    base = make(name="prenorm", norm_eps=1e-12)(idx).logits
    assert (hc - base).abs().max().item() > 1e-3


@pytest.mark.parametrize("options", [{}, {"dynamic": True}, {"init": "mhar_baseline", "dynamic": True}])
def test_matches_equations(float64, options):
    model = make(options)
    perturb_pathway(model, 0.3)
    p, n = model.pathway, 4
    for site, (state, x, u, new) in enumerate(trace(model, tokens())):
        H = state.streams                                                    # [B, T, n, D]
        a_m, a_r, b = p.read[site], p.mix[site], p.write[site]
        if options.get("dynamic"):
            hbar = rms_norm(H, model.shape.norm_eps)
            w = p.dynamic[site].weight                                       # [n+2, D]
            a_m = a_m + p.scale_a[site] * torch.tanh(hbar @ w[0])
            a_r = a_r + p.scale_a[site] * torch.tanh(hbar @ w[1:n + 1].T)
            b = b + p.scale_b[site] * torch.tanh(hbar @ w[n + 1])
        else:
            a_m, a_r, b = a_m.expand(2, 16, n), a_r.expand(2, 16, n, n), b.expand(2, 16, n)
        if options.get("init") == "mhar_baseline":
            a_m = torch.softmax(a_m, -1)
        h_in = sum(a_m[..., i, None] * H[..., i, :] for i in range(n))
        assert (x - h_in).abs().max().item() < 1e-12, site
        for j in range(n):
            expected = b[..., j, None] * u + sum(a_r[..., i, j, None] * H[..., i, :] for i in range(n))
            assert (new.streams[..., j, :] - expected).abs().max().item() < 1e-12, (site, j)


def test_stream_sums_the_streams_and_readout_averages_them():
    model = make()
    perturb_pathway(model, 0.3)
    idx = tokens()
    state = trace(model, idx)[-1][-1]
    assert torch.equal(model.pathway.stream(state), state.streams.sum(-2))
    assert torch.equal(model.pathway.readout(state), state.streams.sum(-2) / 4)
    summed = make({"stream_scale": False})
    assert torch.equal(summed.pathway.readout(state), state.streams.sum(-2))
    streams = model.layer_streams(idx)
    assert len(streams) == 3 and streams[0].shape == (2, 16, D)


def test_param_count():
    for n in (1, 2, 4):
        static = n * n + 2 * n
        assert make({"streams": n}).pathway.extra_params() == SITES * static
        dynamic = static + D * (n + 2) + 2
        assert make({"streams": n, "dynamic": True}).pathway.extra_params() == SITES * dynamic
    cls = get_variant("hyper_connections")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 2 * (16 + 8)
    assert cls(cls.Config(dynamic=True), shape).extra_params_per_layer() == 2 * (24 + 768 * 6 + 2)


def test_gradients_dynamic():
    # W = 0 makes tanh(Hbar W) = 0, so the scales s_a, s_b get no gradient at step 0; one
    # AdamW step moves W (its gradient is s * dL/dcoeff * Hbar != 0) and unblocks them
    model = make({"dynamic": True})
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    assert model.pathway.scale_a.grad.abs().sum() == 0 and model.pathway.scale_b.grad.abs().sum() == 0
    assert all(lin.weight.grad.abs().sum() > 0 for lin in model.pathway.dynamic)
    train_steps(model, 2)
    model.zero_grad()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    assert_every_parameter_has_grad(model)


@pytest.mark.parametrize("options", [{}, {"dynamic": True}, {"init": "mhar_baseline"}])
def test_training_lowers_loss(options):
    losses = train_steps(make(options), 30)
    assert losses[-1] < losses[0] - 0.5, losses
