"""Interventions on a trained model (models/interventions.py, issue 36): every knock-out against an
independent computation of the same forward: forward hooks on the real backbone (prenorm), a
hand-written loop of the variant's equations (AttnRes), or the variant's formula with the gate pinned.
Models are the SMALL test model in float64 with the pathway moved off its init (so reads are not
uniform and gates not at 1/2), one batch of two windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from variant_testing import make_model, perturb_pathway, tokens

from reslab.common.errors import ConfigError
from reslab.models.interventions import Intervention, check, count, effects, menu
from reslab.models.layers import rms_norm
from reslab.models.residual import variants

pytestmark = pytest.mark.usefixtures("float64", "one_thread")


def batch(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(tokens(2, 16, seed), tokens(2, 16, seed + 100))]


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The backbone's loss: cross-entropy on float32 logits (so float64 models agree to ~1e-7)."""
    return float(F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))


def trained(name: str, options: dict | None = None, scale: float = 0.3) -> torch.nn.Module:
    model = make_model(name, options)
    perturb_pathway(model, scale)
    return model


def one(model, intervention: Intervention, batches=None) -> dict:
    return effects(model, batches or batch(), [intervention])[0]


# --- prenorm: forward hooks on the real backbone ------------------------------------------------------------

def hooked_prenorm_loss(model, site: int, source: str, batches, replace=None) -> float:
    """The loss with `source`'s term subtracted from what `site`'s norm reads (plus `replace`, when
    given): forward hooks capture the term and rewrite the norm's input; nothing of the pathway runs."""
    captured: dict[str, torch.Tensor] = {}
    handles = []
    if source == "emb":
        handles.append(model.embed.register_forward_hook(lambda _m, _i, out: captured.__setitem__("t", out)))
    else:
        j = int(source[1:])
        handles.append(model.sublayers[j].register_forward_hook(lambda _m, _i, out: captured.__setitem__("t", out)))
    norm = model.final_norm if site == model.shape.n_sites else model.norms[site]

    def rewrite(_m, args):
        x = args[0] - captured["t"]
        return (x if replace is None else x + replace,)

    handles.append(norm.register_forward_pre_hook(rewrite))
    try:
        (x, y), = batches
        with torch.no_grad():
            return loss_of(model(x).logits, y)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("site,source", [(0, "emb"), (3, "s1"), (5, "s4"), (6, "emb"), (6, "s0"), (6, "s5")])
def test_prenorm_zero_knockout_is_the_stream_without_that_term(site, source):
    model = make_model("prenorm")
    batches = batch()
    row = one(model, Intervention("source", site, source, "zero"), batches)
    assert row["loss"] == pytest.approx(hooked_prenorm_loss(model, site, source, batches), rel=1e-6)
    assert row["delta"] != 0.0


def test_prenorm_mean_knockout_swaps_the_term_for_its_mean_over_the_windows():
    model = make_model("prenorm")
    batches = batch()
    captured = []
    handle = model.sublayers[2].register_forward_hook(lambda _m, _i, out: captured.append(out))
    with torch.no_grad():
        model(batches[0][0])
    handle.remove()
    mean = captured[0].reshape(-1, captured[0].shape[-1]).mean(0)  # over every token of the windows
    row = one(model, Intervention("source", 5, "s2", "mean"), batches)
    assert row["loss"] == pytest.approx(hooked_prenorm_loss(model, 5, "s2", batches, replace=mean), rel=1e-6)
    assert row["delta"] != 0.0


# --- AttnRes: a hand-written loop of the paper's read --------------------------------------------------------

def hand_attnres_loss(model, batches, site: int, drop: int, stream_scale: bool) -> float:
    """Full AttnRes written out: sources [e, f_0, ...]; site k reads sum_i softmax_i(q_k . RMSNorm_{g_k}(v_i)) v_i
    (times the number of sources read with stream_scale); at `site` the source `drop` is left out."""
    p, eps = model.pathway, model.shape.norm_eps
    (x, y), = batches

    def read(sources, k):
        if k == site:
            sources = [v for i, v in enumerate(sources) if i != drop]
        values = torch.stack(sources)
        logits = (rms_norm(values, eps) * p.key_gains[k] * p.queries[k]).sum(-1)
        out = (torch.softmax(logits, 0).unsqueeze(-1) * values).sum(0)
        return out * len(sources) if stream_scale else out

    with torch.no_grad():
        sources = [model.embed(x)]
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            sources.append(sub(norm(read(sources, k))))
        h = read(sources, model.shape.n_sites)
        return loss_of(F.linear(model.final_norm(h), model.embed.weight), y)


@pytest.mark.parametrize("stream_scale", [True, False])
@pytest.mark.parametrize("site,drop", [(1, 0), (4, 2), (6, 6)])
def test_zero_query_attnres_knockout_drops_the_term_and_averages_the_rest(stream_scale, site, drop):
    model = make_model("attnres", {"stream_scale": stream_scale})   # zero queries: uniform reads
    batches = batch()
    label = "emb" if drop == 0 else f"s{drop - 1}"
    row = one(model, Intervention("source", site, label, "zero"), batches)
    expected = hand_attnres_loss(model, batches, site, drop, stream_scale)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0
    if stream_scale:  # a zero-query read without a source is prenorm's stream without that term
        prenorm = make_model("prenorm")
        assert row["loss"] == pytest.approx(one(prenorm, Intervention("source", site, label, "zero"),
                                                batches)["loss"], rel=1e-6)


