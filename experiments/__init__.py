"""Study specs: the schema (`spec`), the expansion into runs (`expand`) and the example studies
(the YAML files in this folder).

Plain data only: loading a study imports the residual registry to check variants and knobs, but
nothing here trains, dispatches or tracks.
"""

from reslab.experiments.expand import RESULTS_VERSION, RunSpec, expand, grid_key_of, run_id_of
from reslab.experiments.spec import METRICS, Arm, Comparison, GridAxis, SpecError, Study, load_study

__all__ = [
    "METRICS", "RESULTS_VERSION", "Arm", "Comparison", "GridAxis", "RunSpec", "SpecError", "Study",
    "expand", "grid_key_of", "load_study", "run_id_of",
]
