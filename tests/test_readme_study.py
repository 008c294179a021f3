"""The README's complete study with a grid is the shipped file it names, and it is valid."""

from __future__ import annotations

import re
from pathlib import Path

from reslab.experiments import expand, load_study

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_grid_study_is_the_shipped_file_and_valid(tmp_path):
    readme = (ROOT / "README.md").read_text()
    named = re.search(r"A complete study with a grid, `(experiments/[\w.]+\.yaml)`", readme)
    assert named, "the README no longer shows a complete study with a grid"
    block = readme[named.end():]
    shown = block[block.index("```yaml\n") + len("```yaml\n"):block.index("```", block.index("```yaml\n") + 7)]
    shipped = (ROOT / named.group(1)).read_text()
    assert shown.strip() == "\n".join(line for line in shipped.splitlines() if not line.startswith("#")).strip()
    path = tmp_path / "copied.yaml"
    path.write_text(shown)
    study = load_study(path)
    assert study.grid and len(expand(study)) == len(study.arms) * len(study.seeds) * 2 == 24


def test_the_readmes_multi_gpu_study_is_the_shipped_file_and_places_runs_on_8_ranks(tmp_path):
    readme = (ROOT / "README.md").read_text()
    named = re.search(r"A study of 350m models on 8-GPU nodes,\s+`(experiments/[\w.]+\.yaml)`", readme)
    assert named, "the README no longer shows the multi-GPU study"
    block = readme[named.end():]
    shown = block[block.index("```yaml\n") + len("```yaml\n"):block.index("```", block.index("```yaml\n") + 7)]
    shipped = (ROOT / named.group(1)).read_text()
    assert shown.strip() == "\n".join(line for line in shipped.splitlines() if not line.startswith("#")).strip()
    study = load_study(ROOT / named.group(1))
    assert (study.resources.gpus_per_run, study.resources.sharding) == (8, "ddp")
    assert len(expand(study)) == 12
