"""What `reslab data prepare` runs: its flags, as a `PrepareRequest`, turned into one
`models.data.prepare` call.

`prepare_corpus` checks the flags together (each message names the flag), opens the documents
(files read as text, JSONL or Parquet, or a Hugging Face dataset streamed with `--hub`), builds
the tokenizer (BPE trained on the train-split documents) and hands both to `prepare`. It raises
`ValueError` with a one-line message for anything the user asked wrongly; the CLI reports that as
a usage error.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from reslab.models.data.corpus import (
    Document,
    hub_documents,
    jsonl_documents,
    parquet_documents,
    text_documents,
)
from reslab.models.data.prepare import (
    SHARD_TOKENS,
    Meta,
    PrepareOptions,
    hf_tokenizer_source,
    hub_revision,
    prepare,
    train_documents,
)
from reslab.models.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, train_bpe

FORMATS = ("text", "jsonl", "parquet")


@dataclass(frozen=True, kw_only=True)
class PrepareRequest:
    """One `reslab data prepare`: read `inputs` as `fmt` (or stream the Hugging Face dataset `hub`,
    config `hub_name`, split `split` at `revision`, documents named by its `id_field` column),
    tokenise, write `out_dir`, stopping at `max_tokens` train tokens.

    `text_field` is the JSONL field, Parquet or hub column (ignored for text); `vocab_size` only
    applies to BPE, which is trained on the train-split documents among the first `bpe_docs`
    documents (all documents when None; a hub stream needs a number). `shard_tokens` is the shard
    size and `overwrite` replaces an existing `out_dir`.
    """

    out_dir: str | os.PathLike[str]
    inputs: tuple[str, ...] | list[str] = ()
    fmt: Literal["text", "jsonl", "parquet"] = "text"
    tokenizer: Literal["byte", "bpe", "hf"] = "byte"
    vocab_size: int = 4096
    tokenizer_path: str | None = None  # `hf`: a Hugging Face checkpoint directory holding its tokenizer files
    text_field: str = "text"
    val_fraction: float = 0.02
    overwrite: bool = False
    hub: str | None = None
    hub_name: str | None = None
    split: str = "train"
    revision: str | None = None
    id_field: str = "id"
    max_tokens: int | None = None
    bpe_docs: int | None = None
    shard_tokens: int = SHARD_TOKENS


def prepare_corpus(request: PrepareRequest, progress: Callable[[int, int], None] | None = None) -> Meta:
    """Prepare the corpus `request` asks for; `progress` is handed to `prepare`. Prints nothing."""
    _check(request)
    if request.hub is not None:
        documents = hub_documents(
            request.hub, name=request.hub_name, split=request.split, text_field=request.text_field,
            id_field=request.id_field, revision=request.revision,
        )
    else:
        documents = _read_files(request)
    dataset = _dataset_record(request)
    tokenizer, documents, tokenizer_source = _tokenizer(request, documents)
    options = PrepareOptions(
        tokenizer=tokenizer, val_fraction=request.val_fraction, source_description=_source(request),
        overwrite=request.overwrite, max_train_tokens=request.max_tokens, shard_tokens=request.shard_tokens,
        dataset=dataset, tokenizer_source=tokenizer_source,
    )
    return prepare(documents, Path(request.out_dir), options, progress=progress)


def _check(r: PrepareRequest) -> None:
    """The checks across flags, before anything is read (BPE training can take minutes)."""
    if r.hub is None and not r.inputs:
        raise ValueError("no inputs given; name files or directories, or a dataset with --hub")
    if r.hub is not None and r.inputs:
        raise ValueError(f"--hub {r.hub}: reads the dataset, not files; drop the inputs {' '.join(r.inputs)}")
    if r.hub is not None and r.tokenizer == "bpe" and r.bpe_docs is None:
        raise ValueError("--bpe-docs: a hub stream trains its BPE on its first N documents; give N (e.g. 50000)")
    if r.bpe_docs is not None and r.bpe_docs < 2:
        raise ValueError(f"--bpe-docs: must be >= 2, got {r.bpe_docs}")
    if r.max_tokens is not None and r.max_tokens < 1:
        raise ValueError(f"--tokens: the token budget must be >= 1, got {r.max_tokens}")
    if r.fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {r.fmt!r}")
    if not 0 < r.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in (0, 1), got {r.val_fraction}")
    if r.tokenizer not in ("byte", "bpe", "hf"):
        raise ValueError(f"--tokenizer must be 'byte', 'bpe' or 'hf', got {r.tokenizer!r}")
    if (r.tokenizer == "hf") != (r.tokenizer_path is not None):
        raise ValueError("--tokenizer-path: give it with --tokenizer hf (a checkpoint directory), and only then")
    out = Path(r.out_dir)
    if out.exists() and not r.overwrite:
        raise ValueError(f"{out}: already exists; remove it or prepare with overwrite")


def _read_files(r: PrepareRequest) -> Iterator[Document]:
    if r.fmt == "jsonl":
        return jsonl_documents(r.inputs, r.text_field)
    if r.fmt == "parquet":
        return parquet_documents(r.inputs, r.text_field)
    return text_documents(r.inputs)


def _source(r: PrepareRequest) -> str:
    """The manifest's `source`: where the documents came from, in words."""
    if r.hub is not None:
        name = f" ({r.hub_name})" if r.hub_name else ""
        return f"hub {r.hub}{name}, split {r.split!r}, field {r.text_field!r}"
    field = f", field {r.text_field!r}" if r.fmt != "text" else ""
    return f"{r.fmt}{field}: {', '.join(str(i) for i in r.inputs)}"


def _dataset_record(r: PrepareRequest) -> dict[str, str | None] | None:
    """The manifest's `dataset` for a hub stream (with the commit its revision resolves to), else None."""
    if r.hub is None:
        return None
    return {"hub": r.hub, "name": r.hub_name, "split": r.split, "revision": hub_revision(r.hub, r.revision),
            "text_field": r.text_field}


def _tokenizer(r: PrepareRequest, documents: Iterator[Document]) -> tuple[Tokenizer, Iterator[Document], str]:
    """(tokenizer, the documents to prepare, the manifest's `tokenizer_source`). BPE trains on the
    train-split documents: of a second read of the files, or of the stream's first `bpe_docs`,
    which are put back in front of the stream."""
    if r.tokenizer == "byte":
        return ByteTokenizer(), documents, ""
    if r.tokenizer == "hf":
        assert r.tokenizer_path is not None
        return HFTokenizer(Path(r.tokenizer_path).expanduser(), "--tokenizer"), documents, \
            hf_tokenizer_source(r.tokenizer_path)
    if r.bpe_docs is None:
        tokenizer = train_bpe(train_documents(_read_files(r), r.val_fraction), r.vocab_size)
        return tokenizer, documents, "every train document"
    head = list(itertools.islice(documents, r.bpe_docs))
    tokenizer = train_bpe(train_documents(head, r.val_fraction), r.vocab_size)
    source = f"the train documents among the first {len(head)} of the stream"
    return tokenizer, itertools.chain(head, documents), source
