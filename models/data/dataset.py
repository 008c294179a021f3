"""`TokenDataset`: memory-mapped train/val token files and batches that are pure functions of
their arguments.

Training data is a stream of samples, each a window of `seq_len + 1` tokens (inputs and their
next-token targets). The train split is cut into `n = (tokens - 1) // seq_len` windows that share
no target token (window i starts at token i * seq_len), and every epoch visits each of them once,
in an order drawn from `np.random.default_rng([data_seed, epoch])`: sample g is window
`permutation_{g // n}[g % n]`. A sample is thus a pure function of (data seed, global sample
index), whatever the batch size, gradient accumulation or (later) world size that asks for it, and
resuming from a checkpoint sees exactly the data an uninterrupted run would; a run under one pass
sees no window twice. The training loop asks for samples `[(step * grad_accum + micro) *
batch_size, ... + batch_size)`.

Validation windows are fixed and evenly spaced over the val split, `eval_windows` of them, so every
arm and seed of a study, whatever its batch size, is scored on the same tokens; the batch size
only chunks them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from reslab.models.config import ConfigError, DataConfig
from reslab.models.data.prepare import (
    META_FILE,
    Meta,
    cache_root,
    corpus_path,
    hf_tokenizer_source,
    missing_corpus_message,
    prepare_stdlib,
    read_meta,
)
from reslab.models.data.tokenizer import Tokenizer, load_tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _check_hf_source(meta: Meta, cfg: DataConfig, path: Path) -> None:
    """A corpus prepared with an `hf` tokenizer must have been prepared with the run's own (same files)."""
    mine = hf_tokenizer_source(cfg.tokenizer_path).rsplit(" ", 1)[-1]
    theirs = meta.tokenizer_source.rsplit(" ", 1)[-1]
    if mine != theirs:
        raise ConfigError(f"data.tokenizer_path: {path} was prepared with the hf tokenizer {meta.tokenizer_source!r}, "
                          f"not the one in {cfg.tokenizer_path} ({mine}); prepare the corpus with that tokenizer")


