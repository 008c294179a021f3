"""A run config resolved against the registries: model presets, residual variants, init checkpoints.

Kept apart from `models.config`, which stays a leaf (plain data, importing nothing of reslab but
`common.errors`), so the spec layer can load and hash configs while this module, which imports
the variants (and so torch), is the one place that knows every registry.
"""

from __future__ import annotations

import dataclasses

from reslab.common.errors import ConfigError
from reslab.models.config import DataConfig, RunConfig, check_run_config, cost_lengths
from reslab.models.convert import check_init_from
from reslab.models.hf_import import check_context, check_hf_tokenizer, hf_model_config, hf_path
from reslab.models.optim import resolve_optim
from reslab.models.presets import resolve_model
from reslab.models.residual import resolve_residual


def validate_run_config(cfg: RunConfig, where: str = "config") -> RunConfig:
    """Every check beyond types, each error naming its field under `where`; returns the config
    with the residual, optimizer and schedule knobs resolved to their defaults and the cost's lengths to what fits the
    context (the form that is hashed into a run id). An `hf:` init_from fills the model's shape
    from the checkpoint's config.json (`models.hf_import.hf_model_config`)."""
    init_from = cfg.train.init_from
    hf_dir = hf_path(init_from)
    if init_from is not None and hf_dir is not None:
        cfg = dataclasses.replace(cfg, model=hf_model_config(cfg.model, init_from, where))
    shape = resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256, where=f"{where}.model")
    if hf_dir is not None:
        check_context(hf_dir, shape.seq_len, where)
    if cfg.data.tokenizer == "hf":
        cfg = dataclasses.replace(cfg, data=_hf_tokenizer_data(cfg, where))
    residual = resolve_residual(cfg.residual, where=f"{where}.residual")
    optim = resolve_optim(cfg.optim, where=f"{where}.optim")
    check_run_config(cfg, where)
    prompt, new = cost_lengths(cfg.cost, shape.seq_len, where)
    if init_from is not None and hf_path(init_from) is None:
        check_init_from(init_from, f"{where}.train.init_from")
    cost = dataclasses.replace(cfg.cost, prompt_tokens=prompt, new_tokens=new)
    return dataclasses.replace(cfg, residual=residual, optim=optim, cost=cost)


def _hf_tokenizer_data(cfg: RunConfig, where: str) -> DataConfig:
    """`data` with `tokenizer_path` filled in from `train.init_from: hf:<dir>` where it is null, the
    tokenizer checked to load and, where the model's vocabulary is fixed (a checkpoint's), to fit it."""
    data = cfg.data
    path = data.tokenizer_path
    hf_dir = hf_path(cfg.train.init_from)
    if path is None:
        if hf_dir is None:
            raise ConfigError(f"{where}.data.tokenizer: hf needs a tokenizer directory: set data.tokenizer_path, "
                              "or train.init_from: hf:<dir> (the checkpoint's own tokenizer)")
        path = str(hf_dir)
    check_hf_tokenizer(path, cfg.model.vocab_size, f"{where}.data.tokenizer")
    return dataclasses.replace(data, tokenizer_path=path)
