"""Helpers shared by tests/models/test_variant_*.py: a tiny model, token batches, short training
loops and the causality / gradient checks every residual variant goes through.

Imported as `from variant_testing import ...` (tests/models has no __init__.py, so pytest puts
this folder on sys.path for the test files in it).
"""

from __future__ import annotations

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


def tokens(b: int = 2, t: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


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


def assert_causal(model: torch.nn.Module, idx: torch.Tensor, positions=(3, 7), shift: int = 1) -> None:
    """Changing token t+1 leaves the logits at positions <= t unchanged."""
    ref = model(idx).logits
    for t in positions:
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + shift) % VOCAB
        assert torch.allclose(model(changed).logits[:, : t + 1], ref[:, : t + 1], atol=1e-6)


def assert_causal_and_sensitive(model: torch.nn.Module, idx: torch.Tensor, positions=(0, 5, 10),
                                shift: int = 7) -> None:
    """As assert_causal, and the logits at position t+1 itself do change."""
    for t in positions:
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + shift) % VOCAB
        a, b = model(idx).logits, model(changed).logits
        assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-6)
        assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def assert_every_parameter_has_grad(model: torch.nn.Module) -> None:
    """After a backward pass: every parameter has a gradient, and it is not all zeros."""
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def assert_backbone_equal(base: torch.nn.Module, variant: torch.nn.Module) -> None:
    """Every tensor of `base`'s state dict is bitwise equal in `variant`'s (extra pathway keys allowed)."""
    variant_state = variant.state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(value, variant_state[key]), key
