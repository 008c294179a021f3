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
