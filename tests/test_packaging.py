"""The wheel ships every package: each folder with an `__init__.py` under the top-level folders is
listed in pyproject's `[tool.setuptools] packages` as `reslab.<folder>...` (a folder missing there would
import in this checkout's editable install, which maps whole folders, and be absent from a built wheel)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("common", "models", "kernels", "experiments", "orchestrator", "results", "api")


def test_every_package_folder_is_listed_and_mapped():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        "reslab." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(setuptools["packages"]) == on_disk
    assert setuptools["package-dir"] == {f"reslab.{f}": f for f in FOLDERS}
