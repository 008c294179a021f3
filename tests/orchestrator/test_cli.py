"""The `reslab` command line itself: flags, errors, exit codes and the newcomer's paper cuts."""

from __future__ import annotations

import importlib.metadata
import io
import re
import shlex
import subprocess
import sys

import pytest
from orch_helpers import write_study

from reslab.common.errors import ConfigError
from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main
from reslab.orchestrator.dispatch.local_backend import LocalBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace

RESLAB = [sys.executable, "-m", "reslab.orchestrator.cli"]


def test_version_comes_from_the_installed_package(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"reslab {importlib.metadata.version('reslab')}"


@pytest.mark.parametrize(("words", "expected"), [
    (["tr"], {"train"}),
    (["data", "pr"], {"prepare"}),
    (["run", "q.yaml", "--max-c"], {"--max-concurrent"}),
    (["export", "q.yaml", "--format", ""], {"md", "csv", "parquet", "latex"}),
    (["completion", ""], {"bash", "zsh"}),
])
def test_bash_completion_generated_from_the_parser(words, expected):
    script = subprocess.run([*RESLAB, "completion", "bash"], capture_output=True, text=True, check=True).stdout
    # bash's completion protocol: COMP_WORDS and COMP_CWORD in, COMPREPLY out
    comp_words = " ".join(shlex.quote(w) for w in ["reslab", *words])
    probe = f"{script}\nCOMP_WORDS=({comp_words}); COMP_CWORD={len(words)}; _reslab\n" \
            "printf '%s\\n' \"${COMPREPLY[@]}\"\n"
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) == expected


def test_zsh_completion_reuses_the_bash_script_through_bashcompinit(capsys):
    assert main(["completion", "zsh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("autoload -U +X bashcompinit && bashcompinit\n") and "complete -o default -F _reslab" in out


def test_a_closed_pipe_ends_quietly_with_0():
    # the reader is gone before the command writes, as with `reslab status | head` on long output
    proc = subprocess.Popen([*RESLAB, "completion", "bash"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 0 and err == ""


@pytest.mark.parametrize("argv", [
    ["validate", "SPEC", "--set", "optim.lr=abc"],
    ["train", "--preset", "tiny", "--print-config", "--set", "optim.lr=abc"],
])
def test_a_bad_set_value_blames_the_flag_as_typed(tmp_path, capsys, argv):
    spec = write_study(tmp_path)
    assert main([str(spec) if a == "SPEC" else a for a in argv]) == 2
    err = capsys.readouterr().err
    assert "--set optim.lr: expected a number, got 'abc'" in err and "arms." not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "flag"), [
    (["train", "--steps", "0"], "--steps"),
    (["run", "SPEC", "--retries", "-1"], "--retries"),
    (["run", "SPEC", "--cpus-per-run", "0"], "--cpus-per-run"),
    (["compare", "SPEC", "--alpha", "1.5"], "--alpha"),
    (["status", "SPEC", "--set", "train.steps"], "--set"),
    (["dashboard", "--port", "70000"], "--port"),
])
def test_flag_checks_fail_while_parsing_with_one_line(tmp_path, capsys, argv, flag):
    spec = write_study(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([str(spec) if a == "SPEC" else a for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}:" in err and len(err.strip().splitlines()) == 1


def test_submit_options_check_themselves():
    with pytest.raises(ConfigError, match=r"ExecutionOptions\.retries: -1 is not allowed; allowed: >= 0"):
        ExecutionOptions(retries=-1)


def test_read_commands_name_the_workspace_and_never_create_it(tmp_path, capsys, monkeypatch):
    spec = write_study(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("RESLAB_WORKSPACE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    default = elsewhere / "reslab-runs"
    for command in ("status", "plan"):
        assert main([command, str(spec)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert first == f"workspace {default} (does not exist: nothing has run here; see --workspace)"
    for command in (["compare", str(spec)], ["export", str(spec), "--format", "md", "-o", "t.md"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert f"--workspace: no MLflow store at {default / 'mlflow.db'}" in err
    assert list(elsewhere.iterdir()) == []


def test_the_commands_that_read_a_whole_study_pause_the_cyclic_collector_and_restore_it(tmp_path, monkeypatch):
    """compare, export, report, status and plan run with `gc` paused (their records are millions of acyclic
    objects; issue 39), and the collector is as it was after them, an error included; other commands leave it."""
    import gc

    from reslab.orchestrator.cli import results, study

    seen = {}

    def spy(name, code):
        def command(args):
            seen[name] = gc.isenabled()
            if code == 2:
                raise ConfigError("bad")
            return code
        return command

    spec = str(write_study(tmp_path))
    for module, attr, name in ((results, "cmd_compare", "compare"), (study, "cmd_status", "status"),
                               (study, "cmd_validate", "validate")):
        monkeypatch.setattr(module, attr, spy(name, 2 if name == "status" else 0))
    assert gc.isenabled()
    assert [main(["compare", spec]), main(["status", spec]), main(["validate", spec])] == [0, 2, 0]
    assert seen == {"compare": False, "status": False, "validate": True}
    assert gc.isenabled()
    gc.disable()
    try:
        main(["compare", spec])
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()


def test_variants_prints_whole_parameter_counts(capsys):
    assert main(["variants", "--preset", "tiny"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert len(lines) > 10
    for line in lines:
        assert re.match(r"^  \S+ +\+[\d,]+ +~?[\d,]+/layer  ", line), line


def test_an_interrupt_before_any_run_started_says_so(tmp_path):
    class InterruptedWhileStarting(LocalBackend):
        """A fake: Ctrl-C must land before the first run starts, which a real backend cannot time."""

        def start(self):
            raise KeyboardInterrupt

    study = load_study(write_study(tmp_path))
    said: list[str] = []
    result = submit(study, expand(study), Workspace(tmp_path / "ws"), InterruptedWhileStarting(), None,
                    stream=io.StringIO(), say=said.append)
    assert result.interrupted and result.count("to run") == 4
    assert "interrupted before any run started; nothing to resume" in said[-1]
    assert not any("0 run(s) stopped" in s for s in said)


def test_train_sets_the_threads_it_is_given(tmp_path):
    import torch

    from reslab.orchestrator.attempt.threads import default_threads

    before = torch.get_num_threads()
    try:
        assert main(["train", "--preset", "tiny", "--steps", "1", "--threads", "1", "--out", str(tmp_path / "r"),
                     "--set", "train.eval_every=1", "--set", "train.eval_windows=16"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert 1 <= default_threads() <= 4
