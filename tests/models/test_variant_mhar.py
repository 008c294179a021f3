"""MHAR (`mhar`, `block_mhar`; arXiv 2607.27230): H=1 is AttnRes, same parameters, heads matter."""

from __future__ import annotations

import pytest
import torch
from variant_testing import SMALL, tokens, train_on
from variant_testing import make_model as make

from reslab.models.config import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [("mhar", "attnres", {}), ("block_mhar", "block_attnres", {"block_size": 2})]


def randomise_queries(model: torch.nn.Module, seed: int = 5, std: float = 0.5) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        q = model.pathway.queries
        q.copy_(torch.randn(q.shape, generator=gen, dtype=torch.float64).to(q.dtype) * std)
        g = model.pathway.key_gains
        g.copy_(1 + 0.3 * torch.randn(g.shape, generator=gen, dtype=torch.float64).to(g.dtype))


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_one_head_is_the_parent_exactly(float64, name, parent, options):
    idx = tokens()
    base = make(parent, options)
    randomise_queries(base)
    mh = make(name, {**options, "heads": 1})
    mh.load_state_dict(base.state_dict())
    assert torch.equal(mh(idx).logits, base(idx).logits)


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_heads_change_the_function(float64, name, parent, options):
    idx = tokens()
    outs = []
    for heads in (1, 2, 4):
        model = make(name, {**options, "heads": heads})
        randomise_queries(model)
        outs.append(model(idx).logits)
    assert not torch.allclose(outs[0], outs[1], atol=1e-6)
    assert not torch.allclose(outs[1], outs[2], atol=1e-6)


@pytest.mark.parametrize("name,parent,options", PAIRS)
def test_extra_params_equal_attnres(name, parent, options):
    d, n_layers = SMALL["d_model"], SMALL["n_layers"]
    for heads in (1, 4, 8):
        model = make(name, {**options, "heads": heads})
        assert model.pathway.extra_params() == make(parent, options).pathway.extra_params()
        assert model.pathway.extra_params() == 4 * d * n_layers + 2 * d
        assert model.pathway.queries.shape == (2 * n_layers + 1, d)


@pytest.mark.parametrize("name", ["mhar", "block_mhar"])
def test_heads_must_divide_width(name):
    with pytest.raises(ConfigError, match=r"residual\.options\.heads: 5 does not divide d_model=32"):
        make(name, {"heads": 5})
    with pytest.raises(ConfigError, match="heads must be >= 1"):
        make(name, {"heads": 0})


def test_routing_weights_are_recorded_per_head():
    model = make("mhar", {"heads": 4})
    randomise_queries(model)
    recorder = model.routing_stats(tokens())
    n_sites = 2 * SMALL["n_layers"]
    assert sorted(site for site, _ in recorder.sites) == list(range(n_sites + 1))
    readout = recorder.sites[(n_sites, "")]
    assert readout.head_weights.shape == (4, n_sites + 1)
    assert torch.allclose(readout.head_weights.sum(-1), torch.ones(4), atol=1e-5)


@pytest.mark.parametrize("name", ["mhar", "block_mhar"])
def test_training_lowers_the_loss(name):
    model = make(name, {"heads": 4})
    idx = tokens(b=4, t=16, seed=3)
    losses = train_on(model, idx, idx, 30, lr=3e-3)
    assert losses[-1] < losses[0] - 0.5, (losses[0], losses[-1])
