"""`reslab power`: seeds each comparison of a study needs, before any compute is spent."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Any

from reslab.common.errors import ConfigError
from reslab.orchestrator.cli.args import (
    add_study_args,
    non_negative_float,
    positive_float,
    positive_int,
    probability,
    sampling_seed,
    simulation_reps,
    unit_interval,
)
from reslab.orchestrator.cli.common import load, read_workspace
from reslab.orchestrator.cli.jsonout import add_json_arg, emit

if TYPE_CHECKING:
    from reslab.experiments import Study
    from reslab.results.power import PowerRow, TaskPowerRow


def _pilot_sd(args: argparse.Namespace, study: Study) -> dict[str, float]:
    """Per comparison of ``study``: the pooled paired SD of the pilot's rows of the same name, else of all its rows."""
    from reslab.orchestrator.gathering.gather import gather
    from reslab.results.power import pilot_sd

    pilot_args = argparse.Namespace(**{**vars(args), "spec": args.pilot})
    pilot, runs = load(pilot_args)
    workspace = read_workspace(pilot_args, pilot, runs)
    pairs = gather(pilot, runs, workspace, workspace.tracking_uri(args.tracking_uri), cached=args.cached).pairs
    groups = {key: g["delta"].dropna().to_numpy() for key, g in pairs.groupby(["comparison", "treatment", "grid_key"])}
    overall = pilot_sd(groups.values())
    out = {}
    for c in study.comparisons:
        own = [d for (name, _, _), d in groups.items() if name == c.name and d.size >= 2]
        out[c.name] = pilot_sd(own) if own else overall
    print(f"pilot {pilot.name}: paired SD pooled over its rows {overall:.3g}")
    return out


def _line(r: PowerRow) -> str:
    from reslab.results.power import EXACT_MAX_N

    def n(x: int | None) -> str:
        return ">10000" if x is None else str(x)

    def pct(x: float) -> str:
        return "n/a" if math.isnan(x) else f"{100 * x:.0f}%"

    what = (f"margin +-{r.effect:g}, true delta {r.true_delta:g}" if r.kind == "equivalence"
            else "no mei declared" if r.effect is None else f"mei {r.effect:g}")
    test = "sign-flip TOST" if r.kind == "equivalence" else "sign flip"
    floor = r.power_now == 0 and r.power_now_se == 0  # sign_flip_power's exact 0 below the floor
    se = ("" if math.isnan(r.power_now_se) else ", exact: the floor exceeds the level" if floor
          else f", Monte Carlo SE {100 * r.power_now_se:.1f}%")
    approx = (f"; paired-t figures stand in for the sign flip's beyond {EXACT_MAX_N} pairs: {', '.join(r.approximate)}"
              if r.approximate else "")
    head = (f"  {r.comparison} ({r.kind}; {what}; SD {r.sd:.3g}; family {r.family!r} of {r.family_size}, "
            f"{r.correction}, level {r.level:.3g}): ")
    if r.effect is None:
        return f"{head}no power without an effect (give --mei); sign-flip floor needs {r.seeds_floor}"
    return (f"{head}power now {pct(r.power_now)} ({test}{se}; paired t "
            f"{pct(r.t_power_now)}) with {r.seeds_now} seeds; seeds for 80%: {n(r.seeds_80)}, 90%: "
            f"{n(r.seeds_90)} (paired t: {n(r.t_seeds_80)}, {n(r.t_seeds_90)}); sign-flip floor needs "
            f"{r.seeds_floor}; recommended {n(r.seeds_recommended)}{approx}")


