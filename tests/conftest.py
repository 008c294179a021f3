"""Suite-wide settings: one torch thread and an isolated data cache.

CI has 2 cores and the Ray tests run workers beside pytest; with torch's default of one thread
per core, the small ops of these tiny models run 10x+ slower from oversubscription.
"""

import os

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Prepared corpora go to a per-session cache, never the user's ~/.cache/reslab."""
    if "RESLAB_TEST_CACHE" in os.environ:  # reuse across local runs when asked to
        os.environ["RESLAB_CACHE"] = os.environ["RESLAB_TEST_CACHE"]
    else:
        os.environ["RESLAB_CACHE"] = str(tmp_path_factory.mktemp("reslab-cache"))


@pytest.fixture
def hub_off(monkeypatch, tmp_path):
    """Offline, with an empty Hugging Face cache: a test that uses it may not reach the hub (the eval tests)."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets", raising=False)


# ----------------------------------------------------------------------------- tiers
# `pytest` alone runs the fast tier: everything but the tests marked `slow` (they start Ray, MLflow servers,
# PostgreSQL, an S3 server or Chromium). `pytest --all` runs both tiers (CI does); naming files or `-m` runs
# what they select, slow tests included.


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="run both tiers: the slow end-to-end tests (Ray, MLflow servers, PostgreSQL, S3, Chromium) "
                          "too; without it, a bare `pytest` runs the fast tier only")


def _fast_tier_only(config) -> bool:
    return (not config.getoption("--all") and not config.getoption("markexpr")
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS)


def pytest_collection_modifyitems(config, items):
    if not _fast_tier_only(config):
        return
    slow = [item for item in items if "slow" in item.keywords]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if "slow" not in item.keywords]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 2`) a test file runs whole on one worker: a module fixture (a study trained once
    for its file's tests) is then paid once, not once per worker. An explicit `--dist` is kept."""
    if any(arg == "--dist" or arg.startswith("--dist=") for arg in config.invocation_params.args):
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_report_header(config):
    if _fast_tier_only(config):
        return "the fast tier: tests marked slow are deselected (`pytest --all` runs them too)"
    return None
