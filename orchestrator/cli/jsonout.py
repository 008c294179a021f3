"""`--json`: a command's result as one versioned JSON document on stdout, for loops and scripts.

Every document is an object whose first two keys are `schema` (`reslab.<command>/<version>`, e.g.
`reslab.compare/1`) and `reslab_version` (the installed package's); the rest is the command's payload, as
its schema in `schemas/<command>.v<version>.json` (JSON Schema, draft 2020-12, shipped as package data)
declares it. A command under `--json` builds its payload from the same library values its text formats
and calls `emit` once; `main` sends everything else the command prints (status lines, tables, notes) to
stderr while it runs (`json_mode`), so stdout holds the one document and nothing else. A failure under
`--json` keeps its exit code and one-line message on stderr and also emits a `reslab.error/1` document
(`emit_error`), so a loop parses every outcome the same way.

Values are made plain here, once: NaN and infinities become null, numpy and pandas scalars and arrays
Python numbers and lists, paths and enums strings, dataclasses objects. A payload is otherwise the
command's own: keys are stable within a version, a new optional key is not a new version (CONTRIBUTING).

A leaf of the command modules: they import it, it imports none of them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import json
import math
import sys
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import PurePath
from typing import Any, TextIO

SCHEMA_PACKAGE = "reslab.orchestrator.cli"
SCHEMA_FOLDER = "schemas"
ERROR = "error"  # the command name of the failure document, `reslab.error/1`

_target: list[TextIO] = []  # where `emit` writes while `json_mode` has stdout pointed at stderr


def schema_id(command: str, version: int = 1) -> str:
    """The document id a command's payload carries: `reslab.<command>/<version>`."""
    return f"reslab.{command}/{version}"


@functools.cache
def schema(command: str, version: int = 1) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `command`'s document at `version`, from the package data."""
    name = f"{command}.v{version}.json"
    path = resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_FOLDER, name)
    if not path.is_file():
        raise KeyError(f"no JSON schema {name} in {SCHEMA_PACKAGE}/{SCHEMA_FOLDER}")
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


def schemas() -> list[tuple[str, int]]:
    """Every (command, version) the package ships a schema for, sorted."""
    folder = resources.files(SCHEMA_PACKAGE).joinpath(SCHEMA_FOLDER)
    found = []
    for entry in folder.iterdir():
        stem, _, ext = entry.name.rpartition(".")
        command, _, version = stem.rpartition(".v")
        if ext == "json" and command and version.isdigit():
            found.append((command, int(version)))
    return sorted(found)


@functools.cache
def reslab_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("reslab")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "unknown"


def plain(value: Any) -> Any:
    """`value` as JSON's types: NaN/inf -> None, numpy/pandas scalars and arrays -> numbers and lists, a mapping's
    keys -> strings, paths and enums -> strings, dataclasses -> objects, sets -> sorted lists."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, set | frozenset):
        return [plain(v) for v in sorted(value, key=str)]
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, PurePath):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain({f.name: getattr(value, f.name) for f in dataclasses.fields(value)})
    return _plain_foreign(value)


def _plain_foreign(value: Any) -> Any:
    """numpy and pandas values, without importing either (a command that never loaded them has none)."""
    kind = type(value).__module__.split(".")[0]
    if kind == "numpy" and hasattr(value, "tolist"):  # an array or a scalar: Python numbers, nested lists
        return plain(value.tolist())
    if kind == "pandas":
        import pandas as pd

        if value is pd.NA or value is pd.NaT:
            return None
        if isinstance(value, pd.Timestamp):
            return value.isoformat()
        if isinstance(value, pd.DataFrame):
            return records(value)
        if isinstance(value, pd.Series):
            return plain(value.tolist())
    if hasattr(value, "isoformat"):  # datetime, date
        return value.isoformat()
    raise TypeError(f"--json: no JSON form for a {type(value).__name__} ({value!r:.80})")


def records(frame: Any, columns: list[str] | None = None) -> list[dict[str, Any]]:
    """A DataFrame's rows as plain objects (`columns`: those, in that order; default every column)."""
    cols = list(frame.columns) if columns is None else columns
    out: list[dict[str, Any]] = [plain(dict(zip(cols, row, strict=True)))
                                 for row in frame[cols].itertuples(index=False, name=None)]
    return out


def document(command: str, payload: Mapping[str, Any], version: int = 1) -> dict[str, Any]:
    """The document `emit` writes: the envelope (`schema`, `reslab_version`) then the payload, made plain."""
    doc: dict[str, Any] = {"schema": schema_id(command, version), "reslab_version": reslab_version()}
    doc.update(plain(payload))
    return doc


def emit(command: str, payload: Mapping[str, Any], version: int = 1) -> None:
    """Write `command`'s one JSON document to stdout (the real one, under `json_mode`)."""
    import orjson

    out = _target[-1] if _target else sys.stdout
    out.write(orjson.dumps(document(command, payload, version), option=orjson.OPT_INDENT_2).decode() + "\n")
    out.flush()


def emit_error(command: str | None, exc: BaseException | str, exit_code: int, kind: str | None = None) -> None:
    """The failure document (`reslab.error/1`): the command, the error's kind (its class name, `usage` for a
    flag argparse refused, `interrupted`), the one-line message stderr also shows, and the exit code."""
    message = exc if isinstance(exc, str) else " ".join(str(exc).split("\n"))
    emit(ERROR, {"command": command, "error": {
        "kind": kind or type(exc).__name__, "message": " ".join(message.split()), "exit_code": exit_code}})


@contextlib.contextmanager
def json_mode() -> Iterator[None]:
    """While a `--json` command runs: whatever it prints goes to stderr, and `emit` to the stdout it had."""
    _target.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _target.pop()


def add_json_arg(p: argparse.ArgumentParser, command: str, version: int = 1) -> None:
    """`--json` on a command whose document is `reslab.<command>/<version>`."""
    p.add_argument("--json", action="store_true",
                   help=f"print one JSON document ({schema_id(command, version)}) to stdout and nothing else (notes "
                        "go to stderr; a failure also prints a reslab.error/1 document); see the README's "
                        "'Machine-readable output'")


def wants_json(argv: list[str]) -> bool:
    """Whether a command line asks for `--json`: read before parsing, so a usage error can answer in JSON too."""
    return "--json" in argv[: argv.index("--")] if "--" in argv else "--json" in argv