def cmd_power(args: argparse.Namespace) -> int:
    """Seeds for 80% and 90% power per comparison from a declared paired SD (--sd) or a pilot study (--pilot)."""
    from reslab.results.power import power_rows

    study, _ = load(args)
    doc: dict[str, Any] = {"study": study.name, "seeds": len(study.seeds), "alpha": args.alpha}
    if args.task_gain is not None:
        tasks = _task_lines(args, study)
        if args.json:
            emit("power", {**doc, "mode": "tasks", "sd": None, "rows": [], "sequential": None, "ladder": None,
                           "tasks": tasks})
        return 0
    if study.gates is not None:
        _gates_lines(args, study)
        if not study.comparisons:
            return 0
    if not study.comparisons:
        raise ConfigError(f"{study.path}: comparisons: none declared; nothing to size")
    sd: float | dict[str, float] = args.sd if args.sd is not None else _pilot_sd(args, study)
    rows = power_rows(study.comparisons, len(study.seeds), study.grid_sizes(), sd, args.alpha,
                      true_delta=args.true_delta, mei=args.mei)
    draws = rows[0].draws
    if not args.json:
        print(f"{study.name}: {len(study.seeds)} seeds, alpha={args.alpha:g}; power of the test that decides the "
              f"verdict, the exact sign flip (sign-flip TOST for equivalence) at alpha / family size, Monte Carlo "
              f"over {draws} normal draws of the deltas, beside the paired t (noncentral t; TOST for equivalence); "
              "recommended seeds: the sign flip's for 80%, at least the sign-flip floor after the family's "
              "correction")
        for r in rows:
            print(_line(r))
    sequential = _sequential_lines(study, rows, args.alpha, args.json) if args.sequential else None
    ladder = _ladder_lines(study, sd, args.k, args.alpha, args.json) if study.ladder else None
    if args.json:
        emit("power", {**doc, "mode": "sd" if args.sd is not None else "pilot", "sd": sd, "rows": rows,
                       "sequential": sequential, "ladder": ladder, "tasks": None})
    return 0


def _task_lines(args: argparse.Namespace, study: Study) -> list[TaskPowerRow]:
    """Seeds and items each downstream task needs to detect `--task-gain` (`results.power.task_power`): the study's
    tasks (one when it declares none) at alpha / their number, its seeds, and `--items` or its `evals.limit`."""
    from reslab.results.power import TaskVariance, task_power

    if args.seed_sd is None:
        raise ConfigError("--seed-sd: required with --task-gain; allowed: the SD across seeds of one seed's paired "
                          "accuracy delta, e.g. 0.01 (a pilot's task row: its seed share of the variance)")
    items = args.items or (study.evals.limit if study.evals is not None else None)
    if items is None:
        raise ConfigError(f"--items: {study.path} sets no evals.limit; allowed: the task's item count, e.g. "
                          "--items 500")
    tasks = study.evals.tasks if study.evals is not None else ("task",)
    level = args.alpha / len(tasks)
    variance = TaskVariance.of_accuracy(args.task_gain, args.seed_sd, args.accuracy, args.item_share)
    seeds = len(study.seeds)
    if not args.json:
        print(f"{study.name}: downstream tasks, gain {100 * args.task_gain:g} points at accuracy "
              f"{100 * args.accuracy:g}%, seed SD {100 * args.seed_sd:g} points, items' share {args.item_share:g} of "
              f"the per-item variance (SD {variance.item_sd:.3g} items', {variance.interaction_sd:.3g} seed x item); "
              f"power of the task rows' two-way t (variance components, Satterthwaite df) at alpha / {len(tasks)} "
              f"task(s) = {level:.3g}")

    def n(x: int | None, what: str) -> str:
        return "unreachable (the seeds' variance alone is too wide)" if x is None and what == "items" else (
            ">10000" if x is None else str(x))

    out = [task_power(task, args.task_gain, variance, seeds, items, level) for task in tasks]
    for r in [] if args.json else out:
        print(f"  {r.task}: power now {100 * r.power_now:.0f}% with {seeds} seeds x {items} items; seeds for 80%: "
              f"{n(r.seeds_80, 'seeds')}, 90%: {n(r.seeds_90, 'seeds')} (at {items} items); items for 80%: "
              f"{n(r.items_80, 'items')}, 90%: {n(r.items_90, 'items')} (at {seeds} seeds)")
    return out


SEQUENTIAL_REPS = 2000
GATES_REPS = 100  # results.gates_power.GATES_REPS: the CLI's default, kept here so the parser imports no results
# the design a fixed study could declare, simulated by `power --sequential`: seeds 4, +1 per look
FIXED_START, FIXED_BATCH, FIXED_MAX = 4, 1, 16


