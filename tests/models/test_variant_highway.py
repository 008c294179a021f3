"""Additive Highway control (`highway`): h + sigma(W h + b) u, the zero-gate start shared with
Review, the private-generator init, parameter count, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from variant_testing import maker, tokens, train_steps

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

make = maker("highway")


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    eps, norm_state = model.shape.norm_eps, model.pathway.config.norm_state
    h = model.embed(idx)
    for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
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


def test_normal_init_is_private_and_follows_the_run_seed():
    a, b = make(seed=0).pathway, make(seed=5).pathway
    w = a.gates[0].weight
    assert torch.equal(w, make(seed=0).pathway.gates[0].weight)
    assert not torch.equal(w, b.gates[0].weight)
    assert abs(w.std().item() - 0.02) < 0.003 and not torch.equal(w, a.gates[1].weight)
    assert all(torch.equal(g.bias, torch.zeros(32)) for g in a.gates)


def test_param_count():
    d, n_sites = 32, 6
    assert make().pathway.extra_params() == n_sites * (d * d + d)
    cls = get_variant("highway")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 2 * 768**2 + 2 * 768
    assert all(isinstance(g, torch.nn.Linear) for g in make().pathway.gates)


def test_training_lowers_loss():
    losses = train_steps(make(), 30)
    assert losses[-1] < losses[0] - 0.5, losses
