"""The curves readout: what the runs recorded while training, drawn for the report. Validation loss
against tokens per arm, each treatment's paired delta over training, the routing weights and their
concentration per layer (per grid point, one colour scale), and the effective depth per run."""

from __future__ import annotations

import numpy as np

from reslab.results.plots import Plot, concentration_profile, deff_plot, delta_curve, loss_curves, routing_heatmaps
from reslab.results.readouts.base import Readout, StudyData, TrainingRecords

__all__ = ["CurvesReadout"]


def _delta_plots(records: TrainingRecords, data: StudyData) -> list[tuple[Plot, str]]:
    evaluated = {arm: set(zip(g["grid_key"].tolist(), g["seed"].tolist(), g["tokens"].tolist(), strict=True))
                 for arm, g in records.evals.groupby("arm")}  # plain tuples: 10^5 runs' evals (issue 39)
    plots = []
    for comp in data.comparisons:
        for treatment in comp.treatments:
            if evaluated.get(comp.control, set()) & evaluated.get(treatment, set()):  # some eval is paired
                plots.append((delta_curve(records.evals, comp.control, treatment, labels=data.labels),
                              f"Paired validation-loss delta {treatment} - {comp.control} over training, "
                              "mean over seeds with its paired-t CI."))
    return plots


def _routing_plots(records: TrainingRecords, data: StudyData) -> list[tuple[Plot, str]]:
    # one colour scale over every grid point too, so an H-sweep's heatmaps compare across H
    vmax = max((float(np.nanmax(m)) for arms in records.routing.values() for m, _ in arms.values()), default=None)
    plots = []
    for point, arms in records.routing.items():
        at = f" at {data.labels(point)}" if point else ""
        plots.append((routing_heatmaps(arms, vmax=vmax), f"Routing weights{at} (last evaluation, mean over seeds), "
                                                        "one colour scale for every arm and grid point."))
        plots.append((concentration_profile(records.profiles[point]),
                      f"Routing concentration 1 - H/ln N per layer{at}."))
    return plots


class CurvesReadout(Readout):
    name = "curves"

    def compute(self, data: StudyData) -> StudyData:
        return data  # the records are read from the run directories when a report draws them

    def plots(self, result: StudyData, data: StudyData) -> list[tuple[Plot, str]]:
        records = data.records
        plots = []
        if not records.evals.empty:
            plots.append((loss_curves(records.evals, labels=data.labels),
                          "Validation loss against tokens: mean over seeds, min-max band."))
            plots += _delta_plots(records, data)
        plots += _routing_plots(records, data)
        if not records.depths.empty:
            plots.append((deff_plot(records.depths, data.labels),
                          "Effective depth D_eff per run (the participation ratio L^2 / sum C_ij of the layers' "
                          "debiased-CKA matrix C; the bar is the mean over seeds), against F_L = 2L/(L+1), the D_eff "
                          "of L orthogonal, equal-norm updates: below F_L, the layers' updates are correlated."))
        return plots
