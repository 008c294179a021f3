"""Review Residuals (`review`): r = 0.5 at init (pre-norm with halved updates), the gate equations
in both forms, parameter count, seed-matched backbone, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from variant_testing import maker, perturb_pathway, tokens, train_steps

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

make = maker("review")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Section 7.1 written out: W_r split into its state half and its update half."""
    eps, d, form = model.shape.norm_eps, model.shape.d_model, model.pathway.config.form
    h = model.embed(idx)
    for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
        u = sub(norm(h))
        gate = model.pathway.gates[site]
        r = torch.sigmoid(rms(h, eps) @ gate.weight[:, :d].T + rms(u, eps) @ gate.weight[:, d:].T + gate.bias)
        h = h + r * u if form == "additive" else (1 - r) * h + r * u
    return F.linear(model.final_norm(h), model.embed.weight)


@pytest.mark.parametrize("form", ["additive", "convex"])
def test_matches_equations(float64, form):
    model = make({"form": form})
    perturb_pathway(model, 0.3)
    idx = tokens()
    diff = (model(idx).logits - reference_logits(model, idx)).abs().max().item()
    assert diff < 1e-10, diff


def test_additive_init_is_prenorm_with_halved_updates(float64):
    # W_r = 0, b_r = 0: r = 0.5, so h' = h + u / 2 = pre-norm with output projections halved
    idx = tokens()
    review = make()
    base = make(name="prenorm")
    with torch.no_grad():
        for sub in base.sublayers:
            (sub.o_proj if hasattr(sub, "o_proj") else sub.down_proj).weight.mul_(0.5)
    diff = (review(idx).logits - base(idx).logits).abs().max().item()
    assert diff < 1e-12, diff
    assert (review(idx).logits - make(name="prenorm")(idx).logits).abs().max().item() > 1e-4


def test_convex_init_halves_the_state(float64):
    model = make({"form": "convex"})
    eps = model.shape.norm_eps
    h = torch.randn(2, 5, 32)
    u = torch.randn(2, 5, 32)
    assert torch.allclose(model.pathway.update(h, 0, u), 0.5 * h + 0.5 * u, atol=1e-15)
    assert torch.equal(model.pathway.gates[0](torch.cat([rms(h, eps), rms(u, eps)], -1)), torch.zeros(2, 5, 32))


def test_param_count():
    d, n_sites = 32, 6
    assert make().pathway.extra_params() == n_sites * (2 * d * d + d)
    cls = get_variant("review")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 4 * 768**2 + 2 * 768
    # the gate matrices are nn.Linear, so the optimizer decays them
    assert all(isinstance(g, torch.nn.Linear) for g in make().pathway.gates)


@pytest.mark.parametrize("form", ["additive", "convex"])
def test_training_lowers_loss(form):
    losses = train_steps(make({"form": form}), 30)
    assert losses[-1] < losses[0] - 0.5, losses
