import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_testing import shard_bytes, split_tokens

from reslab.models.data.corpus import Document
from reslab.models.data.prepare import (
    Meta,
    PrepareOptions,
    corpus_fingerprint,
    is_val_document,
    prepare,
    prepare_if_missing,
    read_meta,
    token_dtype,
)
from reslab.models.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from reslab.orchestrator.driving.dataprep import PrepareRequest, prepare_corpus

META_KEYS = {
    "format_version", "tokenizer", "vocab_size", "eot_id", "dtype", "n_train_tokens", "n_val_tokens",
    "n_documents", "n_val_documents", "corpus_fingerprint", "tokens_fingerprint", "val_fraction", "source",
    "shards", "dataset", "token_budget", "tokenizer_source",
}


def byte_prepare(docs, out, val_fraction, **kwargs) -> Meta:
    tok = ByteTokenizer()
    return prepare(docs, out, PrepareOptions(tokenizer=tok, val_fraction=val_fraction, source_description="", **kwargs))


def make_docs(n: int) -> list[Document]:
    return [Document(f"doc-{i:03d}", f"document {i}: " + "abcdefgh"[i % 8] * (i % 13 + 1)) for i in range(n)]


def test_meta_fields_and_files(tmp_path):
    docs = make_docs(200)
    out = tmp_path / "corpus"
    options = PrepareOptions(tokenizer=ByteTokenizer(), val_fraction=0.1, source_description="unit test")
    meta = prepare(docs, out, options)
    raw = json.loads((out / "meta.json").read_text())
    assert set(raw) == META_KEYS
    assert Meta.from_dict(raw) == meta == read_meta(out)
    assert (meta.tokenizer, meta.vocab_size, meta.eot_id, meta.dtype) == ("byte", 257, 256, "uint16")
    assert meta.source == "unit test" and meta.val_fraction == 0.1 and meta.format_version == 2
    n_val_docs = sum(is_val_document(d.doc_id, 0.1) for d in docs)
    assert meta.n_documents == 200 and meta.n_val_documents == n_val_docs and 0 < n_val_docs < 200
    total = sum(len(d.text.encode()) + 1 for d in docs)
    assert meta.n_train_tokens + meta.n_val_tokens == total
    assert meta.shards == {"train": [["train-00000.bin", meta.n_train_tokens]],
                           "val": [["val-00000.bin", meta.n_val_tokens]]}
    train, val = split_tokens(out, "train"), split_tokens(out, "val")
    assert train.dtype == val.dtype == np.uint16
    assert (train.size, val.size) == (meta.n_train_tokens, meta.n_val_tokens)
    assert (train == 256).sum() == 200 - n_val_docs and (val == 256).sum() == n_val_docs
    expected_train = b"".join(d.text.encode() + b"\x00" for d in docs if not is_val_document(d.doc_id, 0.1))
    assert ByteTokenizer().decode(train.tolist()) == expected_train.decode().replace("\x00", "<|endoftext|>")
    tokens = hashlib.sha256(shard_bytes(out)).hexdigest()
    assert meta.tokens_fingerprint == tokens
    assert meta.corpus_fingerprint == corpus_fingerprint(docs)
    assert isinstance(load_tokenizer(out), ByteTokenizer)
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]  # no temp dirs left behind


def test_split_is_by_document_and_order_independent(tmp_path):
    docs = make_docs(300)
    a = byte_prepare(docs, tmp_path / "a", 0.05)
    b = byte_prepare(docs[::-1], tmp_path / "b", 0.05)
    assert a.n_val_documents == b.n_val_documents > 0
    assert a.n_val_tokens == b.n_val_tokens
    val_a = np.sort(split_tokens(tmp_path / "a", "val"))
    val_b = np.sort(split_tokens(tmp_path / "b", "val"))
    assert np.array_equal(val_a, val_b)
    assert a.corpus_fingerprint != b.corpus_fingerprint  # order is part of the corpus identity
    # chunking does not change the bytes
    c = byte_prepare(docs, tmp_path / "c", 0.05, chunk_chars=50)
    assert c.tokens_fingerprint == a.tokens_fingerprint


def test_at_least_one_val_document(tmp_path):
    docs = [Document(name, f"text of {name}") for name in ("x", "y", "z", "w")]
    assert not any(is_val_document(d.doc_id, 0.001) for d in docs)
    meta = byte_prepare(docs, tmp_path / "c", 0.001)
    assert meta.n_val_documents == 1
    val, train = split_tokens(tmp_path / "c", "val"), split_tokens(tmp_path / "c", "train")
    assert val[-1] == 256 and (val == 256).sum() == 1 and (train == 256).sum() == 3
    assert val.size + train.size == sum(len(d.text) + 1 for d in docs)
    # the chosen document does not depend on order either
    again = byte_prepare(docs[::-1], tmp_path / "d", 0.001)
    assert np.array_equal(split_tokens(tmp_path / "d", "val"), val)
    assert again.n_train_tokens == meta.n_train_tokens


