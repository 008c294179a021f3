"""Convert a trained `prenorm` checkpoint into a routing variant that starts from its weights
(the Delta/MHAR conversion recipe, https://arxiv.org/abs/2605.18855; variants.md 5.4).

The backbone's weights load with `strict=False`, where only the target pathway's own parameters
may be missing; they keep their init. What the converted model computes at step 0:
- `delta_attnres` (zero queries): the source's function up to the RMSNorm eps (variants.md 0.1);
- `delta_block` with gate="learnable_alpha", gate_init=0: exactly the source's function;
- `delta_block` ungated: NOT the source's function (its sources omit the partial block).

The output is a new run config (the source's, with the target residual and `train.init_from`
naming the converted weights) and the weights, a full `state_dict` of the target model that
`train.init_from` loads with `strict=True`, `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from reslab.models.backbone import build_model
from reslab.models.config import ResidualConfig, RunConfig, load, to_dict
from reslab.models.residual import resolve_residual

WEIGHTS_NAME = "init_from.pt"
CONFIG_NAME = "run_config.json"


class Conversion(NamedTuple):
    config: dict[str, Any]   # the new RunConfig as plain data, train.init_from = str(weights)
    weights: Path            # the converted model's state_dict


def convert_checkpoint(
    src_checkpoint_path: str | Path, target_residual: ResidualConfig, out_dir: str | Path
) -> Conversion:
    """Load a `prenorm` run's checkpoint.pt, build `target_residual` on its backbone, and write
    `out_dir/init_from.pt` (the weights) and `out_dir/run_config.json` (the new run config).

    Raises ValueError when the checkpoint is not a `prenorm` run's, or when any key other than
    the target pathway's parameters is missing or unexpected.
    """
    src = Path(src_checkpoint_path)
    ckpt = torch.load(src, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or not {"model", "config"} <= set(ckpt):
        raise ValueError(f"{src}: not a reslab training checkpoint (needs the keys 'model' and 'config')")
    src_cfg = load(RunConfig, json.loads(ckpt["config"]), f"{src} config")
    if src_cfg.residual.name != "prenorm":
        raise ValueError(
            f"{src}: the source run's residual is {src_cfg.residual.name!r}; conversion starts from 'prenorm'"
        )
    target = resolve_residual(target_residual, "target_residual")
    state = ckpt["model"]

    # the vocabulary comes from the tokenizer at train time; the embedding already has its final size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(src_cfg.train.seed)
        model = build_model(src_cfg.model, target, vocab_size=state["embed.weight"].shape[0], impl="reference")
    missing, unexpected = model.load_state_dict(state, strict=False)
    backbone_missing = [k for k in missing if not k.startswith("pathway.")]
    if backbone_missing or unexpected:
        raise ValueError(
            f"{src}: the checkpoint does not match a {target.name!r} model's backbone: "
            f"missing {backbone_missing or 'nothing'}, unexpected {unexpected or 'nothing'} "
            "(only the pathway's own parameters may be missing)"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = (out / WEIGHTS_NAME).resolve()
    torch.save(model.state_dict(), weights)
    config = to_dict(dataclasses.replace(src_cfg, residual=target))
    config["train"]["init_from"] = str(weights)
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Conversion(config, weights)
