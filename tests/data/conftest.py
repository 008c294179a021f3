import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Keep every data test away from the user's ~/.cache/reslab."""
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "reslab-cache"))
