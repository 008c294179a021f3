"""`TokenDataset`: memory-mapped train/val token files and batches that are pure functions of
their arguments.

Training windows come from `np.random.default_rng([data_seed, step, micro])`, so the batch of
any (step, micro-step) can be recomputed without replaying the ones before it: resuming from a
checkpoint sees exactly the data an uninterrupted run would. Validation windows are fixed and
evenly spaced, so every arm and seed is scored on the same tokens.
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


class TokenDataset:
    """A prepared corpus directory, opened read-only."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self._meta = read_meta(self.directory)
        self._train = _Shards(self.directory, self._meta, "train")
        self._val = _Shards(self.directory, self._meta, "val")
        self._tokenizer: Tokenizer | None = None

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

    def train_batch(self, step: int, micro: int, batch_size: int, seq_len: int, data_seed: int) -> Batch:
        """Random windows of the train split; offsets depend only on (data_seed, step, micro)."""
        _check_positive(batch_size=batch_size, seq_len=seq_len)
        for name, v in (("data_seed", data_seed), ("step", step), ("micro", micro)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
        n = self.n_train_tokens
        self._check_window("train", n, seq_len)
        rng = np.random.default_rng([int(data_seed), int(step), int(micro)])
        starts = rng.integers(0, n - seq_len, size=batch_size)  # last valid start: n - seq_len - 1
        return self._to_batch(self._train.windows(starts, seq_len + 1))

    def val_batches(self, n_batches: int, batch_size: int, seq_len: int) -> list[Batch]:
        """`n_batches` batches of fixed windows spread evenly over the whole val split.

        Independent of any seed. Windows do not overlap when the split holds
        `n_batches * batch_size * (seq_len + 1)` tokens; a shorter split is still covered
        end to end with overlapping windows (at distinct starts) rather than refused.
        """
        _check_positive(n_batches=n_batches, batch_size=batch_size, seq_len=seq_len)
        n = self.n_val_tokens
        self._check_window("validation", n, seq_len)
        count, width = n_batches * batch_size, seq_len + 1
        if count > n - width + 1:
            raise ValueError(
                f"validation split of {self.directory} has {n} tokens: room for {n - width + 1} distinct "
                f"windows of {width} tokens, fewer than {n_batches} batches x {batch_size}; ask for fewer "
                "eval batches or a shorter seq_len, or prepare with a larger val_fraction"
            )
        # start_i = floor(i * (n - width) / (count - 1)): first window at 0, last one ends at n
        starts = np.arange(count, dtype=np.int64) * (n - width) // max(count - 1, 1)
        windows = self._val.windows(starts, width).reshape(n_batches, batch_size, width)
        return [self._to_batch(w) for w in windows]


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
