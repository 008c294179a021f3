"""Text from a finished run: its checkpoint's model, rebuilt from the config the checkpoint carries, and its
tokenizer (`reslab generate`).

`load_run_model` reads `checkpoint.pt` (`weights_only=True`) or a committed DCP step, rebuilds the model the
checkpoint's config describes and refuses, in one line naming them, tensors whose names or shapes differ
from the rebuilt model's (a checkpoint of other code). `generate_text` encodes text prompts with the run's
tokenizer, decodes them as one left-padded batch (`Decoder.generate`) in the run's dtype and returns the
continuations as text.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from reslab.common.errors import ConfigError
from reslab.models.backbone import Decoder, build_model
from reslab.models.config import RunConfig, load
from reslab.models.data.tokenizer import ByteTokenizer, Tokenizer
from reslab.models.serving import serving_copy

# new tokens per prompt when not given (fewer when the context is shorter)
DEFAULT_NEW_TOKENS = 64


def _mismatch(where: Path, name: str, shapes: dict[str, tuple[int, ...]], model: nn.Module) -> str | None:
    """One line saying how a checkpoint's tensors (name -> shape) differ from the rebuilt model's, or None."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(own) - set(shapes))
    unexpected = sorted(set(shapes) - set(own))
    differ = [f"{k} {list(shapes[k])} vs {list(own[k])}" for k in sorted(set(own) & set(shapes)) if shapes[k] != own[k]]
    if not (missing or unexpected or differ):
        return None

    def few(items: list[str]) -> str:
        return ", ".join(items[:4]) + (f" and {len(items) - 4} more" if len(items) > 4 else "")

    parts = ([f"missing from the checkpoint: {few(missing)}"] if missing else []) + \
            ([f"not in the model: {few(unexpected)}"] if unexpected else []) + \
            ([f"shapes (checkpoint vs model): {few(differ)}"] if differ else [])
    return (f"{where} does not match this code's {name} model ({'; '.join(parts)}); it was written by other "
            "code: use the commit that trained it")


def _dcp_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model's tensors in a DCP step (`checkpoint.save_sharded` saves them under `model.`), by name."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): tuple(getattr(m, "size", ())) for k, m in meta.items() if k.startswith("model.")}


def run_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer a run trained with: bytes need no corpus; BPE is the prepared corpus's own."""
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    from reslab.models.data import TokenDataset

    return TokenDataset.open(cfg.data).tokenizer


def load_run_model(checkpoint: Path, device: torch.device) -> tuple[Decoder, RunConfig, Tokenizer, int]:
    """The model of a run's checkpoint (`checkpoint.pt`, loaded with `weights_only=True`, or a committed
    DCP step), rebuilt from the config the checkpoint carries, on `device` in eval mode; returns it with
    that config (resolved), the run's tokenizer and the checkpoint's step. A checkpoint whose tensors do
    not match the rebuilt model's (names or shapes) is a ConfigError naming them."""
    from reslab.models.checkpoint import CHECKPOINT_NAME, CheckpointUnreadable, load_checkpoint, read_progress
    from reslab.models.resolve import validate_run_config

    whole = checkpoint.name == CHECKPOINT_NAME
    try:
        progress = load_checkpoint(checkpoint, torch.device("cpu")) if whole else read_progress(checkpoint)
    except (CheckpointUnreadable, OSError, ValueError) as exc:
        raise ConfigError(f"{checkpoint} cannot be read: {str(exc).splitlines()[0][:300]}") from None
    cfg = validate_run_config(load(RunConfig, json.loads(progress["config"]), f"{checkpoint}: config"))
    tokenizer = run_tokenizer(cfg)
    model = build_model(cfg.model, cfg.residual, vocab_size=tokenizer.vocab_size)
    if whole:
        state = progress["model"]
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    else:
        shapes = _dcp_model_shapes(checkpoint)
    problem = _mismatch(checkpoint, cfg.residual.name, shapes, model)
    if problem:
        raise ConfigError(problem)
    if not whole:
        import torch.distributed.checkpoint as dcp

        state = model.state_dict()
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*load in a single process")
            dcp.load({"model": state}, checkpoint_id=checkpoint)  # in place, the model's tensors only
    model.load_state_dict(state)
    return model.to(device).eval(), cfg, tokenizer, int(progress["step"])


@dataclass(frozen=True)
class Generated:
    """What `generate_text` made: one continuation per prompt, and what made them."""

    continuations: list[str]
    config: RunConfig
    step: int  # the checkpoint's
    device: str
    max_new_tokens: int


def generate_text(checkpoint: Path, prompts: Sequence[str], *, max_new_tokens: int | None = None,
                  temperature: float = 0.0, top_k: int | None = None, seed: int = 0, stop: Sequence[str] = (),
                  device: str = "auto") -> Generated:
    """Continue each text prompt with the model of `checkpoint` (`load_run_model`), as one left-padded batch
    on `device` in the run's dtype (`train.dtype`).

    `max_new_tokens` None: 64, or what the context leaves after the longest prompt if less. A row stops at
    the end-of-text token and at a `stop` text that is one token; each continuation is cut before the first
    end-of-text or `stop` text (a stop of several tokens therefore ends the text, not the decoding). Ids the
    tokenizer does not have (the vocabulary's padding) are left out of the text; an empty prompt is the
    end-of-text token alone, the start of a document."""
    from reslab.models.decoding import GenerateOptions
    from reslab.models.training import pick_device, pick_dtype

    where = pick_device(device)
    model, cfg, tokenizer, step = load_run_model(checkpoint, where)
    model = serving_copy(model, pick_dtype(cfg.train.dtype, where))
    # an empty prompt starts a document: the corpus puts end-of-text before each one
    encoded = [tokenizer.encode(p) or [tokenizer.eot_id] for p in prompts]
    seq_len = model.shape.seq_len
    longest = max((len(e) for e in encoded), default=0)
    if longest >= seq_len:
        which = next(i for i, e in enumerate(encoded) if len(e) == longest)
        raise ConfigError(f"generate: prompt {which + 1} is {longest} tokens; the model's context is seq_len={seq_len} "
                          f"tokens and must hold the prompt and a new token; allowed: prompts of at most "
                          f"{seq_len - 1} tokens")
    new = max_new_tokens if max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, seq_len - longest)
    stops = [tokenizer.eot_id, *(ids[0] for text in stop if len(ids := tokenizer.encode(text)) == 1)]
    options = GenerateOptions(max_new_tokens=new, temperature=temperature, top_k=top_k,
                              stop_tokens=tuple(dict.fromkeys(stops)), seed=seed, pad_id=tokenizer.eot_id)
    texts = []
    for ids in model.generate(encoded, options):
        ids = ids[:ids.index(tokenizer.eot_id)] if tokenizer.eot_id in ids else ids
        text = tokenizer.decode(i for i in ids if 0 <= i < tokenizer.vocab_size)
        for end in stop:
            text = text.partition(end)[0] if end else text
        texts.append(text)
    return Generated(texts, cfg, step, str(where), new)
