"""Document sources: the interpreter's own standard library (offline, always present), readers
for user corpora (plain text files, JSON Lines, Parquet in the FineWeb-Edu layout) and a Hugging
Face dataset streamed through `datasets` (`hub_documents`).

Every reader yields `Document(doc_id, text)` in a deterministic order. `doc_id` never contains an
absolute path, so the by-document validation split and the corpus fingerprint do not depend on
where the files live: stdlib files are named by their path relative to the stdlib root, user
files by their base name (files given directly) or `<dir name>/<relative path>` (directories).
Bad input raises `ValueError` naming the file, the line or row, and what was expected.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

PathLike = str | os.PathLike[str]

TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})
TEXT_SUFFIXES = (".txt", ".md", ".py")


@dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def _scrub(text: str) -> str:
    """Replace lone surrogates (legal in JSON, not encodable as UTF-8) with '?'."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", errors="replace").decode("utf-8")


# ----------------------------------------------------------------------------- stdlib


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_excluded_dir(name: str, include_tests: bool) -> bool:
    if name in ("site-packages", "dist-packages", "__pycache__"):
        return True
    # config-3.x-<platform>/ holds build-specific helpers that embed install paths; skipping it
    # (and _sysconfigdata_*.py below) keeps the corpus identical across installs of one version.
    if name.startswith("config-"):
        return True
    return not include_tests and name in TEST_DIR_NAMES


def stdlib_files(include_tests: bool = False) -> list[tuple[str, Path]]:
    """`(relative posix path, absolute path)` of every stdlib `.py` file, sorted by relative path."""
    root = stdlib_root()
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _stdlib_excluded_dir(d, include_tests)]
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata_"):
                continue
            path = Path(dirpath) / name
            found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def stdlib_documents(include_tests: bool = False) -> Iterator[Document]:
    """Every `.py` file of the running interpreter's standard library, sorted by relative path.

    Excludes third-party packages and, unless `include_tests`, the test suites (directories
    named `test`, `tests`, `idle_test`): about 12 MB of source without tests, 31 MB with.
    """
    for rel, path in stdlib_files(include_tests):
        yield Document(rel, path.read_bytes().decode("utf-8", errors="replace"))


# ----------------------------------------------------------------------------- user corpora


def _expand(paths: Iterable[PathLike], suffixes: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    """`(id prefix, file)` for each input: a file as given, or a directory's matching files
    (recursive, sorted by relative path). Inputs keep their order."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            yield path.name, path
        elif path.is_dir():
            files = sorted(
                (p.relative_to(path).as_posix(), p)
                for p in path.rglob("*")
                if p.is_file() and p.name.endswith(suffixes)
            )
            if not files:
                raise ValueError(f"{path}: directory holds no {'/'.join(suffixes)} files")
            name = path.resolve().name
            for rel, p in files:
                yield f"{name}/{rel}", p
        else:
            raise ValueError(f"{path}: no such file or directory")


def text_documents(paths: Iterable[PathLike]) -> Iterator[Document]:
    """One document per file: files given directly (any name) or the .txt/.md/.py files under
    given directories. UTF-8, undecodable bytes replaced."""
    for doc_id, path in _expand(paths, TEXT_SUFFIXES):
        yield Document(doc_id, path.read_bytes().decode("utf-8", errors="replace"))


def jsonl_documents(paths: Iterable[PathLike], text_field: str = "text") -> Iterator[Document]:
    """One document per non-blank line of each JSON Lines file: the string at `text_field`.

    doc_id is `<file>:<line>` (1-based line number)."""
    for file_id, path in _expand(paths, (".jsonl",)):
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                line = raw.decode("utf-8", errors="replace").strip()
                if not line:
                    continue
                where = f"{path}: line {lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"{where}: expected a JSON object, got invalid JSON ({exc.msg})"
                    ) from None
                if not isinstance(record, dict):
                    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
                if text_field not in record:
                    keys = ", ".join(map(repr, list(record)[:10]))
                    raise ValueError(
                        f"{where}: expected a string field {text_field!r}; the object has {keys or 'no keys'}"
                    )
                text = record[text_field]
                if not isinstance(text, str):
                    raise ValueError(
                        f"{where}: field {text_field!r} must be a string, got {type(text).__name__}"
                    )
                yield Document(f"{file_id}:{lineno}", _scrub(text))


def parquet_documents(paths: Iterable[PathLike], text_column: str = "text") -> Iterator[Document]:
    """One document per row of each Parquet file (FineWeb-Edu layout: a string `text` column),
    streamed one row group at a time. doc_id is `<file>:<row>` (0-based row in the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file_id, path in _expand(paths, (".parquet",)):
        try:
            pf = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: expected a Parquet file ({exc})") from None
        schema = pf.schema_arrow
        if text_column not in schema.names:
            raise ValueError(
                f"{path}: expected a column {text_column!r}; columns are {', '.join(map(repr, schema.names))}"
            )
        col_type = schema.field(text_column).type
        if not (pa.types.is_string(col_type) or pa.types.is_large_string(col_type)):
            raise ValueError(f"{path}: column {text_column!r} must hold strings, its type is {col_type}")
        row = 0
        for group in range(pf.num_row_groups):
            values = pf.read_row_group(group, columns=[text_column]).column(0).to_pylist()
            for text in values:
                if not isinstance(text, str):
                    raise ValueError(f"{path}: row {row}: column {text_column!r} must be a string, got null")
                yield Document(f"{file_id}:{row}", text)
                row += 1


def hub_documents(
    dataset: str,
    *,
    name: str | None = None,
    split: str = "train",
    text_field: str = "text",
    id_field: str = "id",
    revision: str | None = None,
) -> Iterator[Document]:
    """One document per row of a Hugging Face dataset, streamed through `datasets.load_dataset`.

    `dataset` is a hub id (`HuggingFaceFW/fineweb-edu`) or a local folder in the hub's layout
    (Parquet shards, configs declared in its README.md); `name` is the config (`sample-10BT`).
    Rows come in the dataset's own order, so the first N documents are the same on every machine.
    doc_id is the row's `id_field` when it has one (FineWeb's `<urn:uuid:...>`), else
    `<split>:<row>`, so the validation split does not depend on where the stream is read from.
    """
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "--hub: reading a Hugging Face dataset needs the `datasets` package: pip install 'reslab[hub]'"
        ) from None
    try:
        stream = datasets.load_dataset(dataset, name=name, split=split, streaming=True, revision=revision)
    except (FileNotFoundError, ValueError, ConnectionError) as exc:
        raise ValueError(f"--hub {dataset} (name {name!r}, split {split!r}): cannot open it ({exc})") from None
    for row_index, row in enumerate(stream):
        if text_field not in row:
            columns = ", ".join(map(repr, row))
            raise ValueError(f"--text-field: {dataset} has no column {text_field!r}; its columns are {columns}")
        text = row[text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"{dataset}: row {row_index}: column {text_field!r} must be a string, got {type(text).__name__}"
            )
        doc_id = row.get(id_field)
        yield Document(str(doc_id) if doc_id is not None else f"{split}:{row_index}", _scrub(text))
