"""`--json`: every command's document validates against its shipped schema (JSON Schema draft 2020-12, checked by
`jsonschema`, an implementation independent of reslab), stdout holds exactly that one document, and a failure
keeps its exit code and prints a `reslab.error/1` document."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest
import readout_fixture

from reslab.orchestrator.cli import main
from reslab.orchestrator.cli.jsonout import document, plain, schema, schema_id, schemas


def validate(doc: dict, command: str) -> None:
    jsonschema.Draft202012Validator(schema(command), format_checker=jsonschema.FormatChecker()).validate(doc)


def one_document(out: str) -> dict:
    """stdout parsed as exactly one JSON document: `json.loads` refuses anything before or after it."""
    doc = json.loads(out)
    assert isinstance(doc, dict)
    return doc


def run_json(capsys, argv: list[str], command: str, code: int = 0) -> tuple[dict, str]:
    assert main(argv) == code
    captured = capsys.readouterr()
    doc = one_document(captured.out)
    assert doc["schema"] == schema_id(command)
    validate(doc, command)
    return doc, captured.err


# --- the framework ------------------------------------------------------------------------------------
COMMANDS = {"validate", "plan", "status", "compare", "export", "power", "check"}


def test_every_schema_is_valid_draft_2020_12_and_names_its_id():
    shipped = schemas()
    assert {c for c, _ in shipped} >= COMMANDS | {"error"}
    for command, version in shipped:
        s = schema(command, version)
        jsonschema.Draft202012Validator.check_schema(s)
        assert s["$id"] == schema_id(command, version)
        assert s["properties"]["schema"] == {"const": schema_id(command, version),
                                             "description": "This document's schema id."}
        assert {"schema", "reslab_version"} <= set(s["required"]) and s["additionalProperties"] is False


def test_a_wrong_document_fails_validation():
    doc = document("error", {"command": "compare", "error": {"kind": "ConfigError", "message": "x", "exit_code": 2}})
    validate(doc, "error")
    for broken in ({**doc, "extra": 1}, {**doc, "schema": "reslab.error/2"},
                   {**doc, "error": {**doc["error"], "exit_code": 3}},
                   {k: v for k, v in doc.items() if k != "command"}):
        with pytest.raises(jsonschema.ValidationError):
            validate(broken, "error")


def test_values_are_made_plain():
    from pathlib import Path

    import pandas as pd

    value = {"nan": float("nan"), "inf": np.float64("inf"), "i": np.int64(3), "arr": np.array([1.5, np.nan]),
             "path": Path("/a/b"), "na": pd.NA, 4: {1, 2}, "frame": pd.DataFrame({"x": [1, 2], "y": [0.5, None]})}
    assert plain(value) == {"nan": None, "inf": None, "i": 3, "arr": [1.5, None], "path": "/a/b", "na": None,
                            "4": [1, 2], "frame": [{"x": 1, "y": 0.5}, {"x": 2, "y": None}]}
    with pytest.raises(TypeError, match="no JSON form for a object"):
        plain(object())


def test_a_usage_error_under_json_prints_the_error_document(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "highway", "--layers", "0", "--json"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    doc = one_document(captured.out)
    validate(doc, "error")
    assert doc["command"] == "check" and doc["error"]["kind"] == "usage" and doc["error"]["exit_code"] == 2
    assert "--layers" in doc["error"]["message"] and captured.err.count("\n") == 1


def test_a_reslab_error_under_json_keeps_its_code_and_line(capsys):
    doc, err = run_json(capsys, ["check", "atnres", "--json"], "error", code=2)
    assert doc["command"] == "check" and doc["error"]["kind"] == "ConfigError"
    assert err.startswith("reslab: error: ") and err.count("\n") == 1 and doc["error"]["message"] in err


# --- check ---------------------------------------------------------------------------------------------
def test_check_json(capsys):
    doc, _ = run_json(capsys, ["check", "highway", "--only", "identity,seed,float32", "--json"], "check")
    assert doc["passed"] is True and doc["failed"] == [] and doc["variant"] == "highway"
    assert [(c["name"], c["status"]) for c in doc["checks"]] == [("identity", "pass"), ("seed", "pass"),
                                                                 ("float32", "skip")]
    assert doc["checks"][2]["passed"] is None


# --- the study commands, on `readout_fixture`'s synthetic records (no training) -----------------------------
# its study without the ladder: the ladder's seed bootstrap alone takes ~20 s of `compare` on 2 loaded cores; the
# rest of its readouts (sequential looks, a failed run, costs, contrasts, a comparison at equal FLOPs) stay
STUDY = re.sub(r"ladder:\n(  .*\n)+", "grid:\n  model.n_layers: [2, 3]\n", readout_fixture.STUDY).replace(
    "seq_len: 32}", "seq_len: 32, d_model: 16, ffn_hidden: 32}").replace("train: {eval_every",
                                                                         "train: {steps: 4, eval_every")


@pytest.fixture(scope="module")
def fixture_study(tmp_path_factory):
    directory = tmp_path_factory.mktemp("json")
    _, runs, workspace = readout_fixture.build(directory, STUDY)
    return str(directory / "golden.yaml"), ["--workspace", str(workspace.root)], runs, directory


def test_validate_json(fixture_study, capsys, tmp_path):
    spec, _, runs, _ = fixture_study
    doc, _ = run_json(capsys, ["validate", spec, "--json"], "validate")
    assert doc["ok"] is True and doc["problems"] == [] and doc["study"]["runs"] == len(runs)
    assert doc["study"]["sequential"]["looks"] == [3, 5, 7] and doc["study"]["arms"] == ["control", "attnres", "block"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(STUDY.replace("mei: 0.02", "mei: -1"))
    doc, err = run_json(capsys, ["validate", str(bad), "--json"], "validate", code=2)
    assert doc["ok"] is False and doc["study"] is None and err.count("\n") == 1
    assert doc["problems"][0]["field"] == "comparisons[0].mei" and doc["problems"][0]["message"] in err


def test_plan_and_status_json(fixture_study, capsys):
    spec, ws, runs, _ = fixture_study
    doc, err = run_json(capsys, ["plan", spec, *ws, "--json"], "plan")
    assert err.startswith("workspace ") and doc["runs"] == len(runs) == len(doc["entries"])
    # the synthetic runs hold no summary.json, so no look counts as read: the first is in progress
    assert doc["counts"]["runs"] == len(runs) and doc["sequential"]["looks"] == [3, 5, 7]
    assert doc["sequential"]["current"] == 3 and doc["later"] == doc["sequential"]["later"] > 0
    assert [e["run_id"] for e in doc["entries"]] == [r.run_id for r in runs]
    assert doc["placement"] is None and doc["on_gpus"] is False and doc["budget"]
    doc, _ = run_json(capsys, ["status", spec, *ws, "--json"], "status")
    assert doc["total"] == len(runs) and sum(doc["counts"].values()) == len(runs)
    assert doc["counts"]["failed"] == 1 and doc["sequential"]["current"] == 3
    assert {r["state"] for r in doc["runs"]} <= {"succeeded", "failed", "to run", "later look", "not needed"}


def test_compare_and_export_json(fixture_study, capsys, tmp_path):
    spec, ws, runs, directory = fixture_study
    doc, _ = run_json(capsys, ["compare", spec, *ws, "--cached", "--json"], "compare")
    assert list(doc["readouts"]) == ["sequential", "paired", "costs", "contrasts"]
    assert doc["runs"]["finished"] == doc["runs"]["total"] - 1 and doc["runs"]["unfinished"][0]["status"] == "FAILED"
    paired = doc["readouts"]["paired"]
    first = paired[0]
    assert first["seeds"] == [0, 1, 2, 3, 4] and len(first["control_run_ids"]) == 5
    assert first["verdict"] == "inconclusive"
    assert first["ci_low"] < first["mean_delta"] < first["ci_high"]
    assert {r["decision"] for r in doc["readouts"]["sequential"]} <= {"undecided", "better", "worse", "equivalent"}
    # the same numbers the text prints: the CSV export's rows, written from the same table
    import pandas as pd

    out = tmp_path / "x.csv"
    doc2, _ = run_json(capsys, ["export", spec, *ws, "--cached", "--format", "csv", "-o", str(out), "--json"], "export")
    assert doc2["path"] == str(out.resolve()) and doc2["comparison_rows"] == len(paired)
    table = pd.read_csv(out)
    assert np.allclose(table["mean_delta"].iloc[: len(paired)], [r["mean_delta"] for r in paired])


def test_power_json(fixture_study, capsys):
    spec, _, _, _ = fixture_study
    doc, _ = run_json(capsys, ["power", spec, "--sd", "0.02", "--json"], "power")
    assert doc["mode"] == "sd" and [r["comparison"] for r in doc["rows"]] == ["main", "per-flop"]
    assert doc["sequential"] is None and doc["tasks"] is None
    doc, _ = run_json(capsys, ["power", spec, "--task-gain", "0.02", "--seed-sd", "0.01", "--items", "200", "--json"],
                      "power")
    assert doc["mode"] == "tasks" and doc["tasks"][0]["items_now"] == 200


def test_a_real_process_prints_one_document(fixture_study):
    """The `reslab` entry point as a user runs it: whatever the libraries write, stdout holds the one document."""
    spec, ws, _, _ = fixture_study
    proc = subprocess.run([sys.executable, "-m", "reslab.orchestrator.cli", "status", spec, *ws, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    validate(one_document(proc.stdout), "status")
    assert proc.stderr.startswith("workspace ")
