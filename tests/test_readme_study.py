"""The README's complete study with a grid is the shipped file it names, and it is valid."""

from __future__ import annotations

import re
from pathlib import Path

from reslab.experiments import expand, load_study

ROOT = Path(__file__).resolve().parents[1]


def readme_study(lead: str, what: str) -> tuple[str, Path]:
    """The YAML block after the README's sentence `lead` + "`experiments/NAME.yaml`", and that shipped file,
    asserted to be the same study (the file's comment lines aside)."""
    readme = (ROOT / "README.md").read_text()
    named = re.search(lead + r"\s+`(experiments/[\w.]+\.yaml)`", readme)
    assert named, f"the README no longer shows {what}"
    block = readme[named.end():]
    shown = block[block.index("```yaml\n") + len("```yaml\n"):block.index("```", block.index("```yaml\n") + 7)]
    shipped = ROOT / named.group(1)
    assert shown.strip() == "\n".join(line for line in shipped.read_text().splitlines()
                                      if not line.startswith("#")).strip()
    return shown, shipped


def test_the_readmes_grid_study_is_the_shipped_file_and_valid(tmp_path):
    shown, _ = readme_study("A complete study with a grid,", "a complete study with a grid")
    path = tmp_path / "copied.yaml"
    path.write_text(shown)
    study = load_study(path)
    assert study.grid and len(expand(study)) == len(study.arms) * len(study.seeds) * 2 == 24


def test_the_readmes_multi_gpu_study_is_the_shipped_file_and_places_runs_on_8_ranks(tmp_path):
    _, shipped = readme_study("A study of 350m models on 8-GPU nodes,", "the multi-GPU study")
    study = load_study(shipped)
    assert (study.resources.gpus_per_run, study.resources.sharding) == (8, "ddp")
    assert len(expand(study)) == 12
