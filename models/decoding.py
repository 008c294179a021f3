"""Incremental decoding: a KV cache for the backbone's attention, and generation.

A batch of prompts is left-padded to one length; `valid` [B, S] marks the slots that hold a real
token. Every token gets its own position, counted from its row's first real token (left padding
gets negative positions and is never attended to), so a padded row computes what the same prompt
computes alone. Prefill runs the prompt through `Decoder.extend` once and stores every attention
layer's keys and values; each decode step runs one new token per row against the cache.

The residual pathway's state is per token: `start` rebuilds it for each new token from its own
embedding and sublayer outputs. What a pathway carries from one token to the next (`seq_swa`'s
window of keys and values; nothing for the variants that mix only across depth) goes through
`ResidualPathway.resume` and `ResidualPathway.carry`, and lives in `DecodeState.carry` between steps.

The decode step uses SDPA with an explicit mask and the pathway's own decode path (the AttnRes
family's static read through a depth cache that scores each source once, Block AttnRes in two phases
on it; with `impl="triton"` the AttnRes family reads through the history kernel and keeps its buffer
from step to step); nothing here is fused.

Shape legend: B batch, t new tokens, S cache slots, K key/value heads, H query heads, E head dim,
V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from reslab.common.errors import ConfigError


class KVCache:
    """Keys and values of every attention layer, one slot per token in time order, for B rows.

    Layer l's keys and values are [B, K, reserved, E], allocated at their first write in the dtype and
    device the attention produced, and grown as the cache fills: when the next tokens need more slots
    than are reserved, to twice the slots reserved or the slots needed if more (never past `capacity`,
    the model's context), so a row reserves less than twice the slots it uses and each slot is copied
    O(1) times on average. `extend(valid)` opens the next t slots: it records which are real tokens,
    the new tokens' positions [B, t] and the attention mask [B, 1, t, length]; every attention layer
    then writes its t keys and values there (`attend`).
    """

    def __init__(self, n_layers: int, batch: int, capacity: int):
        self.capacity = capacity
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.valid = torch.zeros(batch, 0, dtype=torch.bool)             # [B, reserved] a real token in the slot
        self.length = 0                                                  # slots filled, this step's included
        self.start = 0                                                   # this step's first slot
        self.positions = torch.zeros(batch, 0, dtype=torch.long)         # [B, t] this step's positions
        self.mask = torch.zeros(batch, 1, 0, 0, dtype=torch.bool)        # [B, 1, t, length]

    def reserve(self, needed: int) -> int:
        """The slots to reserve for `needed` filled ones, given `self.valid`'s: as they are if enough,
        else twice as many or `needed` if more, at most `capacity`."""
        reserved = self.valid.shape[1]
        return reserved if needed <= reserved else min(self.capacity, max(needed, 2 * reserved))

    def extend(self, valid: Tensor) -> Tensor:
        """Open slots for t new tokens per row (`valid` [B, t]: False on left padding); returns
        their positions [B, t], each token's index among its row's real tokens (-1 on padding)."""
        t = valid.shape[1]
        if self.length + t > self.capacity:
            raise ConfigError(f"decoding: {self.length} cached tokens plus {t} new ones is {self.length + t} "
                              f"tokens, over the model's context seq_len={self.capacity}; allowed: at most "
                              f"{self.capacity} tokens per row")
        self.valid = _grown(self.valid.to(valid.device), self.reserve(self.length + t), dim=1)
        self.start, self.length = self.length, self.length + t
        self.valid[:, self.start:self.length] = valid
        seen = self.valid[:, :self.length]
        self.positions = (seen.long().cumsum(-1) - 1)[:, self.start:]
        query = torch.arange(self.start, self.length, device=valid.device).view(-1, 1)     # [t, 1]
        key = torch.arange(self.length, device=valid.device).view(1, -1)                   # [1, length]
        # a padding query sees only itself, so its softmax stays finite; real tokens never see padding
        self.mask = ((key <= query) & (seen.unsqueeze(1) | (key == query))).unsqueeze(1)
        return self.positions

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's k, v [B, K, t, E] for `layer` and attend q [B, H, t, E] over every
        slot so far; returns [B, H, t, E]."""
        keys, values = self.keys[layer], self.values[layer]
        reserved = self.valid.shape[1]
        if keys is None or values is None:
            keys, values = k.new_zeros(*k.shape[:2], 0, k.shape[3]), v.new_zeros(*v.shape[:2], 0, v.shape[3])
        if keys.shape[2] != reserved:
            keys, values = _grown(keys, reserved, dim=2), _grown(values, reserved, dim=2)
            self.keys[layer], self.values[layer] = keys, values
        keys[:, :, self.start:self.length] = k
        values[:, :, self.start:self.length] = v
        return F.scaled_dot_product_attention(
            q, keys[:, :, :self.length], values[:, :, :self.length], attn_mask=self.mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )

    def reserved_bytes(self) -> int:
        """Bytes of the keys and values as allocated (every layer's reserved slots)."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values] if t is not None)

    def used_bytes(self) -> int:
        """Bytes of the keys and values of the filled slots (`length` of them per row)."""
        return sum(t[:, :, :self.length].numel() * t.element_size() for t in [*self.keys, *self.values]
                   if t is not None)


def _grown(x: Tensor, size: int, dim: int) -> Tensor:
    """`x` itself when its `dim` already has `size` entries, else a zero tensor that size there with
    `x` copied into its first entries."""
    if x.shape[dim] == size:
        return x
    out = x.new_zeros(*x.shape[:dim], size, *x.shape[dim + 1:])
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


@dataclass
class DecodeState:
    """Everything a batch being decoded keeps between steps."""

    cache: KVCache
    carry: Any = None  # what the residual pathway carries across tokens (ResidualPathway.carry)


def tensor_bytes(obj: Any, exclude: Any = None) -> int:
    """Bytes of every distinct tensor storage reachable from `obj` (tensors, lists, tuples, dicts,
    dataclasses and plain objects' attributes), each storage counted once; storages also reachable
    from `exclude` are not counted."""
    return sum(_storages(obj).values()) - sum(_storages(obj, _storages(exclude)).values())


def _storages(obj: Any, within: dict[int, int] | None = None) -> dict[int, int]:
    """{storage address: bytes} of the tensors reachable from `obj`; with `within`, only those in it."""
    found: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            storage = item.untyped_storage()
            if within is None or storage.data_ptr() in within:
                found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, list | tuple | set):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif hasattr(item, "__dict__") and not isinstance(item, type | torch.nn.Module):
            stack.extend(vars(item).values())
    return found


@dataclass(frozen=True)
class StateBytes:
    """What decoding keeps, in bytes, by what it grows with: `kv` per cached token (keys and values of
    every layer: the one part that grows with the context), `pathway` per row for the step of its token
    in flight (the residual pathway's state of that token at its deepest: the depth history, the
    streams, the block summaries; gone after the step), `carry` per row between steps (what the pathway
    carries from token to token: the window of a sequence-axis block; 0 for a variant that mixes only
    across depth). A row holding `context` tokens keeps `kv x context + per_row` bytes."""

    kv: int
    pathway: int
    carry: int

    @property
    def per_row(self) -> int:
        """Bytes a row holds whatever its context: its token in flight's pathway state and its carry."""
        return self.pathway + self.carry

    def row(self, context: int) -> int:
        """Bytes of a row holding `context` cached tokens while it decodes the next."""
        return self.kv * context + self.per_row


class Extendable(Protocol):
    """What generation needs of a model (`backbone.Decoder`)."""

    def prefill(self, idx: Tensor, valid: Tensor | None = None) -> tuple[Tensor, DecodeState]: ...

    def decode_step(self, token: Tensor, state: DecodeState) -> Tensor: ...


@dataclass(frozen=True)
class GenerateOptions:
    """max_new_tokens: tokens generated per row at most. temperature: 0 is greedy (argmax);
    above 0 samples from softmax(logits / temperature). top_k: sample among the k likeliest
    tokens only (None: all). stop_tokens: a row that generates one of these (kept in its output)
    stops growing. seed: the sampling generator's seed. pad_id: the token left padding and
    finished rows feed the model (never attended to, or never read)."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    stop_tokens: tuple[int, ...] = ()
    seed: int = 0
    pad_id: int = 0

    def __post_init__(self):
        for name in ("max_new_tokens", "seed", "pad_id", "top_k"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (name == "top_k" and value is None):
                raise ConfigError(f"generate.{name}: {value!r} is not allowed; allowed: an integer")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ConfigError(f"generate.temperature: {self.temperature!r} is not allowed; allowed: a number >= 0")
        if self.max_new_tokens < 1:
            raise ConfigError(f"generate.max_new_tokens: {self.max_new_tokens} is not allowed; allowed: >= 1")
        if not self.temperature >= 0:
            raise ConfigError(f"generate.temperature: {self.temperature} is not allowed; allowed: >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"generate.top_k: {self.top_k} is not allowed; allowed: >= 1, or None for all tokens")


@dataclass
class Batch:
    """Prompts left-padded to one length: idx [B, P] and valid [B, P] (False on padding)."""

    idx: Tensor
    valid: Tensor
    lengths: list[int] = field(default_factory=list)


def left_pad(prompts: Sequence[Sequence[int] | Tensor], pad_id: int, device: torch.device | str = "cpu") -> Batch:
    """One row per prompt, padded on the left with `pad_id`; an empty prompt is a ConfigError."""
    try:
        rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"generate.prompts: {type(exc).__name__} reading the prompts; allowed: sequences of "
                          "integer token ids") from None
    if not rows or any(r.numel() == 0 for r in rows):
        raise ConfigError("generate.prompts: an empty batch or an empty prompt; allowed: one or more prompts "
                          "of at least one token each")
    lengths = [r.numel() for r in rows]
    width = max(lengths)
    idx = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        idx[i, width - row.numel():] = row
        valid[i, width - row.numel():] = True
    return Batch(idx.to(device), valid.to(device), lengths)


def check_tokens(batch: Batch, vocab_size: int) -> None:
    """Every prompt token is an id of the model's vocabulary."""
    ids = batch.idx[batch.valid]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ConfigError(f"generate.prompts: token ids from {int(ids.min())} to {int(ids.max())}; allowed: "
                          f"0 to {vocab_size - 1}, the model's vocabulary")


def check_context(prompt_len: int, max_new_tokens: int, seq_len: int) -> None:
    """The longest prompt plus the new tokens must fit the model's context (`seq_len`)."""
    total = prompt_len + max_new_tokens
    if total > seq_len:
        raise ConfigError(f"generate: a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} is "
                          f"{total} tokens, over the model's context seq_len={seq_len}; allowed: prompt + "
                          f"max_new_tokens <= {seq_len}")


def pick(logits: Tensor, options: GenerateOptions, generator: torch.Generator | None) -> Tensor:
    """The next token per row from logits [B, V]: argmax at temperature 0, else a sample. [B]"""
    if options.temperature == 0:
        return logits.argmax(-1)
    scores = logits.float() / options.temperature
    if options.top_k is not None and options.top_k < scores.shape[-1]:
        kth = scores.topk(options.top_k, dim=-1).values[:, -1:]                       # [B, 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.multinomial(torch.softmax(scores, -1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Extendable, prompts: Sequence[Sequence[int] | Tensor], options: GenerateOptions,
             seq_len: int, vocab_size: int, device: torch.device) -> list[list[int]]:
    """The new tokens of every prompt (a stop token ends its row and is kept), decoded as one left-padded
    batch on `device`; `seq_len` is the model's context, `vocab_size` its vocabulary."""
    batch = left_pad(prompts, options.pad_id, device)
    check_tokens(batch, vocab_size)
    check_context(batch.idx.shape[1], options.max_new_tokens, seq_len)
    generator = None
    if options.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(options.seed)
    stops = torch.tensor(options.stop_tokens, dtype=torch.long, device=device)
    logits, state = model.prefill(batch.idx, batch.valid)
    logits = logits[:, -1]                                                             # [B, V]
    out: list[list[int]] = [[] for _ in batch.lengths]
    done = torch.zeros(len(out), dtype=torch.bool, device=device)
    for step in range(options.max_new_tokens):
        token = pick(logits, options, generator).masked_fill(done, options.pad_id)      # [B]
        for i in (~done).nonzero().flatten().tolist():
            out[i].append(int(token[i]))
        done = done | torch.isin(token, stops)
        if bool(done.all()) or step + 1 == options.max_new_tokens:
            break
        logits = model.decode_step(token, state)
    return out
