import os
import pickle

import numpy as np
import pytest
import torch

from reslab.models.config import ConfigError, DataConfig
from reslab.models.data import TokenDataset, cache_root, stdlib_documents
from reslab.models.data.corpus import Document
from reslab.models.data.prepare import prepare, prepare_from_cli
from reslab.models.data.tokenizer import ByteTokenizer


@pytest.fixture
def small(tmp_path) -> TokenDataset:
    docs = [Document(f"d{i}", f"doc {i} " + "xyz" * (50 + i % 17)) for i in range(120)]
    prepare(docs, tmp_path / "small", tokenizer=ByteTokenizer(), val_fraction=0.2, source_description="")
    return TokenDataset(tmp_path / "small")


def test_train_batch_is_a_pure_function(small):
    x, y = small.train_batch(step=5, micro=1, batch_size=4, seq_len=32, data_seed=7)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    x2, y2 = small.train_batch(5, 1, 4, 32, 7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    reopened = TokenDataset(small.directory)
    assert torch.equal(reopened.train_batch(5, 1, 4, 32, 7)[0], x)
    for args in [(5, 1, 4, 32, 8), (6, 1, 4, 32, 7), (5, 0, 4, 32, 7)]:
        assert not torch.equal(small.train_batch(*args)[0], x)
    # windows really come from train.bin
    train = np.fromfile(small.directory / "train.bin", dtype=np.uint16).astype(np.int64)
    row = x[0].numpy()
    starts = np.flatnonzero(train[: len(train) - 32] == row[0])
    assert any(np.array_equal(train[s : s + 32], row) for s in starts)
    assert int(x.max()) < small.vocab_size


def test_batch_argument_errors(small):
    with pytest.raises(ValueError, match="has only"):
        small.train_batch(0, 0, 2, small.n_train_tokens, 1)
    with pytest.raises(ValueError, match="data_seed must be a non-negative"):
        small.train_batch(0, 0, 2, 8, -1)
    with pytest.raises(ValueError, match="batch_size must be a positive"):
        small.train_batch(0, 0, 0, 8, 1)
    with pytest.raises(ValueError, match="validation split .* has only"):
        small.val_batches(1, 1, small.n_val_tokens)
    with pytest.raises(ValueError, match="distinct windows"):
        small.val_batches(small.n_val_tokens, 2, 8)


def test_val_batches_are_fixed_and_span_the_split(small):
    a = small.val_batches(3, 4, 16)
    b = TokenDataset(small.directory).val_batches(3, 4, 16)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b):
        assert xa.shape == (4, 16) and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    val = np.fromfile(small.directory / "val.bin", dtype=np.uint16).astype(np.int64)
    assert np.array_equal(a[0][0][0].numpy(), val[:16])  # first window at the start
    assert np.array_equal(a[-1][1][-1].numpy(), val[-16:])  # last window ends at the end
    # a request larger than the split still works, with overlapping windows
    n_windows = small.n_val_tokens // 9 + 3
    assert len(small.val_batches(n_windows, 1, 8)) == n_windows


def test_open_prepared_dir_and_mismatches(tmp_path):
    out = tmp_path / "bpe"
    lines = [f'{{"text": "line {i} " }}' for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines * 3))
    meta = prepare_from_cli([str(tmp_path / "d.jsonl")], "jsonl", out, "bpe", 280, "text", 0.2)
    ds = TokenDataset.open(DataConfig(corpus=str(out), tokenizer="bpe", bpe_vocab_size=meta.vocab_size))
    assert ds.vocab_size == meta.vocab_size and ds.fingerprint == meta.fingerprint
    assert ds.tokenizer.decode(ds.val_batches(1, 1, 4)[0][0][0].tolist())
    with pytest.raises(ConfigError, match="data.tokenizer: the config says 'byte' but .* 'bpe'"):
        TokenDataset.open(DataConfig(corpus=str(out), tokenizer="byte"))
    with pytest.raises(ConfigError, match="data.bpe_vocab_size"):
        TokenDataset.open(DataConfig(corpus=str(out), tokenizer="bpe", bpe_vocab_size=meta.vocab_size + 1))
    with pytest.raises(ConfigError, match="run `reslab data prepare`"):
        TokenDataset.open(DataConfig(corpus=str(tmp_path / "nothing")))


def test_pickles_by_directory(small):
    clone = pickle.loads(pickle.dumps(small))
    assert clone.fingerprint == small.fingerprint
    assert torch.equal(clone.train_batch(1, 0, 2, 8, 3)[0], small.train_batch(1, 0, 2, 8, 3)[0])


# ----------------------------------------------------------------------------- the real stdlib corpus


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("stdlib-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RESLAB_CACHE", str(root))
        first = TokenDataset.open(DataConfig())
        yield root, first


def test_stdlib_corpus(stdlib_cache, monkeypatch):
    root, first = stdlib_cache
    monkeypatch.setenv("RESLAB_CACHE", str(root))
    assert cache_root() == root
    assert first.directory.parent == root / "data"
    assert first.directory.name.startswith("stdlib-py") and "-byte-notests-" in first.directory.name
    meta_mtime = os.stat(first.directory / "meta.json").st_mtime_ns
    second = TokenDataset.open(DataConfig())
    assert second.directory == first.directory and second.fingerprint == first.fingerprint
    assert os.stat(first.directory / "meta.json").st_mtime_ns == meta_mtime  # reused, not rebuilt
    m = first.meta
    n_bytes = sum(len(d.text.encode("utf-8")) + 1 for d in stdlib_documents())
    assert m.n_train_tokens + m.n_val_tokens == n_bytes
    assert 8e6 < n_bytes < 20e6
    assert m.n_val_documents >= 1 and m.n_val_tokens > 10_000
    assert first.vocab_size == 257
    x, y = first.train_batch(0, 0, 2, 64, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(first.val_batches(8, 16, 128)) == 8
    # another val_fraction is a different cache entry, not a clash
    other = TokenDataset.open(DataConfig(val_fraction=0.1))
    assert other.directory != first.directory and other.meta.corpus_fingerprint == m.corpus_fingerprint
