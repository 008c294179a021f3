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

REMOVABLE = [(name, {}) for name, cls in variants().items() if {"source", "stream"} & set(cls.intervention_kinds)]
KNOBS = [  # the knobs that change what a read's sources are or how it weighs them
    ("attnres", {"query_form": "scalar"}), ("attnres", {"query_form": "input", "score": "sigmoid"}),
    ("block_attnres", {"block_size": 3}), ("dar", {"block_size": 2, "key_source": "value", "mix": "learned"}),
    ("delta_attnres", {"null_source": True, "route_first": True, "pre_gated": True, "gate": "sigmoid_vector"}),
    ("delta_attnres", {"sources": "cumulative", "heads": 2}), ("delta_block", {"route_first": True, "num_blocks": 2}),
    ("depth_swa", {"window": 3, "query": "projected"}), ("denseformer", {"dilation": 2}),
    ("hyper_connections", {"init": "mhar_baseline", "dynamic": True}), ("mhc", {"variant": "lite", "streams": 3}),
    ("mgr", {"per": "layer", "gate_type": "softmax"}), ("rd_attnres", {"parent": "full", "value_route": "fixed"}),
    ("rd_attnres", {"value_route": "merged"}),
]


@pytest.mark.parametrize("name,options", REMOVABLE + KNOBS)
def test_mean_of_a_source_constant_over_tokens_changes_nothing(name, options):
    """Every window holds one token repeated: every source, stream and read is the same at every
    token, so its mean over the windows is itself ("mean": delta 0), while "zero" changes the loss.
    Every entry of the menu runs (a read whose sources and labels disagree raises)."""
    model = trained(name, options)
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


# --- gates pinned: the variants' formulas written out --------------------------------------------------------

def pinned(site: int, pin_site: int | None, pin: float | None) -> float | None:
    return pin if pin is not None and (pin_site is None or pin_site == site) else None


def hand_review_loss(model, batches, pin_site: int | None, pin: float) -> float:
    """Review written out, h' = h + r u (additive) or h + r (u - h) (convex), r = sigma(W [RMSNorm(h); RMSNorm(u)] + b),
    with r = `pin` at `pin_site` (None: every site)."""
    p, eps = model.pathway, model.shape.norm_eps
    (x, y), = batches
    with torch.no_grad():
        h = model.embed(x)
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            u = sub(norm(h))
            gate = p.gates[k]
            r = pinned(k, pin_site, pin)
            if r is None:
                r = torch.sigmoid(torch.cat([rms_norm(h, eps), rms_norm(u, eps)], -1) @ gate.weight.T + gate.bias)
            h = h + r * u if p.config.form == "additive" else h + r * (u - h)
        return loss_of(F.linear(model.final_norm(h), model.embed.weight), y)


@pytest.mark.parametrize("form", ["additive", "convex"])
@pytest.mark.parametrize("pin_site,mode", [(2, "open"), (3, "closed"), (None, "open"), (None, "closed")])
def test_review_gate_pinned_is_the_formula_with_that_r(form, pin_site, mode):
    model = trained("review", {"form": form})
    batches = batch()
    row = one(model, Intervention("gate", pin_site, "gate", mode), batches)
    expected = hand_review_loss(model, batches, pin_site, 1.0 if mode == "open" else 0.0)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0


def test_highway_and_ddl_gates_closed_everywhere_ignore_every_sublayer():
    """Every gate closed: h' = h at every site (highway: r = 0; DDL: beta = 0), so the head reads the embedding."""
    (x, y), = batches = batch()
    for name in ("highway", "ddl"):
        model = trained(name)
        with torch.no_grad():
            expected = loss_of(F.linear(model.final_norm(model.embed(x)), model.embed.weight), y)
        assert one(model, Intervention("gate", None, "gate", "closed"), batches)["loss"] == pytest.approx(expected,
                                                                                                            rel=1e-6)


def test_ddl_gate_open_is_the_projection():
    """beta = 1 at one site: x' = x + k (v - k . x), written out with the site's own k and v."""
    model = trained("ddl")
    p = model.pathway
    (x, y), = batches = batch()
    with torch.no_grad():
        h = model.embed(x)
        for site, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            u = sub(norm(h))
            k = u / torch.sqrt((u * u).sum(-1, keepdim=True) + p.config.k_eps ** 2)
            beta = 1.0 if site == 4 else 2 * torch.sigmoid(p.beta[site](rms_norm(h, model.shape.norm_eps)))
            v = 4 * torch.sigmoid(p.value[site](h))
            h = h + beta * (v - (k * h).sum(-1, keepdim=True)) * k
        expected = loss_of(F.linear(model.final_norm(h), model.embed.weight), y)
    assert one(model, Intervention("gate", 4, "gate", "open"), batches)["loss"] == pytest.approx(expected, rel=1e-6)


