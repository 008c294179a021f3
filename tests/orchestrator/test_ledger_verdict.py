"""The ledger end to end (issue 55 item 4): two studies with different names and arm names but the same comparison,
the second on a new replicate's seeds, each trained by `submit` (what `reslab run` runs, on the in-process backend:
no Ray), show tries=2 in `reslab verdict --json` (validated against the shipped schema by `jsonschema`); a
re-submission adds no try; `--ledger-correction` decides the first at alpha * 6 / pi^2 and the second at a quarter
of that (`results.tries.spent_alpha`), with its interval at that level."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest
from orch_helpers import submit_quietly, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.cli.jsonout import schema
from reslab.orchestrator.durability.ledger import read_ledger

pytestmark = pytest.mark.slow

STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: 4, eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 2}}
  cost: {{measure: false}}
arms:
  {control}: prenorm
  {treatment}: {{residual: attnres}}
seeds: {seeds}
comparisons:
  - {{name: main, control: {control}, treatments: [{treatment}]}}
"""


def verdicts(capsys, spec, ws, *flags: str) -> list[dict]:
    assert main(["verdict", str(spec), "--workspace", str(ws.root), "--json", *flags]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator(schema("verdict")).validate(doc)
    return doc["verdicts"]


def test_the_same_comparison_under_another_name_is_the_second_try_in_the_verdict(tmp_path, workspace, capsys):
    first = write_study(tmp_path, "la", text=STUDY.format(name="la", control="control", treatment="attnres",
                                                          seeds=2))
    second = write_study(tmp_path, "lb", text=STUDY.format(name="lb", control="base", treatment="routed",
                                                           seeds="{count: 2, replicate: 1}"))
    for spec in (first, first, second):  # the first twice: a re-submission is not a new try
        study = load_study(spec)
        submit_quietly(study, expand(study), workspace, [])
    assert len(read_ledger(workspace.root)) == 2 and len({r["key"] for r in read_ledger(workspace.root)}) == 1

    (a,) = verdicts(capsys, first, workspace)
    (b,) = verdicts(capsys, second, workspace)
    assert a["tries"] == b["tries"] == 2 and a["alpha_used"] == b["alpha_used"] == a["alpha"] == 0.05
    assert b["seeds"] != [0, 1] and len(b["seeds"]) == 2 and a["seeds"] == [0, 1]

    (a1,) = verdicts(capsys, first, workspace, "--ledger-correction")
    (b2,) = verdicts(capsys, second, workspace, "--ledger-correction")
    first_level = 0.05 * 6 / math.pi ** 2
    assert a1["alpha_used"] == pytest.approx(first_level) and b2["alpha_used"] == pytest.approx(first_level / 4)
    assert b2["level"] == pytest.approx(1 - first_level / 4) and b2["alpha"] == 0.05 and b2["tries"] == 2
    assert b2["high"] - b2["low"] > b["high"] - b["low"]  # the wider interval of the stricter level
    assert main(["verdict", str(second), "--workspace", str(workspace.root), "--ledger-correction"]) == 0
    assert f"tried 2 times (alpha {first_level / 4:.3g})" in capsys.readouterr().out
