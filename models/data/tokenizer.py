"""Tokenizers: raw UTF-8 bytes, a byte-level BPE trained with the `tokenizers` library, or a
pretrained checkpoint's own tokenizer (`hf`: the tokenizer files of a Hugging Face checkpoint
directory, read with `transformers.AutoTokenizer`, the eval extra).

Both reserve one end-of-text id (EOT). A corpus is the concatenation of each document's tokens
followed by EOT. A literal "<|endoftext|>" inside a document is ordinary text, never EOT.
A tokenizer saves itself to a directory (`tokenizer_info.json`, plus `tokenizer.json` for BPE)
and `load_tokenizer` reads it back from that directory or from a prepared corpus directory.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from reslab.common.errors import ConfigError
from reslab.models.data.corpus import Document

EOT_TEXT = "<|endoftext|>"
INFO_FILE = "tokenizer_info.json"
BPE_FILE = "tokenizer.json"


class Tokenizer(abc.ABC):
    """Text <-> token ids, with one reserved end-of-text id."""

    name: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def eot_id(self) -> int: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, without EOT."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids followed by EOT, as int64 arrays (the unit `prepare` writes)."""
        eot = self.eot_id
        return [np.array(ids + [eot], dtype=np.int64) for ids in self.encode_batch(texts)]

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; EOT renders as "<|endoftext|>"."""

    def info(self) -> dict:
        return {"tokenizer": self.name, "vocab_size": self.vocab_size, "eot_id": self.eot_id}

    def save(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / INFO_FILE).write_text(json.dumps(self.info(), indent=2) + "\n")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes 0..255 plus EOT = 256 (vocab 257)."""

    name = "byte"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eot_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_documents(self, texts: Sequence[str]) -> list[np.ndarray]:
        # Straight from the byte buffer: ~10x faster than going through Python int lists.
        out = []
        for text in texts:
            raw = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8)
            ids = np.empty(raw.size + 1, dtype=np.int64)
            ids[:-1] = raw
            ids[-1] = self.eot_id
            out.append(ids)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        parts: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i == self.eot_id:
                parts.append(buf.decode("utf-8", errors="replace") + EOT_TEXT)
                buf = bytearray()
            elif 0 <= i < 256:
                buf.append(i)
            else:
                raise ValueError(f"byte tokenizer: id {i} is outside 0..256")
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)


class BatchTokenizer(Tokenizer):
    """A tokenizer whose library encodes whole batches: one `encode` is a batch of one; `_eot` is set by
    the subclass's `__init__`."""

    _eot: int

    @property
    def eot_id(self) -> int:
        return self._eot

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    @abc.abstractmethod
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


class BPETokenizer(BatchTokenizer):
    """Byte-level BPE (GPT-2 style pre-tokenisation) wrapping a `tokenizers.Tokenizer`."""

    name = "bpe"

    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        # Match "<|endoftext|>" in input as plain text: EOT only ever comes from document joins.
        self._tok.encode_special_tokens = True
        eot = self._tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise ValueError(f"BPE tokenizer has no {EOT_TEXT!r} token")
        self._eot = eot

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        try:
            encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        except TypeError:  # lone surrogates cannot cross into Rust; replace them like the byte tokenizer
            texts = [t.encode("utf-8", errors="replace").decode("utf-8") for t in texts]
            encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self._tok.to_str()

    def save(self, directory: str | os.PathLike[str]) -> None:
        super().save(directory)
        self._tok.save(str(Path(directory) / BPE_FILE))


