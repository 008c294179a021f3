"""Run identity: the id is a pure function of the resolved config and the results version."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from reslab.experiments import expand, load_study, run_id_of
from reslab.experiments.spec import replicate_seeds
from reslab.models.config import RunConfig, flatten, load, set_path, to_dict
from reslab.models.resolve import validate_run_config

expand_mod = importlib.import_module("reslab.experiments.expand")
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


@pytest.mark.slow  # ~9 s: a fresh Python process that imports torch and expands the quickstart
def test_run_ids_are_stable_across_processes_and_execution_settings(tmp_path):
    here = {r.label: r.run_id for r in expand(load_study(QUICKSTART))}
    code = ("import json; from reslab.experiments import expand, load_study; "
            f"print(json.dumps({{r.label: r.run_id for r in expand(load_study({str(QUICKSTART)!r}))}}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "12345", "RAY_ADDRESS": "10.0.0.1:6379",
           "MLFLOW_TRACKING_URI": "http://127.0.0.1:1", "RESLAB_WORKSPACE": str(tmp_path / "elsewhere")}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    # The plan command with other execution settings prints the same ids.
    plan = subprocess.run(
        [sys.executable, "-m", "reslab.orchestrator.cli", "plan", str(QUICKSTART), "--workspace", str(tmp_path / "w2"),
         "--tracking-uri", "sqlite:///nowhere.db", "--lease-timeout", "30"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert all(run_id in plan for run_id in here.values())


def test_the_run_id_names_the_variant_and_hashes_the_config():
    run = expand(load_study(QUICKSTART))[0]
    assert run.run_id.startswith(run.config.residual.name + "-") and len(run.run_id.split("-")[-1]) == 12
    assert run.run_id == run_id_of(validate_run_config(load(RunConfig, to_dict(run.config))))


def _perturb(tp: typing.Any, value: typing.Any) -> typing.Any:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return next(a for a in typing.get_args(tp) if a != value)
    if origin in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if dataclasses.is_dataclass(args[0]):  # an optional section (model.moe): null -> its defaults
            return {} if value is None else None
        return _perturb(args[0], value) if value is not None else _perturb(args[0], _default(args[0]))
    if tp is bool:
        return not value
    if tp is int:
        return value + 1
    if tp is float:
        return value * 1.5 + 0.01
    if tp is str:
        return value + "x"
    if origin is dict:
        return {**value, "extra_knob": 1}
    raise TypeError(tp)


def _default(tp):
    return {int: 7, float: 0.5, str: "s", bool: True}[tp]


def _leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def test_every_config_field_changes_the_run_id():
    base = RunConfig()
    data = to_dict(base)
    seen = {run_id_of(base)}
    leaves = list(_leaves(RunConfig))
    assert len(leaves) >= 40  # the whole config, not a chosen subset
    for path, tp in leaves:
        value = flatten(data).get(path, {})
        changed = load(RunConfig, set_path(data, path, _perturb(tp, value)))
        run_id = run_id_of(changed)
        assert run_id not in seen, f"changing {path} did not change the run id"
        seen.add(run_id)


def test_results_version_enters_the_id(monkeypatch):
    before = run_id_of(RunConfig())
    monkeypatch.setattr(expand_mod, "RESULTS_VERSION", "1999.01.01")
    assert run_id_of(RunConfig()) != before


def test_knob_defaults_resolve_before_hashing(tmp_path):
    implicit = validate_run_config(load(RunConfig, {"residual": {"name": "attnres"}}))
    explicit = validate_run_config(load(RunConfig, {"residual": {"name": "attnres", "options": {"readout": True}}}))
    assert run_id_of(implicit) == run_id_of(explicit)


def test_study_and_arm_names_do_not_enter_the_id(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("study: one\nbase: {train: {steps: 5}}\narms: {x: prenorm, y: attnres}\nseeds: 1\n")
    b = tmp_path / "b.yaml"
    b.write_text("study: two\nbase: {train: {steps: 5}}\narms: {control: prenorm, routed: attnres}\nseeds: 1\n")
    assert sorted(r.run_id for r in expand(load_study(a))) == sorted(r.run_id for r in expand(load_study(b)))


def test_pair_key_matches_arms_on_grid_point_and_seed(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(
        "study: p\nbase: {model: {preset: tiny}, train: {steps: 5}}\n"
        "arms: {control: prenorm, attnres: attnres, block: block_attnres}\n"
        "seeds: {count: 2, replicate: 1}\ngrid: {model.d_model: [32, 64]}\n"
    )
    runs = expand(load_study(path))
    pairs: dict[tuple, list] = {}
    for r in runs:
        pairs.setdefault(r.pair, []).append(r)
        assert r.config.train.seed == r.seed and r.config.data_seed == r.seed
        assert r.pair_key == f"{r.grid_key}|seed={r.seed}"
    a, b = sorted(replicate_seeds(2, 1))
    assert sorted(pairs) == [("model.d_model=32", a), ("model.d_model=32", b), ("model.d_model=64", a),
                             ("model.d_model=64", b)]
    for members in pairs.values():
        assert sorted(m.arm for m in members) == ["attnres", "block", "control"]
        # within a pair, the configs differ only in the residual pathway
        stripped = {json.dumps({k: v for k, v in to_dict(m.config).items() if k != "residual"}, sort_keys=True)
                    for m in members}
        assert len(stripped) == 1
    assert len({r.run_id for r in runs}) == len(runs)
    assert [r.seed for r in runs[:6]] == [replicate_seeds(2, 1)[0]] * 6  # seed-major: complete pairs come first


def test_seed_count_expands_from_zero(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("study: c\narms: {control: prenorm}\nseeds: 3\n")
    assert [r.seed for r in expand(load_study(path))] == [0, 1, 2]
    assert expand(load_study(path))[0].label == "control/s0"


def test_spec_json_holds_identity_and_config_only():
    run = expand(load_study(QUICKSTART))[0]
    record = run.to_dict()
    assert set(record) == {"run_id", "study", "arm", "grid_key", "grid", "seed", "pair_key", "results_version",
                           "config"}
    assert record["config"] == to_dict(run.config)
