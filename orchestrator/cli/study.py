"""Studies: `validate`, `plan`, `run` and `status`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reslab.orchestrator.cli.args import MAX_CLUSTER_GPUS, add_study_args, cluster_gpus, whole_gpus
from reslab.orchestrator.cli.common import (
    ALLOW_UNDERPOWERED,
    add_cluster_args,
    add_execution_args,
    add_flags,
    add_tune_args,
    checked_options,
    load,
    load_study_of,
    ray_backend,
    read_workspace,
    set_up,
)
from reslab.orchestrator.cli.jsonout import add_json_arg, emit
from reslab.orchestrator.cli.payloads import (
    attainable_row,
    gates_payload,
    looks_payload,
    plan_costs,
    plan_entry,
    problem,
    status_payload,
    study_summary,
)
from reslab.orchestrator.durability.workspace import Workspace
from reslab.orchestrator.tasks import Action

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from reslab.experiments.budget import RunBudget
    from reslab.experiments.expand import RunSpec
    from reslab.experiments.spec import Study
    from reslab.orchestrator.dispatch.ray_backend import RayBackend
    from reslab.orchestrator.driving.gates import GatesStatus
    from reslab.orchestrator.driving.plan import PlanCounts, PlanEntry
    from reslab.orchestrator.driving.sequential import SequentialStatus
    from reslab.results.power import Attainable


def cmd_validate(args: argparse.Namespace) -> int:
    if not args.json:
        return _validate(args)
    from reslab.common.errors import ReslabError

    try:
        return _validate(args)
    except ReslabError as exc:  # a refusal is the document's answer, not an error document
        message = " ".join(str(exc).split())
        print(f"reslab: error: {message}", file=sys.stderr)
        emit("validate", {"ok": False, "spec": args.spec, "study": None, "problems": [problem(message, args.spec)],
                          "notes": []})
        return exc.exit_code


def _validate(args: argparse.Namespace) -> int:
    from reslab.experiments import load_study
    from reslab.experiments.budget import corpus_lines
    from reslab.orchestrator.driving.preflight import check_study

    study = load_study(args.spec, args.set, args.max_runs)
    runs, budgets = check_study(study, args.allow_underpowered)
    per_seed = len(study.seeds)
    if args.json:
        emit("validate", {"ok": True, "spec": args.spec, "study": study_summary(study, len(runs) * per_seed),
                          "problems": [], "notes": [*corpus_lines(budgets), *_device_lines(runs)]})
        return 0
    grid = " x ".join(f"{a.path}[{len(a.values)}]" for a in study.grid) or "none"
    ladder = f", ladder {' + '.join(a.path for a in study.ladder)}[{len(study.rungs())} rungs]" if study.ladder else ""
    print(f"{study.path}: ok. study {study.name!r}: {len(study.arms)} arms ({', '.join(a.name for a in study.arms)}), "
          f"{len(study.seeds)} seeds, grid {grid}{ladder} -> {len(runs) * per_seed} runs")
    if study.sequential is not None:
        d = study.sequential
        print(f"  sequential: seeds {d.start}, then +{d.batch} per look until every comparison is decided, at most "
              f"{d.max} (looks at {d.looks()}); the runs above count the maximum")
    if study.gates is not None:
        from reslab.orchestrator.driving.gates import rung_flops

        print("\n".join(f"  {line}" for line in study.gates.lines(rung_flops(study, runs))))
    for c in study.comparisons:
        print(f"  comparison {c.describe()}")
    if study.tune is not None:
        print(f"  tune: {study.tune.describe()}")
    if study.interventions is not None:
        print(f"  interventions: {study.interventions.describe()}")
    for line in corpus_lines(budgets):
        print(f"  {line}")
    for line in _device_lines(runs):
        print(f"  {line}")
    return 0


def _device_lines(runs: list[RunSpec]) -> list[str]:
    """What a run on this machine would refuse of the runs' devices (the check `run` makes with a local Ray,
    `ray_backend.check_local_devices`), one line each, as `validate` reports a corpus `run` would refuse."""
    from reslab.common.errors import ConfigError
    from reslab.kernels import select_impl
    from reslab.models.training import pick_device

    lines = []
    for device, impl in sorted({(r.config.train.device, r.config.residual.impl) for r in runs}):
        try:
            select_impl(impl, pick_device(device).type)
        except ConfigError as exc:
            lines.append(f"this machine: {exc} (`reslab run` here refuses it; a cluster's workers check their own)")
    return lines


LISTED_RUNS = 100  # a plan lists each run by default up to this many runs; `--ids` lists any number


@dataclasses.dataclass
class StudyPlan:
    """A study's plan as `reslab plan` counts it: its runs at the first seed, a sequential study's looks, the
    counts, and a fresh iterator over its entries each call (`entries()`)."""

    firsts: list[RunSpec]
    looks: SequentialStatus | GatesStatus | None
    counts: PlanCounts
    entries: Callable[[], Iterator[PlanEntry]]


def plan_study(study: Study, workspace: Workspace, *, rerun_failed: bool = False,
               lease_timeout_s: float = 120.0) -> StudyPlan:
    """The plan of `study` in `workspace`, counted (`plan.plan_counts`, else its entries counted). The runs are
    expanded lazily: a study's size costs time in the runs that have a run directory, never memory."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.driving.plan import PlanCounts, plan_counts

    firsts = expand(study, study.seeds[:1])  # one run per (arm, grid point): budgets, devices, widths
    from reslab.orchestrator.driving.progress import where_looks_stand

    # every run of a study with looks (few); any other's stay lazy
    looks = where_looks_stand(study, expand(study), workspace) if study.sequential or study.gates else None
    entries = _plan_entries(study, workspace, looks, rerun_failed, lease_timeout_s)
    counts = plan_counts(study, firsts, workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s) \
        if looks is None else None
    return StudyPlan(firsts, looks, counts or PlanCounts.of(entries()), entries)


