"""`--json`: every command's document validates against its shipped schema (JSON Schema draft 2020-12, checked by
`jsonschema`, an implementation independent of reslab), stdout holds exactly that one document, and a failure
keeps its exit code and prints a `reslab.error/1` document."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

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
def test_every_schema_is_valid_draft_2020_12_and_names_its_id():
    shipped = schemas()
    assert {c for c, _ in shipped} >= {"error", "check"}
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