def test_trained_attnres_knockout_renormalises_the_softmax():
    model = trained("attnres", {"query_init": "normal"}, scale=1.0)
    batches = batch()
    row = one(model, Intervention("source", 5, "s2", "zero"), batches)
    assert row["loss"] == pytest.approx(hand_attnres_loss(model, batches, 5, 3, True), rel=1e-6)


def test_site_zero_without_its_only_source_reads_zeros():
    model = make_model("attnres")
    (x, y), = batch()
    captured = {}
    handle = model.norms[0].register_forward_pre_hook(lambda _m, args: captured.__setitem__("x", args[0]))
    effects(model, [(x, y)], [Intervention("source", 0, "emb", "zero")])
    handle.remove()
    assert torch.count_nonzero(captured["x"]) == 0


# --- mean mode, errors, counts, an untouched model ----------------------------------------------------------

SUPPORTED = [name for name, cls in variants().items() if cls.intervention_kinds]


@pytest.mark.parametrize("name", SUPPORTED)
def test_mean_of_a_source_constant_over_tokens_changes_nothing(name):
    """Every window holds one token repeated: every source, stream and read is the same at every
    token, so its mean over the windows is itself ("mean": delta 0), while "zero" changes the loss."""
    model = trained(name)
    x = torch.full((2, 8), 5, dtype=torch.long)
    batches = [(x, tokens(2, 8, 3))]
    entries = menu(model.pathway)
    rows = effects(model, batches, [i for i in entries if i.mode == "mean"])
    assert rows and max(abs(r["delta"]) for r in rows) < 1e-9
    zero = effects(model, batches, [i for i in entries if i.mode in ("zero", "closed")])
    assert max(abs(r["delta"]) for r in zero) > 1e-4


def test_effects_leaves_the_model_as_it_was():
    model = trained("attnres", {"query_init": "normal"})
    model.train()
    (x, y), = batch()
    before = model(x, y).logits
    params = {k: v.clone() for k, v in model.state_dict().items()}
    effects(model, [(x, y)], menu(model.pathway)[:6])
    after = model(x, y).logits
    assert torch.equal(before, after)
    assert model.training and model.pathway.intervention is None
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())


def test_rows_carry_the_request_and_the_base_loss():
    model = make_model("prenorm")
    batches = batch()
    asked = [Intervention("source", 2, "s0", "zero"), Intervention("source", 6, "emb", "mean")]
    rows = effects(model, batches, asked)
    (x, y), = batches
    with torch.no_grad():
        base = loss_of(model(x).logits, y)
    for row, a in zip(rows, asked, strict=True):
        assert (row["kind"], row["site"], row["source"], row["mode"]) == (a.kind, a.site, a.source, a.mode)
        assert row["base_loss"] == pytest.approx(base, rel=1e-6)
        assert row["delta"] == pytest.approx(row["loss"] - row["base_loss"], abs=1e-15)
        assert row["tokens"] == y.numel()


def test_menu_and_count_of_prenorm():
    p = make_model("prenorm").pathway   # 3 layers: sites 0..5, readout 6; site k reads emb, s0..s{k-1}
    entries = menu(p)
    assert len(entries) == 2 * sum(k + 1 for k in range(7))
    assert entries[:4] == [Intervention("source", 0, "emb", "zero"), Intervention("source", 0, "emb", "mean"),
                           Intervention("source", 1, "emb", "zero"), Intervention("source", 1, "emb", "mean")]
    assert menu(p, "zero") == [i for i in entries if i.mode == "zero"]
    assert count(p, ["source"], "zero") == 28 + 1
    assert count(p, ["source"], ["zero", "mean"], sites=[6]) == 14 + 1
    assert count(p, ["gate"], "open") == 0


@pytest.mark.parametrize("asked,names", [
    (Intervention("source", 9, "emb", "zero"), "sites are 0..6"),
    (Intervention("source", 2, "s5", "zero"), "site 2 reads emb, s0, s1"),
    (Intervention("source", 2, "s0", "erase"), "modes of a source are zero, mean"),
    (Intervention("stream", None, "stream0", "zero"), "'stream' is supported by"),
    (Intervention("gate", None, "gate", "open"), "'gate' is supported by"),
])
def test_bad_requests_name_what_exists(asked, names):
    with pytest.raises(ConfigError) as err:
        check(make_model("prenorm").pathway, [asked])
    assert names in str(err.value) and "\n" not in str(err.value)


def test_a_variant_without_interventions_says_which_have_them():
    unsupported = [name for name, cls in variants().items() if not cls.intervention_kinds]
    if not unsupported:
        pytest.skip("every variant supports interventions")
    with pytest.raises(ConfigError, match="supports none; sources: .*prenorm"):
        menu(make_model(unsupported[0]).pathway)


def test_the_kernels_are_refused():
    model = make_model("attnres")
    model.pathway.impl = "triton"
    with pytest.raises(ConfigError, match="impl='reference' only"):
        check(model.pathway, [])
