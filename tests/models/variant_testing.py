"""Helpers shared by tests/models/test_variant_*.py: a tiny model, token batches, a site-by-site
trace of the forward pass and short training loops. The checks every variant goes through
(causality, gradient reach, backbone init, declared identities) are test_variant_contract.py.

Imported as `from variant_testing import ...` (tests/models has no __init__.py, so pytest puts
this folder on sys.path for the test files in it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from reslab.models.backbone import build_model
from reslab.models.config import ModelConfig, ResidualConfig

VOCAB = 64
SMALL = dict(preset="tiny", d_model=32, n_layers=3, n_heads=2, ffn_hidden=64, seq_len=16)


def make_model(name: str, options: dict | None = None, seed: int = 0, **model) -> torch.nn.Module:
    """The SMALL model (fields overridden by `model`) with residual variant `name`, seeded."""
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**SMALL, **model})
    return build_model(cfg, ResidualConfig(name=name, options=options or {}), vocab_size=VOCAB)


def maker(default: str) -> Callable[..., torch.nn.Module]:
    """`make(options=None, name=default, seed=0, **model)`: `make_model` with a test file's variant
    as the default name."""
    def make(options: dict | None = None, name: str = default, seed: int = 0, **model: Any) -> torch.nn.Module:
        return make_model(name, options, seed, **model)
    return make


def trace(model: torch.nn.Module, idx: torch.Tensor) -> list[tuple[Any, torch.Tensor, torch.Tensor, Any]]:
    """(prepared state, sublayer input, sublayer output, next state) for every site of one forward
    pass, driven through the pathway contract as the backbone drives it (without value routes)."""
    p = model.pathway
    positions = torch.arange(idx.shape[1]).expand(idx.shape[0], -1)
    state = p.resume(p.start(model.embed(idx)), None, positions)
    out = []
    for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
        state = p.prepare(state, site)
        x = p.sublayer_input(state, site)
        u = sub(norm(x))
        new = p.update(state, site, u)
        out.append((state, x, u, new))
        state = new
    return out


def tokens(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def reference_step(model: torch.nn.Module, idx: torch.Tensor,
                   targets: torch.Tensor) -> tuple[Any, dict[str, torch.Tensor]]:
    """One process's forward and backward of the objective training minimises (LM loss plus the pathway's
    auxiliary term): the model's output and every parameter's gradient by name; the gradients are zeroed after."""
    out = model(idx, targets)
    (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, ref


def perturb_pathway(model: torch.nn.Module, scale: float) -> None:
    """Add seeded N(0, scale^2) noise to every pathway parameter (moves them off their init)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.pathway.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def train_on(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, steps: int,
             lr: float) -> list[float]:
    """`steps` AdamW steps on one fixed batch; the loss before each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(inputs, targets).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_steps(model: torch.nn.Module, steps: int, lr: float = 3e-3) -> list[float]:
    """Next-token training on the fixed batch tokens(b=4, seed=3)."""
    idx = tokens(b=4, seed=3)
    return train_on(model, idx[:, :-1], idx[:, 1:], steps, lr)


def assert_every_parameter_has_grad(model: torch.nn.Module) -> None:
    """After a backward pass: every parameter has a gradient, and it is not all zeros."""
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
