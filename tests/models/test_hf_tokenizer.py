"""`data.tokenizer: hf`: a run from a Hugging Face checkpoint tokenizes its text with that checkpoint's own
tokenizer (`transformers.AutoTokenizer` on the directory), whose ids must fit the checkpoint's embedding.

The reference for the ids is `transformers` itself: the tokenizer loaded straight from the checkpoint
directory encodes each document, and the corpus must hold exactly those ids, each document followed by
the tokenizer's eos_token.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from reslab.models.config import (
    ConfigError,
    CostConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.data.corpus import Document, stdlib_documents
from reslab.models.data.prepare import PrepareOptions, hf_tokenizer_source, prepare
from reslab.models.data.tokenizer import HFTokenizer, load_tokenizer
from reslab.models.hf_import import write_tiny_checkpoint, write_tiny_tokenizer
from reslab.models.resolve import validate_run_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "Qwen3ForCausalLM")


def documents(n: int = 24) -> list[Document]:
    """Real text: the first stdlib modules after the 64 the tiny tokenizer was trained on."""
    docs = list(zip(range(64 + n), stdlib_documents(False), strict=False))[64:]
    return [Document(d.doc_id, d.text[:4000]) for _, d in docs]


@pytest.fixture(scope="module")
def corpus(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "hf-corpus"
    prepare(documents(), out, PrepareOptions(tokenizer=HFTokenizer(checkpoint), val_fraction=0.1,
                                             source_description="test", tokenizer_source=hf_tokenizer_source(
                                                 str(checkpoint))))
    return out


def hf_run(checkpoint, corpus, **data_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(seq_len=32), data=DataConfig(corpus=str(corpus), tokenizer="hf", **data_kw),
        optim=OptimConfig(batch_size=2, warmup_steps=1, lr=1e-3),
        train=TrainConfig(steps=3, eval_every=3, eval_windows=4, log_every=1, seed=3, init_from=f"hf:{checkpoint}",
                          diagnostics=False, magnitudes=False),
        cost=CostConfig(measure=False))


def test_the_tiny_checkpoint_has_its_own_tokenizer(checkpoint):
    """write_tiny_checkpoint saves a byte-level BPE AutoTokenizer loads, eos <|endoftext|>, of the embedding's size."""
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    config = transformers.AutoConfig.from_pretrained(str(checkpoint))
    assert tok.eos_token == "<|endoftext|>" and len(tok) == config.vocab_size == 320
    text = "def f(x):\n    return x + 1  # é\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_the_corpus_ids_are_the_tokenizers_own_encoding(checkpoint, corpus):
    """Every document of the prepared corpus, train and val in file order, is AutoTokenizer's ids + eos."""
    from reslab.models.data import TokenDataset
    from reslab.models.data.prepare import is_val_document

    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    ds = TokenDataset.open(validate_run_config(hf_run(checkpoint, corpus)).data)
    assert ds.meta.tokenizer == "hf" and ds.vocab_size == len(tok) and ds.eot_id == tok.eos_token_id
    for split in ("train", "val"):
        want = np.concatenate([tok(d.text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                               for d in documents() if is_val_document(d.doc_id, 0.1) == (split == "val")])
        shards = ds.meta.shard_files(split)
        got = np.concatenate([np.fromfile(corpus / name, dtype=ds.meta.dtype) for name, _ in shards])
        np.testing.assert_array_equal(got, want)
    again = load_tokenizer(corpus)  # the corpus carries the tokenizer: it decodes its own ids
    assert again.name == "hf" and again.decode(again.encode(documents()[0].text)) == documents()[0].text


def test_a_run_from_the_checkpoint_trains_on_its_tokenizer(checkpoint, corpus):
    """init_from hf with data.tokenizer hf: the tokenizer directory defaults to the checkpoint's, a few steps train."""
    import torch

    from reslab.models.training import Trainer

    cfg = validate_run_config(hf_run(checkpoint, corpus))
    assert cfg.data.tokenizer_path == str(checkpoint)
    trainer = Trainer(cfg, resume=False)
    x, _ = trainer.dataset.train_samples(0, 2, 32, cfg.data_seed)
    assert int(x.max()) < 320
    result = trainer.fit()
    losses = [e["train_loss"] for e in result.history["train"]]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_corpus_of_another_tokenizer_is_refused(checkpoint, corpus, tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", "Qwen3ForCausalLM", seed=1)
    write_tiny_tokenizer(other, 320, documents=32)  # trained on other text: other merges
    from reslab.models.data import TokenDataset

    cfg = validate_run_config(hf_run(other, corpus))
    with pytest.raises(ConfigError, match=r"data.tokenizer_path: .* was prepared with the hf tokenizer"):
        TokenDataset.open(cfg.data)


def test_a_tokenizer_larger_than_the_embedding_is_one_line(checkpoint, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", tied=False)
    write_tiny_tokenizer(path, 400)  # more ids than the checkpoint's 320 embedding rows
    with pytest.raises(ConfigError, match=r"^config.data.tokenizer: the hf tokenizer in .* has 400 ids but the "
                                          r"model's embedding has 320 rows"):
        validate_run_config(hf_run(path, "stdlib"))


def test_hf_without_a_tokenizer_directory_or_transformers(checkpoint, monkeypatch, tmp_path):
    no_dir = RunConfig(data=DataConfig(tokenizer="hf"))
    with pytest.raises(ConfigError, match=r"config.data.tokenizer: hf needs a tokenizer directory: set "
                                          r"data.tokenizer_path, or train.init_from: hf:<dir>"):
        validate_run_config(no_dir)
    with pytest.raises(ConfigError, match=r"holds no tokenizer transformers can load"):
        validate_run_config(RunConfig(data=DataConfig(tokenizer="hf", tokenizer_path=str(tmp_path))))
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the eval extra were not installed
    with pytest.raises(ConfigError, match=r"^data.tokenizer: hf needs the transformers library; install the eval"):
        HFTokenizer(checkpoint)


def test_a_context_over_the_checkpoints_positions_is_one_line_exit_2(checkpoint, tmp_path, capsys):
    """seq_len above config.json's max_position_embeddings (256 in the tiny checkpoint)."""
    from pathlib import Path

    from reslab.orchestrator.cli import main

    with pytest.raises(ConfigError, match=r"config.model.seq_len: 512 is over the checkpoint's "
                                          r"max_position_embeddings 256"):
        validate_run_config(RunConfig(model=ModelConfig(seq_len=512), train=TrainConfig(init_from=f"hf:{checkpoint}")))
    spec = Path(__file__).parents[2] / "experiments" / "delta_from_pretrained.yaml"
    capsys.readouterr()
    code = main(["validate", str(spec), "--set", f"train.init_from=hf:{checkpoint}", "--set", "model.seq_len=512"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "max_position_embeddings 256" in err, err


def test_data_prepare_with_the_hf_tokenizer(checkpoint, tmp_path, capsys):
    """`reslab data prepare FILES --tokenizer hf --tokenizer-path DIR`: a corpus a run with that tokenizer opens,
    each file's ids AutoTokenizer's own; --tokenizer-path without --tokenizer hf is one line, exit 2."""
    from reslab.models.data import TokenDataset
    from reslab.orchestrator.cli import main

    texts = {f"doc{i}.txt": d.text for i, d in enumerate(documents(12))}
    for name, text in texts.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "corpus"
    files = [str(tmp_path / name) for name in texts]
    assert main(["data", "prepare", *files, "--tokenizer", "hf", "--tokenizer-path", str(checkpoint),
                 "--val-fraction", "0.2", "--out", str(out)]) == 0
    ds = TokenDataset.open(validate_run_config(hf_run(checkpoint, out)).data)
    tok = transformers.AutoTokenizer.from_pretrained(str(checkpoint), local_files_only=True)
    every = np.concatenate([np.fromfile(out / name, dtype=ds.meta.dtype)
                            for split in ("train", "val") for name, _ in ds.meta.shard_files(split)])
    want = sorted(tuple(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in texts.values())
    cuts = np.flatnonzero(every == tok.eos_token_id) + 1
    got = sorted(tuple(int(i) for i in part) for part in np.split(every, cuts) if part.size)
    assert got == want
    capsys.readouterr()
    assert main(["data", "prepare", *files, "--tokenizer-path", str(checkpoint), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--tokenizer-path: give it with --tokenizer hf" in err, err
