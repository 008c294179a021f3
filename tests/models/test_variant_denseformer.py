"""DenseFormer (`denseformer`): exactly pre-norm at init for every k x p, the DWA equations with
dilation and period against a hand-written walk, parameter counts, recorded weights, decay
placement, causality, gradients, training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from variant_testing import maker, perturb_pathway, tokens, train_steps

from reslab.models.config import ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import get_variant

make = maker("denseformer")


def reference_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Section 8.2 written out block by block, with the dilation and period rules spelled out."""
    k, p = model.pathway.config.dilation, model.pathway.config.period
    xs = [model.embed(idx)]
    y = xs[0]
    for i in range(1, model.shape.n_layers + 1):
        attn, mlp = model.sublayers[2 * i - 2], model.sublayers[2 * i - 1]
        h = y + attn(model.norms[2 * i - 2](y))
        xs.append(h + mlp(model.norms[2 * i - 1](h)))
        if i % p:
            y = xs[i]
            continue
        a = model.pathway.dwa[str(i)].weight.view(-1)
        js = [j for j in range(i + 1) if (i - j) % k == 0]
        y = sum(a[n] * xs[j] for n, j in enumerate(js))
    return F.linear(model.final_norm(y), model.embed.weight)


@pytest.mark.parametrize("options", [{}, {"dilation": 2}, {"period": 2}, {"dilation": 2, "period": 3}])
def test_exactly_prenorm_at_init(options):
    idx = tokens()
    base = make(name="prenorm", n_layers=6)
    variant = make(options, n_layers=6)
    assert torch.equal(variant(idx).logits, base(idx).logits)


@pytest.mark.parametrize("options", [{}, {"dilation": 2}, {"period": 2}, {"dilation": 3, "period": 2}])
def test_matches_equations(float64, options):
    model = make(options, n_layers=6)
    perturb_pathway(model, 0.5)
    idx = tokens()
    diff = (model(idx).logits - reference_logits(model, idx)).abs().max().item()
    assert diff < 1e-10, diff


@pytest.mark.parametrize("n_layers", [1, 3, 6, 12])
def test_param_count_1x1(n_layers):
    # block i mixes x_0..x_i: sum_{i=1}^{L} (i + 1) = L (L + 3) / 2
    assert make(n_layers=n_layers).pathway.extra_params() == n_layers * (n_layers + 3) // 2


@pytest.mark.parametrize("k,p,expected", [
    (2, 1, 1 + 2 + 2 + 3),   # i=1: x1; i=2: x0,x2; i=3: x1,x3; i=4: x0,x2,x4
    (1, 2, 3 + 5),           # DWAs after blocks 2 and 4 only
    (2, 2, 2 + 3),           # i=2: x0,x2; i=4: x0,x2,x4
    (3, 3, 2),               # only block 3 has a DWA: x0, x3
])
def test_param_count_dilated_periodic(k, p, expected):
    model = make({"dilation": k, "period": p}, n_layers=4)
    assert model.pathway.extra_params() == expected
    assert model.pathway.extra_params() == sum(i // k + 1 for i in range(1, 5) if i % p == 0)


def test_gpt2_param_count():
    cls = get_variant("denseformer")
    shape = resolve_model(ModelConfig(preset="gpt2-124m"), vocab_size=256)
    assert cls(cls.Config(), shape).extra_params() == 12 * 15 // 2


def test_records_normalised_magnitudes():
    model = make({"dilation": 2}, n_layers=4)
    rec = model.routing_stats(tokens())
    assert set(rec.sites) == {(2 * i, "dwa") for i in range(1, 5)}
    # at init a_{i,i} = 1: all weight on the block's own output
    for (site, _), stats in rec.sites.items():
        i = site // 2
        assert torch.equal(stats.weights, torch.eye(i + 1)[i])
    with torch.no_grad():
        model.pathway.dwa["4"].weight.copy_(torch.tensor([[1.0, -2.0, 1.0]]))
    w = model.routing_stats(tokens()).sites[(8, "dwa")].weights
    assert torch.allclose(w, torch.tensor([0.25, 0.0, 0.5, 0.0, 0.25]))


def test_decay_placement():
    decayed = make().pathway.dwa
    plain = make({"decay_weights": False}).pathway.dwa
    assert all(isinstance(m, torch.nn.Linear) for m in decayed.values())
    assert not any(isinstance(m, torch.nn.Linear) for m in plain.values())
    idx = tokens()
    assert torch.equal(make()(idx).logits, make({"decay_weights": False})(idx).logits)


def test_training_lowers_loss():
    losses = train_steps(make({"dilation": 2}), 30)
    assert losses[-1] < losses[0] - 0.5, losses
