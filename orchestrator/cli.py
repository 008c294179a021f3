"""The `reslab` command line.

Single runs: `train`, `variants`, `data prepare`. Studies: `validate`, `plan`, `run`, `status`,
`compare`, `export`; and `dashboard` serves the MLflow UI. Study commands share `--workspace`
(default `$RESLAB_WORKSPACE` or `./reslab-runs`), `--tracking-uri` (default
`$MLFLOW_TRACKING_URI` or the workspace's SQLite file) and `--set FIELD=VALUE` overrides applied
to every run of the study (they change run ids, so pass the same ones to `plan`, `status`,
`compare` and `export`).

Exit codes: 0 success, 1 a run failed, 2 a spec/config/backend error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from reslab.models.config import ConfigError, RunConfig, load, set_path, to_dict


def _parse_value(text: str) -> Any:
    """`--set optim.lr=3e-4`: values are read as YAML scalars (numbers, booleans, lists)."""
    value = yaml.safe_load(text)
    return text if value is None and text not in ("null", "~") else value


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    data: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config: no such file {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    shortcuts = {
        "model.preset": args.preset, "residual.name": args.residual, "train.seed": args.seed,
        "train.steps": args.steps, "residual.impl": args.impl, "train.device": args.device,
        "data.corpus": args.corpus,
    }
    for dotted, value in shortcuts.items():
        if value is not None:
            data = set_path(data, dotted, value)
    for item in args.residual_opt or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--opt {item!r}: expected KNOB=VALUE, e.g. --opt block_size=4")
        data = set_path(data, f"residual.options.{key}", _parse_value(value))
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set optim.lr=3e-4")
        data = set_path(data, key, _parse_value(value))
    return load(RunConfig, data, where=args.config or "config")


def cmd_train(args: argparse.Namespace) -> int:
    from reslab.models.config import validate_run_config
    from reslab.models.training import train

    cfg = validate_run_config(run_config_from_args(args), where=args.config or "config")
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    result = train(cfg, run_dir=args.out, log=print, resume=not args.no_resume)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps({"summary": result.summary, "info": result.info}, indent=2))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """prenorm checkpoint -> a routing variant with the same function at step 0, then train on."""
    from reslab.models.config import ResidualConfig, validate_run_config
    from reslab.models.convert import convert_checkpoint

    options = {}
    for item in args.residual_opt or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--opt {item!r}: expected KNOB=VALUE, e.g. --opt gate=learnable_alpha")
        options[key] = _parse_value(value)
    if not Path(args.checkpoint).is_file():
        raise ConfigError(f"convert: no such checkpoint {args.checkpoint}")
    try:
        conversion = convert_checkpoint(args.checkpoint, ResidualConfig(name=args.residual, options=options), args.out)
    except ValueError as exc:
        raise ConfigError(f"convert: {exc}") from None
    config_path = Path(args.out) / "run_config.json"
    print(f"converted {args.checkpoint} -> {args.residual}: weights {conversion.weights}, config {config_path}")
    if args.steps is None:
        print(f"continue training with: reslab train --config {config_path} --out {Path(args.out) / 'run'}")
        return 0
    from reslab.models.training import train

    data = set_path(conversion.config, "train.steps", args.steps)
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE")
        data = set_path(data, key, _parse_value(value))
    cfg = validate_run_config(load(RunConfig, data, where=str(config_path)), where=str(config_path))
    train(cfg, run_dir=Path(args.out) / "run", log=print)
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from reslab.models.data import prepare_from_cli

    try:
        meta = prepare_from_cli(
            args.inputs, fmt=args.format, out_dir=args.out, tokenizer=args.tokenizer,
            vocab_size=args.vocab_size, text_field=args.text_field, val_fraction=args.val_fraction,
        )
    except ValueError as exc:  # bad inputs (too few documents, a missing field): a usage error
        raise ConfigError(f"data prepare: {exc}") from None
    print(json.dumps(meta if isinstance(meta, dict) else to_dict(meta), indent=2, default=str))
    return 0


def cmd_variants(args: argparse.Namespace) -> int:
    from reslab.models.config import ModelConfig
    from reslab.models.presets import resolve_model
    from reslab.models.residual import variants

    shape = resolve_model(ModelConfig(preset=args.preset), vocab_size=256)
    print(f"residual variants (extra parameters per layer at preset {args.preset!r}, d={shape.d_model}, "
          f"L={shape.n_layers}):")
    for name, cls in variants().items():
        pathway = cls(cls.Config(), shape)
        knobs = ", ".join(f"{k}={v!r}" for k, v, _ in cls.knobs()) or "(no knobs)"
        print(f"  {name:<18} +{pathway.extra_params_per_layer():>12,.1f}/layer  {knobs}")
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with a run config (model/residual/data/optim/train)")
    p.add_argument("--preset", help="model preset: tiny, small, 100m, gpt2-124m, 350m")
    p.add_argument("--residual", help="residual variant name (see `reslab variants`)")
    p.add_argument("--opt", dest="residual_opt", action="append", metavar="KNOB=VALUE",
                   help="a residual knob, repeatable (e.g. --opt block_size=4)")
    p.add_argument("--seed", type=int, help="seed: fixes init and data order")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--impl", choices=["auto", "reference", "triton"], help="routing implementation")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--corpus", help="stdlib (default) or a directory from `reslab data prepare`")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="any config field by dotted path, repeatable (e.g. --set optim.lr=3e-4)")




# ----------------------------------------------------------------------------- studies


def _overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    out = []
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set train.steps=6")
        out.append((key, _parse_value(value)))
    return out


def _study(args: argparse.Namespace):
    from reslab.experiments import expand, load_study

    study = load_study(args.spec, _overrides(args))
    return study, expand(study)


def _workspace(args: argparse.Namespace):
    from reslab.orchestrator.workspace import Workspace

    return Workspace.at(args.workspace)


def cmd_validate(args: argparse.Namespace) -> int:
    study, runs = _study(args)
    grid = " x ".join(f"{a.path}[{len(a.values)}]" for a in study.grid) or "none"
    print(f"{study.path}: ok. study {study.name!r}: {len(study.arms)} arms ({', '.join(a.name for a in study.arms)}), "
          f"{len(study.seeds)} seeds, grid {grid} -> {len(runs)} runs")
    for c in study.comparisons:
        print(f"  comparison {c.name}: {c.control} vs {', '.join(c.treatments)} on {c.metric} ({c.direction}, "
              f"family {c.family})")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from reslab.orchestrator.plan import plan, summarize

    study, runs = _study(args)
    entries = plan(runs, _workspace(args), rerun_failed=args.rerun_failed, lease_timeout_s=args.lease_timeout)
    print(f"{study.name}: {summarize(entries)}")
    print(f"{'':<4}  {'run id':<28} {'arm/grid point/seed':<36} why")
    for e in entries:
        print(e.line())
    return 0


def _final_table(study, runs, workspace, tracking_uri: str, fmt: str = "text") -> str | None:
    from reslab.results import compare, format_table
    from reslab.results.collect import collect

    if not study.comparisons:
        return None
    table = collect(study.name, tracking_uri, expected=runs, cache_dir=workspace.cache)
    return format_table(compare(table, _stats_comparisons(study)), fmt)


def _stats_comparisons(study):
    import dataclasses

    from reslab.results import Comparison

    return [Comparison(**dataclasses.asdict(c)) for c in study.comparisons]


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    from reslab.orchestrator.submit import SubmitOptions, submit

    study, runs = _study(args)
    if args.dry_run:
        return cmd_plan(args)
    workspace = _workspace(args)
    workspace.root.mkdir(parents=True, exist_ok=True)
    tracking_uri = workspace.tracking_uri(args.tracking_uri)
    options = SubmitOptions(
        max_concurrent=args.max_concurrent, cpus_per_run=args.cpus_per_run, gpus_per_run=args.gpus_per_run,
        retries=args.retries, rerun_failed=args.rerun_failed, lease_timeout_s=args.lease_timeout,
    )
    for bad, rule in ((options.retries < 0, "--retries must be >= 0"),
                      (options.cpus_per_run <= 0, "--cpus-per-run must be > 0"),
                      (options.gpus_per_run is not None and options.gpus_per_run < 0, "--gpus-per-run must be >= 0"),
                      (options.max_concurrent is not None and options.max_concurrent < 1, "--max-concurrent must be >= 1")):
        if bad:
            raise ConfigError(rule)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)  # until submit() installs its own handlers
    from reslab.orchestrator.dispatch.ray_backend import RayBackend
    from reslab.orchestrator.tracking import Tracker

    tracker = Tracker(tracking_uri, workspace)
    backend = RayBackend(args.address, workspace=workspace.root)
    print(f"workspace {workspace.root} | tracking {tracking_uri}")
    result = submit(study, runs, workspace, backend, tracker, options)
    print(f"{study.name}: {result.count('succeeded')} succeeded, {result.count('skipped')} skipped, "
          f"{result.count('failed')} failed, {result.count('busy')} busy elsewhere, "
          f"{result.count('interrupted')} interrupted" +
          (f", {result.count('not started')} not started" if result.interrupted else "") + f" in {result.wall_s:.0f}s")
    for run_id, error in result.errors.items():
        print(f"  FAILED {run_id}: {error}")
    if result.interrupted:
        return 130
    table = _final_table(study, runs, workspace, tracking_uri)
    if table:
        print(table, end="")
    return 0 if result.ok else 1


def cmd_status(args: argparse.Namespace) -> int:
    """The state of every run from its run directory (no Ray, no MLflow): counts, each run's step
    and latest losses, and an ETA from the step rate the running runs show in metrics.jsonl."""
    from reslab.orchestrator.plan import BUSY, RUN, SKIP, plan
    from reslab.orchestrator.progress import fmt_duration

    study, runs = _study(args)
    workspace = _workspace(args)
    entries = plan(runs, workspace, lease_timeout_s=args.lease_timeout)
    counts = {"succeeded": 0, "running": 0, "failed": 0, "to run": 0}
    lines = []
    left_steps, rate = 0, 0.0
    for e in entries:
        rows = workspace.run_dir(study.name, e.run.run_id).metrics()
        steps = e.run.config.train.steps
        step = max((r["step"] for r in rows), default=0)
        train = next((r["train_loss"] for r in reversed(rows) if r.get("kind") == "train"), None)
        val = next((r["val_loss"] for r in reversed(rows) if r.get("kind") == "eval"), None)
        if e.action == SKIP and e.state == "SUCCESS":
            state, step = "succeeded", steps
        else:
            state = {BUSY: "running", SKIP: "failed", RUN: "to run"}[e.action]
        counts[state] += 1
        if state in ("running", "to run"):
            left_steps += steps - step
        if state == "running" and len(rows) > 1 and rows[-1]["time"] > rows[0]["time"]:
            rate += (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
        losses = ("train -" if train is None else f"train {train:.4f}") + ("  val -" if val is None else f"  val {val:.4f}")
        why = "" if state == "succeeded" else f"  ({e.reason})"
        lines.append(f"  {state:<9} {e.run.run_id:<28} {e.run.label:<34} step {step:>6}/{steps:<6} {losses}{why}")
    eta = f" | ETA {fmt_duration(left_steps / rate)} at the running runs' pace" if rate > 0 else ""
    print(f"{study.name}: {len(entries)} runs: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + eta)
    print("\n".join(lines))
    return 0


def _compare_table(args: argparse.Namespace):
    from reslab.results import compare
    from reslab.results.collect import collect, load_cached

    study, runs = _study(args)
    if not study.comparisons:
        raise ConfigError(f"{study.path}: comparisons: none declared; add a `comparisons:` list to compare arms")
    workspace = _workspace(args)
    if args.cached:
        table = load_cached(study.name, workspace.cache)
        ids = {r.run_id for r in runs}
        table = table[table["run_id"].isin(ids)]
    else:
        table = collect(study.name, workspace.tracking_uri(args.tracking_uri), expected=runs, cache_dir=workspace.cache)
    comparisons = _stats_comparisons(study)
    return study, table, compare(table, comparisons, alpha=args.alpha), comparisons


def cmd_compare(args: argparse.Namespace) -> int:
    from reslab.results import format_table

    study, runs_table, table, _ = _compare_table(args)
    finished = int((runs_table["status"] == "FINISHED").sum())
    print(f"{study.name}: {finished}/{len(runs_table)} runs finished")
    print(format_table(table, args.format), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """CSV and Parquet carry every column, the per-seed run ids of both arms included
    (`seeds`, `control_run_ids`, `treatment_run_ids`, aligned). Markdown and LaTeX show the
    paper-style table and, below it, one row per seed with both run ids."""
    import tempfile

    from reslab.results import export_table, format_table
    from reslab.results.collect import pairs_table
    from reslab.results.export import latex_escape

    _, runs_table, table, comparisons = _compare_table(args)
    out = Path(args.output)
    if args.format in ("csv", "parquet"):
        export_table(table, out, args.format)
    else:
        pairs = pairs_table(runs_table, comparisons)
        header = ["comparison", "grid point", "seed", "control run", "treatment run", "delta"]
        rows = [[r.comparison, r.grid_key or "-", str(r.seed), f"{r.control} {r.control_run_id or 'missing'}",
                 f"{r.treatment} {r.treatment_run_id or 'missing'}",
                 "n/a" if r.delta != r.delta else f"{r.delta:.4f}"] for r in pairs.itertuples()]
        if args.format == "md":
            main = format_table(table, "md")
            extra = "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                               *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)])
            text = main + "\nPer-seed pairs:\n\n" + extra + "\n"
        else:
            with tempfile.TemporaryDirectory() as tmp:
                main = export_table(table, Path(tmp) / "t.tex", "latex").read_text()
            body = [" & ".join(latex_escape(c) for c in r) + " \\\\" for r in rows]
            text = main + "\n" + "\n".join([
                "\\begin{tabular}{llrlll}", "\\toprule", " & ".join(latex_escape(h) for h in header) + " \\\\",
                "\\midrule", *body, "\\bottomrule", "\\end{tabular}"]) + "\n"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = out.with_name(f".{out.name}.tmp")
        tmp_path.write_text(text)
        tmp_path.replace(out)
    print(f"wrote {out} ({args.format}, {len(table)} comparison rows)")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from reslab.orchestrator.tracking import start_dashboard

    workspace = _workspace(args)
    uri = workspace.tracking_uri(args.tracking_uri)
    if uri.startswith(("http://", "https://")):
        print(f"tracking server: {uri} (already served; nothing to start)")
        return 0
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    print(f"starting the MLflow UI for {uri} ...", flush=True)
    dash = start_dashboard(workspace, host=args.host, port=args.port, tracking_uri=uri)
    print(f"MLflow UI: {dash.url}  (Ctrl-C to stop; log: {workspace.root / 'dashboard.log'})", flush=True)
    try:
        while dash.process.poll() is None:
            time.sleep(0.5)
        print(f"reslab: the MLflow server exited with code {dash.process.returncode}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        dash.stop()
        print("MLflow UI stopped", flush=True)
        return 0

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reslab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train one residual architecture")
    _add_run_args(p)
    p.add_argument("--out", help="run directory: checkpoints go here and an existing one is resumed")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if --out has a checkpoint")
    p.add_argument("--summary-json", help="write the final summary to this file")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("variants", help="list residual variants, their knobs and extra parameters")
    p.add_argument("--preset", default="gpt2-124m")
    p.set_defaults(func=cmd_variants)

    data = sub.add_parser("data", help="prepare corpora").add_subparsers(dest="data_command", required=True)
    p = data.add_parser("prepare", help="tokenise text/JSONL/Parquet into memory-mapped shards")
    p.add_argument("inputs", nargs="+", help="files or directories")
    p.add_argument("--format", choices=["text", "jsonl", "parquet"], default="text")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    p.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--out", required=True, help="output directory (use it as data.corpus)")
    p.set_defaults(func=cmd_data_prepare)

    def study_parser(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("spec", metavar="SPEC", help="study YAML file, e.g. experiments/quickstart.yaml")
        p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                       help="override a config field in every run, repeatable (changes run ids)")
        p.add_argument("--workspace", help="workspace root (default: $RESLAB_WORKSPACE or ./reslab-runs)")
        p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the "
                                              "workspace's mlflow.db)")
        p.add_argument("--lease-timeout", type=float, default=120.0,
                       help="seconds without heartbeat after which a RUNNING run counts as abandoned")
        return p

    p = study_parser("validate", "check a study file and count its runs")
    p.set_defaults(func=cmd_validate)

    p = study_parser("plan", "list every run of a study, its id, and whether it would run or be skipped")
    p.add_argument("--rerun-failed", action="store_true", help="plan failed runs to run again")
    p.set_defaults(func=cmd_plan)

    p = study_parser("run", "run a study on Ray (local by default), tracked in MLflow")
    p.add_argument("--address", help="Ray cluster address (default: $RAY_ADDRESS, else start a local instance)")
    p.add_argument("--max-concurrent", type=int,
                   help="runs at once (default: the cluster's GPUs / --gpus-per-run for GPU runs, "
                        "its CPUs / --cpus-per-run otherwise)")
    p.add_argument("--cpus-per-run", type=float, default=1.0, help="CPUs per run, also its torch threads (default 1)")
    p.add_argument("--gpus-per-run", type=float,
                   help="GPUs per run (default: 1 if the cluster has GPUs, else 0)")
    p.add_argument("--retries", type=int, default=1,
                   help="extra attempts for a run that crashed (not for divergence or config errors; default 1)")
    p.add_argument("--rerun-failed", action="store_true", help="run again runs that failed in earlier submissions")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit (same as `reslab plan`)")
    p.set_defaults(func=cmd_run)

    p = study_parser("status", "show a study's runs: done, running, failed, to run; losses; no side effects")
    p.set_defaults(func=cmd_status)

    for name, helptext in (("compare", "print the paired-comparison table of a study"),
                           ("export", "write the paired-comparison table with per-seed run ids")):
        p = study_parser(name, helptext)
        p.add_argument("--alpha", type=float, default=0.05, help="CI level is 1-alpha (default 0.05)")
        p.add_argument("--cached", action="store_true",
                       help="use the Parquet cache of the last collect instead of reading MLflow")
        if name == "compare":
            p.add_argument("--format", choices=["text", "md"], default="text")
            p.set_defaults(func=cmd_compare)
        else:
            p.add_argument("--format", choices=["md", "csv", "parquet", "latex"], required=True)
            p.add_argument("-o", "--output", required=True, help="output file")
            p.set_defaults(func=cmd_export)

    p = sub.add_parser("convert", help="convert a trained prenorm checkpoint into a routing variant")
    p.add_argument("checkpoint", help="a prenorm run's checkpoint.pt")
    p.add_argument("--residual", required=True, help="target variant, e.g. delta_attnres or delta_block")
    p.add_argument("--opt", dest="residual_opt", action="append", metavar="KNOB=VALUE",
                   help="a knob of the target, repeatable (e.g. --opt gate=learnable_alpha)")
    p.add_argument("--out", required=True, help="directory for init_from.pt and run_config.json")
    p.add_argument("--steps", type=int, help="continue training for this many steps (into OUT/run)")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a field of the new run")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("dashboard", help="serve the MLflow UI for the workspace store on 127.0.0.1")
    p.add_argument("--workspace", help="workspace root (default: $RESLAB_WORKSPACE or ./reslab-runs)")
    p.add_argument("--tracking-uri", help="a tracking server URI is printed, not served")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000)
    p.set_defaults(func=cmd_dashboard)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"reslab: error: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"reslab: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from reslab.models.training import TrainingDiverged
        from reslab.orchestrator.dispatch import BackendError
        from reslab.orchestrator.tracking import TrackingUnavailable

        if isinstance(exc, TrainingDiverged):
            print(f"reslab: training diverged: {exc}", file=sys.stderr)
            return 1
        if not isinstance(exc, (BackendError, TrackingUnavailable)):
            raise
        print(f"reslab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("reslab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
