"""The lm-evaluation-harness adapter (`models.evals.adapter.ReslabLM`) against the model's own forward: the
harness's log-likelihoods (batched, sorted, right-padded, left-truncated past the context) equal those computed
from one unpadded forward per request to 1e-6 (float64), for the byte tokenizer and a BPE; the rolling
log-likelihood equals the harness's disjoint windows scored directly; `generate_until` equals a greedy loop over
full forwards among the tokenizer's ids, cut at the stop string."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from reslab.models.backbone import build_model  # noqa: E402
from reslab.models.config import ModelConfig, ResidualConfig  # noqa: E402
from reslab.models.data.corpus import stdlib_documents  # noqa: E402
from reslab.models.data.tokenizer import ByteTokenizer, train_bpe  # noqa: E402
from reslab.models.evals.adapter import ReslabLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64")


def make_model(vocab_size, residual="attnres", seq_len=64):
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="tiny", seq_len=seq_len), ResidualConfig(name=residual),
                        vocab_size=vocab_size)
    with torch.no_grad():  # the zero-initialised pseudo-queries would make attnres the baseline's function
        for p in model.pathway.parameters():
            p.normal_(0, 0.5)
    return model.eval()


def direct_loglikelihood(model, context, continuation):
    """Sum of log p(continuation) from one forward over the (left-truncated) unpadded sequence."""
    ids = (context + continuation)[-(model.shape.seq_len + 1):]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
    logp = F.log_softmax(logits.double(), -1)
    n = len(continuation)
    target = torch.tensor(ids[-n:])
    span = logp[len(ids) - 1 - n:]
    return float(span.gather(-1, target[:, None]).sum()), bool((span.argmax(-1) == target).all())


TEXTS = [("def f(x):\n    return", " x + 1\n"), ("", "import os\n"), ("class A:\n", "    pass"),
         ("x" * 150 + "\n", "y = 2\n"), ("for i in range(10):\n    print(i)\n" * 3, "print('done')\n"),
         ("a = [", "1, 2, 3]"), ("# comment\n", "\n")]


def requests_of(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.mark.parametrize("residual", ["prenorm", "attnres"])
def test_loglikelihood_is_the_forward_byte(residual):
    tok = ByteTokenizer()
    model = make_model(tok.vocab_size, residual)
    lm = ReslabLM(model, tok, batch_size=3)
    got = lm.loglikelihood(requests_of("loglikelihood", TEXTS))
    for (context, continuation), (score, greedy) in zip(TEXTS, got, strict=True):
        head, tail = lm._encode_pair(context, continuation) if context else ([tok.eot_id], tok.encode(continuation))
        assert head + tail == ([tok.eot_id] if not context else []) + tok.encode(context + continuation)
        want, want_greedy = direct_loglikelihood(model, head, tail)
        assert score == pytest.approx(want, abs=1e-6) and greedy == want_greedy


def test_loglikelihood_is_the_forward_bpe():
    docs = [d.text for _, d in zip(range(30), stdlib_documents(), strict=False)]
    tok = train_bpe(docs, 400)
    model = make_model(tok.vocab_size)
    lm = ReslabLM(model, tok, batch_size=4)
    got = lm.loglikelihood(requests_of("loglikelihood", TEXTS))
    for (context, continuation), (score, _) in zip(TEXTS, got, strict=True):
        if not context:
            head, tail = [tok.eot_id], tok.encode(continuation)
        else:
            stripped = context.rstrip()
            head = tok.encode(stripped)
            tail = tok.encode(context + continuation)[len(head):]
        assert score == pytest.approx(direct_loglikelihood(model, head, tail)[0], abs=1e-6)


def test_the_batch_size_does_not_change_a_score():
    tok = ByteTokenizer()
    model = make_model(tok.vocab_size)
    one = ReslabLM(model, tok, batch_size=1).loglikelihood(requests_of("loglikelihood", TEXTS))
    many = ReslabLM(model, tok, batch_size=16).loglikelihood(requests_of("loglikelihood", TEXTS))
    assert np.allclose([s for s, _ in one], [s for s, _ in many], atol=1e-9, rtol=0)


def test_rolling_loglikelihood_is_the_disjoint_windows():
    tok = ByteTokenizer()
    model = make_model(tok.vocab_size, seq_len=32)
    texts = ["short text", "x = 1\n" * 20]                        # 10 tokens; 120 tokens: four windows of 32
    got = ReslabLM(model, tok, batch_size=2).loglikelihood_rolling(requests_of("loglikelihood_rolling",
                                                                               [(t,) for t in texts]))
    for text, score in zip(texts, got, strict=True):
        ids = tok.encode(text)
        done = min(len(ids), 32)
        want = direct_loglikelihood(model, [tok.eot_id], ids[:done])[0]    # the first window: from end-of-text
        while done < len(ids):                                             # then 32 more, on the 32 before
            end = min(done + 32, len(ids))
            want += direct_loglikelihood(model, ids[:done], ids[done:end])[0]
            done = end
        assert score == pytest.approx(want, abs=1e-6)


def test_generate_until_is_greedy_decoding_cut_at_the_stop():
    tok = ByteTokenizer()
    model = make_model(tok.vocab_size)
    prompts = ["def f(x):\n", "import"]
    lm = ReslabLM(model, tok, batch_size=2)
    got = lm.generate_until(requests_of("generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 12})
                                                           for p in prompts]))
    for prompt, text in zip(prompts, got, strict=True):
        ids = tok.encode(prompt)
        new = []
        with torch.no_grad():
            for _ in range(12):
                token = int(model(torch.tensor([ids + new])).logits[0, -1, : tok.vocab_size].argmax())
                new.append(token)
                if token == tok.eot_id:
                    break
        want = tok.decode([t for t in new if t != tok.eot_id]).split("\n\n")[0]
        assert text == want


def test_generate_until_returns_what_decoder_generate_returns():
    """Batched prompts of different lengths, greedy, stopped at end-of-text or `max_gen_toks`, then cut at the
    first `until` string: the text of `Decoder.generate`'s tokens (the model's own KV-cache decoding, which
    `reslab generate` runs) on a model whose vocabulary is exactly the tokenizer's (a BPE of 448 ids, a multiple of
    the vocabulary's padding), so the adapter's mask of padded ids changes nothing. (With the byte tokenizer's 257
    of 320 ids an untrained model picks padded ids, which the adapter never generates.)"""
    from reslab.models.decoding import GenerateOptions

    docs = [d.text for _, d in zip(range(30), stdlib_documents(), strict=False)]
    tok = train_bpe(docs, 448)
    model = make_model(tok.vocab_size)
    assert model.shape.vocab_size == tok.vocab_size
    prompts = ["def f(x):\n    return", "import", "class A:\n    def __init__(self):\n        self.x = 1\n", "#"]
    until = ["\n", "x"]
    lm = ReslabLM(model, tok, batch_size=3)
    got = lm.generate_until(requests_of("generate_until", [(p, {"until": until, "max_gen_toks": 10})
                                                           for p in prompts]))
    options = GenerateOptions(max_new_tokens=10, stop_tokens=(tok.eot_id,), pad_id=tok.eot_id)
    with torch.no_grad():
        outputs = model.generate([tok.encode(p) for p in prompts], options)
    cut = 0
    for text, ids in zip(got, outputs, strict=True):
        whole = want = tok.decode([t for t in ids if t != tok.eot_id])
        for stop in until:
            want = want.split(stop)[0]
        cut += want != whole
        assert text == want
    assert cut and any(got)  # some text was cut at a stop string, and some was generated
