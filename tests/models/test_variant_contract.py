"""The contract every registered residual variant keeps, checked for each variant the registry holds
(a new variant is covered without editing this file):

- causality: changing future tokens leaves the logits of earlier positions unchanged;
- gradient reach: with the pathway moved off its init, every parameter gets a nonzero gradient;
- untouched backbone init (issue 10's "pairs without holes"): the backbone's parameters, and the
  global RNG after the build, equal prenorm's for the same seed, for the default knobs, every value
  of every Literal knob, every flipped bool and a non-default value of every numeric knob;
- the identities each variant declares (`ResidualPathway.identities`, its paper's claims), each
  checked in float64 at the shipped RMSNorm eps (ModelConfig's default, 1e-6): logits, loss and
  every backbone gradient, to rounding (issue 20: "prenorm up to the RMSNorm eps" was off by 8%
  in the logits and 30% in the gradients here, because a zero-query read is the stream / N);
- the `stream_scale` knob's old value (the literal read) still violates a prenorm identity at the
  shipped eps wherever the knob changes the function, and only through the eps.

Causality and gradient reach run over the same knob settings as the backbone check. A setting the
variant refuses (a knob that never fits, e.g. one another variant of the family owns) must be
refused with a ConfigError that names the knob.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import pytest
import torch
from variant_testing import SMALL, VOCAB, make_model, perturb_pathway, tokens

from reslab.models import conformance
from reslab.models.config import ConfigError, ModelConfig
from reslab.models.presets import resolve_model
from reslab.models.residual import variants

# four layers: every knob default fits (delta_block's num_blocks=4 needs L >= 4)
SHAPE = {**SMALL, "n_layers": 4}
SHIPPED_EPS = ModelConfig().norm_eps
# float64 makes a declared identity exact to rounding (~1e-15 here), far inside issue 20's 1e-6 bar
IDENTITY_RTOL = conformance.IDENTITY_RTOL
# the variants the papers gave us; a missing one means discovery broke, not that it may go untested
KNOWN = {
    "attnres", "block_attnres", "block_mhar", "dar", "ddl", "delta_attnres", "delta_block", "denseformer",
    "depth_swa", "highway", "hyper_connections", "mgr", "mhar", "mhc", "prenorm", "rd_attnres", "review", "seq_swa",
}


def build(name: str, options: dict[str, Any], **model: Any) -> torch.nn.Module:
    return make_model(name, options, n_layers=SHAPE["n_layers"], **model)


def _numeric_candidates(tp: type, default: Any) -> list[Any]:
    if tp is int:
        return [2 * default, default + 1] if default > 0 else [1, 2]
    return [2 * default, default / 2] if default != 0 else [0.5, -0.5]


def _accepts(cls: type, knob: str, value: Any) -> bool:
    try:
        config = cls.Config(**{knob: value})
    except (ValueError, TypeError):
        return False
    return not cls.check_shape(config, resolve_model(ModelConfig(**SHAPE), vocab_size=VOCAB))


def knob_settings(cls: type) -> list[tuple[str, dict[str, Any]]]:
    """(id, options): the defaults, then one knob changed at a time (see the module docstring)."""
    out: list[tuple[str, dict[str, Any]]] = [("default", {})]
    hints = typing.get_type_hints(cls.Config)
    for f in dataclasses.fields(cls.Config):
        tp, default = hints[f.name], f.default
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            literals = [a for arg in args if typing.get_origin(arg) is typing.Literal for a in typing.get_args(arg)]
            numeric = [arg for arg in args if arg in (int, float)]
        elif typing.get_origin(tp) is typing.Literal:
            literals, numeric = list(args), []
        elif tp is bool:
            literals, numeric = [not default], []
        else:
            literals, numeric = [], [tp] if tp in (int, float) else []
        values = [v for v in literals if v != default]
        for num_tp in numeric:
            base = default if isinstance(default, int | float) and not isinstance(default, bool) else num_tp(1)
            candidates = _numeric_candidates(num_tp, base)
            # the first candidate the variant accepts at SHAPE; else the first, to be refused visibly
            values.append(next((v for v in candidates if _accepts(cls, f.name, v)), candidates[0]))
        out += [(f"{f.name}={v}", {f.name: v}) for v in values]
    return out


SETTINGS = [pytest.param(name, options, id=f"{name}-{label}")
            for name, cls in variants().items() for label, options in knob_settings(cls)]
IDENTITIES = [pytest.param(name, identity, id=f"{name}-{i}")
              for name, cls in variants().items() for i, identity in enumerate(vars(cls).get("identities", ()))]


def build_or_skip(name: str, options: dict[str, Any], **kw: Any) -> torch.nn.Module:
    """The model; when the variant refuses `options` with a ConfigError naming the knob, the test is skipped
    with that reason (so the count of settings left unchecked shows); a refusal naming no knob fails."""
    try:
        return build(name, options, **kw)
    except ConfigError as exc:
        assert options and all(f"options.{knob}" in str(exc) for knob in options), str(exc)
        pytest.skip(f"{name} refuses {options} at the contract's shape: {exc}")


def test_the_registry_holds_every_known_variant():
    missing = KNOWN - set(variants())
    assert not missing, sorted(missing)


def test_every_knob_has_a_type_the_contract_varies():
    varied = (bool, int, float)
    for name, cls in variants().items():
        for f in dataclasses.fields(cls.Config):
            tp = typing.get_type_hints(cls.Config)[f.name]
            parts = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
            assert all(p in varied or typing.get_origin(p) is typing.Literal for p in parts), (name, f.name, tp)


@pytest.mark.parametrize("name,options", SETTINGS)
def test_backbone_init_and_global_rng_are_prenorms(name, options):
    base = build("prenorm", {})
    rng_after_base = torch.get_rng_state()
    model = build_or_skip(name, options)
    assert torch.equal(torch.get_rng_state(), rng_after_base), "the pathway drew from the global RNG"
    state = model.state_dict()
    for key, value in base.state_dict().items():
        assert torch.equal(value, state[key]), key


@pytest.mark.parametrize("name,options", SETTINGS)
def test_causal(name, options):
    model = build_or_skip(name, options)
    # off its init: uniform depth weights could hide a leak across positions
    perturb_pathway(model, 0.2)
    idx = tokens(t=12)
    with torch.no_grad():
        ref = model(idx).logits
        for t in (0, 4, 9):
            changed = idx.clone()
            changed[:, t + 1:] = (changed[:, t + 1:] + 7) % VOCAB
            out = model(changed).logits
            assert torch.allclose(out[:, : t + 1], ref[:, : t + 1], atol=1e-5), t
            assert not torch.allclose(out[:, t + 1], ref[:, t + 1]), t


@pytest.mark.parametrize("name,options", SETTINGS)
def test_every_parameter_gets_a_gradient(name, options):
    model = build_or_skip(name, options)
    # off its init: zero-initialised routers and gates give their partners no gradient at step 0
    perturb_pathway(model, 0.2)
    idx = tokens(t=12)
    out = model(idx[:, :-1], idx[:, 1:])
    (out.loss if out.aux_loss is None else out.loss + out.aux_loss).backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not silent, silent


def test_every_variant_declares_its_own_identities():
    # declared on the class itself: a subclass never inherits its parent's claims by accident
    undeclared = sorted(name for name, cls in variants().items() if "identities" not in vars(cls))
    assert not undeclared, f"declare `identities` (() with the reason if the paper claims none): {undeclared}"


def test_the_design_cards_identities_are_declared():
    # DESIGN.md: zero pseudo-queries make Full/Block AttnRes, MHAR and Delta AttnRes the baseline at
    # step 0; H=1 MHAR is AttnRes; tied RD is its parent
    claims = {(name, identity.equals) for name, cls in variants().items() for identity in vars(cls)["identities"]}
    assert claims >= {("attnres", "prenorm"), ("block_attnres", "prenorm"), ("mhar", "prenorm"),
                      ("delta_attnres", "prenorm"), ("mhar", "attnres"), ("rd_attnres", "block_attnres")}


def init_differences(model: torch.nn.Module, other: torch.nn.Module) -> dict[str, float]:
    """Relative differences of one training step's forward and backward at init: the logits (max
    |difference| over max |logit|), the loss, and the worst backbone parameter's gradient (max
    |difference| over that gradient's max |entry|, infinite where a backbone parameter has no gradient;
    the pathways' own parameters are not compared): `models.conformance.init_differences`, what
    `reslab check`'s identity check measures."""
    return conformance.init_differences(model, other, tokens(t=13))


