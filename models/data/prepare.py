"""Tokenise documents into sharded, memory-mapped token files with a manifest (`meta.json`).

The layout of a prepared directory:
    train-00000.bin ...  every train document's ids followed by EOT, concatenated (uint16 or uint32);
                         a new shard starts once one holds `shard_tokens`, never inside a document
    val-00000.bin ...    the same for the validation documents
    meta.json            `Meta`: the manifest (dataset, revision, shards and their token counts,
                         tokenizer, token budget) and the corpus/tokens fingerprints
    tokenizer_info.json  (+ tokenizer.json for BPE) so the ids can be decoded again

The validation split is by document and depends only on each doc_id (sha256), never on corpus
order. The directory is written under a temporary name in the same parent and renamed into place,
so a crash never leaves a half-written corpus; `prepare_stdlib` adds a lock file so several
processes on one machine can ask for the same cached corpus at once.

Corpora live where a study can name them: `data.corpus: fineweb-edu-10bt` is the directory
`$RESLAB_CACHE/corpora/fineweb-edu-10bt` (`corpus_path`), written by
`reslab data prepare ... --corpus fineweb-edu-10bt`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Literal

import numpy as np

from reslab.common.io import cache_root, file_lock
from reslab.models.config import DataConfig
from reslab.models.data.corpus import Document, stdlib_documents, stdlib_root
from reslab.models.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, tokenizer_files_fingerprint, train_bpe

FORMAT_VERSION = 2
META_FILE = "meta.json"
SPLITS = ("train", "val")
# 2^28 tokens: 512 MiB of uint16 per shard, about 12 shards for FineWeb-Edu at 3B tokens
SHARD_TOKENS = 1 << 28
CORPUS_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")

# how to prepare the corpora the shipped studies name; `missing_corpus_message` prints it
RECIPES: dict[str, str] = {
    "fineweb-edu-10bt": (
        "reslab data prepare --hub HuggingFaceFW/fineweb-edu --name sample-10BT --split train --text-field text "
        "--tokens 9e9 --tokenizer bpe --vocab-size 32768 --bpe-docs 50000 --val-fraction 0.001 "
        "--corpus fineweb-edu-10bt"
    ),
}


@dataclass(frozen=True, kw_only=True)
class Meta:
    """Contents of `meta.json`: the manifest of a prepared corpus.

    `shards` maps each split to its `[file name, token count]` list in order; `dataset` says where
    the documents came from (`{"hub": ..., "name": ..., "split": ..., "revision": ..., "text_field":
    ...}` for a hub dataset, else null with `source` describing it); `token_budget` is the train
    token budget that stopped the stream (null: the whole source was read); `tokenizer_source`
    says what the BPE was trained on.
    """

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
    shards: dict[str, list[list]]
    dataset: dict[str, str | None] | None = None
    token_budget: int | None = None
    tokenizer_source: str = ""

    @property
    def fingerprint(self) -> str:
        """Short `corpus.tokens` fingerprint recorded with every run."""
        return f"{self.corpus_fingerprint[:16]}.{self.tokens_fingerprint[:16]}"

    def shard_files(self, split: str) -> list[tuple[str, int]]:
        return [(str(name), int(n)) for name, n in self.shards[split]]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, where: str = "meta") -> Meta:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = sorted(n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING)
        if missing:
            raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
        return cls(**{k: data[k] for k in fields if k in data})

    def write(self, directory: Path) -> None:
        (directory / META_FILE).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")


def read_meta(directory: str | os.PathLike[str]) -> Meta:
    """Read and sanity-check a prepared directory's `meta.json` (shard sizes must match the counts)."""
    path = Path(directory)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise ValueError(
            f"{path}: not a prepared corpus (no {META_FILE}); run `reslab data prepare` to create one"
        )
    try:
        raw = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{meta_path}: not valid JSON ({exc.msg})") from None
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{meta_path}: format_version {raw.get('format_version')}, this reslab reads {FORMAT_VERSION}; "
            "prepare the corpus again"
        )
    meta = Meta.from_dict(raw, where=str(meta_path))
    itemsize = np.dtype(meta.dtype).itemsize
    for split, total in (("train", meta.n_train_tokens), ("val", meta.n_val_tokens)):
        shards = meta.shard_files(split)
        if sum(n for _, n in shards) != total:
            raise ValueError(f"{meta_path}: the {split} shards do not add up to {total} tokens; the corpus is damaged")
        for name, n in shards:
            f = path / name
            if not f.is_file() or f.stat().st_size != n * itemsize:
                raise ValueError(
                    f"{f}: expected {n} {meta.dtype} tokens ({n * itemsize} bytes); the corpus is damaged"
                )
    return meta


