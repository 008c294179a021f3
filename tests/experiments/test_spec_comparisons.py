"""Comparisons in the study schema: one type shared with the statistics, every field's errors, and
the shipped studies sized so that each confirmatory comparison can reach alpha."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from reslab.experiments import SpecError, load_study
from reslab.results.comparison import Comparison
from reslab.results.power import attainable_p, check_confirmatory, plan_attainable

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"

BASE = """
study: s
base:
  model: {preset: tiny, d_model: 32, seq_len: 32, n_layers: 2}
  optim: {batch_size: 4}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
  block: {residual: block_attnres}
seeds: 2
grid: {optim.lr: [1.0e-3, 2.0e-3]}
comparisons:
  - control: control
"""


def load(tmp_path: Path, comparisons: str):
    path = tmp_path / "study.yaml"
    path.write_text(textwrap.dedent(BASE).replace("  - control: control\n", textwrap.dedent(comparisons)))
    return load_study(path)


def test_the_spec_builds_the_statistics_type(tmp_path):
    study = load(tmp_path, """\
      - name: eq
        control: attnres
        treatments: [block]
        kind: equivalence
        margin: 0.02
        pool: [optim.lr]
        family: eq
      - {name: sup, control: control, mei: 0.01, exploratory: true, correction: bh, family: sup}
    """)
    eq, sup = study.comparisons
    assert isinstance(eq, Comparison)
    assert (eq.kind, eq.margin, eq.pool, eq.threshold) == ("equivalence", 0.02, ("optim.lr",), 0.02)
    assert (sup.mei, sup.exploratory, sup.correction, sup.treatments) == (0.01, True, "bh", ("attnres", "block"))
    assert sup.direction == "minimize" and sup.metric == "val_loss_tail"


@pytest.mark.parametrize("comparisons,expect", [
    ("  - {control: control, kind: equivalence}\n", ["comparisons[0].margin", "missing", "nats/token"]),
    ("  - {control: control, margin: 0.01}\n", ["comparisons[0].margin", "only for kind: equivalence", "mei"]),
    ("  - {control: control, mei: -0.01}\n", ["comparisons[0].mei", "positive number", "nats/token", "-0.01"]),
    ("  - {control: control, mei: yes}\n", ["comparisons[0].mei", "positive number"]),
    ("  - {control: control, kind: noninferiority}\n", ["comparisons[0].kind", "allowed: superiority, equivalence"]),
    ("  - {control: control, correction: bonferroni}\n", ["comparisons[0].correction", "allowed: holm, bh"]),
    ("  - {control: control, exploratory: maybe}\n", ["comparisons[0].exploratory", "true or false"]),
    ("  - {control: control, pool: [model.preset]}\n",
     ["comparisons[0].pool[0]", "'model.preset' is not a grid axis", "allowed: optim.lr"]),
    ("  - {control: control, pool: [optim.lr, optim.lr]}\n", ["comparisons[0].pool", "repeat"]),
    ("  - {name: a, control: control, family: f}\n  - {name: b, control: attnres, family: f, correction: bh}\n",
     ["comparisons[1].correction", "'bh' differs from 'holm' of 'a' in family 'f'"]),
    ("  - {control: control, mie: 0.01}\n", ["comparisons[0]", "'mie'", "did you mean 'mei'"]),
])
def test_comparison_errors_name_the_field(tmp_path, comparisons, expect):
    with pytest.raises(SpecError) as info:
        load(tmp_path, comparisons)
    message = str(info.value)
    assert "\n" not in message
    for part in expect:
        assert part in message, f"{part!r} not in: {message}"


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_confirmatory_comparisons_can_reach_alpha(path, tmp_path):
    overrides = []
    if path.stem == "delta_from_pretrained":  # it names a local HF checkpoint: the tiny one its header writes
        from reslab.models.hf_import import write_tiny_checkpoint

        overrides = [("train.init_from", f"hf:{write_tiny_checkpoint(tmp_path / 'tiny-qwen3')}")]
    study = load_study(path, overrides=overrides)
    grid = {axis.path: len(axis.values) for axis in study.grid}
    plan = check_confirmatory(study.comparisons, len(study.seeds), grid, 0.05, study=study.name)
    for a in plan:
        assert a.p == attainable_p(a.n_pairs, a.family_size, a.comparison.correction, a.comparison.kind)
    # The header names the effect and SD that sized it (see `reslab power`), or says why it is exploratory.
    header = path.read_text().split("\nstudy:")[0]
    if study.gates is not None:  # decided by its gates, not by comparisons: the header states their error budget
        assert "alpha 0.05" in header, f"{path.name}: header does not state the gates' error budget"
    elif any(not c.exploratory for c in study.comparisons):
        assert "power" in header and "SD" in header, f"{path.name}: header does not say how it was sized"
    else:
        assert "exploratory" in header, f"{path.name}: header does not say the study is exploratory"


def test_quickstart_stays_small_and_exploratory():
    study = load_study(EXPERIMENTS / "quickstart.yaml")
    assert len(study.arms) * len(study.seeds) == 9
    assert all(c.exploratory for c in study.comparisons)
    assert not any(a.reachable for a in plan_attainable(study.comparisons, 3, {}))


def with_contrasts(tmp_path: Path, contrasts: str):
    path = tmp_path / "study.yaml"
    path.write_text(textwrap.dedent(BASE) + "contrasts:\n" + textwrap.dedent(contrasts))
    return load_study(path)


def test_contrasts_parse_into_the_statistics_type(tmp_path):
    study = with_contrasts(tmp_path, """\
        - {name: keeps, fraction: {control: control, full: attnres, cheaper: block}}
        - {name: ni, weights: {block: 1, attnres: -1}, margin: 0.01, metric: val_loss}
        - {weights: {control: -1, attnres: 2, block: -1}}
    """)
    keeps, ni, u = study.contrasts
    assert keeps.kind == "fraction" and keeps.arms == ("control", "attnres", "block")
    assert ni.kind == "non-inferiority" and ni.margin == 0.01 and ni.metric == "val_loss"
    assert u.name == "contrast-2" and u.kind == "linear" and u.weights == (("control", -1.0), ("attnres", 2.0),
                                                                           ("block", -1.0))


@pytest.mark.parametrize("contrast,expect", [
    ("- {weights: {block: 1, attnres: -2}}", "contrasts[0].weights: sum to -1; a contrast's weights sum to 0"),
    ("- {weights: {block: 1, nope: -1}}", "contrasts[0].weights.nope: not an arm; allowed: control, attnres, block"),
    ("- {weights: {block: 1}}", "contrasts[0].weights: expected a mapping of at least two arms"),
    ("- {weights: {block: 1, attnres: 0}}", "contrasts[0].weights.attnres: expected a non-zero number"),
    ("- {fraction: {control: control, full: attnres}}", "contrasts[0].fraction: expected a mapping with exactly"),
    ("- {fraction: {control: control, full: block, cheaper: block}}", "three different arms"),
    ("- {fraction: {control: control, full: attnres, cheaper: block}, margin: 0.1}",
     "contrasts[0].margin: only for `weights:`"),
    ("- {name: a}", "contrasts[0]: give exactly one of `weights:`"),
    ("- {weights: {block: 1, attnres: -1}, margin: -1}", "contrasts[0].margin: expected a positive number"),
    ("- {weights: {block: 1, attnres: -1}, metric: loss}", "contrasts[0].metric: 'loss' is not a metric"),
    ("- {weights: {block: 1, attnres: -1}, wieghts: 1}", "did you mean 'weights'?"),
    ("- {name: a, weights: {block: 1, attnres: -1}}\n- {name: a, weights: {block: 1, control: -1}}",
     "contrasts: name(s) ['a'] repeat"),
])
def test_contrast_mistakes_name_the_field(tmp_path, contrast, expect):
    with pytest.raises(SpecError) as info:
        with_contrasts(tmp_path, contrast + "\n")
    assert expect in str(info.value) and "\n" not in str(info.value)


def with_costs(tmp_path: Path, costs: str, comparisons: bool = True):
    text = textwrap.dedent(BASE)
    if not comparisons:
        text = text.split("comparisons:")[0]
    path = tmp_path / "study.yaml"
    path.write_text(text + f"costs: {costs}\n")
    return load_study(path)


def test_costs_are_cost_metrics_each_comparison_reads_as_a_ratio(tmp_path):
    assert with_costs(tmp_path, "[decode_tps, decode_state_bytes, tokens_per_s]").costs == (
        "decode_tps", "decode_state_bytes", "tokens_per_s")
    assert load(tmp_path, "  - control: control\n").costs == ()


@pytest.mark.parametrize("costs,expect", [
    ("[decode_tsp]", ["costs[0]: 'decode_tsp' is not a cost metric (did you mean 'decode_tps'?)",
                      "allowed: prefill_tps, decode_tps, decode_tps_batch, decode_state_bytes"]),
    ("[val_loss]", ["costs[0]: 'val_loss' is not a cost metric; allowed:", "params_total"]),
    ("[]", ["costs: expected a non-empty list of cost metrics, got []"]),
    ("decode_tps", ["costs: expected a non-empty list", "'decode_tps'"]),
    ("[decode_tps, flops_per_token, decode_tps]", ["costs: decode_tps repeat(s); name each cost metric once"]),
    ("[{decode_tps: 1}]", ["costs[0]", "is not a cost metric"]),
])
def test_cost_errors_are_one_line_naming_what_is_allowed(tmp_path, costs, expect):
    with pytest.raises(SpecError) as info:
        with_costs(tmp_path, costs)
    message = str(info.value)
    assert "\n" not in message
    for part in expect:
        assert part in message, f"{part!r} not in: {message}"


def test_costs_need_comparisons(tmp_path):
    with pytest.raises(SpecError, match="costs: a cost is compared as a ratio within each of the study's comparisons"):
        with_costs(tmp_path, "[decode_tps]", comparisons=False)


def with_mechanisms(tmp_path: Path, mechanisms: str, comparisons: bool = True):
    text = textwrap.dedent(BASE)
    if not comparisons:
        text = text.split("comparisons:")[0]
    path = tmp_path / "study.yaml"
    path.write_text(text + f"mechanisms: {mechanisms}\n")
    return load_study(path)


def test_mechanisms_are_mechanism_metrics_each_comparison_reads_as_a_delta(tmp_path):
    assert with_mechanisms(tmp_path, "[growth, route_max_late]").mechanisms == ("growth", "route_max_late")
    assert load(tmp_path, "  - control: control\n").mechanisms == ()


@pytest.mark.parametrize("mechanisms,expect", [
    ("[growht]", ["mechanisms[0]: 'growht' is not a mechanism metric (did you mean 'growth'?)",
                  "allowed: growth, stream_growth, grad_cv, route_max_late"]),
    ("[val_loss]", ["mechanisms[0]: 'val_loss' is not a mechanism metric; allowed: growth"]),
    ("[]", ["mechanisms: expected a non-empty list of mechanism metrics, got []"]),
    ("[growth, growth]", ["mechanisms: growth repeat(s); name each mechanism metric once"]),
])
def test_mechanism_errors_are_one_line_naming_what_exists(tmp_path, mechanisms, expect):
    with pytest.raises(SpecError) as info:
        with_mechanisms(tmp_path, mechanisms)
    message = str(info.value)
    assert "\n" not in message
    for part in expect:
        assert part in message, f"{part!r} not in: {message}"


def test_mechanisms_need_comparisons(tmp_path):
    with pytest.raises(SpecError, match="mechanisms: a mechanism is compared as a paired delta within each"):
        with_mechanisms(tmp_path, "[growth]", comparisons=False)