def test_prepare_rejects_degenerate_input(tmp_path):
    with pytest.raises(ValueError, match="at least 2 documents"):
        byte_prepare(make_docs(1), tmp_path / "a", 0.1)
    with pytest.raises(ValueError, match="val_fraction"):
        byte_prepare(make_docs(5), tmp_path / "b", 0.0)
    byte_prepare(make_docs(5), tmp_path / "c", 0.5)
    with pytest.raises(ValueError, match="already exists"):
        byte_prepare(make_docs(5), tmp_path / "c", 0.5)
    meta = byte_prepare(make_docs(9), tmp_path / "c", 0.5, overwrite=True)
    assert read_meta(tmp_path / "c") == meta and meta.n_documents == 9


def test_crash_leaves_nothing_behind(tmp_path):
    def docs():
        yield from make_docs(10)
        raise RuntimeError("reader died")

    with pytest.raises(RuntimeError, match="reader died"):
        byte_prepare(docs(), tmp_path / "out", 0.1, chunk_chars=20)
    assert list(tmp_path.iterdir()) == []


class WideTokenizer(Tokenizer):
    """Bytes shifted up to 60000.. so ids need more than 16 bits."""

    name = "wide"
    vocab_size = 70000
    eot_id = 69999

    def encode(self, text: str) -> list[int]:
        return [60000 + b for b in text.encode()]

    def decode(self, ids) -> str:
        return bytes(i - 60000 for i in ids if i != self.eot_id).decode()


def test_dtype_selection(tmp_path):
    assert token_dtype(257) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint32
    tok = WideTokenizer()
    meta = prepare(make_docs(20), tmp_path / "w", PrepareOptions(tokenizer=tok, val_fraction=0.2,
                                                                 source_description=""))
    assert meta.dtype == "uint32"
    train = split_tokens(tmp_path / "w", "train")
    assert train.dtype == np.uint32
    assert (tmp_path / "w" / "train-00000.bin").stat().st_size == 4 * meta.n_train_tokens
    assert train.max() == 69999 and train.min() >= 60000


def test_read_meta_errors(tmp_path):
    with pytest.raises(ValueError, match="reslab data prepare"):
        read_meta(tmp_path)
    byte_prepare(make_docs(10), tmp_path / "c", 0.2)
    with open(tmp_path / "c" / "train-00000.bin", "ab") as fh:
        fh.write(b"\x00\x00")
    with pytest.raises(ValueError, match="damaged"):
        read_meta(tmp_path / "c")


def test_prepare_if_missing_builds_once_under_concurrency(tmp_path):
    out = tmp_path / "shared"
    built: list[int] = []
    gate = threading.Barrier(6)

    def build(path: Path) -> Meta:
        built.append(1)
        return byte_prepare(make_docs(50), path, 0.1, overwrite=True)

    results: list[Meta] = []

    def worker() -> None:
        gate.wait()
        results.append(prepare_if_missing(out, build))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and len(results) == 6 and len({m.tokens_fingerprint for m in results}) == 1
    # a present corpus that is not accepted is rebuilt in place
    meta = prepare_if_missing(out, build, accept=lambda m: m.n_documents == 999)
    assert len(built) == 2 and read_meta(out) == meta


def from_files(path, fmt, out, tokenizer, vocab_size, text_field, val_fraction) -> Meta:
    """`reslab data prepare PATH --format FMT ...` without the CLI."""
    return prepare_corpus(PrepareRequest(inputs=[str(path)], fmt=fmt, out_dir=out, tokenizer=tokenizer,
                                         vocab_size=vocab_size, text_field=text_field, val_fraction=val_fraction))


def test_prepare_corpus_formats(tmp_path):
    (tmp_path / "txt").mkdir()
    for i in range(6):
        (tmp_path / "txt" / f"{i}.txt").write_text(f"plain text number {i} " * 20)
    meta = from_files(tmp_path / "txt", "text", tmp_path / "o1", "byte", 0, "text", 0.2)
    assert meta.n_documents == 6 and meta.tokenizer == "byte" and meta.source.startswith("text: ")

    lines = [json.dumps({"body": f"json line {i} " * 30}) for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    meta = from_files(tmp_path / "d.jsonl", "jsonl", tmp_path / "o2", "bpe", 300, "body", 0.1)
    assert meta.tokenizer == "bpe" and 257 < meta.vocab_size <= 300 and meta.n_documents == 30
    assert load_tokenizer(tmp_path / "o2").vocab_size == meta.vocab_size
    assert meta.n_train_tokens + meta.n_val_tokens < sum(len(json.loads(line)["body"]) for line in lines)

    pq.write_table(pa.table({"text": [f"parquet row {i}" for i in range(10)]}), tmp_path / "p.parquet")
    meta = from_files(tmp_path / "p.parquet", "parquet", tmp_path / "o3", "byte", 0, "text", 0.3)
    assert meta.n_documents == 10

    with pytest.raises(ValueError, match="already exists"):
        from_files(tmp_path / "p.parquet", "parquet", tmp_path / "o3", "byte", 0, "text", 0.3)
    with pytest.raises(ValueError, match="--format must be one of"):
        from_files(tmp_path / "p.parquet", "csv", tmp_path / "o4", "byte", 0, "text", 0.3)
    with pytest.raises(ValueError, match="expected a column 'body'"):
        from_files(tmp_path / "p.parquet", "parquet", tmp_path / "o5", "byte", 0, "body", 0.3)
    assert not (tmp_path / "o5").exists()