def corpus_path(corpus: str) -> Path:
    """The directory `data.corpus` names: a bare name (`fineweb-edu-10bt`) is
    `$RESLAB_CACHE/corpora/<name>`; anything with a path separator, `~` or `.` in front is a path."""
    if CORPUS_NAME_RE.match(corpus) and os.sep not in corpus and "/" not in corpus:
        return cache_root() / "corpora" / corpus
    return Path(corpus).expanduser()


def prepare_command(corpus: str) -> str:
    """The command that prepares `corpus` (the recipe of a known name, else a template)."""
    if corpus in RECIPES:
        return RECIPES[corpus]
    target = f"--corpus {corpus}" if corpus_path(corpus).parent == cache_root() / "corpora" else f"--out {corpus}"
    return f"reslab data prepare FILES... --format parquet --tokenizer bpe --vocab-size 32768 {target}"


def missing_corpus_message(corpus: str) -> str:
    return f"data.corpus: {corpus!r} is not prepared ({corpus_path(corpus)} has no {META_FILE}); prepare it with: " \
        f"{prepare_command(corpus)}"


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


class _ShardWriter:
    """Appends documents to `<split>-00000.bin`, starting a new shard before a document once the
    current one holds `shard_tokens`; a document never spans two shards."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards: list[list] = []
        self._fh: BinaryIO | None = None

    @property
    def n_tokens(self) -> int:
        return sum(n for _, n in self.shards)

    def write(self, documents: list[np.ndarray]) -> list[tuple[int, int]]:
        """Write each document's ids; return each one's (shard index, offset in that shard)."""
        where: list[tuple[int, int]] = []
        pending: list[np.ndarray] = []
        for ids in documents:
            if self._fh is None or self.shards[-1][1] >= self.shard_tokens:
                self._flush(pending)
                pending = []
                self.close()
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._fh = open(self.directory / name, "wb")  # noqa: SIM115 - closed by close(), across calls
                self.shards.append([name, 0])
            where.append((len(self.shards) - 1, self.shards[-1][1]))
            pending.append(ids)
            self.shards[-1][1] += ids.size
        self._flush(pending)
        return where

    def _flush(self, pending: list[np.ndarray]) -> None:
        if pending:
            assert self._fh is not None
            np.concatenate(pending).astype(self.dtype).tofile(self._fh)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _move_doc_to_val(tmp: Path, train: _ShardWriter, val: _ShardWriter, doc: tuple[int, int, int]) -> None:
    """Move one train document (shard index, offset, length) to the validation split (the
    at-least-one-val fallback). A document never spans two shards."""
    shard, start, length = doc
    name = train.shards[shard][0]
    src = np.fromfile(tmp / name, dtype=train.dtype)
    val.write([src[start : start + length]])
    np.concatenate([src[:start], src[start + length :]]).tofile(tmp / name)
    train.shards[shard][1] -= length


@dataclass(frozen=True, kw_only=True)
class PrepareOptions:
    """How `prepare` tokenises and writes a corpus.

    `tokenizer` encodes every document. A document goes to validation when `split_hash(doc_id) <
    val_fraction`. `source_description`, `dataset` and `tokenizer_source` are recorded in the
    manifest (`Meta.source`, `Meta.dataset`, `Meta.tokenizer_source`). `overwrite` replaces an
    existing output directory. The stream is read in chunks of about `chunk_chars` characters.
    `max_train_tokens` is the train token budget (None: read the whole stream); `shard_tokens` the
    tokens after which a new shard file starts.
    """

    tokenizer: Tokenizer
    val_fraction: float
    source_description: str
    overwrite: bool = False
    chunk_chars: int = 1 << 22
    max_train_tokens: int | None = None
    shard_tokens: int = SHARD_TOKENS
    dataset: dict[str, str | None] | None = None
    tokenizer_source: str = ""


@dataclass
class _Tally:
    """What the stream has written so far: the corpus hash, the document counts, the train tokens
    (for the budget) and the train document with the smallest split hash, as (hash, (shard, offset,
    length)), which the at-least-one-val fallback moves."""

    hasher: CorpusHasher = field(default_factory=CorpusHasher)
    n_docs: int = 0
    n_val_docs: int = 0
    train_tokens_seen: int = 0
    smallest: tuple[float, tuple[int, int, int]] | None = None


def prepare(
    documents: Iterable[Document],
    out_dir: str | os.PathLike[str],
    options: PrepareOptions,
    progress: Callable[[int, int], None] | None = None,
) -> Meta:
    """Tokenise `documents` into `out_dir` (train/val shards, meta.json, tokenizer files).

    A document goes to validation when `split_hash(doc_id) < options.val_fraction`; if none does,
    the document with the smallest hash does, so the rule stays order-independent. Streams in
    chunks. With a token budget `options.max_train_tokens` the corpus is the shortest prefix of
    `documents` whose train documents hold at least that many tokens (the same prefix whatever the
    chunk size); the rest of the stream is never read past that chunk. `progress(documents, train
    tokens)` is called after every chunk. `out_dir` must not exist unless `options.overwrite`.
    """
    _check_options(options)
    out = Path(out_dir)
    if out.exists() and not options.overwrite:
        raise ValueError(f"{out}: already exists; remove it or prepare with overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(options.tokenizer.vocab_size)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    writers = {split: _ShardWriter(tmp, split, dtype, options.shard_tokens) for split in SPLITS}
    try:
        tally = _write_stream(documents, writers, options, progress)
        _settle_validation(tmp, writers, tally, options.val_fraction)
        options.tokenizer.save(tmp)
        meta = _manifest(tmp, writers, tally, options)
        meta.write(tmp)
        _install(tmp, out)
        return meta
    finally:
        for w in writers.values():
            w.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _check_options(options: PrepareOptions) -> None:
    if not 0 < options.val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {options.val_fraction}")
    if options.max_train_tokens is not None and options.max_train_tokens < 1:
        raise ValueError(f"--tokens: the token budget must be >= 1, got {options.max_train_tokens}")
    if options.shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {options.shard_tokens}")


def _write_stream(
    documents: Iterable[Document],
    writers: dict[str, _ShardWriter],
    options: PrepareOptions,
    progress: Callable[[int, int], None] | None,
) -> _Tally:
    """Encode and write `documents` chunk by chunk until the stream ends or the budget is reached."""
    tally = _Tally()
    tokenizer = options.tokenizer
    for chunk in _chunks(documents, options.chunk_chars, 4096):
        parts, train_hashes, budget_reached = _split_chunk(chunk, options, tally)
        for split, arrays in parts.items():
            if not arrays:
                continue
            lo, hi = min(a.min() for a in arrays), max(a.max() for a in arrays)
            if lo < 0 or hi >= tokenizer.vocab_size:
                raise ValueError(f"tokenizer {tokenizer.name!r} produced an id outside 0..{tokenizer.vocab_size - 1}")
            where = writers[split].write(arrays)
            if split == "train":
                i = int(np.argmin(train_hashes))
                if tally.smallest is None or train_hashes[i] < tally.smallest[0]:
                    tally.smallest = (train_hashes[i], (*where[i], arrays[i].size))
        if progress is not None:
            progress(tally.n_docs, tally.train_tokens_seen)
        if budget_reached:
            break
    return tally


def _split_chunk(
    chunk: list[Document], options: PrepareOptions, tally: _Tally
) -> tuple[dict[str, list[np.ndarray]], list[float], bool]:
    """Encode one chunk and sort its documents into train and val, counting them in `tally`;
    returns the ids per split, the train documents' split hashes, and whether the budget was reached
    (the chunk's documents after that one are dropped)."""
    encoded = options.tokenizer.encode_documents([d.text for d in chunk])
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    train_hashes: list[float] = []
    for doc, ids in zip(chunk, encoded, strict=True):
        tally.hasher.update(doc)
        tally.n_docs += 1
        h = split_hash(doc.doc_id)
        if h < options.val_fraction:
            parts["val"].append(ids)
            tally.n_val_docs += 1
            continue
        parts["train"].append(ids)
        train_hashes.append(h)
        tally.train_tokens_seen += ids.size
        if options.max_train_tokens is not None and tally.train_tokens_seen >= options.max_train_tokens:
            return parts, train_hashes, True
    return parts, train_hashes, False


def _settle_validation(tmp: Path, writers: dict[str, _ShardWriter], tally: _Tally, val_fraction: float) -> None:
    """Close the shards and make the split usable: at least 2 documents, at least one of them in
    validation (the fallback moves the smallest-hash train document) and at least one in train."""
    for w in writers.values():
        w.close()
    if tally.n_docs < 2:
        raise ValueError(f"need at least 2 documents for a train/validation split, got {tally.n_docs}")
    if tally.n_val_docs == 0:
        assert tally.smallest is not None
        _move_doc_to_val(tmp, writers["train"], writers["val"], tally.smallest[1])
        writers["val"].close()
        tally.n_val_docs = 1
    if tally.n_val_docs == tally.n_docs:
        raise ValueError(
            f"all {tally.n_docs} documents fell into validation at val_fraction={val_fraction}; lower it"
        )


def _manifest(tmp: Path, writers: dict[str, _ShardWriter], tally: _Tally, options: PrepareOptions) -> Meta:
    tokenizer = options.tokenizer
    shards = {split: w.shards for split, w in writers.items()}
    return Meta(
        format_version=FORMAT_VERSION,
        tokenizer=tokenizer.name,
        vocab_size=tokenizer.vocab_size,
        eot_id=tokenizer.eot_id,
        dtype=writers["train"].dtype.name,
        n_train_tokens=writers["train"].n_tokens,
        n_val_tokens=writers["val"].n_tokens,
        n_documents=tally.n_docs,
        n_val_documents=tally.n_val_docs,
        corpus_fingerprint=tally.hasher.hexdigest(),
        tokens_fingerprint=_file_sha256([tmp / name for split in SPLITS for name, _ in shards[split]]),
        val_fraction=options.val_fraction,
        source=options.source_description,
        shards=shards,
        dataset=options.dataset,
        token_budget=options.max_train_tokens,
        tokenizer_source=options.tokenizer_source,
    )


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


def train_documents(documents: Iterable[Document], val_fraction: float) -> Iterator[Document]:
    return (d for d in documents if not is_val_document(d.doc_id, val_fraction))


def stdlib_dir_name(
    corpus_fp: str, *, tokenizer: str, bpe_vocab_size: int, val_fraction: float, include_tests: bool,
    tokenizer_path: str | None = None,
) -> str:
    vocab = f"-{bpe_vocab_size}" if tokenizer == "bpe" else ""
    if tokenizer == "hf":  # named by the tokenizer files' hash: another checkpoint's tokenizer is another corpus
        vocab = f"-{tokenizer_files_fingerprint(Path(tokenizer_path or '.').expanduser())[:12]}"
    tests = "tests" if include_tests else "notests"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"stdlib-{py}-{tokenizer}{vocab}-{tests}-val{val_fraction:g}-{corpus_fp[:12]}"


def prepare_stdlib(
    root: str | os.PathLike[str],
    *,
    tokenizer: Literal["byte", "bpe", "hf"] = "byte",
    bpe_vocab_size: int = 4096,
    val_fraction: float = 0.02,
    include_tests: bool = False,
    tokenizer_path: str | None = None,
) -> tuple[Path, Meta]:
    """Prepare (once) and return the stdlib corpus cached under `root`. BPE is trained on the
    train split only; `hf` is the checkpoint tokenizer in `tokenizer_path`."""
    docs = list(stdlib_documents(include_tests))
    fp = corpus_fingerprint(docs)
    name = stdlib_dir_name(
        fp, tokenizer=tokenizer, bpe_vocab_size=bpe_vocab_size, val_fraction=val_fraction,
        include_tests=include_tests, tokenizer_path=tokenizer_path,
    )
    out = Path(root) / name

    def accept(meta: Meta) -> bool:
        return (meta.corpus_fingerprint, meta.tokenizer, meta.val_fraction) == (fp, tokenizer, val_fraction)

    def build(path: Path) -> Meta:
        tok: Tokenizer
        if tokenizer == "byte":
            tok = ByteTokenizer()
        elif tokenizer == "bpe":
            tok = train_bpe(train_documents(docs, val_fraction), bpe_vocab_size)
        elif tokenizer == "hf":
            tok = HFTokenizer(Path(tokenizer_path or ".").expanduser())
        else:
            raise ValueError(f"tokenizer must be 'byte', 'bpe' or 'hf', got {tokenizer!r}")
        tests = "with" if include_tests else "without"
        source = f"python {sys.version.split()[0]} standard library at {stdlib_root()} ({tests} tests)"
        options = PrepareOptions(tokenizer=tok, val_fraction=val_fraction, source_description=source, overwrite=True,
                                 tokenizer_source=hf_tokenizer_source(tokenizer_path) if tokenizer == "hf" else "")
        return prepare(docs, path, options)

    return out, prepare_if_missing(out, build, accept)


def hf_tokenizer_source(tokenizer_path: str | None) -> str:
    """What a corpus's manifest records of an `hf` tokenizer (`Meta.tokenizer_source`): its directory
    and the sha256 of its files, which `TokenDataset.open` compares with the run's."""
    path = Path(tokenizer_path or ".").expanduser()
    return f"hf:{path} sha256:{tokenizer_files_fingerprint(path)}"


def hub_revision(dataset: str, revision: str | None) -> str | None:
    """The commit a hub dataset resolves to (what the manifest records), `local` for a folder, or
    the requested revision when the hub cannot be asked (offline)."""
    if Path(dataset).expanduser().is_dir():
        return "local"
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(dataset, revision=revision).sha or revision
    except Exception:  # offline, or no hub client: the revision is a record, not a requirement
        return revision


def corpus_dir(data: DataConfig) -> Path:
    """Where the corpus of `data` lives: the stdlib corpus in `$RESLAB_CACHE/data/` (named by its
    fingerprint, so this reads the stdlib sources), any other by `corpus_path`."""
    if data.corpus != "stdlib":
        return corpus_path(data.corpus)
    fp = corpus_fingerprint(stdlib_documents(data.include_tests))
    name = stdlib_dir_name(
        fp, tokenizer=data.tokenizer, bpe_vocab_size=data.bpe_vocab_size, val_fraction=data.val_fraction,
        include_tests=data.include_tests, tokenizer_path=data.tokenizer_path,
    )
    return cache_root() / "data" / name


def prepared_meta(data: DataConfig) -> Meta | None:
    """The manifest of the corpus `data` names, or None when it is not prepared yet (the stdlib
    corpus is prepared on first use; any other needs `reslab data prepare`)."""
    path = corpus_dir(data)
    if not (path / META_FILE).is_file():
        return None
    return read_meta(path)
