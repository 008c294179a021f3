"""A run config resolved against the registries: model presets, residual variants, init checkpoints.

Kept apart from `models.config`, which stays a leaf (plain data, importing nothing of reslab but
`common.errors`), so the spec layer can load and hash configs while this module, which imports
the variants (and so torch), is the one place that knows every registry.
"""

from __future__ import annotations

import dataclasses

from reslab.common.errors import ConfigError
from reslab.models.config import LARGEST_DEVICE_BYTES, CostConfig, DataConfig, RunConfig, check_run_config, cost_lengths
from reslab.models.convert import check_init_from
from reslab.models.hf_import import check_context, check_hf_tokenizer, check_hf_weights, hf_model_config, hf_path
from reslab.models.optim import resolve_optim
from reslab.models.presets import ModelShape, resolve_model
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
        check_hf_weights(hf_dir, shape, f"{where}.train.init_from")
    if cfg.data.tokenizer == "hf":
        cfg = dataclasses.replace(cfg, data=_hf_tokenizer_data(cfg, where))
    residual = resolve_residual(cfg.residual, where=f"{where}.residual")
    optim = resolve_optim(cfg.optim, where=f"{where}.optim")
    check_run_config(cfg, where)
    prompt, new = cost_lengths(cfg.cost, shape.seq_len, where)
    if cfg.cost.measure and prompt is not None:
        check_cost_memory(cfg.cost, shape, prompt, where)
    if init_from is not None and hf_path(init_from) is None:
        check_init_from(init_from, f"{where}.train.init_from")
    cost = dataclasses.replace(cfg.cost, prompt_tokens=prompt, new_tokens=new)
    return dataclasses.replace(cfg, residual=residual, optim=optim, cost=cost)


def check_cost_memory(cost: CostConfig, shape: ModelShape, prompt: int, where: str) -> None:
    """Refuse a cost measurement no device can hold, as the plan refuses a model no run can train
    (`experiments.size.check_model_size`): its batched prefill allocates, at the least, the KV cache of
    `decode_batch` rows of `seq_len` slots (`Decoder.prefill`) and the prompts' logits [B, P, V], each
    element 2 bytes (bfloat16, the smallest dtype a run uses), against `LARGEST_DEVICE_BYTES`."""
    kv_per_token = 2 * shape.n_layers * shape.n_kv_heads * shape.head_dim
    elems = cost.decode_batch * (shape.seq_len * kv_per_token + prompt * shape.vocab_size)
    need = 2 * elems
    if need > LARGEST_DEVICE_BYTES:
        most = int(LARGEST_DEVICE_BYTES // (2 * (shape.seq_len * kv_per_token + prompt * shape.vocab_size)))
        raise ConfigError(
            f"{where}.cost.decode_batch: {cost.decode_batch:,} rows decoded together need at least {need / 1e9:,.0f} "
            f"GB (a KV cache of seq_len {shape.seq_len:,} per row, {shape.n_layers:,} layers, and the prompts' "
            f"logits), past the {LARGEST_DEVICE_BYTES / 1e9:.0f} GB of the largest device; allowed: at most "
            f"{max(most, 0):,} rows for this model (or cost.measure: false)")


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