@pytest.mark.parametrize("name,identity", IDENTITIES)
def test_declared_identity_holds_at_init_at_the_shipped_eps(float64, name, identity):
    # float64 at the eps every run uses: "prenorm at init" must hold where training starts, not only
    # in the eps -> 0 limit (issue 20)
    model, other = build(name, identity.options), build(identity.equals, identity.equals_options)
    assert model.shape.norm_eps == other.shape.norm_eps == SHIPPED_EPS
    diffs = init_differences(model, other)
    assert max(diffs.values()) <= IDENTITY_RTOL, f"{identity.why}: relative differences {diffs}"


def has_read_scale(cls: type) -> bool:
    """Whether the variant has the `stream_scale` knob (issue 20: reads at the pre-norm stream's scale)."""
    return "stream_scale" in {f.name for f in dataclasses.fields(cls.Config)}


SCALED = [pytest.param(name, identity, id=f"{name}-{i}")
          for name, cls in variants().items() if has_read_scale(cls)
          for i, identity in enumerate(vars(cls)["identities"]) if identity.equals == "prenorm"]


def test_every_variant_claiming_prenorm_at_init_has_the_read_scale_knob():
    claims = {name for name, cls in variants().items() for identity in vars(cls)["identities"]
              if identity.equals == "prenorm" and not identity.options}
    scaled = {name for name, cls in variants().items() if has_read_scale(cls)}
    # denseformer starts as the identity map exactly and seq_swa's zero W_O adds exactly nothing; every
    # other claim reads a scaled copy of the stream
    assert claims - scaled == {"denseformer", "seq_swa"}, sorted(claims - scaled)


@pytest.mark.parametrize("name,identity", SCALED)
def test_the_literal_read_is_prenorm_only_up_to_the_eps(float64, name, identity):
    # stream_scale=False (the papers' literal read, the behaviour before issue 20): wherever it changes
    # the function, it misses the identity at the shipped eps by far more than 1e-6 and meets it
    # once the eps is negligible, so the eps alone is what the knob's default removes
    literal = {**identity.options, "stream_scale": False}
    with torch.no_grad():
        if torch.equal(build(name, literal)(tokens()).logits, build(name, identity.options)(tokens()).logits):
            pytest.skip(f"{name}: the read scale is 1 here (one HC stream, a closed delta gate): nothing to remove")
    shipped = init_differences(build(name, literal), build("prenorm", {}))
    assert shipped["logits"] > 1e-6 and shipped["gradients"] > 1e-6, f"{identity.why}: {shipped}"
    negligible = init_differences(build(name, literal, norm_eps=1e-30), build("prenorm", {}, norm_eps=1e-30))
    assert max(negligible.values()) <= IDENTITY_RTOL, f"{identity.why}: {negligible}"
