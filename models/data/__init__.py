"""The data layer: documents -> tokens -> memory-mapped shards -> deterministic torch batches.

It lives under `models/` because `TokenDataset` yields torch tensors, and only `models/` and
`kernels/` touch torch. The dataset is imported lazily so that preparing a corpus
(`prepare_from_cli`, used by `reslab data prepare`) needs numpy, pyarrow and tokenizers but
never imports torch.
"""

from typing import TYPE_CHECKING, Any

from reslab.models.data.corpus import (
    Document,
    jsonl_documents,
    parquet_documents,
    stdlib_documents,
    text_documents,
)
from reslab.models.data.prepare import (
    FORMAT_VERSION,
    Meta,
    corpus_fingerprint,
    is_val_document,
    prepare,
    prepare_from_cli,
    prepare_stdlib,
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
    "TokenDataset",
    "Tokenizer",
    "cache_root",
    "corpus_fingerprint",
    "is_val_document",
    "jsonl_documents",
    "load_tokenizer",
    "parquet_documents",
    "prepare",
    "prepare_from_cli",
    "prepare_stdlib",
    "read_meta",
    "stdlib_documents",
    "text_documents",
    "token_dtype",
    "train_bpe",
]

if TYPE_CHECKING:
    from reslab.models.data.dataset import TokenDataset, cache_root


def __getattr__(name: str) -> Any:
    if name in ("TokenDataset", "cache_root"):
        from reslab.models.data import dataset

        return getattr(dataset, name)
    raise AttributeError(f"module 'models.data' has no attribute {name!r}")
