"""Muon beside AdamW (`optim.name: muon`): the parameters split in two (`muon_matrices`):

- Muon (`torch.optim.Muon`): the backbone's hidden matrices, the 2-D weights of the attention and MLP
  sublayers (q/k/v/o and gate/up/down projections), with `optim.weight_decay` (decoupled, as AdamW's);
- AdamW (the flat `optim` fields): everything else, the token embedding (tied output head), every norm, and
  every residual-pathway parameter (routing queries, gates, mixing weights), whatever its shape: the pathway
  is the object of study, so its parameters keep one optimizer across arms.

Both optimizers take the one scheduled lr. `MuonAdamW` steps both and checkpoints both states. Muon trains in
one process and not in pipeline stages (its Newton-Schulz step needs each matrix whole on one rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from reslab.common.errors import ConfigError
from reslab.models.config import OptimConfig
from reslab.models.layers import Attention, SwiGLU
from reslab.models.optim import register_optimizer
from reslab.models.optim.adamw import make_adamw
from reslab.models.optim.base import Optimizer, decay_groups


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


@register_optimizer("muon")
class Muon(Optimizer):
    """Knobs (`optim.options`; before issue 50 the flat fields `optim.muon_<knob>`):
        adjust_lr: torch's `adjust_lr_fn`. `match_rms_adamw` (Moonlight, Liu et al. 2025) scales each
            matrix's update to AdamW's RMS (0.2 * sqrt(max(A, B))), so AdamW's `lr` and `weight_decay` carry
            over; `original` (Keller Jordan's) scales by sqrt(max(1, A/B)) and wants a larger lr.
            Default: match_rms_adamw.
        momentum: in [0, 1). Default: 0.95.
        nesterov: Nesterov momentum. Default: True.
        ns_steps: Newton-Schulz iterations, in [1, 20]. Default: 5.
    """

    max_ranks = 1
    pipeline = False
    flat_prefix = "muon_"

    @dataclass(frozen=True, kw_only=True)
    class Config:
        adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
        momentum: float = 0.95
        nesterov: bool = True
        ns_steps: int = 5

    @classmethod
    def errors(cls, config: Any) -> list[str]:
        checks = [
            (0 <= config.momentum < 1, f"momentum: must be in [0, 1) (got {config.momentum})"),
            (1 <= config.ns_steps <= 20, f"ns_steps: must be in [1, 20] (got {config.ns_steps}); Newton-Schulz "
                                         "iterations"),
        ]
        return [rule for ok, rule in checks if not ok]

    @classmethod
    def build(cls, model: nn.Module, optim: OptimConfig, config: Any, device: torch.device) -> torch.optim.Optimizer:
        matrices = muon_matrices(model)
        muon = torch.optim.Muon(matrices, lr=optim.lr, weight_decay=optim.weight_decay, momentum=config.momentum,
                                nesterov=config.nesterov, ns_steps=config.ns_steps, adjust_lr_fn=config.adjust_lr)
        adamw = make_adamw(decay_groups(model, optim, frozenset(id(p) for p in matrices)), optim, device)
        return MuonAdamW(muon, adamw)
