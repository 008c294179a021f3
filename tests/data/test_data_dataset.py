import dataclasses
import os
import pickle

import numpy as np
import pytest
import torch
from data_testing import split_tokens

from reslab.models.config import ConfigError, DataConfig, RunConfig
from reslab.models.data import TokenDataset, cache_root, stdlib_documents
from reslab.models.data.corpus import Document
from reslab.models.data.prepare import PrepareOptions, prepare
from reslab.models.data.tokenizer import ByteTokenizer
from reslab.orchestrator.driving.dataprep import PrepareRequest, prepare_corpus

BYTES_20 = PrepareOptions(tokenizer=ByteTokenizer(), val_fraction=0.2, source_description="")


@pytest.fixture
def small(tmp_path) -> TokenDataset:
    docs = [Document(f"d{i}", f"doc {i} " + "xyz" * (50 + i % 17)) for i in range(120)]
    prepare(docs, tmp_path / "small", BYTES_20)
    return TokenDataset(tmp_path / "small")


def test_train_samples_are_a_pure_function(small):
    x, y = small.train_samples(first=20, count=4, seq_len=32, data_seed=7)
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    x2, y2 = small.train_samples(20, 4, 32, 7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    reopened = TokenDataset(small.directory)
    assert torch.equal(reopened.train_samples(20, 4, 32, 7)[0], x)
    for args in [(20, 4, 32, 8), (24, 4, 32, 7), (0, 4, 32, 7)]:
        assert not torch.equal(small.train_samples(*args)[0], x)
    # a sample is the same whatever batch asks for it: batch size and accumulation cannot move it
    eight = small.train_samples(16, 8, 32, 7)[0]
    assert torch.equal(eight[4:], x) and torch.equal(torch.cat([small.train_samples(16 + i, 1, 32, 7)[0]
                                                                for i in range(8)]), eight)
    # windows are the train split's, at multiples of seq_len
    train = split_tokens(small.directory, "train").astype(np.int64)
    for row in x.numpy():
        starts = [s for s in range(0, len(train) - 32, 32) if np.array_equal(train[s : s + 32], row)]
        assert starts, "a window that is not one of the split's"
    assert int(x.max()) < small.vocab_size


def test_an_epoch_sees_every_window_once_in_a_new_order(tmp_path):
    """Sampling without replacement: the first `n` samples are the split's `n` windows, each once;
    the next `n` are all of them again, in another order; a batch may straddle the two epochs.
    Random letters make every window's text unique, so a sample's text names its window."""
    rng = np.random.default_rng(0)
    docs = [Document(f"d{i}", "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), 300))) for i in range(40)]
    prepare(docs, tmp_path / "random", BYTES_20)
    ds, seq_len = TokenDataset(tmp_path / "random"), 16
    n = ds.train_windows(seq_len)
    assert n == (ds.n_train_tokens - 1) // seq_len
    train = split_tokens(ds.directory, "train").astype(np.int64)
    index = {tuple(train[i * seq_len : i * seq_len + seq_len + 1]): i for i in range(n)}
    assert len(index) == n

    def windows(first: int, count: int) -> list[int]:
        x, y = ds.train_samples(first, count, seq_len, 3)
        return [index[tuple(row)] for row in torch.cat([x, y[:, -1:]], dim=1).numpy()]

    first = [w for i in range(0, n, 7) for w in windows(i, min(7, n - i))]
    second = [w for i in range(0, n, 7) for w in windows(n + i, min(7, n - i))]
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second and first != sorted(first)
    assert windows(n - 2, 4) == first[-2:] + second[:2]


def test_batch_argument_errors(small):
    with pytest.raises(ValueError, match="has only"):
        small.train_samples(0, 2, small.n_train_tokens, 1)
    with pytest.raises(ValueError, match="data_seed must be a non-negative"):
        small.train_samples(0, 2, 8, -1)
    with pytest.raises(ValueError, match="first must be a non-negative"):
        small.train_samples(-1, 2, 8, 1)
    with pytest.raises(ValueError, match="count must be a positive"):
        small.train_samples(0, 0, 8, 1)
    with pytest.raises(ValueError, match="validation split .* has only"):
        small.val_batches(1, 1, small.n_val_tokens)
    with pytest.raises(ValueError, match="distinct windows"):
        small.val_batches(small.n_val_tokens, 2, 8)


def test_val_batches_are_fixed_and_span_the_split(small):
    a = small.val_batches(12, 4, 16)
    b = TokenDataset(small.directory).val_batches(12, 4, 16)
    assert len(a) == 3
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.shape == (4, 16) and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    val = split_tokens(small.directory, "val").astype(np.int64)
    assert np.array_equal(a[0][0][0].numpy(), val[:16])  # first window at the start
    assert np.array_equal(a[-1][1][-1].numpy(), val[-16:])  # last window ends at the end
    # the batch size chunks the same windows: every arm is scored on the same tokens
    for batch_size in (1, 5, 12, 64):
        chunks = small.val_batches(12, batch_size, 16)
        assert [len(x) for x, _ in chunks][:-1] == [batch_size] * (len(chunks) - 1)
        assert torch.equal(torch.cat([x for x, _ in chunks]), torch.cat([x for x, _ in a]))
    # a request larger than the split still works, with overlapping windows
    n_windows = small.n_val_tokens // 9 + 3
    assert len(small.val_batches(n_windows, 1, 8)) == n_windows


def test_open_prepared_dir_and_mismatches(tmp_path):
    out = tmp_path / "bpe"
    lines = [f'{{"text": "line {i} " }}' for i in range(40)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines * 3))
    meta = prepare_corpus(PrepareRequest(inputs=[str(tmp_path / "d.jsonl")], fmt="jsonl", out_dir=out,
                                         tokenizer="bpe", vocab_size=280, val_fraction=0.2))
    ds = TokenDataset.open(DataConfig(corpus=str(out), tokenizer="bpe", bpe_vocab_size=meta.vocab_size))
    assert ds.vocab_size == meta.vocab_size and ds.fingerprint == meta.fingerprint
    assert ds.tokenizer.decode(ds.val_batches(1, 1, 4)[0][0][0].tolist())
    with pytest.raises(ConfigError, match="data.tokenizer: the config says 'byte' but .* 'bpe'"):
        TokenDataset.open(DataConfig(corpus=str(out), tokenizer="byte"))
    with pytest.raises(ConfigError, match="data.bpe_vocab_size"):
        TokenDataset.open(DataConfig(corpus=str(out), tokenizer="bpe", bpe_vocab_size=meta.vocab_size + 1))
    with pytest.raises(ConfigError, match="data.corpus: .* is not prepared .*: reslab data prepare .* --out "):
        TokenDataset.open(DataConfig(corpus=str(tmp_path / "nothing")))


def test_shards_read_as_one_stream(tmp_path):
    """Shards of 64 tokens give the same windows as the one-shard corpus, including windows that
    cross shard boundaries (checked against the concatenated split read from disk)."""
    docs = [Document(f"d{i}", f"doc {i} " + "pq" * (5 + i % 7)) for i in range(150)]
    one = tmp_path / "one"
    many = tmp_path / "many"
    prepare(docs, one, BYTES_20)
    meta = prepare(docs, many, dataclasses.replace(BYTES_20, shard_tokens=64, chunk_chars=40))
    assert len(meta.shard_files("train")) > 5 and len(meta.shard_files("val")) > 1
    a, b = TokenDataset(one), TokenDataset(many)
    assert (a.n_train_tokens, a.n_val_tokens) == (b.n_train_tokens, b.n_val_tokens)
    assert np.array_equal(split_tokens(one, "train"), split_tokens(many, "train"))
    for step in range(20):
        assert torch.equal(a.train_samples(step * 8, 8, 50, 3)[0], b.train_samples(step * 8, 8, 50, 3)[0])
    for (xa, _), (xb, _) in zip(a.val_batches(8, 2, 30), b.val_batches(8, 2, 30), strict=True):
        assert torch.equal(xa, xb)
    train = split_tokens(many, "train").astype(np.int64)
    starts = np.array([0, 60, 63, 64, 100, b.n_train_tokens - 51])
    assert np.array_equal(b._train.windows(starts, 51), np.stack([train[s : s + 51] for s in starts]))


def test_named_corpus_lives_in_the_cache(tmp_path):
    docs = [Document(f"d{i}", f"doc {i} text") for i in range(30)]
    root = tmp_path / "reslab-cache"  # the autouse fixture's $RESLAB_CACHE
    with pytest.raises(ConfigError, match="data.corpus: 'my-corpus' is not prepared .*--corpus my-corpus"):
        TokenDataset.open(DataConfig(corpus="my-corpus"))
    prepare(docs, root / "corpora" / "my-corpus", BYTES_20)
    assert TokenDataset.open(DataConfig(corpus="my-corpus")).directory == root / "corpora" / "my-corpus"
    from reslab.models.resolve import validate_run_config

    with pytest.raises(ConfigError, match="data.corpus: 'my corpus' is not allowed; use stdlib, a prepared corpus's"):
        validate_run_config(RunConfig(data=DataConfig(corpus="my corpus")))


def test_pickles_by_directory(small):
    clone = pickle.loads(pickle.dumps(small))
    assert clone.fingerprint == small.fingerprint
    assert torch.equal(clone.train_samples(2, 2, 8, 3)[0], small.train_samples(2, 2, 8, 3)[0])


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
    x, y = first.train_samples(0, 2, 64, 1)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(first.val_batches(128, 16, 128)) == 8
    # another val_fraction is a different cache entry, not a clash
    other = TokenDataset.open(DataConfig(val_fraction=0.1))
    assert other.directory != first.directory and other.meta.corpus_fingerprint == m.corpus_fingerprint
