"""Muon beside AdamW, and the warmup-stable-decay schedule.

`optim.name: muon` splits the parameters in two (`muon_matrices`):

- Muon (`torch.optim.Muon`): the backbone's hidden matrices, the 2-D weights of the attention and MLP
  sublayers (q/k/v/o and gate/up/down projections), with `optim.weight_decay` (decoupled, as AdamW's);
- AdamW (the `optim` fields it always reads): everything else, the token embedding (tied output head),
  every norm, and every residual-pathway parameter (routing queries, gates, mixing weights), whatever
  its shape: the pathway is the object of study, so its parameters keep one optimizer across arms.

`optim.muon_adjust_lr` is torch's `adjust_lr_fn`. `match_rms_adamw` (the default; Moonlight, Liu et al.
2025) scales each matrix's update to AdamW's RMS (0.2 * sqrt(max(A, B))), so AdamW's `lr` and
`weight_decay` carry over; `original` (Keller Jordan's) scales by sqrt(max(1, A/B)) and wants a larger lr.
Both optimizers take the one scheduled lr. `MuonAdamW` steps both and checkpoints both states.

`wsd_factor`: `optim.schedule: wsd` (Hu et al. 2024, MiniCPM): linear warmup, the peak lr held, then a
cooldown over the last `cooldown_fraction` of the steps to `min_lr_ratio * lr`, `linear` or `1-sqrt`
(Hagele et al. 2024 find 1-sqrt best).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from reslab.common.errors import ConfigError
from reslab.models.config import OptimConfig
from reslab.models.layers import Attention, SwiGLU


def muon_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon updates: the weights of every attention and MLP sublayer, which must be 2-D
    (their 1-D norm weights stay with AdamW). Raises a ConfigError on a parameter of another shape."""
    found: list[nn.Parameter] = []
    for prefix, module in model.named_modules():
        if not isinstance(module, (Attention, SwiGLU)):
            continue
        for name, p in module.named_parameters():
            if p.ndim == 2:
                found.append(p)
            elif p.ndim > 2:
                raise ConfigError(
                    f"optim.name: muon cannot orthogonalise {prefix}.{name} of shape {tuple(p.shape)}: Muon takes "
                    "2-D matrices only; use optim.name: adamw for this model")
    return found


def make_muon(params: list[nn.Parameter], o: OptimConfig) -> torch.optim.Muon:
    return torch.optim.Muon(params, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps, adjust_lr_fn=o.muon_adjust_lr)


class MuonAdamW(torch.optim.Optimizer):
    """Muon and AdamW stepped as one optimizer: `param_groups` are both optimizers' own group dicts
    (Muon's first), so the scheduler's lr reaches both; the state dict holds both states by name."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW) -> None:
        self.muon, self.adamw = muon, adamw
        # Optimizer.add_param_group keeps each dict it is given (defaults {} adds no key), so these
        # groups are the very dicts the two optimizers read
        super().__init__([*muon.param_groups, *adamw.param_groups], {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        assert closure is None, "MuonAdamW takes no closure"
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise RuntimeError("the checkpoint's optimizer state is not Muon + AdamW; it was written by another "
                               "optim.name")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # loading gives each optimizer new group dicts: point ours at them, or the lr would stop reaching them
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]


def wsd_factor(step: int, total: int, o: OptimConfig) -> float:
    """The multiple of `lr` at 0-based `step` of `total` under warmup-stable-decay: `(step + 1) / warmup`
    during warmup; 1 until the cooldown's n = round(cooldown_fraction * total) last steps (never into the
    warmup); then `min + (1 - min) * f(p)` with p = (step - start + 1) / n, reaching `min_lr_ratio` at the
    last step, f(p) = 1 - p (`linear`) or 1 - sqrt(p) (`1-sqrt`)."""
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    start = max(o.warmup_steps, total - round(o.cooldown_fraction * total))
    if step < start:
        return 1.0
    p = min(1.0, (step - start + 1) / (total - start))
    f = 1 - p if o.cooldown_shape == "linear" else 1 - math.sqrt(p)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * f