def _sequential_lines(study: Study, rows: list[PowerRow], alpha: float, quiet: bool = False) -> dict[str, Any]:
    """Per comparison with an effect: the study's sequential design (a fixed study: start 4, batch 1, up to
    max(16, its seeds), prior scale (smallest effect / SD)^2) simulated at that effect (the treatment better
    by it; equivalence: at --true-delta) and at 0, against the fixed design of the same level and power, in
    seeds and GPU-hours (`reslab plan`'s per-run figures). Printed unless `quiet`; returned as data."""
    from reslab.experiments import expand
    from reslab.experiments.budget import budgets_by_point
    from reslab.results.sequential import TEST_WORDS, SequentialDesign

    effects = [r.effect / r.sd for r in rows if r.effect]
    # a fixed study: the design it could declare, its prior scale the squared standardised effect it assumes
    g = min(16.0, max(0.25, min(effects) ** 2)) if effects else 1.0
    design = study.sequential or SequentialDesign(FIXED_START, FIXED_BATCH, max(FIXED_MAX, len(study.seeds)), g)
    budgets = budgets_by_point(expand(study, study.seeds[:1]))
    levels = sorted({f"{r.level:.3g}" for r in rows if r.effect})
    declared = "its own" if study.sequential else (
        f"seeds: {{sequential: {{start: {design.start}, batch: {design.batch}, max: {design.max}, "
        f"prior_scale: {design.prior_scale:.3g}, test: {design.test}}}}}, which this fixed study could declare")
    scale = ("its prior scale" if design.test in ("t", "flip")
             else "its futility rule reads the t e-process's prior scale")
    if not quiet:
        print(f"sequential design ({declared}): seeds {design.start}, +{design.batch} per look, at most {design.max} "
              f"(the test that decides: {TEST_WORDS[design.test]}; {scale} {design.prior_scale:.3g}); "
              f"{SEQUENTIAL_REPS} simulated studies of normal deltas per line, Monte Carlo SE of the mean seeds in "
              "brackets; like for like: both designs at each row's level, alpha / its family's rows "
              f"({', '.join(levels) or 'none'}), the fixed one sized for the sequential one's power")
    by_name = {c.name: c for c in study.comparisons}
    out = []
    for r in rows:
        comp = by_name[r.comparison]
        if r.effect is None:
            continue
        per_seed = sum(b.gpu_hours for (arm, _), (b, _) in budgets.items() if arm in (comp.control, *comp.treatments))
        row = _sequential_row(comp, r, design, r.family_size, per_seed, alpha)
        out.append(row)
        if not quiet:
            print(_sequential_line(row))
    return {"declared": study.sequential is not None, "start": design.start, "batch": design.batch,
            "max": design.max, "test": design.test, "prior_scale": design.prior_scale, "reps": SEQUENTIAL_REPS,
            "rows": out}


def _sequential_row(comp: Any, r: PowerRow, design: Any, m: int, per_seed: float, alpha: float) -> dict[str, Any]:
    """One comparison's simulated sequential design against the fixed one (`_sequential_lines`), as data."""
    from reslab.results.sequential import RowRule, simulate_design

    superiority = comp.kind == "superiority"
    effect = r.effect or 0.0  # the caller skips rows without an effect
    true = (effect if comp.direction == "maximize" else -effect) if superiority else r.true_delta
    rule = RowRule.of(comp)
    at_effect = simulate_design(design, true, r.sd, alpha=alpha / m, rule=rule, reps=SEQUENTIAL_REPS)
    at_null = simulate_design(design, 0.0, r.sd, alpha=alpha / m, rule=rule, reps=SEQUENTIAL_REPS, seed=1)
    wanted = "better" if superiority else "equivalent"
    power = at_effect.decided.get(wanted, 0.0)
    seeds = at_effect.mean_seeds
    return {"comparison": comp.name, "family": comp.family, "family_rows": m, "true_delta": true, "sd": r.sd,
            "level": alpha / m, "wanted": wanted, "power": power, "mean_seeds": seeds,
            "mean_seeds_se": at_effect.mean_seeds_se, "gpu_hours": seeds * per_seed, "decided": at_effect.decided,
            "null_mean_seeds": at_null.mean_seeds,
            "null_claimed": at_null.decided.get("better", 0.0) + at_null.decided.get("worse", 0.0),
            "fixed": _fixed_design(comp, r, power, seeds, per_seed)}


