"""Adafactor (`models/optim/adafactor.py`): the one module a new optimizer is. Its update is checked against
the algorithm written out by hand from torch's documentation of `torch.optim.Adafactor` (Shazeer & Stern 2018,
Algorithm 4 with torch's relative step min(lr, 1/sqrt(t)) and decoupled weight decay), its groups against
AdamW's rule, and a short run's loss falls."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from reslab.models.config import ConfigError, ModelConfig, OptimConfig, ResidualConfig, RunConfig, TrainConfig, load
from reslab.models.optim import make_optimizer
from reslab.models.training import Trainer, train


def run(steps: int = 8, **optim_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32),
        residual=ResidualConfig(name="attnres"),
        optim=OptimConfig(batch_size=4, warmup_steps=2, name="adafactor", **optim_kw),
        train=TrainConfig(steps=steps, eval_every=4, eval_windows=8, log_every=2, seed=3, diagnostics=False),
    )


def by_hand(theta: torch.Tensor, grads: list[torch.Tensor], lr: float, wd: float, eps2: float, d: float,
            beta2_decay: float) -> torch.Tensor:
    """Adafactor's steps on one tensor as torch's documentation writes them: a matrix keeps the row and column
    means of G^2, its second moment their outer product over the rows' mean; a vector keeps G^2 whole."""
    eps1 = torch.finfo(theta.dtype).eps
    rows = cols = full = None
    for t, g in enumerate(grads, 1):
        beta2 = 1 - t ** beta2_decay
        alpha = max(eps2, theta.square().mean().sqrt().item()) * min(lr, 1 / math.sqrt(t))
        theta = theta * (1 - lr * wd)
        if theta.ndim > 1:
            r, c = (g * g).mean(1, keepdim=True), (g * g).mean(0, keepdim=True)
            rows = r if rows is None else beta2 * rows + (1 - beta2) * r
            cols = c if cols is None else beta2 * cols + (1 - beta2) * c
            v = rows @ cols / rows.mean()
        else:
            full = g * g if full is None else beta2 * full + (1 - beta2) * g * g
            v = full
        u = g / v.sqrt().clamp_min(eps1)
        theta = theta - alpha * u / max(1.0, u.square().mean().sqrt().item() / d)
    return theta


@pytest.mark.parametrize("options", [{}, {"beta2_decay": -0.5, "eps2": 1e-2, "d": 2.0}])
def test_two_steps_match_the_algorithm_by_hand(options):
    torch.manual_seed(0)
    layer = nn.Linear(6, 4).double()
    start = {n: p.detach().clone() for n, p in layer.named_parameters()}
    grads = {n: [torch.randn_like(p), torch.randn_like(p)] for n, p in layer.named_parameters()}
    cfg = run(lr=0.05, weight_decay=0.1, options=options)
    opt = make_optimizer(layer, cfg, torch.device("cpu"))
    assert type(opt) is torch.optim.Adafactor
    for t in range(2):
        for n, p in layer.named_parameters():
            p.grad = grads[n][t]
        opt.step()
    knobs = {"eps2": 1e-3, "d": 1.0, "beta2_decay": -0.8, **options}
    for n, p in layer.named_parameters():
        wd = 0.1 if n == "weight" else 0.0  # AdamW's rule: the Linear's weight decays, its bias does not
        want = by_hand(start[n], grads[n], lr=0.05, wd=wd, **knobs)
        assert torch.allclose(p.detach(), want, rtol=0, atol=1e-12), n


def test_its_groups_are_adamws_and_cover_the_model():
    trainer = Trainer(run())
    groups = trainer.optimizer.param_groups
    decayed = {id(m.weight) for m in trainer.model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {id(p) for p in groups[0]["params"]} == decayed
    assert sum(len(g["params"]) for g in groups) == len(list(trainer.model.parameters()))


def test_it_trains():
    result = train(run(steps=16, lr=1e-2))
    first, last = result.history["eval"][0]["val_loss"], result.summary["val_loss"]
    assert math.isfinite(last) and last < first


@pytest.mark.parametrize("options,match", [
    ({"d": 0.5}, r"^config.optim.options.d: must be >= 1 \(got 0.5\)"),
    ({"beta2_decay": 0.1}, r"^config.optim.options.beta2_decay: must be <= 0"),
    ({"eps": 1e-3}, r"^config.optim.options \(adafactor\): unknown key\(s\) 'eps'"),
])
def test_bad_knobs_are_one_line(options, match):
    from reslab.models.resolve import validate_run_config

    with pytest.raises(ConfigError, match=match) as e:
        validate_run_config(load(RunConfig, {"optim": {"name": "adafactor", "options": options}}))
    assert "\n" not in str(e.value)
