"""The local files a task's items come from: checked whole before anything is submitted, and hashed into each
evaluation's content id (`experiments.evals.eval_id`), so items scored from a damaged file never stand in for
the intact file's.

Two kinds of task read local files: `reslab_next_line`, whose items a run's corpus builds once into the cache
(`models.evals.next_line`, `items.jsonl`), and a harness task whose config names local `data_files` through a
packaged builder (`dataset_path: json|csv|parquet|text|arrow`). A hub data set has no such file: its id stays
what it was (its revision is the hub's).

A file is whole when its builder can read every record of it: JSON (one document, or one per line), CSV (every
row as wide as the header), UTF-8 text, a Parquet or Arrow file whose footer and schema read. `next_line`'s
items must also each be an object with its context, choices and gold answer.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from reslab.common.errors import ConfigError

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow")
ITEM_KEYS = ("context", "choices", "gold")


def _json_error(text: str, items: bool) -> str | None:
    """Why `text` is not JSON its builder reads (None when it is): one document, else one per non-blank line."""
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"line {number} is not JSON ({exc.msg})"
        if items and not (isinstance(record, dict) and all(k in record for k in ITEM_KEYS)):
            return f"line {number} is not an item with {', '.join(ITEM_KEYS)}"
    return None


def _csv_error(text: str) -> str | None:
    rows = csv.reader(text.splitlines())
    width = len(next(rows, []))
    for number, row in enumerate(rows, 2):
        if row and len(row) != width:
            return f"row {number} has {len(row)} fields, the header {width}"
    return None


def file_error(path: Path, builder: str, items: bool = False) -> str | None:
    """Why the `builder` (json, csv, text, parquet, arrow) cannot read `path` whole; None when it can."""
    if builder in ("parquet", "arrow"):
        import pyarrow.ipc
        import pyarrow.parquet

        try:
            pyarrow.parquet.read_schema(path) if builder == "parquet" else pyarrow.ipc.open_stream(path).read_all()
        except Exception as exc:  # noqa: BLE001 (pyarrow raises its own ArrowInvalid, OSError, ...)
            return f"not a whole {builder} file ({type(exc).__name__})"
        return None
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__})"
    except UnicodeDecodeError as exc:
        return f"byte {exc.start} is not UTF-8 text"
    if builder == "json":
        return _json_error(text, items)
    return _csv_error(text) if builder == "csv" else None


def check_file(task: str, path: Path, builder: str, items: bool = False) -> None:
    """ConfigError, one line naming the task and the file, when `file_error` finds it damaged."""
    error = file_error(path, builder, items)
    if error is not None:
        raise ConfigError(f"evals.tasks: {task!r} reads {path}, which is damaged: {error}; allowed: a whole file"
                          + (" (delete its folder and it is built again from the corpus)" if items else ""))


@functools.lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            sha.update(block)
    return sha.hexdigest()


def files_digest(paths: Iterable[Path]) -> str | None:
    """One hash of the files' bytes, in the order given (each file's hash kept while its size and mtime hold);
    None for no file."""
    digests = []
    for path in paths:
        stat = path.stat()
        digests.append(_digest(str(path), stat.st_size, stat.st_mtime_ns))
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:16] if digests else None


def local_files(config: dict[str, Any]) -> tuple[str, list[Path]]:
    """(builder, the local files) a harness task config reads; ("", []) for a hub data set."""
    path, files = config.get("dataset_path"), (config.get("dataset_kwargs") or {}).get("data_files")
    if path not in LOCAL_BUILDERS or not files:
        return "", []
    listed = files.values() if isinstance(files, dict) else [files] if isinstance(files, str) else files
    found = [f for entry in listed for f in ([entry] if isinstance(entry, str) else entry)]
    return str(path), [Path(f) for f in found if "://" not in f]


def next_line_digest(corpus: Path) -> str | None:
    """The hash of `reslab_next_line`'s items for `corpus`, built into the cache first when it lacks them, as the
    evaluation would (a pure function of the corpus)."""
    from reslab.models.evals.next_line import ITEMS_FILE, prepare_next_line

    return files_digest([prepare_next_line(corpus) / ITEMS_FILE])


def check_next_line_items(corpora: Iterable[Path]) -> None:
    """Refuse, before anything is submitted, a `reslab_next_line` items file the cache holds damaged for one of
    `corpora` (a file the cache lacks is built whole when first needed)."""
    from reslab.models.evals.next_line import ITEMS_FILE, TASK_NAME, NextLineOptions, task_dir

    for corpus in dict.fromkeys(corpora):
        try:
            items = task_dir(corpus, NextLineOptions()) / ITEMS_FILE
        except (ValueError, OSError):
            continue  # a corpus not prepared here: it is refused, or prepared, where runs are checked
        if items.is_file():
            check_file(TASK_NAME, items, "json", items=True)


__all__ = ["LOCAL_BUILDERS", "check_file", "check_next_line_items", "file_error", "files_digest", "local_files",
           "next_line_digest"]
