"""Additive Highway control (`highway`): h + sigma(W h + b) u, the zero-gate start shared with
Review, the private-generator init, parameter count, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.backbone import build_model
from models.config import ModelConfig, ResidualConfig
from models.presets import resolve_model
from models.residual import get_variant

VOCAB = 64
SMALL = dict(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)


@pytest.fixture
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def make(options: dict | None = None, name: str = "highway", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**SMALL), ResidualConfig(name=name, options=options or {}), vocab_size=VOCAB)


def tokens(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def train_steps(model: torch.nn.Module, steps: int, lr: float = 3e-3) -> list[float]:
    idx = tokens(b=4, seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(idx[:, :-1], idx[:, 1:]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


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
    base, variant = make(name="prenorm").state_dict(), make().state_dict()
    for key, value in base.items():
        assert torch.equal(value, variant[key]), key


def test_param_count():
    d, n_sites = 32, 6
    assert make().pathway.extra_params() == n_sites * (d * d + d)
    cls = get_variant("highway")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params_per_layer() == 2 * 768**2 + 2 * 768
    assert all(isinstance(g, torch.nn.Linear) for g in make().pathway.gates)


def test_causal():
    model = make()
    idx = tokens(t=12)
    ref = model(idx).logits
    for t in (3, 7):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % VOCAB
        assert torch.allclose(model(changed).logits[:, : t + 1], ref[:, : t + 1], atol=1e-6)


@pytest.mark.parametrize("options", [{}, {"gate_init": "zero"}])
def test_gradients_reach_every_parameter(options):
    model = make(options)
    idx = tokens()
    model(idx[:, :-1], idx[:, 1:]).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_training_lowers_loss():
    losses = train_steps(make(), 30)
    assert losses[-1] < losses[0] - 0.5, losses
