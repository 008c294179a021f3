"""`compare`, `status` and `export` without the `--set` flags a study's runs were trained under (issue 52, item
13): the runs the command expands to are missing, and it says that finished runs of the study exist under other
overrides, with the flags that read them. The runs are trained for real, in-process (`submit_quietly`)."""

from __future__ import annotations

import pytest
from orch_helpers import submit_quietly, write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main

pytestmark = pytest.mark.slow  # trains four tiny runs in-process (~40 s on two busy cores)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from reslab.orchestrator.durability.workspace import Workspace

    root = tmp_path_factory.mktemp("overrides")
    spec = write_study(root, "over", steps=4)
    study = load_study(spec, overrides=[("train.steps", 3), ("optim.lr", 0.002)])
    ws = Workspace(root / "ws")
    ws.root.mkdir()
    result = submit_quietly(study, expand(study), ws, [])
    assert result.ok
    return spec, ws


@pytest.mark.parametrize("command", [["status"], ["compare"], ["export", "--format", "csv", "-o", "{out}"]])
def test_runs_under_other_flags_are_named_with_the_flags(trained, command, capsys, tmp_path):
    spec, ws = trained
    argv = [command[0], str(spec), "--workspace", str(ws.root), *[a.format(out=tmp_path / "x.csv")
                                                                    for a in command[1:]]]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: 4 finished run(s) of over in this workspace were run under other overrides; they read with: " \
           "--set optim.lr=0.002 --set train.steps=3" in out
    assert main([*argv[:4], "--set", "train.steps=3", "--set", "optim.lr=0.002", *argv[4:]]) == 0
    assert "note:" not in capsys.readouterr().out  # the flags given: every run found, nothing to say
