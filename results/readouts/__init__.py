"""The kinds of result a study reads out, one module each behind one protocol (`base.Readout`):
`sequential`, `paired` (equal-cost comparisons folded in), `costs` (declared cost metrics as ratio rows,
the loss against each cost), `ladder`, `contrasts` and `curves` (training curves and routing
diagnostics). `results.readout` holds their ordered list and the `StudyReadout` that loops over it;
nothing outside that list knows the kinds.

A readout computes its result from plain study data (`base.StudyData`, which the orchestrator's
gatherer fills from MLflow, the run directories and the study) and renders it: terminal text, an
HTML report section, plots, artifact files and MLflow tables, and MLflow metric series. Like the
rest of results/, nothing here imports experiments/ or the orchestrator.
"""
