"""`reslab verdict` on a trained tiny study (issue 55): its `--json` document validates against the shipped schema;
the analysis plan is frozen at the first submission, in the workspace and on the parent MLflow run; changing a
margin after results exist marks exactly that comparison exploratory in the verdict, its JSON and the report,
and says after how many finished runs and what changed; a study never submitted has no frozen plan.

The study trains on the in-process backend (`orch_helpers.submit_quietly`, what `reslab run` runs minus Ray's
start): no Ray is started. The sequential verdicts are read from `readout_fixture`'s synthetic records (no
training). The schema is checked by `jsonschema`, independent of reslab."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import readout_fixture
from orch_helpers import submit_quietly, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.cli.jsonout import schema
from reslab.orchestrator.tracking.store import import_mlflow
from reslab.results.verdict import analysis_of, plan_hash

STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: 4, eval_every: 2, log_every: 1, eval_windows: 8, tail_k: 2}}
  cost: {{measure: false}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
comparisons:
  - {{name: main, control: control, treatments: [attnres], kind: equivalence, margin: {margin}}}
  - {{name: side, control: control, treatments: [attnres], metric: val_loss, mei: 0.05, family: other}}
"""


def verdict_json(capsys, spec, ws, *flags: str) -> dict:
    assert main(["verdict", str(spec), "--workspace", str(ws.root), "--json", *flags]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator(schema("verdict")).validate(doc)
    return doc


@pytest.mark.slow
def test_verdict_json_and_a_margin_changed_after_results_is_exploratory_everywhere(tmp_path, workspace, capsys):
    spec = write_study(tmp_path, "vt", text=STUDY.format(name="vt", margin=0.05))
    study = load_study(spec)
    submit_quietly(study, expand(study), workspace, [])
    frozen = analysis_of(study.comparisons, sequential=study.sequential, contrasts=study.contrasts)

    # the plan is frozen in the workspace and on the submission's parent run
    client = import_mlflow()(tracking_uri=workspace.default_tracking_uri())
    experiment = client.get_experiment_by_name("vt")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.reslab_kind = 'submission'")
    assert parent.data.tags["reslab.analysis_hash"] == plan_hash(frozen)
    logged = json.loads((tmp_path / client.download_artifacts(parent.info.run_id, "analysis_plan.json",
                                                                str(tmp_path))).read_text())
    assert logged["hash"] == plan_hash(frozen) and logged["versions"][0]["analysis"] == frozen

    doc = verdict_json(capsys, spec, workspace)
    assert doc["schema"] == "reslab.verdict/1" and doc["design"] == "fixed"
    assert (doc["runs"], doc["finished_runs"]) == (4, 4)
    assert doc["plan"]["state"] == "frozen" and doc["plan"]["frozen_hash"] == plan_hash(frozen)
    got = {v["comparison"]: v for v in doc["verdicts"]}
    assert set(got) == {"main", "side"}
    for v in got.values():
        assert v["decision"] in ("better", "worse", "equivalent", "undecided") and v["seeds"] == [0, 1]
        assert not v["exploratory"] and v["exploratory_why"] is None and v["compute"]["runs"] == 4
        assert v["compute"]["flops"] > 0 and v["compute"]["run_hours"] > 0
        assert v["next"] == "nothing" if v["decision"] != "undecided" else v["next"].startswith("more seeds: ~")

    # the margin changed after 4 runs finished: that comparison alone is exploratory, in the JSON, text and report
    spec.write_text(STUDY.format(name="vt", margin=0.08))
    doc = verdict_json(capsys, spec, workspace)
    got = {v["comparison"]: v for v in doc["verdicts"]}
    why = "analysis changed after 4 finished runs: margin 0.05 -> 0.08"
    assert got["main"]["exploratory"] and got["main"]["exploratory_why"] == why
    assert not got["side"]["exploratory"] and got["side"]["exploratory_why"] is None
    assert doc["plan"]["state"] == "changed"
    assert doc["plan"]["changes"] == {"main": {"finished_runs": 4, "diffs": ["margin 0.05 -> 0.08"]}}
    assert main(["verdict", str(spec), "--workspace", str(workspace.root)]) == 0
    head, *lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("vt:", "  "))]
    assert head.startswith("vt: 4/4 runs finished; fixed design, alpha 0.05; analysis plan changed")
    assert [line.endswith(f"exploratory: {why}") for line in lines] == [True, False]
    out = tmp_path / "report.html"
    assert main(["report", str(spec), "--workspace", str(workspace.root), "-o", str(out)]) == 0
    capsys.readouterr()
    page = out.read_text()
    note = '<p class="flags" id="exploratory-paired-main"><b>main is exploratory</b>: '
    assert note + why.replace(">", "&gt;") in page and "exploratory-paired-side" not in page

    # the workspace keeps both versions: the frozen one and the change, with the finished runs when it was seen
    versions = json.loads((workspace.root / "analysis" / "vt.json").read_text())["versions"]
    assert [(v["version"], v["finished_runs"], v["hash"]) for v in versions] == [
        (1, 0, plan_hash(frozen)), (2, 4, doc["plan"]["current_hash"])]

    # a study never submitted here has no frozen plan: nothing is exploratory, and the verdict says so
    other = write_study(tmp_path, "never", text=STUDY.format(name="never", margin=0.05))
    doc = verdict_json(capsys, other, workspace)
    assert doc["plan"]["state"] == "not frozen" and doc["finished_runs"] == 0
    assert all(not v["exploratory"] and v["decision"] == "undecided" for v in doc["verdicts"])
    assert not (workspace.root / "analysis" / "never.json").exists()

    # a new arm and its comparison declared after the control has run, before the arm had a result: the plan
    # (a loop's next proposal), while the margin changed after results stays exploratory
    spec.write_text(STUDY.format(name="vt", margin=0.08).replace(
        "  attnres: {residual: attnres}\n", "  attnres: {residual: attnres}\n  block: {residual: block_attnres}\n")
        + "  - {name: added, control: control, treatments: [block], family: third}\n")
    study = load_study(spec)
    submit_quietly(study, expand(study), workspace, [])
    got = {v["comparison"]: v for v in verdict_json(capsys, spec, workspace)["verdicts"]}
    assert not got["added"]["exploratory"] and got["main"]["exploratory_why"] == why
    last = json.loads((workspace.root / "analysis" / "vt.json").read_text())["versions"][-1]
    assert last["finished_by_arm"] == {"attnres": 2, "control": 2}