def hand_mgr_loss(model, batches, pin_site=None, pin=None, drop: int | None = None, drop_site=None) -> float:
    """MGR (per sublayer) written out: s_i <- s_i + beta_i (F - s_i), beta_i = sigma(w_beta . RMSNorm(s_i) / sqrt(d)
    + b_i) (or `pin`), h = sum_i softmax_i(w_alpha . RMSNorm(s_i) / sqrt(d)) s_i over the streams but `drop`
    (at the read of `drop_site`, the site after the module's; None: every read)."""
    p, eps, d = model.pathway, model.shape.norm_eps, model.shape.d_model
    (x, y), = batches
    with torch.no_grad():
        e = model.embed(x)
        streams, h = [e] * p.config.streams, e
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            u = sub(norm(h))
            new = []
            for i, s in enumerate(streams):
                beta = pinned(k, pin_site, pin)
                if beta is None:
                    score = (rms_norm(s, eps) * p.w_beta[k]).sum(-1, keepdim=True) / d ** 0.5
                    beta = torch.sigmoid(score + p.b_beta[k, i])
                new.append(s + beta * (u - s))
            streams = new
            read = [s for i, s in enumerate(streams) if not (i == drop and drop_site in (None, k + 1))]
            alpha = torch.softmax(torch.stack([(rms_norm(s, eps) * p.w_alpha[k]).sum(-1) / d ** 0.5 for s in read]), 0)
            h = (alpha.unsqueeze(-1) * torch.stack(read)).sum(0)
        return loss_of(F.linear(model.final_norm(h), model.embed.weight), y)


@pytest.mark.parametrize("asked,hand", [
    (Intervention("gate", 3, "gate", "open"), dict(pin_site=3, pin=1.0)),
    (Intervention("gate", None, "gate", "closed"), dict(pin_site=None, pin=0.0)),
    (Intervention("source", 4, "stream1", "zero"), dict(drop=1, drop_site=4)),
    (Intervention("stream", None, "stream3", "zero"), dict(drop=3)),
])
def test_mgr_pins_and_drops_are_the_formula(asked, hand):
    model = trained("mgr")
    batches = batch()
    row = one(model, asked, batches)
    assert row["loss"] == pytest.approx(hand_mgr_loss(model, batches, **hand), rel=1e-6)
    assert row["delta"] != 0.0


# --- streams removed ------------------------------------------------------------------------------------------

def hand_hc_loss(model, batches, drop: int, drop_site: int | None) -> float:
    """Static Hyper-Connections written out: read sum_i A_m[i] H_i, write H' = A_r^T H + B u, readout the mean of
    the streams; stream `drop` left out of the read of `drop_site` (None: every read, the readout's included)."""
    p = model.pathway
    n = p.config.streams
    (x, y), = batches
    with torch.no_grad():
        e = model.embed(x)
        hs = [e] * n
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            keep = [i for i in range(n) if not (i == drop and drop_site in (None, k))]
            u = sub(norm(sum(p.read[k, i] * hs[i] for i in keep)))
            hs = [sum(p.mix[k, i, j] * hs[i] for i in range(n)) + p.write[k, j] * u for j in range(n)]
        keep = [i for i in range(n) if not (i == drop and drop_site in (None, model.shape.n_sites))]
        h = sum(hs[i] for i in keep) / len(keep)
        return loss_of(F.linear(model.final_norm(h), model.embed.weight), y)


@pytest.mark.parametrize("asked,drop_site", [
    (Intervention("stream", None, "stream1", "zero"), None),
    (Intervention("source", 5, "stream1", "zero"), 5),
    (Intervention("source", 6, "stream2", "zero"), 6),
])
def test_hyper_connections_stream_drop_is_the_hand_read(asked, drop_site):
    model = trained("hyper_connections")
    batches = batch()
    row = one(model, asked, batches)
    drop = int(asked.source.removeprefix("stream"))
    assert row["loss"] == pytest.approx(hand_hc_loss(model, batches, drop, drop_site), rel=1e-6)
    assert row["delta"] != 0.0


def test_dar_stream_drop_changes_only_what_the_branch_and_the_head_read():
    """Stream a removed: every branch input is N r^b and the readout N r^b (the mix gives b all of it),
    with the streams' reads and writes as the unmodified model computes them (driven through the contract)."""
    model = trained("dar")
    p = model.pathway
    (x, y), = batches = batch()
    with torch.no_grad():
        state = p.start(model.embed(x))
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            state = p.prepare(state, k)
            n_sources = len(state.streams[0].sources())
            state = p.update(state, k, sub(norm(n_sources * state.reads[1])))
        _, r_b = p._read(state, model.shape.n_sites)
        h = len(state.streams[0].sources()) * r_b
        expected = loss_of(F.linear(model.final_norm(h), model.embed.weight), y)
    row = one(model, Intervention("stream", None, "a", "zero"), batches)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0


