"""AdamW (`torch.optim.AdamW`), the default: decoupled weight decay on the Linear and Embedding weights
(`optim.decay_scope: matrices`) or on every parameter (`all`), betas, eps and lr from the flat `optim` fields;
fused on CUDA. No knobs of its own."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from reslab.models.config import OptimConfig
from reslab.models.optim import register_optimizer
from reslab.models.optim.base import Optimizer, decay_groups


def make_adamw(groups: list[dict[str, Any]], optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                             fused=device.type == "cuda")


@register_optimizer("adamw")
class AdamW(Optimizer):
    flat_prefix = ""  # no knobs, then or now

    @classmethod
    def build(cls, model: nn.Module, optim: OptimConfig, config: Any, device: torch.device) -> torch.optim.Optimizer:
        return make_adamw(decay_groups(model, optim), optim, device)
