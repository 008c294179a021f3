"""Helpers shared by the data tests (imported as `from data_testing import ...`; tests/data has no
__init__.py, so pytest puts this folder on sys.path)."""

from pathlib import Path

import numpy as np

from reslab.models.data.prepare import read_meta


def split_tokens(directory: Path, split: str) -> np.ndarray:
    """Every token of one split, its shards concatenated in manifest order, read straight from disk."""
    meta = read_meta(directory)
    files = [np.fromfile(directory / name, dtype=meta.dtype) for name, _ in meta.shard_files(split)]
    return np.concatenate(files) if files else np.empty(0, dtype=meta.dtype)


def shard_bytes(directory: Path) -> bytes:
    """The bytes of every shard, train then val, in manifest order (what tokens_fingerprint hashes)."""
    meta = read_meta(directory)
    names = [name for split in ("train", "val") for name, _ in meta.shard_files(split)]
    return b"".join((directory / name).read_bytes() for name in names)