def _sequential_line(row: dict[str, Any]) -> str:
    return (f"  {row['comparison']} (true delta {row['true_delta']:g}, SD {row['sd']:.3g}, level {row['level']:.3g}: "
            f"alpha / {row['family_rows']} row(s) of family {row['family']!r}): expected {row['mean_seeds']:.1f} "
            f"[{row['mean_seeds_se']:.2f}] seeds ({row['gpu_hours']:.3g} GPU-h), {row['wanted']} in "
            f"{100 * row['power']:.0f}% ({_decisions(row['decided'])}); at delta 0: {row['null_mean_seeds']:.1f} "
            f"seeds, a difference claimed in {100 * row['null_claimed']:.1f}%; {_fixed_line(row['fixed'])}")


def _fixed_design(comp: Any, r: PowerRow, power: float, seeds: float, per_seed: float) -> dict[str, Any]:
    """The fixed design of the same error rates: the seeds the paired t (TOST for equivalence) needs for the
    power the sequential design reached, at the row's level, and at least the sign flip's floor (the fixed
    verdict's test); and the saving (None: more than 10000 seeds)."""
    from reslab.results.power import paired_t_power, seeds_needed, tost_power

    target = min(power, 0.995)
    if comp.kind == "equivalence" or r.effect is None:
        margin = float(comp.margin if comp.kind == "equivalence" else r.effect or 0.0)
        n = seeds_needed(target, lambda k: tost_power(r.true_delta, r.sd, k, margin, r.level))
    else:
        n = seeds_needed(target, lambda k: paired_t_power(r.effect or 0.0, r.sd, k, r.level))
    if n is None:
        return {"power": target, "seeds": None, "gpu_hours": None, "saving": None}
    n = max(n, r.seeds_floor)
    return {"power": target, "seeds": n, "gpu_hours": n * per_seed, "saving": 1 - seeds / n}


def _fixed_line(fixed: dict[str, Any]) -> str:
    target, n, saving = fixed["power"], fixed["seeds"], fixed["saving"]
    if n is None:
        return f"a fixed design needs more than 10000 seeds for {100 * target:.0f}%"
    verdict = (f"the sequential design saves {100 * saving:.0f}% on average" if saving >= 0 else
               f"the sequential design costs {100 * -saving:.0f}% more on average: a fixed design is cheaper here")
    return (f"a fixed design at the same level and power ({100 * target:.0f}%: the paired t, at least the sign "
            f"flip's floor) needs {n} seeds ({fixed['gpu_hours']:.3g} GPU-h): {verdict}")


def _decisions(decided: dict[str, float]) -> str:
    return ", ".join(f"{k} {100 * v:.0f}%" for k, v in decided.items())


LADDER_SEEDS = (3, 4, 6, 8, 12, 16)


