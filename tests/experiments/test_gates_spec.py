"""`gates:` in the study spec (issue 54): the plan it builds, what `reslab plan` says it spends, and one line for
every mistake, naming the field and what is allowed."""

from __future__ import annotations

import re
import textwrap

import pytest

from reslab.common.errors import ConfigError
from reslab.experiments import load_study
from reslab.results.gates import Gate

STUDY = """
study: gated
base: {{model: {{preset: tiny}}, train: {{steps: 10}}}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
  mhc: {{residual: mhc}}
seeds: {seeds}
ladder: {{model.d_model: [32, 48, 64], train.steps: [10, 20, 30]}}
{extra}
gates:
{gates}
"""
GATES = """\
  control: control
  looks: [3, 4, 6]
  target: [1.0e+21, 1.0e23]
  law: {floor: 0.5}
  stages:
    - {name: g1, rungs: [0, 1]}
    - {name: g2, rungs: [2, 0, 1], threshold: 1.05, at: 1.0e+21}"""


def _load(tmp_path, gates: str = GATES, seeds: str = "6", extra: str = ""):
    path = tmp_path / "gated.yaml"
    path.write_text(textwrap.dedent(STUDY.format(seeds=seeds, extra=extra, gates=gates)))
    return load_study(path)


def test_a_gates_section_builds_the_plan_the_driver_reads(tmp_path):
    g = _load(tmp_path).gates
    plan = g.plan
    assert (g.control, g.treatments, g.metric, g.targets, g.max_decades) == (
        "control", ("attnres", "mhc"), "val_loss", (1e21, 1e23), 2.0)
    assert plan.gates == (Gate((0, 1), 1.0, None, "g1"), Gate((0, 1, 2), 1.05, 1e21, "g2"))
    assert (plan.looks, plan.alpha, plan.treatments, plan.form.floor, plan.errors) == ((3, 4, 6), 0.05, 2, 0.5, "each")
    # alpha over 2 gates x 2 treatments, Bonferroni (results.gates.GatePlan.gate_alpha)
    assert plan.gate_alpha() == pytest.approx(0.05 / 4)
    assert g.rungs == (0, 1, 2) and g.worst_runs() == 3 * 3 * 6 and g.least_runs() == 3 * 2 * 3
    fitted = _load(tmp_path, GATES.replace("law: {floor: 0.5}", "law: {floor: null}").replace("[0, 1]", "[0, 1, 2]"))
    assert fitted.gates.plan.form.floor is None


def test_the_plan_lines_state_the_error_spent_at_each_gate_and_in_all(tmp_path):
    g = _load(tmp_path).gates
    flops = {(a, r): 10.0 ** r for a in g.arms for r in range(3)}
    lines = g.lines(flops)
    assert "wrong promotions <= 0.05 and wrong drops <= 0.05 in all" in lines[0]
    assert "0.0125 per gate and treatment" in lines[0]
    # per gate, over its 2 treatments: 2 x 0.0125; the lower bound one-sided at 0.0125 / 3 looks
    assert "wrong promotions <= 0.025 and wrong drops <= 0.025 here" in lines[1]
    assert f"lower bound of a {100 * (1 - 2 * 0.0125 / 3):.2f}% interval" in lines[1]
    assert "k projected to 1e+21 FLOPs is above 1.05" in lines[2]
    # at most: 3 arms x (1 + 10 + 100) FLOPs x 6 seeds; at least: 3 arms x (1 + 10) x 3
    assert "at most 54" in lines[3] and "at least 18" in lines[3]
    assert f"FLOPs at most {3 * 111 * 6:.3g}, at least {3 * 11 * 3:.3g}" in lines[3]
    joint = _load(tmp_path, GATES + "\n  errors: joint").gates.lines()
    assert "every decision right with probability >= 0.95 in all" in joint[0]


