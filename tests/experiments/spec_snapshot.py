"""The study schema's before/after safety net: every study input the suite feeds the loader, with what the
loader made of it (the validated study and its run ids, or the exact one-line error).

`spec_snapshot.json` was written by `python -m tests.experiments.spec_snapshot` on the hand-written parsers
(commit 7652683): it ran `tests/experiments/` and `tests/test_fuzz_cli.py` with `experiments.spec.parse_study`
wrapped to record each input, added every shipped study, and stored each input's outcome; `--edges` then added
`EDGES`, the edges of each section the suite does not reach (run on 7652683's code too, through PYTHONPATH).
`test_spec_snapshot.py` recomputes the outcomes on the code of the day and compares them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("spec_snapshot.json")
# ids listed in full up to this many runs; a larger study keeps their count and a digest
LISTED_RUNS = 40


# fields of the study added after the snapshot, left out while they hold their default (None): a study that does
# not use one reads as it did (issue 54: `gates:`)
ADDED_FIELDS = ("gates",)


def _plain(obj: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name != "path"
                and not (f.name in ADDED_FIELDS and getattr(obj, f.name) is None)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return "nan"
    return obj if isinstance(obj, (str, int, float, bool, type(None))) else repr(obj)


def outcome(case: dict[str, Any]) -> dict[str, Any]:
    """What the loader makes of one recorded input: the error's text, or the study and its run ids."""
    from reslab.experiments import expand
    from reslab.experiments.spec import parse_study
    from reslab.models.config import ConfigError

    data = yaml.safe_load(case["data"])
    overrides = [tuple(pair) for pair in yaml.safe_load(case["overrides"])]
    try:
        study = parse_study(data, Path(case["stem"] + ".yaml"), overrides, case["max_runs"])
    except ConfigError as exc:
        return {"error": str(exc)}
    out: dict[str, Any] = {"study": json.loads(json.dumps(_plain(study), sort_keys=True, default=repr))}
    try:
        ids = [f"{r.label} {r.run_id}" for r in expand(study)]
    except ConfigError as exc:
        return out | {"expand_error": str(exc)}
    digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    return out | {"runs": len(ids), "digest": digest, "ids": ids if len(ids) <= LISTED_RUNS else ids[:5]}


def _case(data: Any, path: Path, overrides: Any, max_runs: Any) -> dict[str, Any] | None:
    try:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        pairs = yaml.safe_dump([list(p) for p in overrides])
    except yaml.YAMLError:
        return None
    if "pytest-of" in text or "/tmp" in text or "pytest-of" in pairs:
        return None  # names a temporary file that is gone when the snapshot is compared
    return {"data": text, "overrides": pairs, "max_runs": max_runs, "stem": path.stem}


def record() -> list[dict[str, Any]]:
    import pytest

    from reslab.experiments import spec
    from reslab.experiments.spec import load_yaml

    cases: dict[str, dict[str, Any]] = {}
    original = spec.parse_study

    def recording(data: Any, path: Path, overrides: Any = (), max_runs: Any = None) -> Any:
        case = _case(data, Path(path), tuple(overrides), max_runs)
        if case is not None:
            cases.setdefault(json.dumps(case, sort_keys=True), case)
        return original(data, path, overrides, max_runs)

    spec.parse_study = recording  # type: ignore[assignment]
    try:
        pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not gpu", str(ROOT / "tests" / "experiments"),
                     str(ROOT / "tests" / "test_fuzz_cli.py")])
    finally:
        spec.parse_study = original  # type: ignore[assignment]
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        case = _case(load_yaml(path), path, (), None)
        assert case is not None
        key = json.dumps(case, sort_keys=True)
        cases[key] = cases.get(key, case) | {"shipped": path.name}
    return list(cases.values())


