"""What an optimizer and a learning-rate schedule are to the registry (`models.optim`).

An optimizer is a class registered with `@register_optimizer("name")`, a subclass of `Optimizer` with a nested
frozen `Config` (its knobs: `optim.options`), `errors` (the knobs' ranges, one "<knob>: <rule>" each), `build`
(its parameter groups and the torch optimizer over them) and its restrictions: `max_ranks` (the most processes
a run may train on with it), `pipeline` (whether it trains a run split into pipeline stages) and `shards`
(whether it steps FSDP's sharded parameters), which `refusal` turns into one line.

A schedule is a class registered with `@register_schedule("name")`, a subclass of `Schedule` with a nested
`Config` (`optim.schedule_options`), `errors` and `lr(step, total, optim, config)`.

`flat_prefix`: the kinds that existed before issue 50 had their knobs as flat fields of `optim`
(`optim.muon_momentum`, `optim.cooldown_fraction`); such a kind names the prefix those fields had, which is
how the run id still hashes them (`models.optim.hashed_optim`), so the ids of existing studies do not change.
A new kind leaves it None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from reslab.models.config import OptimConfig


class Knobbed:
    """What an optimizer and a schedule share: a registered name, the knobs (`Config`) and their checks."""

    name: ClassVar[str] = ""
    flat_prefix: ClassVar[str | None] = None

    @dataclass(frozen=True, kw_only=True)
    class Config:
        pass

    @classmethod
    def errors(cls, config: Any) -> list[str]:
        """Every knob of `config` out of its range, each "<knob>: <what is wrong>; <what is allowed>"."""
        return []


class Optimizer(Knobbed):
    """An optimizer kind: its knobs (`Config`), their checks, its parameter groups and where it trains."""

    max_ranks: ClassVar[int | None] = None  # None: any number of data-parallel ranks
    pipeline: ClassVar[bool] = True
    shards: ClassVar[bool] = True

    @classmethod
    def build(cls, model: nn.Module, optim: OptimConfig, config: Any, device: torch.device) -> torch.optim.Optimizer:
        """The torch optimizer over `model`'s parameters, its groups this kind's own."""
        raise NotImplementedError(f"{cls.__name__} must define build()")

    @classmethod
    def refusal(cls, allowed: list[str], *, ranks: int = 1, stages: int = 1, sharding: str = "ddp") -> str | None:
        """Why this optimizer cannot train a run on `ranks` processes in `stages` pipeline stages with `sharding`,
        in words after "optim.name: "; None when it can. `allowed`: the optimizers that could."""
        instead = ", ".join(allowed) or "(none)"
        if stages > 1 and not cls.pipeline:
            return f"{cls.name} with pipeline_stages is not supported; allowed: {instead}"
        if cls.max_ranks is not None and ranks > cls.max_ranks:
            where = "one process" if cls.max_ranks == 1 else f"at most {cls.max_ranks} ranks"
            return f"{cls.name} trains in {where} (got {ranks} ranks); use {instead}"
        if ranks > 1 and sharding == "fsdp" and not cls.shards:
            return f"{cls.name} with sharding: fsdp is not supported (a rank holds shards); allowed: {instead}"
        return None


class Schedule(Knobbed):
    """A learning-rate schedule: its knobs (`Config`), their checks and the lr at each step."""

    @classmethod
    def lr(cls, step: int, total: int, optim: OptimConfig, config: Any) -> float:
        """The learning rate at 0-based `step` of `total`."""
        raise NotImplementedError(f"{cls.__name__} must define lr()")


def decay_groups(model: nn.Module, optim: OptimConfig, skip: frozenset[int] = frozenset()) -> list[dict[str, Any]]:
    """AdamW's two groups over `model`'s parameters but those in `skip` (ids): with `optim.weight_decay` the
    weights of every Linear and Embedding (`decay_scope: matrices`) or every parameter (`all`), without it
    the rest (norms, biases, the pathway's vectors)."""
    decayed = set()
    if optim.decay_scope == "matrices":
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                decayed.add(id(module.weight))
    decay, no_decay = [], []
    for p in model.parameters():
        if id(p) in skip:
            continue
        if optim.decay_scope == "all" or id(p) in decayed:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