@pytest.mark.parametrize(("gates", "seeds", "extra", "message"), [
    (GATES.replace("control: control", "control: nope"), "6", "",
     r"^gates\.control: 'nope' is not an arm; allowed: control, attnres, mhc$"),
    (GATES + "\n  treatments: [attnres, control]", "6", "",
     r"^gates\.treatments\[1\]: 'control' is the control; a treatment must be another arm$"),
    (GATES + "\n  treatments: [attnres, ghost]", "6", "", r"^gates\.treatments\[1\]: 'ghost' is not an arm"),
    (GATES.replace("[3, 4, 6]", "[3, 6, 4]"), "6", "",
     r"^gates\.looks: expected seed counts from 3, increasing .* got \[3, 6, 4\]$"),
    (GATES.replace("[3, 4, 6]", "[2, 4, 6]"), "6", "", r"^gates\.looks: expected seed counts from 3"),
    (GATES, "8", "", r"^gates\.looks: the last look reads 6 seeds, but `seeds:` gives 8; allowed: seeds: 6"),
    (GATES, "[0, 1, 2, 3, 4, 7]", "", r"^seeds: a list of seeds is not allowed: seeds come from the design"),
    (GATES, "{sequential: {start: 4}}", "", r"^seeds: a gates study reads its seeds at gates\.looks; give a count"),
    (GATES.replace("[0, 1]}", "[0, 3]}"), "6", "",
     r"^gates\.stages\[0\]\.rungs: rung 3 is not on the ladder; allowed: 0 to 2 \(the ladder has 3 rungs\)$"),
    (GATES.replace("[0, 1]}", "[1, 1]}"), "6", "", r"^gates\.stages\[0\]\.rungs: rungs repeat: \[1, 1\]$"),
    (GATES.replace("[0, 1]}", "[0]}"), "6", "",
     r"^gates\.stages\[0\]\.rungs: 1 rung\(s\); the law with a fixed floor needs at least 2"),
    (GATES.replace("law: {floor: 0.5}", "law: {}"), "6", "",
     r"^gates\.stages\[0\]\.rungs: 2 rung\(s\); the law with a fitted floor needs at least 3"),
    (GATES.replace("threshold: 1.05", "threshold: 0"), "6", "",
     r"^gates\.stages\[1\]\.threshold: expected a multiplier > 0 \(1\.0: any speed-up\), got 0$"),
    (GATES.replace("at: 1.0e+21", "at: -5"), "6", "", r"^gates\.stages\[1\]\.at: expected a compute in FLOPs > 0"),
    (GATES.replace("name: g2", "name: g1"), "6", "", r"^gates\.stages: name\(s\) \['g1'\] repeat"),
    (GATES.replace("law: {floor: 0.5}", "law: {floor: -1}"), "6", "",
     r"^gates\.law\.floor: expected a fixed floor >= 0"),
    (GATES.replace("law: {floor: 0.5}", "law: {E: 1}"), "6", "", r"^gates\.law: expected a mapping \{floor: E\}"),
    (GATES + "\n  alpha: 1.5", "6", "",
     r"^gates\.alpha: expected a number between 0 and 1 \(e\.g\. 0\.05\), got 1\.5$"),
    (GATES + "\n  errors: some", "6", "", r"^gates\.errors: 'some' is not a budget; allowed: each .*, joint"),
    (GATES + "\n  metric: accuracy", "6", "", r"^gates\.metric: 'accuracy' is not a loss a law fits; allowed: "),
    (GATES + "\n  draws: 5", "6", "", r"^gates\.draws: expected an integer from 100 to 100000, got 5$"),
    (GATES + "\n  max_decades: 0", "6", "", r"^gates\.max_decades: expected a number of decades > 0"),
    (GATES.replace("[1.0e+21, 1.0e23]", "[1.0e+21, 0]"), "6", "", r"^gates\.target\[1\]: expected a compute in FLOPs"),
    (GATES + "\n  when: now", "6", "", r"^gates: unknown key\(s\) 'when'; allowed: control, treatments"),
    (GATES.replace("{name: g1, rungs: [0, 1]}", "{name: g1}"), "6", "", r"^gates\.stages\[0\]\.rungs: missing"),
    ("  control: control\n  looks: [3, 4, 6]\n  stages: []", "6", "", r"^gates\.stages: expected a non-empty list"),
    (GATES, "6", "grid: {optim.lr: [0.001, 0.002]}", r"^grid: a gates study is one ladder"),
])
def test_a_bad_gates_section_is_one_line_naming_the_field(tmp_path, gates, seeds, extra, message):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, gates, seeds, extra)
    said = str(info.value).split("gated.yaml: ", 1)[1]
    assert re.search(message, said) and "\n" not in said


def test_gates_need_a_ladder(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text(textwrap.dedent("""
        base: {model: {preset: tiny}, train: {steps: 10}}
        arms: {control: prenorm, attnres: {residual: attnres}}
        seeds: 3
        gates: {control: control, looks: [3], stages: [{rungs: [0, 1]}]}
    """))
    with pytest.raises(ConfigError, match=r"^.*flat\.yaml: gates: a gates study promotes treatments up a ladder; "
                                          r"add a `ladder:`"):
        load_study(path)


def test_the_shipped_gates_studies_load_with_their_plans():
    cpu = load_study("experiments/gates_cpu.yaml").gates
    assert cpu.names == ("gate1", "gate2") and cpu.treatments == ("attnres", "mhc") and cpu.plan.form.floor == 0.5