GOOD: dict[str, Any] = {
    "study": "edge",
    "base": {"model": {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
                       "ffn_hidden": 64, "seq_len": 32}, "optim": {"batch_size": 4}, "train": {"steps": 6}},
    "arms": {"control": "prenorm", "attnres": {"residual": "attnres"}},
    "seeds": 2,
    "comparisons": [{"name": "main", "control": "control", "treatments": ["attnres"], "exploratory": True}],
}
TUNE = {"trials": 2, "seed": 100, "space": {"optim.lr": {"type": "float", "low": 1e-4, "high": 1e-2}}}
# (top-level key, value) written over GOOD: the edges of each section, beyond what the suite feeds the loader
EDGES: list[tuple[str, Any]] = [
    ("base", 0), ("base", []), ("base", {"train": {"stepz": 1, "evl": 2}}), ("comparisons", {}), ("contrasts", {}),
    ("arms", {"control": "prenorm", "attnres": {"residual": "attnres", "model": None}}),
    ("arms", {"control": "prenorm", "attnres": {"residual": {"name": "attnres", "impl": None}}}),
    ("arms", {"control": "prenorm", "attnres": {"residual": {"name": 5}}}),
    ("arms", {"control": "prenorm", "attnres": {"residual": None}}),
    ("arms", {"control": "prenorm", "attnres": {"residual": {"options": {}}}}),
    ("arms", {"control": "prenorm", "attnres": {"residual": "attnres", "model": {}}}),
    ("evals", None), ("interventions", None), ("tune", None), ("evals", {}), ("evals", {"tasks": []}),
    ("evals", {"tasks": ["a", " "]}), ("evals", {"tasks": ["a"], "limit": 0}),
    ("evals", {"tasks": ["a"], "at": "best"}),
    ("evals", {"tasks": "a", "num_fewshot": True}), ("evals", {"tasks": ["a"], "shots": 1, "x": 2}),
    ("tune", {**TUNE, "objective": None}), ("tune", {**TUNE, "sampler": {"seed": 1}}),
    ("tune", {**TUNE, "sampler": {"name": "tpe", "x": 1}}), ("tune", {**TUNE, "objective": {"metric": "val_loss",
                                                                                           "foo": 1}}),
    ("tune", {"seed": 100}), ("tune", {"trials": 2}), ("tune", {**TUNE, "sampler": "grid"}),
    ("tune", {**TUNE, "sampler": {"name": "random", "seed": -1}}), ("tune", {**TUNE, "trials": True}),
    ("study", None), ("description", None), ("seeds", {}), ("seeds", {"sequential": {}, "x": 1}), ("seeds", []),
    ("seeds", "3"), ("seeds", None), ("seeds", [0, True]), ("costs", None), ("costs", 5), ("mechanisms", []),
    ("costs", ["decode_tp"]), ("costs", ["decode_tps", "decode_tps"]), ("limits", {"max_runs": 0}),
    ("limits", None), ("resources", None), ("resources", {"pipeline_schedule": "gpipe"}), ("grid", {}),
    ("grid", {"optim.lr": None}), ("ladder", []), ("grid", {"optim.lr": [1e-3, 1e-3]}),
    ("comparisons", [{"control": "control", "treatments": None}]), ("comparisons", [{"control": None}]),
    ("comparisons", [{"control": "control", "pool": {"a": 1}}]), ("comparisons", [{"control": "control",
                                                                                   "name": None}]),
    ("comparisons", [{"control": "control", "family": 5}]), ("comparisons", [{"control": "control",
                                                                              "exploratory": None}]),
    ("comparisons", [{"control": "control", "treatments": "attnres", "kind": None}]),
    ("comparisons", [5]), ("comparisons", [{"control": "control", "mei": -1, "kind": "x"}]),
    ("contrasts", [{"weights": None, "fraction": None}]), ("contrasts", [5]), ("contrasts", [{"name": None,
                                                                                             "weights": {}}]),
    ("resources", {"gpus_per_run": None, "sharding": None}), ("resources", {"sharding": 5}),
    ("junk", 1), ("limits", "x"),
]


def edge_cases() -> list[dict[str, Any]]:
    cases = []
    for key, value in EDGES:
        data = {**GOOD, key: value}
        if key == "tune":
            data["seeds"] = [0, 1]
        case = _case(data, Path("edge.yaml"), (), None)
        assert case is not None
        cases.append(case)
    for flag in (0, 10, True):
        cases.append(_case({**GOOD, "limits": {"max_runs": 0}}, Path("edge.yaml"), (), flag))
    return [c for c in cases if c is not None]


def main() -> None:
    if sys.argv[1:] == ["--edges"]:  # add the edge cases' outcomes to the snapshot (run on the original code)
        old = json.loads(SNAPSHOT.read_text())
        snapshot = old + [case | {"outcome": outcome(case), "edge": True} for case in edge_cases()]
        SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
        return
    cases = record()
    snapshot = [case | {"outcome": outcome(case)} for case in cases]
    SNAPSHOT.write_text(json.dumps(snapshot, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"{len(snapshot)} cases, {sum('error' in c['outcome'] for c in snapshot)} errors -> {SNAPSHOT}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
