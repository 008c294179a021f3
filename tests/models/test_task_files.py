"""`models.evals.task_files`: a local task file is whole when its builder reads every record (issue 52, item 6),
and its hash follows its bytes (item 7). The reference for "whole" is the reader itself: each damaged file below
is one `json`, `csv`, `pyarrow` refuses."""

from __future__ import annotations

import json

import pytest

from reslab.common.errors import ConfigError
from reslab.models.evals.task_files import check_file, file_error, files_digest, local_files

ITEMS = [{"context": "a\n", "choices": ["b\n", "c\n"], "gold": 0}, {"context": "d\n", "choices": ["e\n"], "gold": 0}]


def test_whole_files_pass_and_damaged_ones_say_where(tmp_path):
    jsonl = tmp_path / "items.jsonl"
    text = "".join(json.dumps(i) + "\n" for i in ITEMS)
    jsonl.write_text(text)
    assert file_error(jsonl, "json", items=True) is None
    jsonl.write_text(text[: len(text) - 10])
    assert file_error(jsonl, "json", items=True).startswith("line 2 is not JSON")
    jsonl.write_text(text + '{"context": "x"}\n')
    assert file_error(jsonl, "json", items=True) == "line 3 is not an item with context, choices, gold"
    assert file_error(jsonl, "json") is None  # any JSON record, for a harness task's own file
    jsonl.write_bytes(b'{"a": "\xff"}\n')
    assert file_error(jsonl, "json") == "byte 7 is not UTF-8 text"
    table = tmp_path / "t.csv"
    table.write_text("q,a\n1,2\n3\n")
    assert file_error(table, "csv") == "row 3 has 1 fields, the header 2"
    parquet = tmp_path / "t.parquet"
    parquet.write_bytes(b"PAR1 cut short")
    assert file_error(parquet, "parquet").startswith("not a whole parquet file")
    with pytest.raises(ConfigError, match=r"^evals.tasks: 'mytask' reads .*t.csv, which is damaged: row 3"):
        check_file("mytask", table, "csv")


def test_the_digest_follows_the_bytes_and_hub_tasks_have_no_files(tmp_path):
    a = tmp_path / "a.json"
    a.write_text("[1]")
    first = files_digest([a])
    a.write_text("[2, 3]")  # another size: the hash is kept per (size, mtime), and mtimes are coarse
    assert files_digest([a]) != first and files_digest([]) is None
    a.write_text("[1]")
    assert files_digest([a]) == first
    assert local_files({"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(a)}}}) == ("json", [a])
    assert local_files({"dataset_path": "Rowan/hellaswag"}) == ("", [])