class HFTokenizer(BatchTokenizer):
    """A Hugging Face checkpoint's own tokenizer (`transformers.AutoTokenizer` on its directory,
    local files only). EOT is the tokenizer's `eos_token`; a document's ids are the tokenizer's
    encoding without special tokens (`add_special_tokens=False`), a literal special token in the
    text split as plain text, like the other tokenizers. `vocab_size` is `len(tokenizer)`: added
    tokens included, which may be fewer than the checkpoint's embedding rows (Qwen3 pads them)."""

    name = "hf"

    def __init__(self, directory: str | os.PathLike[str], where: str = "data.tokenizer") -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError(f"{where}: hf needs the transformers library; install the eval extra: "
                              "pip install 'reslab[eval]'") from None
        self.directory = Path(directory)
        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 (a damaged tokenizer.json raises the tokenizers library's bare Exception)
            detail = " ".join(str(exc).split())[:160]
            raise ConfigError(f"{where}: hf: {self.directory} holds no tokenizer transformers can load "
                              f"({type(exc).__name__}: {detail}); expected tokenizer.json + tokenizer_config.json, "
                              "whole") from None
        if self._tok.eos_token_id is None:
            raise ConfigError(f"{where}: hf: the tokenizer in {self.directory} has no eos_token; "
                              "a corpus ends every document with it")
        self._eot = int(self._tok.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = [t.encode("utf-8", errors="replace").decode("utf-8") for t in texts]
        return [list(ids) for ids in self._tok(texts, add_special_tokens=False,
                                                split_special_tokens=True)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike[str]) -> None:
        super().save(directory)
        self._tok.save_pretrained(str(directory))


def tokenizer_files_fingerprint(directory: str | os.PathLike[str]) -> str:
    """sha256 over a checkpoint directory's tokenizer files (names and bytes): what names an `hf`
    tokenizer in a corpus's cache name and manifest."""
    import hashlib

    h = hashlib.sha256()
    files = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name != INFO_FILE and (
        p.name.startswith(("tokenizer", "special_tokens")) or p.name in ("vocab.json", "merges.txt")))
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def train_bpe(documents: Iterable[Document | str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE with `vocab_size` ids (EOT included) on `documents`.

    Deterministic: the same documents in the same order give the same merges. A small corpus may
    yield fewer ids than asked for; `vocab_size` of the result is the true count.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"BPE vocab_size must be >= 257 (256 bytes + EOT), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = (d.text if isinstance(d, Document) else d for d in documents)
    tok.train_from_iterator(
        (t.encode("utf-8", errors="replace").decode("utf-8") for t in texts), trainer=trainer
    )
    return BPETokenizer(tok)


def load_tokenizer(dir_or_meta: str | os.PathLike[str]) -> Tokenizer:
    """Load the tokenizer saved in a directory (or named by its `meta.json`/`tokenizer_info.json`).

    Works on a directory written by `Tokenizer.save` and on a prepared corpus directory.
    """
    path = Path(dir_or_meta)
    directory = path.parent if path.is_file() else path
    for candidate in (path if path.is_file() else None, directory / INFO_FILE, directory / "meta.json"):
        if candidate is not None and candidate.is_file():
            info_path = candidate
            break
    else:
        raise ValueError(f"{directory}: no {INFO_FILE} or meta.json to load a tokenizer from")
    try:
        info = json.loads(info_path.read_text())
        name, vocab_size, eot_id = info["tokenizer"], info["vocab_size"], info["eot_id"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{info_path}: expected JSON with tokenizer, vocab_size, eot_id ({exc!r})") from None
    tok: Tokenizer
    if name == "byte":
        tok = ByteTokenizer()
    elif name == "hf":
        tok = HFTokenizer(directory, where=str(info_path))
    elif name == "bpe":
        bpe_path = directory / BPE_FILE
        if not bpe_path.is_file():
            raise ValueError(
                f"{directory}: BPE tokenizer named in {info_path.name} but {BPE_FILE} is missing"
            )
        tok = BPETokenizer.from_file(bpe_path)
    else:
        raise ValueError(f"{info_path}: unknown tokenizer {name!r}; expected 'byte', 'bpe' or 'hf'")
    if (tok.vocab_size, tok.eot_id) != (vocab_size, eot_id):
        raise ValueError(
            f"{info_path}: records vocab_size={vocab_size}, eot_id={eot_id} but the tokenizer has "
            f"vocab_size={tok.vocab_size}, eot_id={tok.eot_id}"
        )
    return tok