def cmd_plan(args: argparse.Namespace) -> int:
    """The plan counted (per arm, to run / skip / busy), its power, cost and placement; each run's line (`--ids`,
    or a study of at most `LISTED_RUNS` runs), streamed (`plan_study`)."""
    from reslab.experiments.expand import count_runs, iter_runs

    study = load_study_of(args)
    workspace = read_workspace(args, study, iter_runs(study))  # consumed only to pull from run storage
    total = count_runs(study)
    plan = plan_study(study, workspace, rerun_failed=args.rerun_failed, lease_timeout_s=args.lease_timeout)
    firsts, looks, counts, entries = plan.firsts, plan.looks, plan.counts, plan.entries
    later = sum(1 for e in entries() if e.run.run_id in looks.later) if looks is not None else 0
    from reslab.results.power import plan_attainable

    attainable = plan_attainable(study.comparisons, len(study.seeds), study.grid_sizes())
    listed = getattr(args, "ids", False) or total <= LISTED_RUNS
    doc = None
    if getattr(args, "json", False):
        doc = {"study": study.name, "runs": total, "counts": counts.to_dict(), "later": later if looks else None,
               "sequential": looks_payload(looks), "gates": gates_payload(looks),
               "power": [attainable_row(a) for a in attainable],
               "entries": [plan_entry(e) for e in entries()] if listed else None}
    else:
        _print_plan_head(study, firsts, counts, looks, later, attainable)
        if listed:
            _print_plan_lines(study, firsts, entries())
        else:
            print(f"(each run's id and why: `reslab plan --ids`, {total:,} lines)")
    return _plan_costs(args, study, firsts, looks, doc)


def _print_plan_head(study: Study, firsts: list[RunSpec], counts: PlanCounts,
                     looks: SequentialStatus | GatesStatus | None, later: int, attainable: list[Attainable]) -> None:
    """The plan's counts, a sequential study's looks, the counts per arm and each comparison's attainable p."""
    if looks is not None:
        print(f"{study.name}: {counts.summary()}" + (f"; {later} of those to run are in later looks, run only if "
                                                      "what needs them stays undecided" if later else ""))
        print("\n".join(looks.lines()))
        if study.gates is not None:
            from reslab.orchestrator.driving.gates import rung_flops

            print("\n".join(study.gates.lines(rung_flops(study, firsts))))
    else:
        print(f"{study.name}: {counts.summary()}")
    if len(study.arms) > 1:
        print("\n".join(f"  {line}" for line in counts.arm_lines()))
    for a in attainable:
        print(f"power: {a.line()}")


def _plan_entries(study: Study, workspace: Workspace, looks: SequentialStatus | GatesStatus | None, rerun_failed: bool,
                  lease_timeout_s: float) -> Callable[[], Iterator[PlanEntry]]:
    """A fresh iterator over the study's plan entries each call (a sequential study's as its looks have them)."""
    from reslab.experiments.expand import iter_runs
    from reslab.orchestrator.driving.plan import plan_iter

    def entries() -> Iterator[PlanEntry]:
        for e in plan_iter(iter_runs(study), workspace, rerun_failed=rerun_failed, lease_timeout_s=lease_timeout_s):
            yield e if looks is None else _sequential_entry(e, looks)

    return entries


