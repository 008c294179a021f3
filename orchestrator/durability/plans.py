"""A study's frozen analysis plan in the workspace: `<workspace>/analysis/<study>.json`, the versions of its
analysis oldest first, each `{"version", "hash", "analysis", "finished_runs", "finished_by_arm", "recorded_at"}`.

The first version is written at the study's first submission and never changed; a later analysis (an edited
study file, another `--alpha`) is appended, once, with the study's finished runs when it was first seen (by a
submission or by a read: `reslab verdict`, `compare`, `report`). The file is rewritten whole under a lock
(`common.io.write_atomic`), so a reader never sees it half-written and two writers never lose a version. What an
analysis holds and what its hash is are the caller's (`results.verdict.analysis_of`, `plan_hash`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from reslab.common.io import file_lock, write_atomic

__all__ = ["plan_path", "read_versions", "record_version"]


def plan_path(root: Path, study: str) -> Path:
    return root / "analysis" / f"{study}.json"


def read_versions(root: Path, study: str) -> list[dict[str, Any]]:
    """The recorded versions, oldest first; none when the study was never submitted in this workspace."""
    path = plan_path(root, study)
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["versions"])
    except FileNotFoundError:
        return []


def record_version(root: Path, study: str, analysis: dict[str, Any], digest: str, finished_by_arm: dict[str, int],
                   *, first: bool) -> list[dict[str, Any]]:
    """Append the analysis, with the study's finished runs per arm then, unless the last version has its hash; with
    `first` False (a read) nothing is recorded for a study that has no version yet (a plan is frozen by a submission
    only). Returns the versions after."""
    path = plan_path(root, study)
    if not first and not path.is_file():
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(path.with_suffix(".lock")):
        versions = read_versions(root, study)
        if versions and versions[-1]["hash"] == digest:
            return versions
        versions.append({"version": len(versions) + 1, "hash": digest, "analysis": analysis,
                         "finished_runs": sum(finished_by_arm.values()),
                         "finished_by_arm": {arm: int(n) for arm, n in sorted(finished_by_arm.items())},
                         "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        write_atomic(path, json.dumps({"study": study, "versions": versions}, indent=1, sort_keys=True) + "\n")
    return versions
