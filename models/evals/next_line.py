"""The local task that never downloads: `reslab_next_line`, a multiple-choice task built from a prepared corpus's
validation split, defined as an lm-evaluation-harness task on local files.

An item is a place in a held-out document: the context is the lines before it (whole lines, at most
`context_chars` characters, at least one line), the choices are the true next line and `distractors` lines
drawn from other documents of the split, each choice followed by a newline, in an order drawn per item. A line
is a candidate (for the answer or a distractor) when it holds at least `min_chars` non-blank characters and at
most `max_chars` characters (so a choice fits a small model's context: 96 bytes fit the `tiny` preset's 128
tokens with room for context) and is not the same text as the true line. Items are spread over the split's
documents: every document contributes its candidate places in turn (document order, then a draw), up to `items`.
Everything is a pure function of the corpus (its validation tokens, decoded with its own tokenizer) and of
`NextLineOptions`, seeded by `seed`.

The validation documents are never trained on (the split is by document, `models.data.prepare`), so the
model has seen neither the answer nor the distractors. Chance is 1 / (distractors + 1); a model that has
learnt the corpus's syntax and indentation beats it.

Written under `$RESLAB_CACHE/tasks/<corpus fingerprint>-next_line-<options hash>/`: `items.jsonl` (one item per
line: context, choices, gold, doc, line) and `reslab_next_line.yaml`, the harness's task config, naming the
JSON file through `dataset_path: json` and `dataset_kwargs.data_files`, so `datasets` reads it from disk with
its packaged JSON builder and nothing is fetched. The directory is written under a temporary name and renamed
into place under a lock.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from reslab.common.errors import ConfigError
from reslab.common.io import cache_root, file_lock
from reslab.models.data.prepare import read_meta
from reslab.models.data.tokenizer import load_tokenizer

TASK_NAME = "reslab_next_line"
ITEMS_FILE = "items.jsonl"
CONFIG_FILE = f"{TASK_NAME}.yaml"
FORMAT = 2  # bump when the items a given corpus and options give change


@dataclass(frozen=True)
class NextLineOptions:
    """items: how many items at most; distractors: wrong choices per item; context_chars: the most characters
    of context (whole lines); min_chars, max_chars: the non-blank characters a line needs, and the characters it
    may have, to be a choice; seed: the draws."""

    items: int = 500
    distractors: int = 3
    context_chars: int = 256
    min_chars: int = 12
    max_chars: int = 96
    seed: int = 0

    def __post_init__(self) -> None:
        for name, least in (("items", 1), ("distractors", 1), ("context_chars", 1), ("min_chars", 1),
                            ("max_chars", self.min_chars if isinstance(self.min_chars, int) else 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"next_line.{name}: {value!r} is not allowed; allowed: an integer >= {least}")

    def key(self) -> str:
        text = json.dumps({"format": FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def val_documents(corpus: Path) -> list[str]:
    """The texts of a prepared corpus's validation documents, decoded with its own tokenizer."""
    meta = read_meta(corpus)
    tokenizer = load_tokenizer(corpus)
    ids = np.concatenate([np.fromfile(corpus / name, dtype=meta.dtype) for name, _ in meta.shard_files("val")])
    ends = np.flatnonzero(ids == meta.eot_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(ids[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


def _candidate(line: str, options: NextLineOptions) -> bool:
    return len(line.strip()) >= options.min_chars and len(line) <= options.max_chars


def _context(lines: list[str], at: int, budget: int) -> str:
    """The whole lines before `at`, newest first while they fit in `budget` characters (at least one)."""
    taken: list[str] = []
    size = 0
    for line in reversed(lines[:at]):
        if taken and size + len(line) + 1 > budget:
            break
        taken.append(line)
        size += len(line) + 1
    return "".join(f"{line}\n" for line in reversed(taken))


def _places(documents: list[list[str]], options: NextLineOptions, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(document, line) of the items: round-robin over documents, each document's places in a drawn order."""
    queues = []
    for d, lines in enumerate(documents):
        places = [i for i in range(1, len(lines)) if _candidate(lines[i], options)
                  and any(line.strip() for line in lines[:i])]
        queues.append([(d, i) for i in rng.permutation(places).tolist()])
    out: list[tuple[int, int]] = []
    depth = 0
    while len(out) < options.items and any(depth < len(q) for q in queues):
        out += [q[depth] for q in queues if depth < len(q)]
        depth += 1
    return out[:options.items]


def build_items(texts: list[str], options: NextLineOptions) -> Iterator[dict]:
    """The task's items from the validation documents' texts (module docstring)."""
    rng = np.random.default_rng(options.seed)
    documents = [text.split("\n") for text in texts]
    pool = [(d, line) for d, lines in enumerate(documents) for line in lines if _candidate(line, options)]
    if len({d for d, _ in pool}) < 2:
        raise ConfigError("next_line: the corpus's validation split needs two or more documents with lines of at "
                          f"least {options.min_chars} characters to draw distractors from; allowed: a larger split "
                          "(data.val_fraction) or a smaller next_line.min_chars")
    for d, i in _places(documents, options, rng):
        answer = documents[d][i]
        wrong: list[str] = []
        while len(wrong) < options.distractors:
            other, line = pool[int(rng.integers(len(pool)))]
            if other != d and line.strip() != answer.strip() and line not in wrong:
                wrong.append(line)
        order = rng.permutation(options.distractors + 1).tolist()
        choices = [f"{([answer, *wrong])[k]}\n" for k in order]
        yield {"context": _context(documents[d], i, options.context_chars), "choices": choices,
               "gold": order.index(0), "doc": d, "line": i}


def task_config(items_file: Path) -> str:
    """The harness's YAML task config over the local JSON Lines file: a 0-shot multiple choice scored by
    accuracy (the true line likeliest) and length-normalised accuracy, the choice following the context
    directly (no delimiter: the context ends with its newline)."""
    return "\n".join([
        f"task: {TASK_NAME}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {json.dumps(str(items_file))}",
        "test_split: test",
        "output_type: multiple_choice",
        "doc_to_text: context",
        "doc_to_choice: choices",
        "doc_to_target: gold",
        'target_delimiter: ""',
        "metric_list:",
        "  - {metric: acc, aggregation: mean, higher_is_better: true}",
        "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}",
        "metadata: {version: 1.0}",
        "",
    ])


def task_dir(corpus: Path, options: NextLineOptions) -> Path:
    """Where the task of `corpus` with `options` lives: the cache, named by the corpus's fingerprint."""
    return cache_root() / "tasks" / f"{read_meta(corpus).fingerprint}-next_line-{options.key()}"


def prepare_next_line(corpus: Path, options: NextLineOptions | None = None) -> Path:
    """Write the task for `corpus` once (module docstring) and return its directory, the harness's
    `include_path` for it."""
    options = options or NextLineOptions()
    out = task_dir(corpus, options)
    if (out / CONFIG_FILE).is_file():
        return out
    with file_lock(out.with_name(out.name + ".lock")):
        if (out / CONFIG_FILE).is_file():
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            items = list(build_items(val_documents(corpus), options))
            (tmp / ITEMS_FILE).write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")
            (tmp / CONFIG_FILE).write_text(task_config(out / ITEMS_FILE), encoding="utf-8")
            tmp.chmod(0o755)
            tmp.replace(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