def _print_plan_lines(study: Study, firsts: list[RunSpec], entries: Iterable[PlanEntry]) -> None:
    """The header and one line per entry, streamed; the columns are as wide as their widest cell (a ladder's
    grid keys run past any fixed width), so `why` starts at the same column in every line: a label differs
    between seeds only in its seed's digits."""
    digits = max(len(str(s)) for s in study.seeds) - len(str(study.seeds[0]))
    id_width = max([28, *(len(r.run_id) for r in firsts)])
    label_width = max([36, *(len(r.label) + digits for r in firsts)])
    print(f"{'':<4}  {'run id':<{id_width}} {'arm/grid point/seed':<{label_width}} why")
    for e in entries:
        print(e.line(id_width, label_width))


def _plan_costs(args: argparse.Namespace, study: Study, firsts: list[RunSpec],
                looks: SequentialStatus | GatesStatus | None, doc: dict[str, Any] | None = None) -> int:
    """The plan's interventions, budget, ladder and placement, from one run per (arm, grid point) times the seeds;
    with `doc` (`plan --json`), added to it and the document emitted instead."""
    seeds = len(study.seeds)
    if study.interventions is not None and doc is None:  # work after training: what it costs
        from reslab.experiments.interventions import cost_lines

        print("\n".join(cost_lines(study.interventions, firsts, per_run=seeds)))
    from reslab.experiments.budget import budgets_by_point, format_budget, format_ladder

    gpus = _on_gpus(args, study, firsts)
    budgets = {key: (b, n * seeds) for key, (b, n) in budgets_by_point(firsts).items()}
    rungs = ladder_budgets(study, budgets) if study.ladder else [("study", list(budgets.values()))]
    # `run --dry-run` comes here too: its --gpus-per-run may be unset (the study's `resources:` or the
    # cluster decide) or fractional
    per_run = max(1, int(getattr(args, "gpus_per_run", None) or study.resources.gpus_per_run or 1))
    if doc is not None:
        emit("plan", {**doc, **plan_costs(grouped_budgets(budgets), rungs if study.ladder else None, gpus, per_run,
                                          getattr(args, "cluster_gpus", None))})
        return 0
    print(format_budget(grouped_budgets(budgets), gpus=gpus))
    if looks is not None:
        print(looks.budget_note())
    if study.ladder:
        print(format_ladder(rungs, gpus=gpus))
    if not gpus:
        print("placement: on CPUs, each run in one process of --cpus-per-run CPUs (no GPUs to place it on)")
        return 0
    from reslab.experiments.budget import format_placement

    print(format_placement(rungs, per_run, getattr(args, "cluster_gpus", None)))
    return 0


def grouped_budgets(budgets: dict[tuple[str, str], tuple[RunBudget, int]]) -> list[tuple[RunBudget, int]]:
    """The budget table's rows: an arm's grid points whose budgets are equal in everything but their label (a
    grid over settings that change no budget: a learning rate, a seed of the data) one row, "arm @ N grid points",
    their runs summed, as the run list groups them."""
    groups: dict[tuple[str, RunBudget], list[tuple[RunBudget, int]]] = {}
    for (arm, _), (b, n) in budgets.items():
        groups.setdefault((arm, dataclasses.replace(b, label="")), []).append((b, n))
    rows = []
    for (arm, _), members in groups.items():
        first = members[0][0]
        label = first.label if len(members) == 1 else f"{arm} @ {len(members)} grid points"
        rows.append((dataclasses.replace(first, label=label), sum(n for _, n in members)))
    return rows


def _on_gpus(args: argparse.Namespace, study: Study, runs: list[RunSpec]) -> bool:
    """Whether the runs train on GPUs, so that GPU-hours mean something: a run on `train.device: cpu` never
    does; one on `auto` does when it is given a GPU (--gpus-per-run, --cluster-gpus, the study's
    `resources:`), joins a cluster (`run --dry-run --address`), or this machine has one."""
    devices = {r.config.train.device for r in runs}
    if devices <= {"cpu", "mps"}:
        return False
    if any(d.startswith("cuda") for d in devices):
        return True
    gpus = getattr(args, "gpus_per_run", None)
    if gpus is not None:
        return gpus > 0
    if getattr(args, "cluster_gpus", None) or study.resources.gpus_per_run:
        return True
    if getattr(args, "address", None) or os.environ.get("RAY_ADDRESS"):
        return True
    import torch

    return torch.cuda.is_available()


