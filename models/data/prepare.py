"""Tokenise documents into nanoGPT-style flat token files: `train.bin`, `val.bin`, `meta.json`.

The layout of a prepared directory:
    train.bin, val.bin   every document's ids followed by EOT, concatenated (uint16 or uint32)
    meta.json            `Meta`: counts, dtype, tokenizer and the corpus/tokens fingerprints
    tokenizer_info.json  (+ tokenizer.json for BPE) so the ids can be decoded again

The validation split is by document and depends only on each doc_id (sha256), never on corpus
order. The directory is written under a temporary name in the same parent and renamed into place,
so a crash never leaves a half-written corpus; `prepare_stdlib` adds a lock file so several
processes on one machine can ask for the same cached corpus at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from reslab.models.data.corpus import (
    Document,
    jsonl_documents,
    parquet_documents,
    stdlib_documents,
    stdlib_root,
    text_documents,
)
from reslab.models.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe

FORMAT_VERSION = 1
META_FILE = "meta.json"
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"


@dataclass(frozen=True, kw_only=True)
class Meta:
    """Contents of `meta.json`."""

    format_version: int
    tokenizer: str
    vocab_size: int
    eot_id: int
    dtype: str
    n_train_tokens: int
    n_val_tokens: int
    n_documents: int
    n_val_documents: int
    corpus_fingerprint: str
    tokens_fingerprint: str
    val_fraction: float
    source: str

    @property
    def fingerprint(self) -> str:
        """Short `corpus.tokens` fingerprint recorded with every run."""
        return f"{self.corpus_fingerprint[:16]}.{self.tokens_fingerprint[:16]}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "meta") -> Meta:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data))
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
        return cls(**{k: data[k] for k in names})

    def write(self, directory: Path) -> None:
        (directory / META_FILE).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | os.PathLike[str]) -> Meta:
    """Read and sanity-check a prepared directory's `meta.json` (file sizes must match the counts)."""
    path = Path(directory)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise ValueError(
            f"{path}: not a prepared corpus (no {META_FILE}); run `reslab data prepare` to create one"
        )
    try:
        meta = Meta.from_dict(json.loads(meta_path.read_text()), where=str(meta_path))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path}: not valid JSON ({exc.msg})") from None
    if meta.format_version != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version {meta.format_version}, this reslab reads {FORMAT_VERSION}; "
            "prepare the corpus again"
        )
    itemsize = np.dtype(meta.dtype).itemsize
    for name, n in ((TRAIN_FILE, meta.n_train_tokens), (VAL_FILE, meta.n_val_tokens)):
        f = path / name
        if not f.is_file() or f.stat().st_size != n * itemsize:
            raise ValueError(
                f"{f}: expected {n} {meta.dtype} tokens ({n * itemsize} bytes); the corpus is damaged"
            )
    return meta


