"""A residual variant from outside the package (issue 53): examples/external_variant, a package of its own.

- installed (pip, into a folder on PYTHONPATH: the reslab package and its venv untouched), its entry point
  `gated_residual` is a variant like an in-tree one: `reslab variants` lists it, `reslab check` passes it and a
  paired study with it runs on a local Ray from the command line, each run recording the module's hash in its
  code version;
- named by path (`scaled_residual.gated:GatedResidual`) by a driver that imports it from a folder its Ray
  workers do not have: `--ship-code on` ships it with reslab and the study runs; without shipping, every run
  fails (every run of the submission: its code includes the module) with one line naming the module;
- the code version and the workers' check see a change to its source (fast, no Ray).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reslab.models.residual import EXTERNAL, get_variant
from reslab.orchestrator.attempt.envinfo import (
    REPO_ROOT,
    StaleCode,
    check_code_fingerprint,
    code_fingerprint,
    code_version,
    short_code_version,
    submission_code,
)

EXAMPLE = REPO_ROOT / "examples" / "external_variant"
PATH_NAME = "scaled_residual.gated:GatedResidual"

STUDY = """
study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2, lr: 3.0e-3}}
  train: {{steps: 4, eval_every: 2, log_every: 1, eval_windows: 4, tail_k: 2}}
  cost: {{measure: {measure}, decode_batch: 2, new_tokens: 2, repeats: 1}}
arms:
  control: prenorm
  gated: {{residual: {{name: "{variant}", options: {{per_site: false}}}}}}
seeds: 2
comparisons:
  - {{name: main, control: control, treatments: [gated], exploratory: true}}
"""


def _copy_example(tmp_path: Path) -> Path:
    """The example package copied out of the repository (a build writes its egg-info beside the sources)."""
    dest = tmp_path / "external_variant"
    shutil.copytree(EXAMPLE, dest, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    return dest


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "TRITON_INTERPRET")}
    return {**env, **extra}


def _reslab(args: list[str], env: dict[str, str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "reslab.orchestrator.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def forget_external():
    """The path-form variants and modules a test resolves in this process, forgotten after it."""
    before = set(sys.modules)
    yield
    EXTERNAL.clear()
    for name in set(sys.modules) - before:
        if name.split(".")[0] == "scaled_residual":
            del sys.modules[name]


@pytest.mark.slow
def test_an_installed_entry_point_runs_a_paired_study_on_local_ray(tmp_path):
    source = _copy_example(tmp_path)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, timeout=300)
    env = _env(PYTHONPATH=str(target))
    listed = _reslab(["variants", "--preset", "tiny"], env, tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert "gated_residual" in listed.stdout
    checked = _reslab(["check", "gated_residual", "--opt", "per_site=false"], env, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == "gated_residual:reference on cpu: passed"

    spec = tmp_path / "ext.yaml"
    spec.write_text(textwrap.dedent(STUDY.format(name="ext", variant="gated_residual", measure="true")))
    ws = tmp_path / "ws"
    ran = _reslab(["run", str(spec), "--address", "local", "--workspace", str(ws)], env, tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "4 succeeded" in ran.stdout, ran.stdout
    envs = [json.loads(p.read_text()) for p in ws.rglob("env.json")]
    assert len(envs) >= 4  # each run's record (the workspace's and the run's scratch copy)
    # every run records the driver's hash of the external module (the control's runs too: one submission)
    recorded = [e.get("external_code") for e in envs]
    assert all(r is not None and set(r) == {"scaled_residual"} and r == recorded[0] for r in recorded), recorded
    compared = _reslab(["compare", str(spec), "--workspace", str(ws)], env, tmp_path)
    assert compared.returncode == 0, compared.stderr
    assert "gated" in compared.stdout
    # its cost rows, measured like an in-tree variant's (the serving cost of every run)
    summaries = [json.loads(p.read_text()) for p in ws.rglob("summary.json")]
    assert summaries and all("decode_state_bytes" in s["summary"] and "cost" in s["info"] for s in summaries)
    assert not (EXAMPLE / "scaled_residual.egg-info").exists() and not (EXAMPLE / "build").exists()


DRIVER = """
import io, sys
from pathlib import Path
sys.path.insert(0, {src!r})  # this driver imports the example; its Ray workers have no such folder
from reslab.experiments import expand, load_study
from reslab.orchestrator.dispatch.ray_backend import RayBackend
from reslab.orchestrator.driving.submit import ExecutionOptions, submit
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tracking.guarded import GuardedTracker