def _sequential_entry(entry: PlanEntry, looks: SequentialStatus | GatesStatus) -> PlanEntry:
    """A sequential study's plan entry as its looks have it: a run of a later look runs only if the rows needing
    it are undecided then; one no look needs is skipped."""
    from reslab.orchestrator.driving.sequential import LATER

    word = looks.word(entry.run.run_id)
    if entry.action != Action.RUN or word is None:
        return entry
    if word == LATER:
        return dataclasses.replace(entry, reason=f"later look, only if still undecided; {entry.reason}")
    return dataclasses.replace(entry, action=Action.SKIP, reason="not needed: the rows that need it are decided")


def ladder_budgets(study: Study, budgets: dict[tuple[str, str], tuple[RunBudget, int]]
                   ) -> list[tuple[str, list[tuple[RunBudget, int]]]]:
    """Per rung of the study's ladder, its label and the budgets of every arm and grid point on it."""
    from reslab.experiments.expand import rung_keys

    at_points = [rung_keys(study, point) for point in study.scope_points()]
    out = []
    for i, rung in enumerate(study.rungs()):
        keys = {keys[i] for keys in at_points}
        label = f"{i}: " + ", ".join(f"{path.rsplit('.', 1)[-1]}={value}" for path, value in rung)
        out.append((label, [b for (_, key), b in budgets.items() if key in keys]))
    return out


@dataclasses.dataclass
class Ran:
    """What one `reslab run` submission did: the study, its workspace and tracker, and `submit`'s result."""

    study: Study
    workspace: Workspace
    tracker: Any
    result: Any  # driving.submit.SubmitResult


def run_study(args: argparse.Namespace, study: Study | None = None) -> Ran:
    """`reslab run`'s work, as `args` (its parsed flags) ask: the study loaded (or `study`, already loaded: the
    Python interface's), checked and submitted, its driver in this process; raises what `run` reports."""
    workspace = Workspace.at(args.workspace, args.storage)
    backend = ray_backend(args, workspace)
    try:
        if not workspace.root.exists() and Path(args.spec).is_file():
            # nothing recorded here yet, so a valid study has runs to run: a local Ray starts now,
            # beside the study's load (torch) and MLflow's store, not after them (~1 s on 2 cores;
            # a study that then fails its checks stops it unused)
            backend.prestart()
        study, tracker, result = _submit_study(args, workspace, backend, study)
    finally:
        backend.shutdown()  # what submit() started it stopped; this stops a prestart it never used
    return Ran(study, workspace, tracker, result)


def cmd_run(args: argparse.Namespace) -> int:
    if args.dry_run:
        return cmd_plan(args)
    ran = run_study(args)
    study, result = ran.study, ran.result
    print(f"{study.name}: {result.summary()} in {result.wall_s:.0f}s")
    for run_id, error in result.errors.items():
        print(f"  FAILED {run_id}: {error}")
    if result.interrupted:
        return 130
    if study.comparisons or study.gates is not None:
        from reslab.orchestrator.gathering.gather import study_result

        # published on the parent run before it ended (`_submit_study`); printed here
        study_result(study, result.runs, ran.workspace, ran.tracker, publish=result.published is not None,
                     readout=result.published)
    return 0 if result.ok else 1


def _submit_study(args: argparse.Namespace, workspace: Workspace, backend: RayBackend,
                  study: Study | None = None) -> tuple[Any, ...]:
    """Load (unless given), check and submit the study: (study, tracker, submit's result)."""
    from reslab.experiments.expand import expand
    from reslab.orchestrator.driving.plan import RUN, study_counts
    from reslab.orchestrator.driving.submit import LazyRuns, check_power, submit

    study = load_study_of(args) if study is None else study
    check_power(study, args.allow_underpowered)
    from reslab.orchestrator.attempt.simulate import SIMULATE_ENV, check_simulation

    if os.environ.get(SIMULATE_ENV):  # the bench's simulated runs (issue 39): a bad one refused before any run
        check_simulation(study.name, os.environ[SIMULATE_ENV])
    firsts = expand(study, study.seeds[:1])
    if study.evals is not None:  # unknown tasks and data not readable here: before anything trains
        from reslab.orchestrator.driving.preflight import check_eval_inputs

        check_eval_inputs(study.evals, firsts)
    # devices and budgets are per (arm, grid point): one seed's runs carry every check, and the plan is counted
    # from the run directories that exist (`plan.study_counts`), not planned run by run; the runs are drawn as
    # slots free up (`submit.LazyRuns`), so a study of 10^6 runs starts dispatching without building them
    options = checked_options(args, study, firsts)
    counts = study_counts(study, firsts, workspace, rerun_failed=options.rerun_failed,
                          lease_timeout_s=options.lease_timeout_s)
    tracker = set_up(args, workspace, backend, options, prestart=counts.actions[RUN] > 0)

    def publish(result: Any) -> None:  # before the parent run ends: it is FINISHED only with the study's result on it
        from reslab.orchestrator.gathering.gather import publish_result

        result.published = publish_result(study, result.runs, workspace, tracker, result.result_key)

    tracker.publisher = publish if study.comparisons or study.gates is not None else None
    return study, tracker, submit(study, LazyRuns(firsts, counts), workspace, backend, tracker, options)


