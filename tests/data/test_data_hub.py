"""`reslab data prepare --hub`: the `datasets` streaming path, run offline on a local folder in the
Hugging Face hub's layout (FineWeb-Edu's: Parquet shards under sample/10BT/, the config declared in
README.md). The expected tokens are computed independently: pyarrow reads the same Parquet files
and the saved tokenizer encodes them."""

import importlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_testing import split_tokens

from reslab.models.data.prepare import hub_revision, is_val_document, read_meta
from reslab.models.data.tokenizer import load_tokenizer
from reslab.orchestrator.driving.dataprep import PrepareRequest, prepare_corpus

README = """---
configs:
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# a FineWeb-Edu-shaped test dataset
"""
WORDS = ["the", "of", "residual", "depth", "attention", "stream", "block", "routing", "query", "key", "value",
         "layer", "norm", "token"]


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network: the hub client and `datasets` run offline with their caches under tmp_path."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    datasets = importlib.import_module("datasets")
    hub_constants = importlib.import_module("huggingface_hub.constants")
    # both read the environment at import time; an earlier import in this process would miss it
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-home" / "datasets")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def fineweb_like(root, n_files: int = 3, rows: int = 40) -> list[dict]:
    """Write the folder; return its rows in file order (what the stream must yield)."""
    rng = np.random.default_rng(0)
    (root / "sample" / "10BT").mkdir(parents=True)
    (root / "README.md").write_text(README)
    out = []
    for f in range(n_files):
        batch = [
            {"text": " ".join(rng.choice(WORDS, size=int(rng.integers(5, 60)))) + f" ({f}.{i})",
             "id": f"<urn:uuid:{f:02d}-{i:04d}>", "dump": "CC-MAIN-2024-10", "score": float(rng.uniform(2.5, 5))}
            for i in range(rows)
        ]
        pq.write_table(pa.Table.from_pylist(batch), root / "sample" / "10BT" / f"{f:03d}_00000.parquet",
                       row_group_size=16)
        out += batch
    return out


def from_hub(out, tokenizer, vocab_size, text_field, val_fraction, **request):
    """`reslab data prepare --hub ...` without the CLI."""
    return prepare_corpus(PrepareRequest(out_dir=out, fmt="parquet", tokenizer=tokenizer, vocab_size=vocab_size,
                                         text_field=text_field, val_fraction=val_fraction, **request))


def test_hub_stream_with_token_budget_and_manifest(tmp_path):
    rows = fineweb_like(tmp_path / "fwe")
    budget = 1500
    meta = from_hub(
        tmp_path / "corpus", "bpe", 300, "text", 0.1, hub=str(tmp_path / "fwe"),
        hub_name="sample-10BT", split="train", max_tokens=budget, bpe_docs=30, shard_tokens=256,
    )
    assert meta.dataset == {"hub": str(tmp_path / "fwe"), "name": "sample-10BT", "split": "train",
                            "revision": "local", "text_field": "text"}
    assert meta.token_budget == budget and meta.tokenizer == "bpe" and meta.vocab_size <= 300
    assert meta.tokenizer_source == "the train documents among the first 30 of the stream"
    assert len(meta.shard_files("train")) >= 5 and meta == read_meta(tmp_path / "corpus")
    assert json.loads((tmp_path / "corpus" / "meta.json").read_text())["shards"]["train"][0][0] == "train-00000.bin"

    # independently: the shortest prefix of the rows whose train documents reach the budget
    tok = load_tokenizer(tmp_path / "corpus")
    expected = {"train": [], "val": []}
    n_train = n_docs = 0
    for row in rows:
        n_docs += 1
        ids = tok.encode(row["text"]) + [tok.eot_id]
        split = "val" if is_val_document(row["id"], 0.1) else "train"
        expected[split] += ids
        n_train += len(ids) if split == "train" else 0
        if n_train >= budget:
            break
    assert meta.n_documents == n_docs < len(rows)  # the stream stopped at the budget
    assert meta.n_train_tokens == n_train >= budget
    for split in ("train", "val"):
        assert split_tokens(tmp_path / "corpus", split).tolist() == expected[split]


