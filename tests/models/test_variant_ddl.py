"""Deep Delta Learning d_v=1 (`ddl`): identity shortcut at init (the model ignores its sublayers),
the rank-1 erase/write equations, projection and reflection at beta = 1 and 2, parameter count,
private-generator init, causality, gradients, training."""

from __future__ import annotations

import math

import pytest
import torch
from variant_testing import maker, tokens, trace, train_steps

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

make = maker("ddl")


def zero_sublayer_logits(idx: torch.Tensor) -> torch.Tensor:
    """A pre-norm model of the same seed whose sublayers all output zero."""
    base = make(name="prenorm")
    with torch.no_grad():
        for sub in base.sublayers:
            (sub.o_proj if hasattr(sub, "o_proj") else sub.down_proj).weight.zero_()
    return base(idx).logits


@pytest.mark.parametrize("options", [{"proj_init": "zero"}, {}, {"beta_mlp": True}])
def test_identity_shortcut_at_init(float64, options):
    # beta_init = 0 (clamped to 1e-6): x' - x = beta k (v - k.x) with |k| = 1, 0 < v < 4
    options = {"beta_init": 0.0, **options}
    model = make(options)
    idx = tokens()
    for site, (x, _, _, new) in enumerate(trace(model, idx)):
        step = (new - x).norm(dim=-1)                                         # [B, T]
        if options.get("proj_init") == "zero":
            # w_beta = 0: beta is exactly 2 sigmoid(logit(5e-7)) = 1e-6 everywhere
            assert (step <= 1e-6 * (4 + x.norm(dim=-1)) + 1e-18).all(), site
        else:
            assert step.max().item() < 2e-5, (site, step.max().item())
    # so the model ignores its sublayers: the logits of final_norm(embedding)
    ref = zero_sublayer_logits(idx)
    rel = ((model(idx).logits - ref).abs().max() / ref.abs().max()).item()
    assert rel < 1e-4, rel


def test_matches_equations(float64):
    model = make({"beta_init": 1.3})
    eps, k_eps = model.shape.norm_eps, model.pathway.config.k_eps
    for site, (x, _, u, new) in enumerate(trace(model, tokens())):
        beta_map, value_map = model.pathway.beta[site].out, model.pathway.value[site]
        k = u / torch.sqrt((u * u).sum(-1, keepdim=True) + k_eps**2)
        x_hat = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        beta = 2 * torch.sigmoid(x_hat @ beta_map.weight.T + beta_map.bias)
        v = 4 * torch.sigmoid(x @ value_map.weight.T + value_map.bias)
        expected = x + beta * k * (v - (k * x).sum(-1, keepdim=True))
        assert (new - expected).abs().max().item() < 1e-12, site


def test_projection_at_beta_one(float64):
    # beta = 1 writes v exactly along k: k . x' = v
    model = make({"beta_init": 1.0, "proj_init": "zero"})
    x, u = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    new = model.pathway.update(x, 0, u)
    k = u / u.norm(dim=-1, keepdim=True)
    v = 4 * torch.sigmoid(torch.zeros(()))
    assert torch.allclose((k * new).sum(-1), torch.full((2, 5), v.item()), atol=1e-9)


def test_reflection_at_beta_two(float64):
    # beta -> 2 and v = 0: a Householder reflection, which preserves the norm and flips k . x
    model = make({"beta_init": 2.0, "proj_init": "zero"})
    with torch.no_grad():
        model.pathway.value[0].bias.fill_(-1e4)
    x, u = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    new = model.pathway.update(x, 0, u)
    k = u / u.norm(dim=-1, keepdim=True)
    assert torch.allclose(new.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.allclose((k * new).sum(-1), -(k * x).sum(-1), atol=1e-5)


def test_init_values():
    p = make().pathway
    brief = make({"beta_init": 0.0}).pathway
    for site in range(6):
        # b_beta = logit(beta_init / 2): 0 for the default 1.0, logit(5e-7) for 0 (clamped to 1e-6)
        assert p.beta[site].out.bias.item() == 0.0
        assert math.isclose(brief.beta[site].out.bias.item(), math.log(5e-7 / (1 - 5e-7)), rel_tol=1e-6)
        assert p.value[site].bias.item() == 0.0
        assert abs(p.value[site].weight.std().item() - 0.5 / math.sqrt(32)) < 0.04
    # private generator: follows the run seed without touching the global RNG
    assert torch.equal(p.value[0].weight, make().pathway.value[0].weight)
    assert not torch.equal(p.value[0].weight, make(seed=9).pathway.value[0].weight)
    zero = make({"proj_init": "zero"}).pathway
    assert zero.beta[0].out.weight.abs().sum() == 0 and zero.value[0].weight.abs().sum() == 0


def test_param_count():
    d, n_sites = 32, 6
    assert make().pathway.extra_params() == n_sites * (2 * d + 2)
    assert make({"beta_mlp": True}).pathway.extra_params() == n_sites * (129 * d + 130)
    cls = get_variant("ddl")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 4 * 768 + 4


@pytest.mark.parametrize("options", [{}, {"beta_init": 0.0}])
def test_training_lowers_loss(options):
    losses = train_steps(make(options), 30)
    assert losses[-1] < losses[0] - 0.5, losses
