"""A finished run's model and tokenizer, read back from its run directory, its evaluation on tasks, and its
knock-out effects on its eval windows (`intervene_run`).

The model is built from the run's own config (`models.backbone.build_model`, the corpus's vocabulary) and
loaded from the run's newest checkpoint of either layout (`checkpoint.pt`, or a committed DCP step: its model
state only), on the device and with the residual implementation the config picks, evaluated in the
config's dtype (`train.dtype`, autocast). The tokenizer is the corpus's own (byte or BPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from reslab.common.errors import ConfigError
from reslab.kernels import select_impl
from reslab.models.backbone import Decoder, build_model
from reslab.models.checkpoint import CHECKPOINT_NAME, load_checkpoint, newer_checkpoint
from reslab.models.config import RunConfig
from reslab.models.data.prepare import corpus_dir, read_meta
from reslab.models.data.tokenizer import Tokenizer, load_tokenizer
from reslab.models.evals.harness import Evaluation, run_tasks
from reslab.models.evals.next_line import TASK_NAME, NextLineOptions, prepare_next_line
from reslab.models.training import pick_device, pick_dtype


@dataclass
class RunModel:
    model: Decoder
    tokenizer: Tokenizer
    dtype: torch.dtype
    corpus: Path


def _load_dcp_model(path: Path, model: Decoder) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])


def load_run_model(cfg: RunConfig, run_dir: Path, device: str | None = None, impl: str | None = None) -> RunModel:
    """The run's trained model (its newest checkpoint) and tokenizer; `device` overrides `train.device`, `impl`
    the residual implementation the config picks (the same weights either way)."""
    corpus = corpus_dir(cfg.data)
    meta = read_meta(corpus)
    where = pick_device(device or cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.residual, vocab_size=meta.vocab_size,
                        impl=impl or select_impl(cfg.residual.impl, where.type)).to(where)
    path = newer_checkpoint(run_dir)
    if path is None:
        raise ConfigError(f"eval: {run_dir} holds no checkpoint; allowed: a finished run's directory")
    if path.name == CHECKPOINT_NAME:
        model.load_state_dict(load_checkpoint(path, where)["model"])
    else:
        _load_dcp_model(path, model)
    return RunModel(model.eval(), load_tokenizer(corpus), pick_dtype(cfg.train.dtype, where), corpus)


def include_paths(corpus: Path, tasks: tuple[str, ...], options: NextLineOptions | None = None) -> list[Path]:
    """The harness's extra task folders the tasks need: the local next-line task of the run's corpus."""
    return [prepare_next_line(corpus, options or NextLineOptions())] if TASK_NAME in tasks else []


def evaluate_run(cfg: RunConfig, run_dir: Path, tasks: tuple[str, ...], *, num_fewshot: int | None = None,
                 limit: int | None = None, batch_size: int = 16, device: str | None = None) -> Evaluation:
    """Evaluate a finished run's model on `tasks` (lm-evaluation-harness names, or `reslab_next_line`)."""
    from reslab.models.evals.adapter import ReslabLM

    loaded = load_run_model(cfg, run_dir, device)
    lm = ReslabLM(loaded.model, loaded.tokenizer, batch_size=batch_size, dtype=loaded.dtype)
    return run_tasks(lm, tasks, include_paths=include_paths(loaded.corpus, tasks), num_fewshot=num_fewshot,
                     limit=limit, seed=0)


def intervene_run(cfg: RunConfig, run_dir: Path, interventions: list, *, device: str | None = None) -> list[dict]:
    """A finished run's knock-out effects (`models.interventions.effects`) on the held-out windows its training
    evaluated on (`train.eval_windows` of the validation split, `train.eval_batch_size` rows each), in the
    config's dtype (autocast) on `device` (default: its `train.device`), with the reference residual
    implementation (the fused kernels take no intervention)."""
    from reslab.models.data import TokenDataset
    from reslab.models.interventions import effects

    loaded = load_run_model(cfg, run_dir, device, impl="reference")
    where = next(loaded.model.parameters()).device
    t, o = cfg.train, cfg.optim
    batches = TokenDataset.open(cfg.data).val_batches(t.eval_windows, t.eval_batch_size or o.batch_size,
                                                      loaded.model.shape.seq_len)
    batches = [(x.to(where), y.to(where)) for x, y in batches]

    def autocast() -> torch.autocast:
        return torch.autocast(where.type, dtype=loaded.dtype, enabled=loaded.dtype != torch.float32)

    return effects(loaded.model, batches, interventions, autocast=autocast)
