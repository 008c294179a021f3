"""Finished runs of a study that the command's own flags do not name (issue 52, item 13): `compare`, `status` and
`export` read the runs the study expands to under the command's `--set` flags, so runs trained under other flags
read as missing. This finds them in the study's folder and says, with the flags, how to read them.

A run's flags are the fields where its recorded config (`spec.json`) differs from the config the study gives
the same arm, grid point and seed here (the seed's own fields aside); the hint names the flags most of those
runs share. Only run directories of the study's folder are read (at most `MAX_READ` of them).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

from reslab.experiments.expand import RunSpec
from reslab.experiments.spec import Study
from reslab.models.config import to_dict
from reslab.orchestrator.durability.workspace import Workspace

MAX_READ = 1000  # run directories read for the hint: enough to name the flags of a submission
SEED_FIELDS = ("train.seed", "train.data_seed")


def _flat(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(data, dict):
        for key, value in data.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], data


def _shown(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def override_flags(expected: dict[str, Any], recorded: dict[str, Any]) -> tuple[str, ...]:
    """`--set FIELD=VALUE` for each field where `recorded` differs from `expected` (both `to_dict` configs)."""
    mine, theirs = dict(_flat(expected)), dict(_flat(recorded))
    return tuple(f"--set {k}={_shown(v)}" for k, v in sorted(theirs.items())
                 if k not in SEED_FIELDS and mine.get(k, v) != v)


def other_overrides_hint(study: Study, runs: list[RunSpec], workspace: Workspace) -> str | None:
    """One line naming the finished runs of `study` in `workspace` that `runs` does not hold, and the flags most of
    them were run under; None when there are none (or every run of `runs` finished)."""
    expected = {r.run_id for r in runs}
    others = sorted(workspace.recorded_ids(study.name) - expected)
    if not others or all(workspace.run_dir(study.name, r.run_id).complete() for r in runs):
        return None
    configs = {(r.arm, r.grid_key, r.seed): r.config for r in runs}
    by_arm = {r.arm: r.config for r in runs}
    flags: Counter[tuple[str, ...]] = Counter()
    for run_id in others[:MAX_READ]:
        rd = workspace.run_dir(study.name, run_id)
        spec = rd.spec() if rd.complete() else None
        if spec is None or not isinstance(spec.get("config"), dict):
            continue
        arm, grid_key, seed = str(spec.get("arm")), str(spec.get("grid_key")), spec.get("seed")
        base = configs.get((arm, grid_key, seed if isinstance(seed, int) else -1)) or by_arm.get(arm)
        if base is not None:
            flags[override_flags(to_dict(base), spec["config"])] += 1
    if not flags:
        return None
    common, n = flags.most_common(1)[0]
    total = sum(flags.values())
    shown = " ".join(common) if common else "the study file as it was then (its runs' configs differ from this one's)"
    return (f"note: {total} finished run(s) of {study.name} in this workspace were run under other overrides; "
            f"{'they' if n == total else f'{n} of them'} read with: {shown}")


__all__ = ["other_overrides_hint", "override_flags"]