def test_hub_plain_data_folder_without_config_name(tmp_path):
    """The other hub layout: Parquet shards under data/, no README configs, no id column."""
    (tmp_path / "ds" / "data").mkdir(parents=True)
    texts = [f"row {i} " + "abc " * (i % 9 + 1) for i in range(30)]
    pq.write_table(pa.table({"content": texts[:15]}), tmp_path / "ds" / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.table({"content": texts[15:]}), tmp_path / "ds" / "data" / "train-00001-of-00002.parquet")
    meta = from_hub(tmp_path / "c", "byte", 0, "content", 0.2, hub=str(tmp_path / "ds"))
    assert meta.n_documents == 30 and meta.token_budget is None and meta.dataset["name"] is None
    n_val = sum(is_val_document(f"train:{i}", 0.2) for i in range(30))  # doc ids fall back to split:row
    assert meta.n_val_documents == n_val
    assert meta.n_train_tokens + meta.n_val_tokens == sum(len(t.encode()) + 1 for t in texts)


def test_hub_errors_name_the_flag(tmp_path):
    fineweb_like(tmp_path / "fwe", n_files=1, rows=10)
    hub = str(tmp_path / "fwe")
    with pytest.raises(ValueError, match="--text-field: .* has no column 'body'; its columns are 'text', 'id'"):
        from_hub(tmp_path / "a", "byte", 0, "body", 0.1, hub=hub, hub_name="sample-10BT")
    with pytest.raises(ValueError, match="--bpe-docs"):
        from_hub(tmp_path / "b", "bpe", 300, "text", 0.1, hub=hub, hub_name="sample-10BT")
    with pytest.raises(ValueError, match="--hub .*: reads the dataset, not files"):
        from_hub(tmp_path / "c", "byte", 0, "text", 0.1, hub=hub, inputs=["x.parquet"])
    with pytest.raises(ValueError, match="--tokens"):
        from_hub(tmp_path / "d", "byte", 0, "text", 0.1, hub=hub, max_tokens=0)
    with pytest.raises(ValueError, match="--hub .*cannot open it"):
        from_hub(tmp_path / "e", "byte", 0, "text", 0.1, hub=hub, hub_name="no-such-config")
    assert not any((tmp_path / n).exists() for n in "abcde")


def test_revision_is_recorded_without_the_network(tmp_path):
    """A local folder records `local`; a hub id the offline client cannot resolve keeps the asked revision."""
    fineweb_like(tmp_path / "fwe", n_files=1, rows=4)
    assert hub_revision(str(tmp_path / "fwe"), None) == "local"
    assert hub_revision("HuggingFaceFW/fineweb-edu", "v1.2.0") == "v1.2.0"
    assert hub_revision("HuggingFaceFW/fineweb-edu", None) is None


def test_cli_prepares_a_named_corpus_a_study_can_use(tmp_path, monkeypatch, capsys):
    """`reslab data prepare --hub ... --corpus NAME` writes $RESLAB_CACHE/corpora/NAME, which a run
    config names as data.corpus: NAME; bad flags exit 2 with one line naming the flag."""
    from reslab.models.config import DataConfig
    from reslab.models.data import TokenDataset
    from reslab.orchestrator.cli import main

    fineweb_like(tmp_path / "fwe")
    args = ["data", "prepare", "--hub", str(tmp_path / "fwe"), "--name", "sample-10BT", "--tokens", "2e3",
            "--tokenizer", "bpe", "--vocab-size", "300", "--bpe-docs", "40", "--val-fraction", "0.1"]
    assert main([*args, "--corpus", "fwe-test"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["token_budget"] == 2000 and manifest["dataset"]["name"] == "sample-10BT"
    ds = TokenDataset.open(DataConfig(corpus="fwe-test", tokenizer="bpe", bpe_vocab_size=manifest["vocab_size"]))
    assert ds.directory == tmp_path / "reslab-cache" / "corpora" / "fwe-test"
    assert ds.n_train_tokens == manifest["n_train_tokens"] >= 2000

    assert main([*args, "--corpus", "../escape"]) == 2
    assert "--corpus: '../escape' is not a corpus name" in capsys.readouterr().err
    assert main([*args[:-2], "--text-field", "body", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--text-field" in err and not (tmp_path / "o").exists()