# `readout_fixture`'s sequential study without its ladder (whose seed bootstrap alone takes ~20 s on 2 loaded cores)
SEQUENTIAL = re.sub(r"ladder:\n(  .*\n)+", "grid:\n  model.n_layers: [2, 3]\n", readout_fixture.STUDY).replace(
    "seq_len: 32}", "seq_len: 32, d_model: 16, ffn_hidden: 32}").replace("train: {eval_every",
                                                                         "train: {steps: 4, eval_every")


def test_a_sequential_studys_verdicts_are_its_looks(tmp_path, capsys):
    study, runs, workspace = readout_fixture.build(tmp_path, SEQUENTIAL)
    doc = verdict_json(capsys, tmp_path / "golden.yaml", workspace, "--cached")
    assert doc["design"] == "sequential" and doc["plan"]["state"] == "not frozen"
    # 3 arms x 2 grid points x 7 seeds; the looks released 5 seeds, and one run failed
    assert (doc["runs"], doc["finished_runs"]) == (len(runs), 6 * readout_fixture.PLANNED_SEEDS - 1) == (42, 29)
    # main: 2 treatments x 2 grid points, per-flop: 1 x 2, in one family of 6 rows: each at alpha / 6
    assert [(v["comparison"], v["treatment"], v["point"]["model.n_layers"]) for v in doc["verdicts"]] == [
        ("main", t, n) for t in ("attnres", "block") for n in ("2", "3")] + [("per-flop", "attnres", n)
                                                                              for n in ("2", "3")]
    for v in doc["verdicts"]:
        assert v["p_value"] is None and v["e_value"] > 0 and v["level"] == pytest.approx(1 - 0.05 / 6)
        assert v["decision"] in ("better", "worse", "equivalent", "undecided", "futility")
        assert v["next"] == "nothing" if v["decision"] != "undecided" else v["next"].startswith("the ")
        assert v["exploratory"] == (v["comparison"] == "per-flop")
        assert v["compute"]["runs"] == 2 * len(v["seeds"])
        assert v["compute"]["flops"] > 0 if v["seeds"] else v["compute"]["flops"] is None
    waiting = [v for v in doc["verdicts"] if not v["seeds"]]  # block's failed seed 1 stops its sequence
    assert [(v["treatment"], v["next"]) for v in waiting] == [
        ("block", "the rerun of seed 1 (the sequence reads seeds in order)")]
    assert all(v["seeds"] == [0, 1, 2, 3, 4] for v in doc["verdicts"] if v not in waiting)
