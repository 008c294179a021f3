"""The data layer: documents -> tokens -> memory-mapped shards -> deterministic torch batches.

It lives under `models/` because `TokenDataset` yields torch tensors, and only `models/` and
`kernels/` touch torch. The dataset is imported lazily so that preparing a corpus
(`prepare`, which `reslab data prepare` runs) and reading a corpus manifest
(`prepared_meta`, used by `reslab plan`) need numpy, pyarrow and tokenizers (and `datasets` for a
hub stream) but never import torch.
"""

from typing import TYPE_CHECKING, Any

from reslab.models.data.corpus import (
    Document,
    hub_documents,
    jsonl_documents,
    parquet_documents,
    stdlib_documents,
    text_documents,
)
from reslab.models.data.prepare import (
    FORMAT_VERSION,
    RECIPES,
    Meta,
    PrepareOptions,
    cache_root,
    corpus_dir,
    corpus_fingerprint,
    corpus_path,
    is_val_document,
    prepare,
    prepare_command,
    prepare_stdlib,
    prepared_meta,
    read_meta,
    token_dtype,
)
from reslab.models.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "Document",
    "FORMAT_VERSION",
    "Meta",
    "PrepareOptions",
    "RECIPES",
    "TokenDataset",
    "Tokenizer",
    "cache_root",
    "corpus_dir",
    "corpus_fingerprint",
    "corpus_path",
    "hub_documents",
    "is_val_document",
    "jsonl_documents",
    "load_tokenizer",
    "parquet_documents",
    "prepare",
    "prepare_command",
    "prepare_stdlib",
    "prepared_meta",
    "read_meta",
    "stdlib_documents",
    "text_documents",
    "token_dtype",
    "train_bpe",
]

if TYPE_CHECKING:
    from reslab.models.data.dataset import TokenDataset


def __getattr__(name: str) -> Any:
    if name == "TokenDataset":
        from reslab.models.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'models.data' has no attribute {name!r}")
