"""The workspace's ledger of tries: every comparison tested in it, across studies and names (issue 55 item 4).

`<workspace>/ledger.jsonl`, append-only, one JSON object a line: `{"key", "try", "study", "comparison",
"treatment", "point", "metric", "design", "replicate", "recorded_at"}`. `key` is the comparison's content
(`results.tries.comparison_key`: both arms' resolved configs without the seed, and the metric) and `try` the seeds
that tested it (`results.tries.try_id`). A submission (`reslab run`, `submit`) appends a line for each of its
comparisons' rows it has not recorded before: a re-submitted or resumed study appends nothing, and another study
with the same comparison and seeds appends a line of the same try. A key's tries are its distinct `try` values in
the order they were first recorded; the verdict reads how many there are and the number of its own
(`results.tries.spent_alpha`).

Two drivers may record at once: each appends its lines under an `flock` on `.ledger.lock` (`common.io.file_lock`)
with one `write` on a file opened for appending, after reading what is there under the same lock, so no line is
lost or written twice. A reader takes no lock; a line cut short by a crash is skipped, and the next append starts
on a new line.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reslab.common.io import file_lock

__all__ = ["Try", "ledger_path", "read_ledger", "record_tries", "tries_of"]

FIELDS = ("key", "try", "study", "comparison", "treatment", "point", "metric", "design", "replicate")


def ledger_path(root: Path) -> Path:
    return Path(root) / "ledger.jsonl"


def read_ledger(root: Path) -> list[dict[str, Any]]:
    """Every whole line, oldest first (none when nothing was ever submitted in this workspace)."""
    try:
        text = ledger_path(root).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a crash cut short
        if isinstance(record, dict) and "key" in record and "try" in record:
            out.append(record)
    return out


def record_tries(root: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Append each record (`FIELDS`) whose (key, try, study, comparison, treatment, point) is not in the ledger
    yet; returns how many were appended."""
    path = ledger_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_name(".ledger.lock")):
        seen = {_identity(r) for r in read_ledger(root)}
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lines = []
        for r in records:
            if _identity(r) not in seen:
                seen.add(_identity(r))
                lines.append(json.dumps({**{k: r.get(k) for k in FIELDS}, "recorded_at": now}, sort_keys=True))
        if lines:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                lead = "\n" if os.fstat(fd).st_size and not _ends_with_newline(path) else ""
                os.write(fd, (lead + "\n".join(lines) + "\n").encode())
            finally:
                os.close(fd)
    return len(lines)


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def _identity(r: Mapping[str, Any]) -> str:
    return json.dumps([r.get(k) for k in ("key", "try", "study", "comparison", "treatment", "point")])


@dataclass(frozen=True)
class Try:
    """One try of a key: its `try` id, its number (1 for the first recorded), its design's words and the
    (study, comparison, treatment) rows that recorded it."""

    id: str
    number: int
    design: str
    studies: tuple[tuple[str, str, str], ...]


def tries_of(root: Path, keys: Iterable[str]) -> dict[str, list[Try]]:
    """Each key's tries, in the order first recorded (a key never recorded: none)."""
    wanted = set(keys)
    found: dict[str, dict[str, tuple[str, list[tuple[str, str, str]]]]] = {k: {} for k in wanted}
    for r in read_ledger(root):
        if r["key"] in wanted:
            design, rows = found[r["key"]].setdefault(r["try"], (str(r.get("design")), []))
            row = (str(r.get("study")), str(r.get("comparison")), str(r.get("treatment")))
            if row not in rows:
                rows.append(row)
    return {k: [Try(t, i + 1, design, tuple(rows)) for i, (t, (design, rows)) in enumerate(tries.items())]
            for k, tries in found.items()}