# ----------------------------------------------------------------------------- split and hashes


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def split_hash(doc_id: str) -> float:
    """A stable number in [0, 1) from the doc_id alone (sha256; Python's hash() is salted)."""
    digest = hashlib.sha256(doc_id.encode("utf-8", errors="surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_val_document(doc_id: str, val_fraction: float) -> bool:
    return split_hash(doc_id) < val_fraction


class CorpusHasher:
    """sha256 over each (doc_id, text) in order, length-prefixed so boundaries are unambiguous."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, doc: Document) -> None:
        for s in (doc.doc_id, doc.text):
            raw = s.encode("utf-8", errors="surrogatepass")
            self._h.update(len(raw).to_bytes(8, "little"))
            self._h.update(raw)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def corpus_fingerprint(documents: Iterable[Document]) -> str:
    h = CorpusHasher()
    for doc in documents:
        h.update(doc)
    return h.hexdigest()


def _file_sha256(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- writing


def _chunks(documents: Iterable[Document], max_chars: int, max_docs: int) -> Iterator[list[Document]]:
    chunk: list[Document] = []
    chars = 0
    for doc in documents:
        if not isinstance(doc, Document):
            raise TypeError(f"prepare: expected Document items, got {type(doc).__name__}")
        chunk.append(doc)
        chars += len(doc.text)
        if chars >= max_chars or len(chunk) >= max_docs:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _move_doc_to_val(tmp: Path, start: int, length: int, dtype: np.dtype) -> None:
    """Move tokens [start, start+length) of train.bin to val.bin (the at-least-one-val fallback)."""
    src = np.memmap(tmp / TRAIN_FILE, dtype=dtype, mode="r")
    src[start : start + length].tofile(tmp / VAL_FILE)
    step = 1 << 24
    with open(tmp / "train.new", "wb") as fh:
        for lo, hi in ((0, start), (start + length, src.size)):
            for i in range(lo, hi, step):
                src[i : min(hi, i + step)].tofile(fh)
    del src
    os.replace(tmp / "train.new", tmp / TRAIN_FILE)


def prepare(
    documents: Iterable[Document],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: Tokenizer,
    val_fraction: float,
    source_description: str,
    overwrite: bool = False,
    chunk_chars: int = 1 << 22,
) -> Meta:
    """Tokenise `documents` into `out_dir` (train.bin, val.bin, meta.json, tokenizer files).

    A document goes to validation when `split_hash(doc_id) < val_fraction`; if none does, the
    document with the smallest hash does, so the rule stays order-independent. Streams in chunks
    of about `chunk_chars` characters. `out_dir` must not exist unless `overwrite`.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists; remove it or prepare with overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hasher = CorpusHasher()
        n_tokens = {"train": 0, "val": 0}
        n_docs = n_val_docs = 0
        smallest: tuple[float, int, int] | None = None  # (hash, train offset, length) over train docs
        with open(tmp / TRAIN_FILE, "wb") as f_train, open(tmp / VAL_FILE, "wb") as f_val:
            files = {"train": f_train, "val": f_val}
            for chunk in _chunks(documents, chunk_chars, 4096):
                encoded = tokenizer.encode_documents([d.text for d in chunk])
                parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
                offset = n_tokens["train"]
                for doc, ids in zip(chunk, encoded, strict=True):
                    hasher.update(doc)
                    h = split_hash(doc.doc_id)
                    if h < val_fraction:
                        parts["val"].append(ids)
                        n_val_docs += 1
                    else:
                        if smallest is None or h < smallest[0]:
                            smallest = (h, offset, ids.size)
                        parts["train"].append(ids)
                        offset += ids.size
                n_docs += len(chunk)
                for split, arrays in parts.items():
                    if not arrays:
                        continue
                    flat = np.concatenate(arrays)
                    if flat.min() < 0 or flat.max() >= tokenizer.vocab_size:
                        raise ValueError(
                            f"tokenizer {tokenizer.name!r} produced an id outside 0..{tokenizer.vocab_size - 1}"
                        )
                    flat.astype(dtype).tofile(files[split])
                    n_tokens[split] += flat.size
        if n_docs < 2:
            raise ValueError(f"need at least 2 documents for a train/validation split, got {n_docs}")
        if n_val_docs == 0:
            assert smallest is not None
            _, start, length = smallest
            _move_doc_to_val(tmp, start, length, dtype)
            n_tokens["train"] -= length
            n_tokens["val"] = length
            n_val_docs = 1
        if n_val_docs == n_docs:
            raise ValueError(
                f"all {n_docs} documents fell into validation at val_fraction={val_fraction}; lower it"
            )
        tokenizer.save(tmp)
        meta = Meta(
            format_version=FORMAT_VERSION,
            tokenizer=tokenizer.name,
            vocab_size=tokenizer.vocab_size,
            eot_id=tokenizer.eot_id,
            dtype=dtype.name,
            n_train_tokens=n_tokens["train"],
            n_val_tokens=n_tokens["val"],
            n_documents=n_docs,
            n_val_documents=n_val_docs,
            corpus_fingerprint=hasher.hexdigest(),
            tokens_fingerprint=_file_sha256([tmp / TRAIN_FILE, tmp / VAL_FILE]),
            val_fraction=val_fraction,
            source=source_description,
        )
        meta.write(tmp)
        _install(tmp, out)
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished temp dir to `out`, moving any previous `out` aside first."""
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a shared cache should be readable like any dir
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """Exclusive advisory lock (fcntl.flock) held for the `with` body; the lock file is kept."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def prepare_if_missing(
    out_dir: str | os.PathLike[str],
    build: Callable[[Path], Meta],
    accept: Callable[[Meta], bool] = lambda meta: True,
) -> Meta:
    """Return the meta of `out_dir` if it is prepared and `accept`ed, else run `build(out_dir)`
    (which must write it with overwrite) under a lock so concurrent callers prepare it once."""
    out = Path(out_dir)

    def current() -> Meta | None:
        try:
            meta = read_meta(out)
        except ValueError:
            return None
        return meta if accept(meta) else None

    if (meta := current()) is not None:
        return meta
    with file_lock(out.with_name(out.name + ".lock")):
        if (meta := current()) is not None:
            return meta
        return build(out)


# ----------------------------------------------------------------------------- entry points


def _train_documents(documents: Iterable[Document], val_fraction: float) -> Iterator[Document]:
    return (d for d in documents if not is_val_document(d.doc_id, val_fraction))


def stdlib_dir_name(
    corpus_fp: str, *, tokenizer: str, bpe_vocab_size: int, val_fraction: float, include_tests: bool
) -> str:
    vocab = f"-{bpe_vocab_size}" if tokenizer == "bpe" else ""
    tests = "tests" if include_tests else "notests"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"stdlib-{py}-{tokenizer}{vocab}-{tests}-val{val_fraction:g}-{corpus_fp[:12]}"


def prepare_stdlib(
    root: str | os.PathLike[str],
    *,
    tokenizer: Literal["byte", "bpe"] = "byte",
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.02,
    include_tests: bool = False,
) -> tuple[Path, Meta]:
    """Prepare (once) and return the stdlib corpus cached under `root`. BPE is trained on the
    train split only."""
    docs = list(stdlib_documents(include_tests))
    fp = corpus_fingerprint(docs)
    name = stdlib_dir_name(
        fp, tokenizer=tokenizer, bpe_vocab_size=bpe_vocab_size, val_fraction=val_fraction,
        include_tests=include_tests,
    )
    out = Path(root) / name

    def accept(meta: Meta) -> bool:
        return (meta.corpus_fingerprint, meta.tokenizer, meta.val_fraction) == (fp, tokenizer, val_fraction)

    def build(path: Path) -> Meta:
        tok: Tokenizer
        if tokenizer == "byte":
            tok = ByteTokenizer()
        elif tokenizer == "bpe":
            tok = train_bpe(_train_documents(docs, val_fraction), bpe_vocab_size)
        else:
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
        tests = "with" if include_tests else "without"
        source = f"python {sys.version.split()[0]} standard library at {stdlib_root()} ({tests} tests)"
        return prepare(
            docs, path, tokenizer=tok, val_fraction=val_fraction, source_description=source, overwrite=True
        )

    return out, prepare_if_missing(out, build, accept)


def prepare_from_cli(
    inputs: list[str],
    fmt: Literal["text", "jsonl", "parquet"],
    out_dir: str | os.PathLike[str],
    tokenizer: Literal["byte", "bpe"],
    vocab_size: int,
    text_field: str,
    val_fraction: float,
    overwrite: bool = False,
) -> Meta:
    """What `reslab data prepare` runs: read `inputs` as `fmt`, tokenise, write `out_dir`.

    `text_field` is the JSONL field or Parquet column (ignored for text); `vocab_size` only
    applies to BPE, which is trained on the train split of the same documents. Prints nothing.
    """
    if not inputs:
        raise ValueError("no inputs given")
    readers: dict[str, Callable[[], Iterator[Document]]] = {
        "text": lambda: text_documents(inputs),
        "jsonl": lambda: jsonl_documents(inputs, text_field),
        "parquet": lambda: parquet_documents(inputs, text_field),
    }
    if fmt not in readers:
        raise ValueError(f"format must be one of {', '.join(readers)}, got {fmt!r}")
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out}: already exists; remove it or prepare with overwrite")
    read = readers[fmt]
    tok: Tokenizer
    if tokenizer == "byte":
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        tok = train_bpe(_train_documents(read(), val_fraction), vocab_size)
    else:
        raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
    field = f", field {text_field!r}" if fmt != "text" else ""
    source = f"{fmt}{field}: {', '.join(str(i) for i in inputs)}"
    return prepare(
        read(), out, tokenizer=tok, val_fraction=val_fraction, source_description=source, overwrite=overwrite
    )