def _ladder_lines(study: Study, sd: float | dict[str, float], k: float, alpha: float,
                  quiet: bool = False) -> dict[str, Any]:
    """Per loss comparison of a ladder study: how tightly each seed count bounds k (the median
    interval ratio of `results.scaling.ladder_interval_ratio`), on the ladder's planned FLOPs and the
    Chinchilla loss at each rung's parameters and tokens. Printed unless `quiet`; returned as data."""
    import numpy as np

    from reslab.experiments import expand
    from reslab.experiments.budget import budgets_by_point
    from reslab.experiments.expand import rung_keys
    from reslab.results.ladder import LOSS_METRICS
    from reslab.results.scaling import CHINCHILLA_LAW, chinchilla_loss, ladder_interval_ratio

    floor = next(n for n in range(1, 64) if 2 / 2**n <= alpha)
    out: dict[str, Any] = {"trend_floor_seeds": floor, "k": k, "sized": len(study.rungs()) >= 4, "rows": []}
    say = (lambda line: None) if quiet else print
    say(f"ladder trend (the sign flip on per-seed slopes of the delta against log size, two-sided): its smallest "
        f"p is 2/2^n, so it can reach alpha={alpha:g} from {floor} seeds ({len(study.seeds)} declared)")
    if len(study.rungs()) < 4:
        say(f"ladder k: not sized for {len(study.rungs())} rungs (the law's 3 parameters pass through the rungs' "
        "means, so the sizing simulation has no residual to work with); size k with 4 or more rungs")
        return out
    budgets = budgets_by_point(expand(study))
    keys = rung_keys(study, study.scope_points()[0])
    say(f"ladder: k's {1 - alpha:.0%} interval at the middle of the rungs, high/low (median over simulated "
        f"ladders: the control on Chinchilla's L(N, D) = {CHINCHILLA_LAW['E']} + {CHINCHILLA_LAW['A']}/N^"
        f"{CHINCHILLA_LAW['alpha']} + {CHINCHILLA_LAW['B']}/D^{CHINCHILLA_LAW['beta']} at each rung's parameters "
        f"and tokens, against FLOPs; the treatment at k = {k:g} x its compute; a paired SD as given)")
    for c in study.comparisons:
        if c.metric not in LOSS_METRICS:
            continue
        rungs = [budgets[c.control, key][0] for key in keys]
        flops = np.array([b.flops for b in rungs])
        loss = chinchilla_loss(np.array([b.params for b in rungs]), np.array([b.tokens for b in rungs]))
        paired = sd[c.name] if isinstance(sd, dict) else sd
        ratios = {n: ladder_interval_ratio(flops, loss, k, paired, n, level=1 - alpha) for n in LADDER_SEEDS}
        shown = ", ".join(f"{n} seeds {r:.3g}" for n, r in ratios.items())
        say(f"  {c.name} (SD {paired:.3g}; {len(study.seeds)} seeds declared): {shown}")
        out["rows"].append({"comparison": c.name, "sd": paired,
                            "interval_ratio": [{"seeds": n, "ratio": r} for n, r in ratios.items()]})
    return out


