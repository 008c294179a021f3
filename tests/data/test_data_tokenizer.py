import json
import random

import numpy as np
import pytest

from reslab.models.data.corpus import Document
from reslab.models.data.tokenizer import EOT_TEXT, BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe


def test_byte_round_trip_and_eot():
    tok = ByteTokenizer()
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("byte", 257, 256)
    text = "héllo, wörld ✓ <|endoftext|>\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert 256 not in ids  # a literal EOT string is ordinary text
    assert tok.decode(ids) == text
    assert tok.decode(ids + [256] + tok.encode("b")) == text + EOT_TEXT + "b"
    docs = tok.encode_documents(["ab", ""])
    assert [d.tolist() for d in docs] == [[97, 98, 256], [256]]
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])


def test_byte_save_load(tmp_path):
    ByteTokenizer().save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert json.loads((tmp_path / "tokenizer_info.json").read_text())["vocab_size"] == 257


WORDS = ["alpha", "beta", "gamma", "déjà", "vu", "naïve", "café", "λ", "def", "return", "(x)", "\n", "    "]


def make_text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def corpus_texts():
    return [make_text(i, 300) for i in range(40)]


def test_bpe_trains_round_trips_and_is_deterministic(corpus_texts, tmp_path):
    docs = [Document(f"d{i}", t) for i, t in enumerate(corpus_texts)]
    a = train_bpe(docs, 320)
    b = train_bpe(iter(docs), 320)
    assert a.to_json() == b.to_json()
    assert a.name == "bpe" and 257 < a.vocab_size <= 320
    assert a.decode([a.eot_id]) == EOT_TEXT
    for text in corpus_texts[:5] + ["unseen ✓ text \t with <|endoftext|> inside", ""]:
        ids = a.encode(text)
        assert a.eot_id not in ids
        assert a.decode(ids) == text
    sample = corpus_texts[0]
    assert len(a.encode(sample)) < len(sample.encode("utf-8"))  # merges actually compress
    assert a.encode_batch(corpus_texts[:3]) == [a.encode(t) for t in corpus_texts[:3]]
    arrays = a.encode_documents(corpus_texts[:2])
    assert all(arr[-1] == a.eot_id and arr.dtype == np.int64 for arr in arrays)

    a.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    assert loaded.encode(sample) == a.encode(sample)
    assert (loaded.vocab_size, loaded.eot_id) == (a.vocab_size, a.eot_id)


def test_bpe_lone_surrogate_does_not_crash(corpus_texts):
    tok = train_bpe(corpus_texts, 300)
    assert tok.decode(tok.encode("a\ud800b")) == "a?b"


def test_bpe_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="257"):
        train_bpe(["abc"], 100)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer_info.json"):
        load_tokenizer(tmp_path)
    info = tmp_path / "tokenizer_info.json"
    info.write_text(json.dumps({"tokenizer": "bpe", "vocab_size": 300, "eot_id": 0}))
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    info.write_text(json.dumps({"tokenizer": "byte", "vocab_size": 300, "eot_id": 0}))
    with pytest.raises(ValueError, match="records vocab_size=300"):
        load_tokenizer(tmp_path)
