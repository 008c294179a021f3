"""`reslab power`: seeds each comparison of a study needs, before any compute is spent."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from reslab.common.errors import ConfigError
from reslab.orchestrator.cli.args import add_study_args, positive_float, probability

if TYPE_CHECKING:
    from reslab.experiments import Study
    from reslab.results.power import Attainable, PowerRow


def attainable(study: Study, alpha: float = 0.05) -> list[Attainable]:
    from reslab.results.power import plan_attainable

    return plan_attainable(study.comparisons, len(study.seeds), study.grid_sizes(), alpha)


def _pilot_sd(args: argparse.Namespace, study: Study) -> dict[str, float]:
    """Per comparison of ``study``: the pooled paired SD of the pilot's rows of the same name, else of all its rows."""
    from reslab.orchestrator.cli.study import load, read_workspace
    from reslab.orchestrator.readout import compare_study
    from reslab.results.power import pilot_sd

    pilot_args = argparse.Namespace(**{**vars(args), "spec": args.pilot})
    pilot, runs = load(pilot_args)
    workspace = read_workspace(pilot_args, pilot, runs)
    pairs = compare_study(pilot, runs, workspace, workspace.tracking_uri(args.tracking_uri), cached=args.cached).pairs
    groups = {key: g["delta"].dropna().to_numpy() for key, g in pairs.groupby(["comparison", "treatment", "grid_key"])}
    overall = pilot_sd(groups.values())
    out = {}
    for c in study.comparisons:
        own = [d for (name, _, _), d in groups.items() if name == c.name and d.size >= 2]
        out[c.name] = pilot_sd(own) if own else overall
    print(f"pilot {pilot.name}: paired SD pooled over its rows {overall:.3g}")
    return out


def _line(r: PowerRow) -> str:
    def n(x: int | None) -> str:
        return ">10000" if x is None else str(x)

    what = (f"margin +-{r.effect:g}, true delta {r.true_delta:g}" if r.kind == "equivalence"
            else "no mei declared" if r.effect is None else f"mei {r.effect:g}")
    power = "n/a" if math.isnan(r.power_now) else f"{100 * r.power_now:.0f}%"
    return (f"  {r.comparison} ({r.kind}; {what}; SD {r.sd:.3g}; family {r.family!r} of {r.family_size}, "
            f"{r.correction}, level {r.level:.3g}): power now {power} with {r.seeds_now} seeds; seeds for 80%: "
            f"{n(r.seeds_80)}, 90%: {n(r.seeds_90)}; sign-flip floor needs {r.seeds_floor}")


def cmd_power(args: argparse.Namespace) -> int:
    """Seeds for 80% and 90% power per comparison from a declared paired SD (--sd) or a pilot study (--pilot)."""
    from reslab.orchestrator.cli.study import load
    from reslab.results.power import power_rows

    if (args.sd is None) == (args.pilot is None):
        raise ConfigError("power: give exactly one of --sd (a declared paired SD in the metric's units) and "
                          "--pilot (a study file whose finished runs give the paired deltas)")
    study, _ = load(args)
    if not study.comparisons:
        raise ConfigError(f"{study.path}: comparisons: none declared; nothing to size")
    sd: float | dict[str, float] = args.sd if args.sd is not None else _pilot_sd(args, study)
    rows = power_rows(study.comparisons, len(study.seeds), study.grid_sizes(), sd, args.alpha,
                      true_delta=args.true_delta, mei=args.mei)
    print(f"{study.name}: {len(study.seeds)} seeds, alpha={args.alpha:g}; paired t via the noncentral t "
          "(TOST for equivalence) at alpha / family size; the sign-flip floor after the family's correction")
    for r in rows:
        print(_line(r))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("power", help="seeds each comparison needs for 80%% and 90%% power (before any compute)")
    add_study_args(p)
    p.add_argument("--sd", type=positive_float, help="declared paired SD (SD of treatment - control across seeds), "
                                                     "in the metric's units")
    p.add_argument("--pilot", metavar="PILOT_SPEC", help="a finished pilot study whose paired deltas give the SD")
    p.add_argument("--cached", action="store_true", help="read the pilot from the Parquet cache, not MLflow")
    p.add_argument("--alpha", type=probability, default=0.05, help="family-wise level (default 0.05)")
    p.add_argument("--mei", type=positive_float,
                   help="minimum effect of interest for comparisons that declare no `mei:` (metric units)")
    p.add_argument("--true-delta", type=float, default=0.0,
                   help="true mean delta assumed for equivalence comparisons (default 0)")
    p.set_defaults(func=cmd_power)