def _gates_lines(args: argparse.Namespace, study: Study) -> None:
    """A gates study's plan simulated at known multipliers against the full ladder with fixed seeds
    (`results.gates_power.gates_power`): the control's law through `--losses` (default Chinchilla's loss at each rung's
    parameters and tokens) over the control's rung FLOPs, each run's own noise the paired SD `--sd` / sqrt(2)."""
    import numpy as np

    from reslab.experiments import expand
    from reslab.experiments.budget import budgets_by_point
    from reslab.experiments.expand import rung_keys
    from reslab.results.gates_power import gates_power, gates_scenarios
    from reslab.results.scaling import chinchilla_loss

    if args.sd is None:
        raise ConfigError("--sd: required for a gates study's power; allowed: the paired SD of one rung's loss delta "
                          "across seeds (nats), e.g. 0.0057")
    spec = study.gates
    assert spec is not None  # the caller's test
    keys = rung_keys(study, study.scope_points()[0])
    budgets = budgets_by_point(expand(study, study.seeds[:1]))
    rungs = [budgets[spec.control, key][0] for key in keys]
    compute = np.array([b.flops for b in rungs])
    if args.losses is not None and len(args.losses) != len(keys):
        raise ConfigError(f"--losses: {len(args.losses)} value(s) for a ladder of {len(keys)} rungs; give one "
                          "assumed control loss per rung, comma-separated")
    losses = np.array(args.losses if args.losses is not None else
                      chinchilla_loss(np.array([b.params for b in rungs]), np.array([b.tokens for b in rungs])))
    own = args.sd / math.sqrt(2.0)
    scenarios = gates_scenarios(spec.plan, compute, losses, own)
    rows = gates_power(spec.plan, scenarios, reps=args.reps, seed=args.seed)
    plan = spec.plan
    print(f"gates ({len(plan.gates)} gates, looks at {list(plan.looks)} seeds, alpha {plan.alpha:g}, errors "
          f"'{plan.errors}'): {args.reps} simulated ladders per design and scenario (seed {args.seed}; --reps for "
          f"more) through the code the study decides with (results.gates.simulate); the control's law through "
          f"{', '.join(f'{x:.3g}' for x in losses)} at the rungs' {', '.join(f'{c:.3g}' for c in compute)} FLOPs "
          f"({'--losses' if args.losses is not None else 'Chinchilla'}), each seed shifting both arms by SD "
          f"{scenarios[0].shared:g}, each run its own noise SD {own:.3g} (--sd / sqrt 2); the full ladder: every "
          f"rung at {plan.looks[-1]} seeds, one look, the same alpha and rule. A wrong promotion promotes where the "
          "true k is at or below the threshold, a wrong drop drops where it is at or above.")
    print("| scenario | true k (last gate) | design | promoted | dropped | undecided | wrong promotion | wrong drop "
          "| FLOPs (both arms) | saved |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        true = ", ".join(f"{k:.3g}" for k in r.true_k)
        for name, s in (("gates", r.gates), ("full ladder", r.fixed)):
            saved = f"{r.saved:+.0%}" if name == "gates" else ""
            print(f"| {r.scenario} | {true} | {name} | {s.promoted:.3f} | {s.dropped:.3f} | {s.undecided:.3f} | "
                  f"{s.wrong_promotion:.3f} | {s.wrong_drop:.3f} | {s.mean_compute:.3g} | {saved} |")


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive losses, got {text!r}")
    return values


def register(sub: Any) -> None:
    p = sub.add_parser("power", help="seeds each comparison needs for 80%% and 90%% power (before any compute)")
    add_study_args(p)
    source = p.add_mutually_exclusive_group(required=True)  # the usage shows it: (--sd SD | --pilot PILOT_SPEC)
    source.add_argument("--sd", type=positive_float, help="declared paired SD (SD of treatment - control across "
                                                          "seeds), in the metric's units; or --pilot")
    source.add_argument("--pilot", metavar="PILOT_SPEC",
                        help="a finished pilot study whose paired deltas give the SD; or --sd")
    source.add_argument("--task-gain", type=positive_float, metavar="GAIN",
                        help="size the study's downstream tasks instead: the accuracy gain to detect (0.02: two "
                             "points), with --seed-sd")
    p.add_argument("--seed-sd", type=non_negative_float,
                   help="with --task-gain: the SD across seeds of one seed's paired accuracy delta (its own shift)")
    p.add_argument("--items", type=positive_int, help="with --task-gain: items per task (default the study's "
                                                      "evals.limit)")
    p.add_argument("--accuracy", type=probability, default=0.5,
                   help="with --task-gain: the control's accuracy (default 0.5, where items vary most)")
    p.add_argument("--item-share", type=unit_interval, default=0.5,
                   help="with --task-gain: the share of the per-item paired variance that is the items' own, the "
                        "same in every seed (the rest: seed x item); a pilot's task row gives it (default 0.5)")
    p.add_argument("--cached", action="store_true", help="read the pilot from the Parquet cache, not MLflow")
    p.add_argument("--alpha", type=probability, default=0.05, help="family-wise level (default 0.05)")
    p.add_argument("--mei", type=positive_float,
                   help="minimum effect of interest for comparisons that declare no `mei:` (metric units)")
    p.add_argument("--k", type=positive_float, default=1.25,
                   help="the compute multiplier assumed when sizing a ladder's seeds (default 1.25, Kimi's)")
    p.add_argument("--sequential", action="store_true",
                   help=f"simulate the study's sequential design (a fixed study: seeds {FIXED_START}, "
                        f"+{FIXED_BATCH} per look, up to max({FIXED_MAX}, its seeds)) at the effect and at 0: expected "
                        "seeds and GPU-hours to a decision against the fixed design at the same level and power")
    p.add_argument("--reps", type=simulation_reps, default=GATES_REPS,
                   help=f"a gates study: simulated ladders per design and scenario (default {GATES_REPS}; more for "
                        "tighter rates, e.g. 400)")
    p.add_argument("--seed", type=sampling_seed, default=0, help="a gates study: the simulation's seed (default 0)")
    p.add_argument("--losses", type=_floats, metavar="L0,L1,...",
                   help="a gates study: the control's assumed loss at each rung (default Chinchilla's at each rung's "
                        "parameters and tokens), e.g. from a pilot")
    p.add_argument("--true-delta", type=float, default=0.0,
                   help="true mean delta assumed for equivalence comparisons (default 0)")
    add_json_arg(p, "power")
    p.set_defaults(func=cmd_power)
