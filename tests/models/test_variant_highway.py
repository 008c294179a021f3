"""Additive Highway control (`highway`): h + sigma(W h + b) u, the zero-gate start shared with
Review, the private-generator init, parameter count, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant
from variant_testing import (
    assert_backbone_equal,
    assert_causal,
    assert_every_parameter_has_grad,
    make_model,
    tokens,
    train_steps,
)


def make(options: dict | None = None, name: str = "highway", seed: int = 0, **model) -> torch.nn.Module:
    return make_model(name, options, seed, **model)


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    eps, norm_state = model.shape.norm_eps, model.pathway.config.norm_state
    h = model.embed(idx)
    for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers)):
        u = sub(norm(h))
        gate = model.pathway.gates[site]
        state = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) if norm_state else h
        h = h + torch.sigmoid(state @ gate.weight.T + gate.bias) * u
    return F.linear(model.final_norm(h), model.embed.weight)


@pytest.mark.parametrize("options", [{}, {"norm_state": True}])
def test_matches_equations(float64, options):
    model = make(options)
    with torch.no_grad():
        for gate in model.pathway.gates:
            gate.bias.add_(torch.linspace(-1, 1, 32))
    idx = tokens()
    diff = (model(idx).logits - reference_logits(model, idx)).abs().max().item()
    assert diff < 1e-10, diff


def test_zero_init_equals_review_at_init(float64):
    # both gates start at sigma(0) = 0.5: the two arms of a seed are the same function at step 0
    idx = tokens()
    highway = make({"gate_init": "zero"})
    review = make(name="review")
    assert (highway(idx).logits - review(idx).logits).abs().max().item() < 1e-12


def test_normal_init_is_private_and_follows_the_run_seed():
    a, b = make(seed=0).pathway, make(seed=5).pathway
    w = a.gates[0].weight
    assert torch.equal(w, make(seed=0).pathway.gates[0].weight)
    assert not torch.equal(w, b.gates[0].weight)
    assert abs(w.std().item() - 0.02) < 0.003 and not torch.equal(w, a.gates[1].weight)
    assert all(torch.equal(g.bias, torch.zeros(32)) for g in a.gates)


def test_backbone_init_matches_prenorm():
    assert_backbone_equal(make(name="prenorm"), make())


def test_param_count():
    d, n_sites = 32, 6
    assert make().pathway.extra_params() == n_sites * (d * d + d)
    cls = get_variant("highway")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 2 * 768**2 + 2 * 768
    assert all(isinstance(g, torch.nn.Linear) for g in make().pathway.gates)


def test_causal():
    model = make()
    assert_causal(model, tokens(t=12))


@pytest.mark.parametrize("options", [{}, {"gate_init": "zero"}])
def test_gradients_reach_every_parameter(options):
    model = make(options)
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    assert_every_parameter_has_grad(model)


def test_training_lowers_loss():
    losses = train_steps(make(), 30)
    assert losses[-1] < losses[0] - 0.5, losses
