"""Multi-Gate Residuals (`mgr`): equations against a hand-written walk, the symmetry hazard and
its breaking, depth-scaled init, recorded pooling weights, parameter count, causality, training."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from variant_testing import maker, perturb_pathway, tokens, train_steps

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

make = maker("mgr")


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """The section-6 equations written out stream by stream, driving the model's own sublayers."""
    p, cfg, shape = model.pathway, model.pathway.config, model.shape
    d, eps = shape.d_model, shape.norm_eps
    e = model.embed(idx)
    streams, h, pending = [e] * cfg.streams, e, None
    for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
        u = sub(norm(h if pending is None else h + pending))
        if cfg.per == "layer" and site % 2 == 0:
            pending = u
            continue
        f = u if cfg.per == "sublayer" else pending + u
        pending = None
        m = site if cfg.per == "sublayer" else site // 2
        scores = torch.stack([
            (rms(s, eps) @ p.w_beta[m]) / math.sqrt(d) + p.b_beta[m, i] for i, s in enumerate(streams)
        ])
        beta = torch.sigmoid(scores) if cfg.gate_type == "sigmoid" else torch.softmax(scores, 0)
        streams = [(1 - beta[i]).unsqueeze(-1) * s + beta[i].unsqueeze(-1) * f for i, s in enumerate(streams)]
        alpha = torch.softmax(torch.stack([(rms(s, eps) @ p.w_alpha[m]) / math.sqrt(d) for s in streams]), 0)
        h = sum(alpha[i].unsqueeze(-1) * s for i, s in enumerate(streams))
    return F.linear(model.final_norm(h), model.embed.weight)


@pytest.mark.parametrize("options", [
    {}, {"per": "layer"}, {"gate_type": "softmax"}, {"per": "layer", "gate_type": "softmax", "streams": 3},
    {"streams": 1}, {"gate_init": 0.3, "bias_spread": 1.5},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_matches_equations(float64, options):
    model = make(options)
    perturb_pathway(model, 2.0)
    idx = tokens()
    diff = (model(idx).logits - reference_logits(model, idx)).abs().max().item()
    assert diff < 1e-10, diff


def test_depth_scaled_init_and_spread():
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    cls = get_variant("mgr")
    for per, modules in (("sublayer", 24), ("layer", 12)):
        p = cls(cls.Config(per=per), shape)
        base = 1 / (1 + math.exp(3)) * math.sqrt(21 / modules)
        rates = torch.sigmoid(p.b_beta.detach())                                   # [M, n]
        logit = math.log(base / (1 - base))
        expected = torch.sigmoid(logit + 0.5 * torch.linspace(-1, 1, 4))
        assert torch.allclose(rates, expected.expand_as(rates), atol=1e-6)
        # the spread is symmetric in logit space around the depth-scaled base
        assert torch.allclose(p.b_beta.detach().mean(-1), torch.full((modules,), logit), atol=1e-6)
    fixed = cls(cls.Config(gate_init=0.1, bias_spread=0.0), shape)
    assert torch.allclose(torch.sigmoid(fixed.b_beta.detach()), torch.full_like(fixed.b_beta, 0.1))


def test_symmetry_hazard_without_spread(float64):
    # identical seeds, shared w and equal biases: identical streams, identical gradients, forever
    model = make({"bias_spread": 0.0})
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    assert model.pathway.w_alpha.grad.abs().max().item() == 0.0  # a softmax over equal scores is flat
    b_grad = model.pathway.b_beta.grad
    assert (b_grad - b_grad[:, :1]).abs().max().item() < 1e-15
    train_steps(model, 5)
    streams = model.layer_states(idx)[-1].streams
    assert (streams - streams[:1]).abs().max().item() < 1e-12


def test_default_spread_breaks_symmetry(float64):
    model = make()
    train_steps(model, 5)
    streams = model.layer_states(tokens())[-1].streams                                       # [n, B, T, D]
    gap = (streams - streams.mean(0)).norm(dim=-1) / streams.norm(dim=-1)
    assert gap.min().item() > 1e-3, gap.min().item()
    b = model.pathway.b_beta.detach()
    assert (b[:, 1:] - b[:, :-1]).min().item() > 0.1  # the bias offsets survive training


def test_records_pooling_weights():
    for options, sites in (({}, range(6)), ({"per": "layer"}, (1, 3, 5))):
        model = make(options)
        perturb_pathway(model, 0.5)
        rec = model.routing_stats(tokens())
        assert set(rec.sites) == {(s, "pool") for s in sites}
        for stats in rec.sites.values():
            assert stats.weights.shape == (4,)
            assert abs(stats.weights.sum().item() - 1) < 1e-5


def test_param_count():
    for per, modules in (("sublayer", 6), ("layer", 3)):
        model = make({"per": per, "streams": 3})
        assert model.pathway.extra_params() == modules * (2 * 32 + 3)
    cls = get_variant("mgr")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 4 * 768 + 2 * 4


@pytest.mark.parametrize("options", [{}, {"per": "layer", "gate_type": "softmax"}])
def test_training_lowers_loss(options):
    losses = train_steps(make(options), 30)
    assert losses[-1] < losses[0] - 0.5, losses
