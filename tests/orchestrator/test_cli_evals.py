"""Bad input to a study's evaluations on the command line (issue 34): an unknown task name (with the harness
registry's closest names) and a task whose data set is not available offline are one line each, exit 2, before
anything trains or is written; `reslab eval` checks the same before it reads the workspace. Slow tier: each
command indexes the harness's task registry (about 10 s)."""

from __future__ import annotations

import pytest
from orch_helpers import TINY_STUDY, write_study

pytest.importorskip("lm_eval")

from reslab.orchestrator.cli import main  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("hub_off")]  # nothing here may reach the hub


@pytest.mark.parametrize(("tasks", "says"), [
    ("[reslab_next_line, hellaswg]", r"'hellaswg' is not a task", ),
    ("[arc_easy]", "not in the Hugging Face cache and the hub is offline"),
])
def test_run_refuses_before_anything_trains(tmp_path, capsys, tasks, says):
    path = write_study(tmp_path, text=TINY_STUDY.format(name="tiny", steps=6) + f"evals: {{tasks: {tasks}}}\n")
    ws = tmp_path / "ws"
    ws.mkdir()  # an existing workspace: `run` prestarts no Ray for it (see test_cli_power.py)
    assert main(["run", str(path), "--workspace", str(ws)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("reslab: error: ") and says in err
    if "hellaswg" in tasks:
        assert "did you mean 'hellaswag'" in err
    assert not any(ws.iterdir())  # nothing written, nothing trained


def test_eval_refuses_an_unknown_task_first(tmp_path, capsys):
    path = write_study(tmp_path)
    assert main(["eval", str(path), "--workspace", str(tmp_path / "none"), "--tasks", "hellaswg"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'hellaswag'" in err
