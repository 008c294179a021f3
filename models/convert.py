"""Convert a trained `prenorm` checkpoint into a routing variant that starts from its weights
(the Delta/MHAR conversion recipe, https://arxiv.org/abs/2605.18855; variants.md 5.4).

The backbone's weights load with `strict=False`, where only the target pathway's own parameters
may be missing; they keep their init. What the converted model computes at step 0:
- `delta_attnres` (zero queries): the source's function (its default `stream_scale` divides
  h_hat = (1 + 1/N) h by 1 + 1/N; with `stream_scale=False` only up to the RMSNorm eps, variants.md 0.1);
- `delta_block` with gate="learnable_alpha", gate_init=0: exactly the source's function;
- `delta_block` ungated: NOT the source's function (its sources omit the partial block).

The output is a new run config (the source's, with the target residual and `train.init_from`
naming the converted weights) and the weights, a full `state_dict` of the target model that
`train.init_from` loads with `strict=True`, `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from reslab.models.backbone import build_model
from reslab.models.config import ConfigError, ResidualConfig, RunConfig, load, to_dict
from reslab.models.residual import control, resolve_residual

WEIGHTS_NAME = "init_from.pt"
CONFIG_NAME = "run_config.json"


def check_init_from(path: str, where: str) -> None:
    """`train.init_from` must be a file that `torch.load(weights_only=True)` reads as a state_dict
    (a mapping of parameter names to tensors); raises `ConfigError` naming `where` otherwise."""
    file = Path(path).expanduser()
    try:
        stat = file.stat()
    except OSError as exc:
        raise ConfigError(f"{where}: {path} cannot be read ({exc.strerror}); expected a state_dict file "
                          f"such as the {WEIGHTS_NAME} written by `reslab convert`") from None
    if not file.is_file():
        raise ConfigError(f"{where}: {path} is not a file; expected a state_dict file such as {WEIGHTS_NAME}")
    problem = _state_dict_problem(str(file.resolve()), stat.st_mtime_ns, stat.st_size)
    if problem:
        raise ConfigError(f"{where}: {path} is not a checkpoint torch loads with weights_only=True ({problem}); "
                          f"expected a state_dict file such as the {WEIGHTS_NAME} written by `reslab convert`")


@functools.lru_cache(maxsize=16)
def _state_dict_problem(path: str, mtime_ns: int, size: int) -> str:
    """'' when `path` holds a state_dict, else why not (cached per file version: a study checks
    each of its configs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle, zip and runtime errors for a bad file
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else 'unreadable'}"
    if not isinstance(state, dict) or not state:
        return f"it holds a {type(state).__name__}, not a non-empty mapping"
    if not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        return "its values are not all tensors keyed by parameter name"
    return ""


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
    try:
        ckpt = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle, zip and runtime errors for a bad file
        raise ValueError(f"{src}: not a checkpoint torch loads with weights_only=True ({type(exc).__name__}); "
                         "expected the checkpoint.pt of a prenorm run") from None
    if not isinstance(ckpt, dict) or not {"model", "config"} <= set(ckpt):
        raise ValueError(f"{src}: not a reslab training checkpoint (needs the keys 'model' and 'config')")
    src_cfg = load(RunConfig, json.loads(ckpt["config"]), f"{src} config")
    if src_cfg.residual.name != control():
        raise ValueError(
            f"{src}: the source run's residual is {src_cfg.residual.name!r}; conversion starts from {control()!r}"
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
