import sys
from pathlib import Path

# The package may not be installed in the test venv and pytest's rootdir is not on sys.path.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
