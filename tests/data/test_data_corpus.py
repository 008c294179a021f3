import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reslab.models.data.corpus import (
    Document,
    jsonl_documents,
    parquet_documents,
    stdlib_documents,
    text_documents,
)


def test_text_documents_dirs_files_and_order(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "a.md").write_text("ay")
    (root / "sub" / "c.py").write_text("x = 1\n")
    (root / "skip.bin").write_bytes(b"\x00\x01")
    odd = tmp_path / "notes.rst"
    odd.write_bytes(b"bad \xff byte")
    docs = list(text_documents([root, odd]))
    assert [d.doc_id for d in docs] == ["corpus/a.md", "corpus/b.txt", "corpus/sub/c.py", "notes.rst"]
    assert docs[0] == Document("corpus/a.md", "ay")
    assert docs[-1].text == "bad \ufffd byte"
    assert list(text_documents(str(odd))) == docs[-1:]  # a single path works too


def test_text_documents_errors(tmp_path):
    with pytest.raises(ValueError, match="missing.txt: no such file"):
        list(text_documents([tmp_path / "missing.txt"]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: directory holds no"):
        list(text_documents([tmp_path / "empty"]))


def test_jsonl_documents(tmp_path):
    f = tmp_path / "data.jsonl"
    rows = [{"text": "one", "id": 1}, {"content": "two", "text": "två"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n" + json.dumps({"text": "lone \ud800"}) + "\n")
    docs = list(jsonl_documents([f]))
    assert docs == [
        Document("data.jsonl:1", "one"),
        Document("data.jsonl:2", "två"),
        Document("data.jsonl:4", "lone ?"),  # lone surrogate replaced
    ]
    g = tmp_path / "other.jsonl"
    g.write_text(json.dumps({"content": "c"}) + "\n")
    assert list(jsonl_documents([g], text_field="content")) == [Document("other.jsonl:1", "c")]


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"body": "x"}', "line 2: expected a string field 'text'; the object has 'body'"),
        ('{"text": 3}', "line 2: field 'text' must be a string, got int"),
        ('{"text": null}', "line 2: field 'text' must be a string, got NoneType"),
        ("[1, 2]", "line 2: expected a JSON object, got list"),
        ("{not json", "line 2: expected a JSON object, got invalid JSON"),
    ],
)
def test_jsonl_bad_input(tmp_path, line, message):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as err:
        list(jsonl_documents([f]))
    assert str(f) in str(err.value) and message in str(err.value)


def test_parquet_documents_streams_row_groups(tmp_path):
    f = tmp_path / "shard.parquet"
    texts = [f"doc {i} ✓" for i in range(7)]
    pq.write_table(pa.table({"id": list(range(7)), "text": texts}), f, row_group_size=3)
    assert pq.ParquetFile(f).num_row_groups == 3
    docs = list(parquet_documents([tmp_path]))
    assert [d.text for d in docs] == texts
    assert [d.doc_id for d in docs] == [f"{tmp_path.name}/shard.parquet:{i}" for i in range(7)]
    assert list(parquet_documents([f]))[6].doc_id == "shard.parquet:6"


def test_parquet_bad_input(tmp_path):
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"content": ["x"], "n": [1]}), f)
    with pytest.raises(ValueError, match=r"a.parquet: expected a column 'text'; columns are 'content', 'n'"):
        list(parquet_documents([f]))
    with pytest.raises(ValueError, match=r"column 'n' must hold strings, its type is int64"):
        list(parquet_documents([f], text_column="n"))
    g = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": ["ok", None, "ok"]}), g)
    with pytest.raises(ValueError, match=r"b.parquet: row 1: column 'text' must be a string, got null"):
        list(parquet_documents([g]))
    h = tmp_path / "c.parquet"
    h.write_text("not parquet")
    with pytest.raises(ValueError, match="c.parquet: expected a Parquet file"):
        list(parquet_documents([h]))
    with pytest.raises(ValueError, match="nope.parquet: no such file"):
        list(parquet_documents([tmp_path / "nope.parquet"]))


def test_stdlib_sizes_and_exclusions():
    plain = list(stdlib_documents())
    ids = [d.doc_id for d in plain]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    assert "os.py" in ids and "json/decoder.py" in ids
    parts = {p for i in ids for p in i.split("/")[:-1]}
    assert not parts & {"test", "tests", "idle_test", "site-packages", "dist-packages"}
    size = sum(len(d.text.encode("utf-8")) for d in plain)
    assert 8e6 < size < 20e6, size  # ~12 MB on CPython 3.11

    with_tests = list(stdlib_documents(include_tests=True))
    size_t = sum(len(d.text.encode("utf-8")) for d in with_tests)
    assert 2 * size < size_t < 60e6, size_t  # ~31 MB on CPython 3.11
    assert any(i.startswith("test/") for i in (d.doc_id for d in with_tests))
    assert set(ids) < {d.doc_id for d in with_tests}