study = load_study({spec!r})
ws = Workspace(Path({ws!r}))
ws.root.mkdir(parents=True, exist_ok=True)
backend = RayBackend("local", workspace=ws.root, num_cpus=2, ship_code={ship!r})
result = submit(study, expand(study), ws, backend, GuardedTracker(ws.default_tracking_uri(), ws),
                ExecutionOptions(), stream=io.StringIO(), say=lambda *_: None)
backend.shutdown()
print("SUMMARY", result.summary())
for error in sorted(set(result.errors.values())):
    print("ERROR", error)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ship", ["on", "off"])
def test_a_path_variant_reaches_workers_that_lack_it_only_when_shipped(tmp_path, ship):
    source = _copy_example(tmp_path)
    spec = tmp_path / "path.yaml"
    spec.write_text(textwrap.dedent(STUDY.format(name="path", variant=PATH_NAME, measure="false")))
    script = DRIVER.format(src=str(source), spec=str(spec), ws=str(tmp_path / "ws"), ship=ship)
    other = tmp_path / "elsewhere"  # the workers' Ray adds the driver's folder to their path: not this one
    other.mkdir()
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), cwd=other, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("SUMMARY"))
    errors = [line for line in proc.stdout.splitlines() if line.startswith("ERROR")]
    if ship == "on":
        assert "4 succeeded" in summary and not errors, proc.stdout
    else:
        # the external module is code of the whole submission: the control's runs check it too
        assert "0 succeeded" in summary and "4 failed" in summary, proc.stdout
        assert errors, proc.stdout
        for line in errors:
            assert "cannot import module 'scaled_residual'" in line and "\n" not in line, line


def test_a_change_to_the_external_source_is_a_change_of_the_code_version(tmp_path, monkeypatch, forget_external):
    source = _copy_example(tmp_path)
    monkeypatch.syspath_prepend(str(source))
    before = code_version()
    assert "external_code" not in before
    cls = get_variant(PATH_NAME)
    assert cls.__name__ == "GatedResidual" and cls.name == PATH_NAME
    first = code_version()["external_code"]
    # reference: sha256 over "<relative path>\0<sha256 of the file>\n" of each .py file, sorted (sha256sum's digests)
    import hashlib

    files = sorted((source / "scaled_residual").rglob("*.py"))
    lines = "".join(f"{p.relative_to(source / 'scaled_residual').as_posix()}\0"
                    f"{hashlib.sha256(p.read_bytes()).hexdigest()}\n" for p in files)
    assert first == {"scaled_residual": hashlib.sha256(lines.encode()).hexdigest()}
    short = short_code_version({**before, "external_code": first})
    assert short.startswith(short_code_version(before) + "+ext.")

    expected = submission_code()["fingerprint"]
    assert expected["external"] == first
    check_code_fingerprint(expected, code_fingerprint(), "here")  # the same code here: nothing to refuse
    gated = source / "scaled_residual" / "gated.py"
    gated.write_text(gated.read_text().replace("h + gate.to(output.dtype) * output", "h + output * gate"))
    second = code_version()["external_code"]
    assert second != first
    assert short_code_version({**before, "external_code": second}) != short
    with pytest.raises(StaleCode, match=r"^node w1 imports module 'scaled_residual' \(an external residual variant\) "
                                        r"from .*differs from the driver's"):
        check_code_fingerprint(expected, code_fingerprint(), "w1")
    gone = {**expected, "external": {"not_installed_pkg": "0" * 64}}
    with pytest.raises(StaleCode, match=r"^node w2 cannot import module 'not_installed_pkg'"):
        check_code_fingerprint(gone, code_fingerprint(), "w2")
