"""The driver at scale (issue 39): reslab's versions of Ray Tune's scalability workloads, with Ray Tune beside.

    python bench/bench_driver_scale.py [--workloads bookkeeping,throughput,network,grid] [--trials 200]
        [--slots 16] [--tracking sqlite,postgres] [--storage local,s3] [--no-tune] [--grid-runs 100000]
        [--capacity RUNS] [--profile FILE]

Every run is a simulated run (`orchestrator.attempt.simulate`, `$RESLAB_SIMULATE`): it sleeps and reports
synthetic metrics through the real worker, run records, run storage and MLflow path, driven by `reslab run` on
a local Ray instance whose resources are declared (`ray.init(num_cpus=slots, num_gpus=gpus)`, started before
the command, which reuses it), so the driver sees a cluster of that many GPUs while nothing trains. Each
measurement runs in its own process (`--child`), which reports:

- elapsed: the whole `reslab run` (plan, MLflow submission, dispatch, the end's bookkeeping), or `tune.run`;
- minimum: trials x length / slots, Ray Tune's "theoretical minimum" (10,000 x 1 s / 16 = 625 s);
- overhead %: (elapsed - minimum) / minimum; per trial: (elapsed - minimum) / trials;
- driver CPU s and peak RSS: of the driver process (`getrusage(RUSAGE_SELF)`; Ray's own processes and the
  workers are not in it);
- MLflow writes/s: calls that write (`log_batch`, `create_run`, `update_run`, `set_terminated`, the
  artifact logs...) counted on `MlflowClient` in the driver process, over elapsed; metric points/s too;
- storage ops: requests the moto S3 server logged (GET/PUT/HEAD/LIST/DELETE) for S3; files in storage for a
  local folder.

Workloads (Ray Tune's `release/tune_tests/scalability_tests/workloads`, scaled to one 2-core machine):

- bookkeeping: `--trials` trials of 1 s, 1 result/s, on `--slots` slots (Ray Tune: 10,000 trials on 16).
- throughput: `--slots` trials at once for `--length` s, 10 results/s each (Ray Tune: 1,000 trials on
  16 x 64 CPUs for 100 s).
- network: `--slots` trials of `--length` s, 1 result/s and a checkpoint every 5 s of `--ckpt-kb` KiB,
  each trained in its own node-local scratch directory (`$RESLAB_SCRATCH`) and pushed to run storage at
  each checkpoint and at its end, the path a run on its own node takes (Ray Tune: 200 trials on 200 nodes
  syncing to the driver). Here the "nodes" share one machine, so this measures the storage path's
  operations and driver cost, not a network.
- grid: `--grid-runs` runs of 0.2 s on a declared 1,000-GPU cluster, at most `--slots` at once (worker
  processes for 1,000 runs at once do not fit a 2-core machine); no Ray Tune beside it.

Ray Tune runs the same workload (a function trainable that sleeps and reports the same number of metrics,
`tune.report`) on a fresh local Ray with the same slots, with its default loggers and `MLflowLoggerCallback`
into its own SQLite store (logging on, as reslab's); the ratio is reslab's elapsed over Tune's. `--capacity`
times the driver's MLflow writer alone (no Ray) on each tracking store: children created/s, metric points/s,
`log_batch`/s, runs finished/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._args import at_least  # noqa: E402

STUDY = """study: {name}
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  optim: {{batch_size: 4, warmup_steps: 2}}
  train: {{steps: {reports}, eval_every: {reports}, log_every: 1, eval_windows: 8}}
arms:
  control: prenorm
