"""The `interventions:` block (`experiments.interventions`, issue 36): its shape, what it resolves to against each
arm's variant (the model's own menu, `models.interventions.menu`), every mistake one line naming what exists,
`reslab validate` / `run` refusing it with exit 2 before anything is written, `reslab plan` stating its cost in
evaluations of the eval windows (`models.interventions.count`), and the content id."""

from __future__ import annotations

import textwrap

import pytest

from reslab.experiments import SpecError, expand, load_study
from reslab.experiments.interventions import InterventionSpec, cost, intervention_id, parse_interventions, resolve
from reslab.models.interventions import menu
from reslab.models.presets import resolve_model
from reslab.models.residual import build_pathway
from reslab.orchestrator.cli import main

BASE = """
study: s
base:
  model: {preset: tiny, d_model: 32, seq_len: 32, n_layers: 2}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - {control: control, exploratory: true}
"""


def write(tmp_path, block: str):
    path = tmp_path / "s.yaml"
    path.write_text(textwrap.dedent(BASE) + block + "\n")
    return path


def test_the_block_resolves_against_each_arms_menu(tmp_path):
    study = load_study(write(tmp_path, "interventions: {kinds: [sources], mode: [zero, mean], sites: [2, 4]}"))
    spec = study.interventions
    assert spec == InterventionSpec(kinds=("source",), modes=("zero", "mean"), sites=(2, 4))
    cfg = next(r for r in expand(study) if r.arm == "attnres").config
    chosen = resolve(spec, cfg)
    pathway = build_pathway(cfg.residual, resolve_model(cfg.model, vocab_size=256))  # what the menu is read from
    expected = [i for i in menu(pathway) if i.kind == "source" and i.site in (2, 4)]
    assert chosen == expected  # the menu's own order, both modes
    assert {i.source for i in chosen if i.site == 2} == {"emb", "s0", "s1"}
    assert cost(spec, cfg) == len(chosen) + 1  # one evaluation each, plus the unmodified pass
    narrowed = InterventionSpec(kinds=("source",), sites=(4,), sources=("emb",))
    assert resolve(narrowed, cfg) == [i for i in expected if i.site == 4 and i.source == "emb" and i.mode == "zero"]
    assert cost(narrowed, cfg) == 2


@pytest.mark.parametrize(("raw", "message"), [
    ([1], "interventions: expected a mapping"),
    ({"mode": "zero"}, "interventions.kinds: missing"),
    ({"kinds": ["sources"], "where": 1}, "interventions.where: unknown key; allowed: kinds, mode, gates"),
    ({"kinds": ["source"]}, r"interventions.kinds: 'source' is not allowed; allowed: one of sources, streams, gates"),
    ({"kinds": []}, r"interventions.kinds: \[\] is not allowed"),
    ({"kinds": ["sources", "sources"]}, "names one twice"),
    ({"kinds": ["sources"], "mode": "drop"}, r"interventions.mode: 'drop' is not allowed; allowed: one of zero, mean"),
    ({"kinds": ["gates"], "gates": ["half"]}, "interventions.gates: 'half' is not allowed; allowed: one of open"),
    ({"kinds": ["sources"], "sites": [-1]}, r"interventions.sites: \[-1\] is not allowed; allowed: all, or a list"),
    ({"kinds": ["sources"], "sites": "first"}, "interventions.sites: 'first' is not allowed"),
    ({"kinds": ["sources"], "sources": [3]}, r"interventions.sources: \[3\] is not allowed"),
    ({"kinds": ["sources"], "arms": ["ghost"]}, "interventions.arms: 'ghost' is not an arm of the study; allowed: "
                                               "control, attnres"),
])
def test_bad_blocks_are_one_line(raw, message):
    with pytest.raises(Exception, match=message) as info:
        parse_interventions(raw, ["control", "attnres"])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("block", "message"), [
    ("interventions: {kinds: [streams]}",
     r"interventions \(arm control\).kinds: variant 'prenorm' has no streams to intervene on; it has: sources"),
    ("interventions: {kinds: [sources], sites: [9]}",
     r"interventions \(arm control\).sites: site 9 is out of range; allowed: 0, 1, 2, 3, 4"),
    ("interventions: {kinds: [sources], sources: [s7], arms: [attnres]}",
     r"interventions \(arm attnres\).sources: 's7' is not a source it has; allowed: emb, s0, s1, s2, s3"),
])
def test_what_a_variant_lacks_is_one_line_naming_what_exists(tmp_path, block, message):
    with pytest.raises(SpecError, match=message) as info:
        load_study(write(tmp_path, block))
    assert "\n" not in str(info.value)


def test_the_commands_refuse_it_before_writing_anything(tmp_path, capsys):
    path = write(tmp_path, "interventions: {kinds: [streams]}")
    ws = tmp_path / "ws"
    for command in ("validate", "plan", "run"):
        assert main([command, str(path), "--workspace", str(ws)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no streams to intervene on; it has: sources" in err
    assert not ws.exists()


def test_plan_states_the_cost(tmp_path, capsys):
    path = write(tmp_path, "interventions: {kinds: [sources], arms: [attnres]}")
    assert main(["plan", str(path), "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    study = load_study(path)
    cfg = next(r for r in expand(study) if r.arm == "attnres").config
    n = cost(study.interventions, cfg)
    assert n == 15 + 1  # 2 layers: sites 0..4 read 1, 2, 3, 4, 5 earlier sources (emb, s0, ...); + the base pass
    assert f"  attnres: {n} evaluations of {cfg.train.eval_windows} eval windows per run x 2 run(s)" in out
    assert f"  total: {2 * n} evaluations of the eval windows after training" in out
    block = out.split("\ninterventions:", 1)[1].split("  total:", 1)[0]
    assert "attnres" in block and "control" not in block  # the arms it names only


def test_the_content_id_moves_with_the_run_and_the_request_only():
    spec = InterventionSpec(kinds=("source",))
    base = intervention_id("run1", spec)
    assert base == intervention_id("run1", InterventionSpec(kinds=("source",), arms=("a",)))  # arms: not the request
    assert len({base, intervention_id("run2", spec), intervention_id("run1", InterventionSpec(kinds=("stream",))),
                intervention_id("run1", InterventionSpec(kinds=("source",), modes=("mean",))),
                intervention_id("run1", InterventionSpec(kinds=("source",), sites=(1,)))}) == 5