class TokenDataset:
    """A prepared corpus directory, opened read-only."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._meta = read_meta(self.directory)
        self._train = _Shards(self.directory, self._meta, "train")
        self._val = _Shards(self.directory, self._meta, "val")
        self._tokenizer: Tokenizer | None = None
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}  # _epoch_order's cache

    @classmethod
    def open(cls, cfg: DataConfig, cache_dir: str | os.PathLike[str] | None = None) -> TokenDataset:
        """Open the corpus `cfg` names (`models.data.prepare.corpus_path`); the stdlib corpus is
        prepared into the cache on first use."""
        if cfg.corpus == "stdlib":
            root = Path(cache_dir) if cache_dir is not None else cache_root() / "data"
            path, _ = prepare_stdlib(
                root,
                tokenizer=cfg.tokenizer,
                bpe_vocab_size=cfg.bpe_vocab_size,
                val_fraction=cfg.val_fraction,
                include_tests=cfg.include_tests,
                tokenizer_path=cfg.tokenizer_path,
            )
            return cls(path)
        path = corpus_path(cfg.corpus)
        if not (path / META_FILE).is_file():
            raise ConfigError(missing_corpus_message(cfg.corpus))
        ds = cls(path)
        if ds.meta.tokenizer != cfg.tokenizer:
            raise ConfigError(
                f"data.tokenizer: the config says {cfg.tokenizer!r} but {path} was prepared with "
                f"{ds.meta.tokenizer!r}; set data.tokenizer: {ds.meta.tokenizer}"
            )
        if cfg.tokenizer == "bpe" and ds.meta.vocab_size != cfg.bpe_vocab_size:
            raise ConfigError(
                f"data.bpe_vocab_size: the config says {cfg.bpe_vocab_size} but {path} has a BPE "
                f"vocabulary of {ds.meta.vocab_size}; set data.bpe_vocab_size: {ds.meta.vocab_size}"
            )
        if cfg.tokenizer == "hf":
            _check_hf_source(ds.meta, cfg, path)
        return ds

    def __reduce__(self):
        # Memmaps do not pickle usefully; reopen from the directory (e.g. in a Ray worker).
        return (type(self), (str(self.directory),))

    @property
    def meta(self) -> Meta:
        return self._meta

    @property
    def vocab_size(self) -> int:
        return self._meta.vocab_size

    @property
    def eot_id(self) -> int:
        return self._meta.eot_id

    @property
    def fingerprint(self) -> str:
        return self._meta.fingerprint

    @property
    def n_train_tokens(self) -> int:
        return self._meta.n_train_tokens

    @property
    def n_val_tokens(self) -> int:
        return self._meta.n_val_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.directory)
        return self._tokenizer

    def _check_window(self, split: str, n_tokens: int, seq_len: int) -> None:
        if seq_len + 1 > n_tokens:
            raise ValueError(
                f"seq_len {seq_len} needs windows of {seq_len + 1} tokens but the {split} split of "
                f"{self.directory} has only {n_tokens}"
            )

    @staticmethod
    def _to_batch(windows: np.ndarray) -> Batch:
        # windows: [B, T+1] -> inputs [B, T], targets [B, T] shifted by one
        full = torch.from_numpy(windows.astype(np.int64, copy=False))
        return full[:, :-1].contiguous(), full[:, 1:].contiguous()

    def train_windows(self, seq_len: int) -> int:
        """Windows per epoch of the train split at `seq_len` (the module doc)."""
        _check_positive(seq_len=seq_len)
        self._check_window("train", self.n_train_tokens, seq_len)
        return (self.n_train_tokens - 1) // seq_len

    def train_samples(self, first: int, count: int, seq_len: int, data_seed: int) -> Batch:
        """Samples `first .. first + count - 1` of the training stream of `data_seed` (the module doc)."""
        _check_positive(count=count, seq_len=seq_len)
        for name, v in (("data_seed", data_seed), ("first", first)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        per_epoch = self.train_windows(seq_len)
        samples = np.arange(int(first), int(first) + count, dtype=np.int64)
        epochs, positions = np.divmod(samples, per_epoch)
        windows = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            windows[at] = self._epoch_order(int(data_seed), int(epoch), per_epoch)[positions[at]]
        return self._to_batch(self._train.windows(windows * seq_len, seq_len + 1))

    def _epoch_order(self, data_seed: int, epoch: int, per_epoch: int) -> np.ndarray:
        """The window order of one epoch; the last two are kept (a batch may straddle epochs)."""
        key = (data_seed, epoch, per_epoch)
        if key not in self._orders:
            order = np.random.default_rng([data_seed, epoch]).permutation(per_epoch)
            self._orders = {k: v for k, v in list(self._orders.items())[-1:]}
            self._orders[key] = order.astype(np.int32 if per_epoch < 2**31 else np.int64)
        return self._orders[key]

    def val_batches(self, n_windows: int, batch_size: int, seq_len: int) -> list[Batch]:
        """`n_windows` fixed windows spread evenly over the whole val split, in batches of at most
        `batch_size` (the last one may be smaller; `batch_size` changes the chunking, not the windows).

        Independent of any seed. Windows do not overlap when the split holds
        `n_windows * (seq_len + 1)` tokens; a shorter split is still covered end to end with
        overlapping windows (at distinct starts) rather than refused.
        """
        _check_positive(n_windows=n_windows, batch_size=batch_size, seq_len=seq_len)
        n = self.n_val_tokens
        self._check_window("validation", n, seq_len)
        width = seq_len + 1
        if n_windows > n - width + 1:  # a config the corpus cannot serve: one line, not a traceback
            raise ConfigError(
                f"validation split of {self.directory} has {n} tokens: room for {n - width + 1} distinct "
                f"windows of {width} tokens, fewer than train.eval_windows={n_windows}; ask for fewer "
                "eval windows or a shorter seq_len, or prepare with a larger val_fraction"
            )
        # start_i = floor(i * (n - width) / (count - 1)): first window at 0, last one ends at n
        starts = np.arange(n_windows, dtype=np.int64) * (n - width) // max(n_windows - 1, 1)
        windows = self._val.windows(starts, width)
        return [self._to_batch(windows[i : i + batch_size]) for i in range(0, n_windows, batch_size)]


class _Shards:
    """One split's shards as one token sequence: memmaps and the global offset of each."""

    def __init__(self, directory: Path, meta: Meta, split: str) -> None:
        files = [(name, n) for name, n in meta.shard_files(split) if n > 0]
        dtype = np.dtype(meta.dtype)
        self._maps = [np.memmap(directory / name, dtype=dtype, mode="r") for name, _ in files]
        self._starts = np.cumsum([0] + [n for _, n in files])  # [n_shards + 1]

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """Tokens [s, s + width) of the split for each start s: [len(starts), width]; a window
        may cross a shard boundary."""
        out = np.empty((len(starts), width), dtype=self._maps[0].dtype)
        for row, start in enumerate(starts):
            pos, end = int(start), int(start) + width
            while pos < end:
                shard = int(np.searchsorted(self._starts, pos, side="right")) - 1
                lo = pos - self._starts[shard]
                take = min(end, int(self._starts[shard + 1])) - pos
                out[row, pos - start : pos - start + take] = self._maps[shard][lo : lo + take]
                pos += take
        return out