def test_dar_source_knockout_renormalises_that_streams_read():
    """Source a.s1 at site 3 dropped: stream a's read there is the softmax over its other entries, keys from
    stream b's states (cross addressing), written out; every other read is the unmodified model's."""
    model = trained("dar")
    p, eps = model.pathway, model.shape.norm_eps
    (x, y), = batches = batch()
    with torch.no_grad():
        state = p.start(model.embed(x))
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            state = p.prepare(state, k)
            if k == 3:
                a, b = state.streams
                keep = [i for i in range(len(a.values)) if i != 2]          # [emb, s0, s1, s2]: drop s1
                values, keys = torch.stack([a.values[i] for i in keep]), torch.stack([b.states[i] for i in keep])
                logits = (rms_norm(keys, eps) * p.key_gains[3, 0] * p.queries[3, 0]).sum(-1)
                r_a = (torch.softmax(logits, 0).unsqueeze(-1) * values).sum(0)
                state.reads = (r_a, state.reads[1])
            x_in = len(state.streams[0].sources()) * 0.5 * (state.reads[0] + state.reads[1])
            state = p.update(state, k, sub(norm(x_in)))
        h = p.readout(state)
        expected = loss_of(F.linear(model.final_norm(h), model.embed.weight), y)
    row = one(model, Intervention("source", 3, "a.s1", "zero"), batches)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0


# --- Delta AttnRes, DenseFormer and depth SWA written out ------------------------------------------------------

def test_delta_attnres_knockout_renormalises_the_additive_read():
    """Delta AttnRes (bias gate, stream_scale): site s reads (h + sum_i softmax_i(q_s . RMSNorm_{g_s}(v_i)) v_i) / c_s,
    c_s = 1 + 1/N_s over the N_s values read; at site 4 the value s2 is left out (N_4 = 4 of 5)."""
    model = trained("delta_attnres")
    p, eps = model.pathway, model.shape.norm_eps
    (x, y), = batches = batch()
    with torch.no_grad():
        h = model.embed(x)
        sources = [h]
        for k, (norm, sub) in enumerate(zip(model.norms, model.sublayers, strict=True)):
            read = h
            if k >= 1:                                       # layer 0's attention is not routed
                values = [v for i, v in enumerate(sources) if not (k == 4 and i == 3)]
                stacked = torch.stack(values)
                logits = (rms_norm(stacked, eps) * p.key_gains[k - 1] * p.queries[k - 1]).sum(-1)
                read = (h + (torch.softmax(logits, 0).unsqueeze(-1) * stacked).sum(0)) / (1 + 1 / len(values))
            u = sub(norm(read))
            h = h + u
            sources.append(u)
        expected = loss_of(F.linear(model.final_norm(h), model.embed.weight), y)
    row = one(model, Intervention("source", 4, "s2", "zero"), batches)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0


def test_denseformer_knockout_drops_a_term_of_the_average():
    """DenseFormer 1x1: y_i = sum_j a_ij x_j after every block; the DWA after block 2 (read at site 4) without x_1."""
    model = trained("denseformer")
    p = model.pathway
    (x, y), = batches = batch()
    with torch.no_grad():
        outputs = [model.embed(x)]
        h = outputs[0]
        for layer in range(model.shape.n_layers):
            h = h + model.sublayers[2 * layer](model.norms[2 * layer](h))
            h = h + model.sublayers[2 * layer + 1](model.norms[2 * layer + 1](h))
            outputs.append(h)
            i = layer + 1
            a = p.dwa[str(i)].weight.view(-1)
            h = sum(a[j] * outputs[j] for j in range(i + 1) if not (i == 2 and j == 1))
        expected = loss_of(F.linear(model.final_norm(h), model.embed.weight), y)
    row = one(model, Intervention("source", 4, "x1", "zero"), batches)
    assert row["loss"] == pytest.approx(expected, rel=1e-6)
    assert row["delta"] != 0.0


def test_depth_swa_menu_is_the_window_and_its_knockout_is_attnres_over_the_window():
    """With window 2 plus the embedding, site 5 reads emb, s3, s4; dropping s3 there equals Full AttnRes's
    read of the same sources without s3 (the hand loop above, which reads every source elsewhere: window 64)."""
    model = trained("depth_swa", {"window": 2, "query_init": "normal"})
    assert [i.source for i in menu(model.pathway, "zero") if i.site == 5] == ["emb", "s3", "s4"]
    wide = trained("depth_swa", {"window": 64, "query_init": "normal"})
    batches = batch()
    row = one(wide, Intervention("source", 5, "s3", "zero"), batches)
    assert row["loss"] == pytest.approx(hand_attnres_loss(wide, batches, 5, 4, True), rel=1e-6)