def cmd_status(args: argparse.Namespace) -> int:
    """Counts, each run's step and latest losses, and an ETA; reads run directories only."""
    from reslab.orchestrator.driving.progress import SUCCEEDED, TO_RUN, UNNEEDED, study_status_of

    study, runs = load(args)
    workspace = read_workspace(args, study, runs)
    status = study_status_of(study, runs, workspace, args.lease_timeout)
    if args.json:  # every run, whatever the study's size: a reader filters by state
        emit("status", status_payload(study, status))
        return 0
    print("\n".join(status.lines(study.name)))
    from reslab.orchestrator.driving.overrides import other_overrides_hint

    hint = other_overrides_hint(study, runs, workspace)
    if hint:
        print(hint)
    storage = workspace.run_storage()
    if storage is not None:
        from reslab.orchestrator.durability.storage import describe_driver, study_driver

        marker = study_driver(storage, study.name)
        print(f"driver: {describe_driver(marker, args.lease_timeout)[1]}" if marker else
              "driver: none holds the study on run storage; a run it shows as running was left by one that stopped")
    listed = status.runs
    if not args.ids and len(listed) > LISTED_RUNS:
        # a large study: the runs that need a look (not succeeded, not to run) up to the cap; the rest counted
        listed = [r for r in status.runs if r.state not in (SUCCEEDED, TO_RUN, UNNEEDED)][:LISTED_RUNS]
    for run in listed:
        print(run.line())
    if len(listed) < len(status.runs):
        print(f"  ... {len(status.runs) - len(listed)} more runs not listed (succeeded or to run, or past the first "
              f"{LISTED_RUNS} others); --ids lists every run")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("validate", help="check a study file and count its runs (the checks `run` makes before "
                       "it starts anything, except the devices and the corpus being prepared)")
    add_study_args(p)
    add_flags(p, (ALLOW_UNDERPOWERED,))
    add_json_arg(p, "validate")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("plan", help="count a study's runs per arm, which would run or be skipped, and their cost "
                                     "(`--ids`: each run's id and why)")
    add_study_args(p)
    add_tune_args(p)
    p.add_argument("--rerun-failed", action="store_true", help="plan failed runs to run again")
    p.add_argument("--ids", action="store_true",
                   help=f"list every run (its id, label and why), streamed; by default a study of more than "
                        f"{LISTED_RUNS} runs is counted per arm, not listed")
    p.add_argument("--gpus-per-run", type=whole_gpus,
                   help="GPUs each run spans, one rank each (as `run --gpus-per-run`; default: the study's "
                        "resources.gpus_per_run, else 1)")
    p.add_argument("--cluster-gpus", type=cluster_gpus,
                   help="size the wall-clock for a cluster of this many GPUs: runs at once and hours per rung (at "
                        f"most {MAX_CLUSTER_GPUS:,})")
    add_json_arg(p, "plan")
    p.set_defaults(func=cmd_plan, reads_study=True)

    p = sub.add_parser("run", help="run a study on Ray (local by default), tracked in MLflow")
    add_study_args(p)
    add_tune_args(p)
    add_cluster_args(p)
    add_execution_args(p, study=True)
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (same as `reslab plan`)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("status", help="show a study's runs: done, running, failed, to run; losses; no side effects")
    add_study_args(p)
    add_tune_args(p)
    p.add_argument("--ids", action="store_true",
                   help=f"list every run; by default a study of more than {LISTED_RUNS} runs lists only its running "
                        "and failed ones (up to that many) and counts the rest")
    add_json_arg(p, "status")
    p.set_defaults(func=cmd_status, reads_study=True)

