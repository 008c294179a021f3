"""The code fingerprint, the worker's refusal of stale code, and the staged copy `--ship-code` sends
(the multi-node behaviour is in test_multinode.py)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest
from orch_helpers import write_study

from reslab.experiments import expand, load_study
from reslab.orchestrator.attempt.envinfo import (
    SUBPACKAGES,
    StaleCode,
    check_code_fingerprint,
    code_fingerprint,
    package_dirs,
)
from reslab.orchestrator.attempt.worker import execute_run
from reslab.orchestrator.dispatch.ray_backend import RayBackend, stage_code
from reslab.orchestrator.durability.workspace import RunDir
from reslab.orchestrator.tasks import FAILED, RunTask

ONE_RUN = """
study: fp
base:
  model: {preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}
  train: {steps: 2}
  cost: {measure: false}
arms:
  control: prenorm
seeds: 1
"""


class _Events:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def emit(self, event: dict) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


def test_the_fingerprint_hashes_every_py_file_of_the_imported_package():
    fp = code_fingerprint()
    # reference: sha256 of each file as `sha256sum` computes it, over the package folders as found on disk
    listed = subprocess.run(["sha256sum", *[str(p) for d in package_dirs().values() for p in sorted(d.rglob("*.py"))]],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    by_path = {path: digest for digest, path in (line.split(maxsplit=1) for line in listed)}
    expected = {f"{name}/{p.relative_to(d).as_posix()}": by_path[str(p)]
                for name, d in package_dirs().items() for p in d.rglob("*.py")}
    assert fp["files"] == expected and "models/training.py" in fp["files"]
    assert {k.split("/")[0] for k in fp["files"]} == set(SUBPACKAGES)
    lines = "".join(f"{rel}\0{h}\n" for rel, h in sorted(expected.items()))
    assert fp["digest"] == hashlib.sha256(lines.encode()).hexdigest()


def test_check_code_fingerprint_names_the_host_and_the_differing_files():
    ours = code_fingerprint()
    check_code_fingerprint(ours, ours, "h")
    check_code_fingerprint(None, ours, "h")  # no driver fingerprint (a caller outside a submission): nothing to check
    theirs = {"digest": "0" * 64, "files": {**ours["files"], "models/training.py": "1" * 64, "models/gone.py": "2"}}
    del theirs["files"]["kernels/__init__.py"]
    with pytest.raises(StaleCode, match=r"^node gpu-7 imports reslab code that differs from the driver's in "
                                        r"kernels/__init__\.py, models/gone\.py, models/training\.py \(imported from "):
        check_code_fingerprint(theirs, ours, "gpu-7")
    assert StaleCode.exit_code == 2


def test_a_worker_with_other_code_refuses_the_run_and_records_its_own_digest(tmp_path):
    (run,) = expand(load_study(write_study(tmp_path, text=ONE_RUN)))
    ours = code_fingerprint()
    driver = {"digest": "f" * 64, "files": {**ours["files"], "models/training.py": "e" * 64}}
    task = RunTask(run=run, run_dir=str(tmp_path / "run"), submission="s1", code={"git_sha": None,
                                                                                   "fingerprint": driver})
    outcome = execute_run(task, _Events())
    assert outcome.state == FAILED and outcome.retryable is False
    assert outcome.error.startswith(f"StaleCode: node {socket.gethostname()} imports reslab code that differs "
                                    "from the driver's in models/training.py")
    rd = RunDir(tmp_path / "run")
    assert rd.status()["state"] == FAILED and rd.status()["retryable"] is False
    env = rd.env()
    assert env["code_fingerprint"] == ours["digest"] and "fingerprint" not in env
    assert not (tmp_path / "run" / "checkpoint.pt").exists()


def test_the_staged_copy_is_what_a_python_with_it_on_its_path_imports(tmp_path):
    staged = stage_code(tmp_path)
    assert code_fingerprint({n: staged / n for n in SUBPACKAGES})["digest"] == code_fingerprint()["digest"]
    assert (staged / "experiments" / "attnres_vs_prenorm.yaml").is_file()  # package data travels too
    assert not list(staged.rglob("__pycache__"))
    # the editable install's finder is on this interpreter too: the staged regular package must win
    probe = ("import json; from reslab.orchestrator.attempt.envinfo import package_dirs; "
             "print(json.dumps({k: str(v) for k, v in package_dirs().items()}))")
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(staged.parent)},
                         capture_output=True, text=True, check=True, cwd=tmp_path).stdout
    assert json.loads(out) == {n: str(staged / n) for n in SUBPACKAGES}


def test_ship_code_accepts_auto_on_off_only(tmp_path):
    from reslab.orchestrator.dispatch import BackendError

    with pytest.raises(BackendError, match=r"--ship-code 'yes': allowed: auto, on, off"):
        RayBackend(workspace=tmp_path, ship_code="yes")