seeds: {trials}
limits: {{max_runs: {trials}}}
"""
WRITES = ("log_batch", "create_run", "update_run", "set_terminated", "log_artifact", "log_artifacts", "log_dict",
          "log_text", "log_table", "set_tag", "set_experiment_tag", "delete_run", "log_metric", "log_param",
          "create_experiment")
# (trial length s, results per s, metrics per result, checkpoint every n results)
WORKLOADS = {"bookkeeping": (1.0, 1, 4, 0), "throughput": (None, 10, 10, 0), "network": (None, 1, 4, 5),
             "grid": (0.2, 10, 4, 0)}


def workload(name: str, args: argparse.Namespace) -> dict[str, Any]:
    length, rate, metrics, every = WORKLOADS[name]
    length = args.length if length is None else length
    trials = {"bookkeeping": args.trials, "grid": args.grid_runs}.get(name, args.slots)
    return {"name": name, "trials": trials, "length": length, "rate": rate, "metrics": metrics, "every": every,
            "slots": args.slots, "gpus": 1000 if name == "grid" else args.slots,
            "minimum": trials * length / args.slots,
            "ckpt_bytes": args.ckpt_kb * 1024 if every else 0}


# ----------------------------------------------------------------------------- the measured processes


def _count_mlflow_writes() -> Counter:
    """Every write call on `MlflowClient` in this process, and the metric points of each `log_batch`."""
    from mlflow.tracking import MlflowClient

    counts: Counter = Counter()
    depth = threading.local()
    for name in WRITES:
        original = getattr(MlflowClient, name, None)
        if original is None:
            continue

        def counted(self, *a, _name=name, _original=original, **kw):
            outer = not getattr(depth, "n", 0)  # `log_dict` calls `log_artifact`: one write, counted once
            if outer:
                counts["writes"] += 1
                counts[_name] += 1
                if _name == "log_batch":
                    counts["points"] += len(kw.get("metrics") or ())
                elif _name == "log_metric":
                    counts["points"] += 1
            depth.n = getattr(depth, "n", 0) + 1
            try:
                return _original(self, *a, **kw)
            finally:
                depth.n -= 1

        setattr(MlflowClient, name, counted)
    return counts


def _usage() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": me.ru_utime + me.ru_stime, "rss_mb": me.ru_maxrss / 1024}


def _start_ray(slots: int, gpus: int) -> str:
    """A local Ray with declared resources; its address (the driver joins it as a cluster: the declared GPUs
    are a cluster's, not this machine's)."""
    import ray

    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_enable_metrics_collection": "0"})
    ray.init(num_cpus=slots, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * 2**20, logging_level="ERROR")
    return str(ray.get_runtime_context().gcs_address)


def child_reslab(spec: dict[str, Any]) -> dict[str, Any]:
    """`reslab run` of the workload's simulated study, on a Ray instance with the declared resources."""
    w, tmp = spec["workload"], Path(spec["tmp"])
    reports = max(1, round(w["length"] * w["rate"]))
    os.environ["RESLAB_SIMULATE"] = (f"sleep={w['length']},report_every={1 / w['rate']},metrics={w['metrics']},"
                                     f"checkpoint_every={w['every']},ckpt_bytes={w['ckpt_bytes']}")
    if w["every"]:
        os.environ["RESLAB_SCRATCH"] = str(tmp / "scratch")  # each run in its "node's" scratch directory
    study = tmp / "study.yaml"
    study.write_text(STUDY.format(name=f"simulated-{w['name']}", reports=reports, trials=w["trials"]))
    counts = _count_mlflow_writes()
    from reslab.orchestrator.cli import main

    address = _start_ray(w["slots"], w["gpus"])
    argv = ["run", str(study), "--address", address, "--workspace", str(tmp / "ws"), "--tracking-uri", spec["tracking"],
            "--max-concurrent", str(w["slots"]), "--cpus-per-run", "1", "--gpus-per-run", "1",
            "--max-runs", str(w["trials"])]
    if spec.get("storage"):
        argv += ["--storage", spec["storage"]]
    profile = None
    if spec.get("profile"):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    start = time.perf_counter()
    with contextlib.redirect_stdout(open(tmp / "reslab.out", "w")):  # noqa: SIM115 - closed at exit
        code = main(argv)
    elapsed = time.perf_counter() - start
    if profile is not None:
        import pstats

        profile.disable()
        with open(spec["profile"], "w") as f:
            pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(40)
    if code:
        print((tmp / "reslab.out").read_text()[-3000:], file=sys.stderr)
    return {"code": code, "elapsed": elapsed, **_usage(), "writes": counts["writes"], "points": counts["points"],
            "calls": dict(counts)}


