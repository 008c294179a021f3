import sys
from pathlib import Path

import pytest

# The package is not installed in the test venv and pytest's rootdir is not on sys.path by default.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Keep every data test away from the user's ~/.cache/reslab."""
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "reslab-cache"))