def _tune_trainable(config: dict[str, Any]) -> None:
    import random

    from ray import tune

    gap, n, keys = config["gap"], config["n"], config["keys"]
    next_at = time.monotonic()
    for i in range(n):
        next_at += gap
        time.sleep(max(0.0, next_at - time.monotonic()))
        tune.report({"score": i + random.random(), **{f"m{k}": random.random() for k in range(keys - 1)}})


def child_tune(spec: dict[str, Any]) -> dict[str, Any]:
    """The same workload as a Ray Tune function trainable, 1 CPU per trial on `slots` CPUs."""
    from ray import tune

    w, tmp = spec["workload"], Path(spec["tmp"])
    counts = _count_mlflow_writes()
    _start_ray(w["slots"], w["gpus"])
    callbacks = []
    if spec.get("tracking"):
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        callbacks.append(MLflowLoggerCallback(tracking_uri=spec["tracking"], experiment_name="tune"))
    config = {"gap": 1 / w["rate"], "n": max(1, round(w["length"] * w["rate"])), "keys": w["metrics"]}
    start = time.perf_counter()
    tuner = tune.Tuner(
        tune.with_resources(_tune_trainable, {"cpu": 1}), param_space=config,
        tune_config=tune.TuneConfig(num_samples=w["trials"], reuse_actors=True),
        run_config=tune.RunConfig(storage_path=str(tmp / "tune"), callbacks=callbacks, verbose=0))
    results = tuner.fit()
    elapsed = time.perf_counter() - start
    return {"code": len(results.errors), "elapsed": elapsed, **_usage(), "writes": counts["writes"],
            "points": counts["points"], "calls": dict(counts)}


def child_capacity(spec: dict[str, Any]) -> dict[str, Any]:
    """The driver's MLflow writer alone (`MlflowWriter`, no Ray): `runs` children created, `rounds` poll ticks
    of one train row of `metrics` metrics per run flushed (one `log_batch` per run per tick), then each run
    finished (its late rows, artifacts, summary tags, FINISHED)."""
    from reslab.experiments import expand, load_study
    from reslab.orchestrator.durability.workspace import Workspace
    from reslab.orchestrator.tracking.writer import MlflowWriter

    tmp, n, rounds, keys = Path(spec["tmp"]), spec["runs"], spec["rounds"], spec["metrics"]
    study = tmp / "study.yaml"
    study.write_text(STUDY.format(name="simulated-capacity", reports=rounds, trials=n))
    runs = expand(load_study(study))
    writer = MlflowWriter(spec["tracking"], Workspace.at(tmp / "ws"))
    writer.begin("simulated-capacity", submission="capacity", code={}, plan={})
    counts = _count_mlflow_writes()
    out: dict[str, Any] = {}
    start = time.perf_counter()
    for run in runs:
        writer.on_event(run, {"type": "start", "attempt": 1, "start_step": 0})
    out["created_per_s"] = n / (time.perf_counter() - start)
    start, before = time.perf_counter(), counts["writes"]
    for step in range(1, rounds + 1):
        for run in runs:
            metrics = {f"m{k}": step + k / keys for k in range(keys)}
            writer.on_event(run, {"type": "train", "step": step, "metrics": metrics, "time": time.time()})
        writer._flush(None)
    seconds = time.perf_counter() - start
    out.update(points_per_s=n * rounds * keys / seconds, batches_per_s=(counts["writes"] - before) / seconds)
    start = time.perf_counter()
    for run in runs:
        writer.finish(run, {"val_loss": 1.0}, env={"host": "bench"}, info={"simulated": "capacity"})
    out["finished_per_s"] = n / (time.perf_counter() - start)
    return {"code": 0, **out}


# ----------------------------------------------------------------------------- services and the table


def run_child(kind: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    out = Path(spec["tmp"]) / f"{kind}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec", json.dumps(spec),
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ})
    if proc.stderr and '"code": 0' not in (out.read_text() if out.is_file() else ""):
        print(f"<!-- {kind}'s stderr:\n{proc.stderr[-3000:]}\n-->", file=sys.stderr)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stderr or proc.stdout)[-3000:]
        print(f"<!-- {kind} failed, exit {proc.returncode}:\n{tail}\n-->", file=sys.stderr)
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(out.read_text())


def storage_ops(kind: str, moto_log: Path | None, offset: int, storage_dir: Path | None) -> str:
    if kind == "s3" and moto_log is not None:
        text = moto_log.read_text(errors="replace")[offset:]
        ops = Counter(m.group(1) for m in re.finditer(r'"(GET|PUT|HEAD|POST|DELETE) ', text))
        return " ".join(f"{k} {v}" for k, v in sorted(ops.items())) or "0"
    if storage_dir is not None and storage_dir.is_dir():
        return f"{sum(1 for p in storage_dir.rglob('*') if p.is_file())} files"
    return "-"


@contextlib.contextmanager
def moto() -> Any:
    """A moto S3 server on 127.0.0.1 logging every request (`bench_storage.moto_server`, with a log)."""
    from bench.bench_storage import moto_server

    log = Path(tempfile.mkdtemp(prefix="bench-moto-")) / "moto.log"
    server, uri = moto_server(log)
    try:
        yield uri, log
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(log.parent, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Any:
    """MLflow's server on a PostgreSQL cluster in a temp dir: the tests' helpers (`test_postgres`)."""
    sys.path.insert(0, str(ROOT / "tests" / "orchestrator"))
    from test_postgres import mlflow_server, postgres_cluster

    with postgres_cluster() as pg, tempfile.TemporaryDirectory() as tmp, \
            mlflow_server(pg.uri(), "127.0.0.1:{port}", Path(tmp)) as url:
        yield url


def row(label: str, w: dict[str, Any], r: dict[str, Any], ops: str, tune: dict[str, Any] | None) -> str:
    if "error" in r or r.get("code"):
        r.setdefault("error", f"exit {r.get('code')}")
        return f"| {w['name']} | {label} | {w['trials']} | failed: {r['error'].splitlines()[-1][:120]} |"
    over = r["elapsed"] - w["minimum"]
    per = over / w["trials"]
    ratio = f"{r['elapsed'] / tune['elapsed']:.2f}" if tune and "elapsed" in tune else "-"
    return (f"| {w['name']} | {label} | {w['trials']} | {r['elapsed']:.1f} | {w['minimum']:.1f} | "
            f"{100 * over / w['minimum']:.0f}% | {per:.2f} | {r['cpu_s']:.1f} | {r['rss_mb']:.0f} | "
            f"{r['writes'] / r['elapsed']:.1f} | {r['points'] / r['elapsed']:.0f} | {ops} | {ratio} |")


HEADER = ("| workload | driver | trials | elapsed s | minimum s | overhead | overhead s / trial | driver CPU s | "
          "peak RSS MB | MLflow writes/s | metric points/s | storage ops | x Ray Tune |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def measure(args: argparse.Namespace, name: str, services: dict[str, Any]) -> list[str]:
    w = workload(name, args)
    lines, tune = [], None
    timeout = w["minimum"] * 20 + 600
    if not args.no_tune and name != "grid":
        with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
            tune = run_child("tune", {"workload": w, "tmp": tmp, "tracking": f"sqlite:///{tmp}/tune.db"}, timeout)
        ops = "-"
        lines.append(row("Ray Tune (+MLflowLoggerCallback, SQLite)", w, tune, ops, None))
        print(lines[-1], flush=True)
    for tracking in args.tracking:
        for storage in args.storage:
            with tempfile.TemporaryDirectory(prefix="bench-reslab-") as tmp:
                uri = f"sqlite:///{tmp}/mlflow.db" if tracking == "sqlite" else services["postgres"]
                store, log, offset = None, None, 0
                if storage == "s3":
                    store, log = services["s3"][0].format(i=f"{name}-{tracking}-{time.time_ns()}"), services["s3"][1]
                    offset = len(log.read_text(errors="replace"))
                elif storage == "local":
                    store = f"{tmp}/storage"
                r = run_child("reslab", {"workload": w, "tmp": tmp, "tracking": uri, "storage": store,
                                         "profile": args.profile}, timeout)
                ops = storage_ops(storage, log, offset, Path(tmp) / "storage")
                lines.append(row(f"reslab ({tracking}, {storage} storage)", w, r, ops, tune))
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="bookkeeping,throughput,network", help="comma-separated; also: grid")
    ap.add_argument("--trials", type=at_least(1), default=200, help="bookkeeping's trials (Ray Tune: 10,000)")
    ap.add_argument("--slots", type=at_least(1), default=16, help="runs at once")
    ap.add_argument("--length", type=at_least(1, float), default=30.0, help="throughput and network trials' length s")
    ap.add_argument("--ckpt-kb", type=at_least(0), default=64, help="network's checkpoint size")
    ap.add_argument("--grid-runs", type=at_least(1), default=100_000, help="the grid workload's runs")
    ap.add_argument("--tracking", default="sqlite", help="comma-separated: sqlite, postgres")
    ap.add_argument("--storage", default="local", help="comma-separated: none, local, s3")
    ap.add_argument("--no-tune", action="store_true", help="leave Ray Tune out")
    ap.add_argument("--profile", help="write the reslab driver's cProfile (top 40 by own time) to this file")
    ap.add_argument("--capacity", type=at_least(0), default=0, metavar="RUNS",
                    help="also measure the MLflow writer alone on RUNS runs (runs/s created and finished, points/s)")
    ap.add_argument("--child", choices=("reslab", "tune", "capacity"), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child = {"reslab": child_reslab, "tune": child_tune, "capacity": child_capacity}[args.child]
        result = child(json.loads(args.spec))
        Path(args.out).write_text(json.dumps(result))
        os._exit(0)  # Ray's atexit hooks would wait for its processes
    names = [n for n in args.workloads.split(",") if n]
    args.tracking, args.storage = args.tracking.split(","), args.storage.split(",")
    for value, allowed, flag in ((names, WORKLOADS, "--workloads"),
                                 (args.tracking, ("sqlite", "postgres"), "--tracking"),
                                 (args.storage, ("none", "local", "s3"), "--storage")):
        bad = [v for v in value if v not in allowed]
        if bad:
            ap.error(f"{flag}: {', '.join(bad)} not allowed; allowed: {', '.join(allowed)}")
    print(f"{os.cpu_count()} CPUs; slots {args.slots}\n\n{HEADER}", flush=True)
    with contextlib.ExitStack() as stack:
        services: dict[str, Any] = {}
        if "s3" in args.storage:
            services["s3"] = stack.enter_context(moto())
        if "postgres" in args.tracking:
            services["postgres"] = stack.enter_context(postgres_server())
        for name in names:
            measure(args, name, services)
        if args.capacity:
            capacity(args, services)


def capacity(args: argparse.Namespace, services: dict[str, Any]) -> None:
    print("\n| tracking | runs | metrics per row | children created/s | metric points/s | log_batch/s | "
          "runs finished/s |\n|---|---|---|---|---|---|---|", flush=True)
    for tracking in args.tracking:
        with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
            uri = f"sqlite:///{tmp}/mlflow.db" if tracking == "sqlite" else services["postgres"]
            r = run_child("capacity", {"tmp": tmp, "tracking": uri, "runs": args.capacity, "rounds": 10,
                                       "metrics": 20}, 1800)
            if "error" in r:
                print(f"| {tracking} | failed: {r['error'].splitlines()[-1][:120]} |")
                continue
            print(f"| {tracking} | {args.capacity} | 20 | {r['created_per_s']:.1f} | {r['points_per_s']:.0f} | "
                  f"{r['batches_per_s']:.1f} | {r['finished_per_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
