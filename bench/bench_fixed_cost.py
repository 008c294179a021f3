"""What one submission costs outside training: `reslab run` of a one-run, two-step study and
`reslab train --preset tiny --steps 2`, broken into phases, printed as a markdown table.

    python bench/bench_fixed_cost.py [--repeats 3] [--warmup 1] [--steps 2] [--commands run,train] [--load]
                                     [--code before=/tmp/before_shim --code after=]

Each repeat runs the command as a subprocess, `reslab run` in a fresh temporary workspace on a
generated study (the quickstart's base, one arm, one seed, `--steps` steps, no comparison, the
default eval set, which a1144f9 also reads as 128 windows), so
Ray is started, the MLflow store created and the run trained every time; the corpus cache
(`$RESLAB_CACHE`) is kept, a prepared stdlib corpus being the steady state (`--warmup` untimed
repeats first). Each `--code LABEL=PYTHONPATH` is a column of its own: the reslab that PYTHONPATH
imports (an empty one: the reslab this Python imports), and the codes take turns within every
repeat, so a change in the machine's load falls on all of them alike. Each row is the median over
the repeats of that row alone, so a column need not add up to its total. `--load` runs `python -c
'while True: pass'` beside every command (the "beside a CPU-bound process" figure). The last row
is the CPU time of the command and of the processes it waited for (Ray's, its workers'), which a
loaded machine inflates far less than wall time.

The phases are timed from outside the product: the subprocess is this script in its `--trace`
mode, which stands in for the `reslab` console script (`sys.exit(main())` of
`reslab.orchestrator.cli`) after wrapping, by name, as their modules are imported, the library
functions the CLI calls (`PHASES`; a name the code lacks is skipped, its time falls into "rest")
and the first imports of torch, scipy, pandas, matplotlib, ray and mlflow. A phase's figure is its
own time, less the phases timed inside it in the same thread; a phase in another thread is listed
"(in the background)" and overlaps the others. "training" is the run's `wall_time_s` (the step
loop, its evaluations and checkpoints) from its summary; "rest" is the wall time no phase covers.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# after the path entries a `--code` shim puts first: this repo's `bench` package, never a `reslab`
sys.path.append(str(Path(__file__).resolve().parents[1]))
from bench._args import at_least  # noqa: E402

STUDY = """study: fixed-cost
description: one run of {steps} steps, the fixed cost of a submission (bench/bench_fixed_cost.py)
base:
  model: {{preset: tiny}}
  data: {{corpus: stdlib, tokenizer: byte}}
  optim: {{lr: 2.0e-3, warmup_steps: 1, batch_size: 16}}
  train: {{steps: {steps}, eval_every: {steps}, tail_k: 1, log_every: 1, checkpoint_every: {steps}}}
arms:
  control: prenorm
seeds: 1
"""
OUTSIDE, CPU = "outside training", "CPU s of the command and the processes it waited for"
BACKGROUND = "(in the background)"  # a span in another thread than the main one
TASK = "Ray task outside training (worker start, imports, corpus, model)"
SETUP = "train(): model, optimizer, eval batches"
# module -> (attribute, phase); the first name of a phase is its row in the table
PHASES: dict[str, list[tuple[str, str]]] = {
    "reslab.orchestrator.cli.study": [("load", "study load and expansion")],
    "reslab.orchestrator.driving.submit": [("preflight", "preflight (power, devices, corpus budget)"),
                                           ("submission_code", "code version and fingerprint")],
    "reslab.orchestrator.driving.loop": [("preflight", "preflight (power, devices, corpus budget)")],
    "reslab.orchestrator.attempt.envinfo": [("submission_code", "code version and fingerprint")],
    "reslab.models.data.prepare": [("prepare_stdlib", "corpus open (stdlib)"), ("corpus_dir", "corpus open (stdlib)")],
    "reslab.orchestrator.tracking.guarded": [("GuardedTracker.__init__", "MLflow store init"),
                                             ("GuardedTracker.begin", "MLflow writes"),
                                             ("GuardedTracker.finish", "MLflow writes"),
                                             ("GuardedTracker.end", "MLflow writes"),
                                             ("GuardedTracker.flush", "MLflow writes"),
                                             ("GuardedTracker.on_event", "MLflow writes")],
    "reslab.orchestrator.dispatch.ray_backend": [("RayBackend.start", "Ray start"), ("RayBackend._init", "Ray start"),
                                                 ("_warm_a_worker", "worker warm-up"),
                                                 ("RayBackend.shutdown", "Ray shutdown"),
                                                 ("RayBackend.submit", "submitted"), ("RayBackend.poll", "polled")],
    "reslab.models.data.dataset": [("TokenDataset.open", "corpus open (stdlib)")],
    "reslab.experiments.spec": [("load_run_config", "run config load")],
    "reslab.models.training": [("train", SETUP)],
}
IMPORTS = {"torch": "import torch", "ray": "import ray", "mlflow": "import mlflow", "scipy": "import scipy, pandas",
           "pandas": "import scipy, pandas", "matplotlib": "import matplotlib"}
# the table's rows in order, and the commands each belongs to
ROWS: list[tuple[str, str]] = [
    ("python start", "run train"), ("CLI import", "run train"), ("import torch", "run train"),
    ("import scipy, pandas", "run train"), ("import matplotlib", "run train"),
    ("study load and expansion", "run"), ("run config load", "train"),
    ("preflight (power, devices, corpus budget)", "run"), ("corpus open (stdlib)", "run train"),
    ("import ray", "run"), ("import mlflow", "run"), ("MLflow store init", "run"),
    ("code version and fingerprint", "run"), (f"Ray start {BACKGROUND}", "run"),
    (f"worker warm-up {BACKGROUND}", "run"), ("Ray start", "run"), ("MLflow writes", "run"), (TASK, "run"),
    (SETUP, "train"), ("training", "run train"), ("Ray shutdown", "run"),
    ("interpreter exit", "run train"), ("rest", "run train"),
]


# ----------------------------------------------------------------------------- the traced child


class _Trace(importlib.abc.MetaPathFinder):
    """Times the first import of `IMPORTS` and wraps `PHASES` as their modules finish loading."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float, int]] = []

    def add(self, label: str, start: float, end: float) -> None:
        main = threading.current_thread() is threading.main_thread()
        self.spans.append((label if main else f"{label} {BACKGROUND}", start, end, threading.get_ident()))

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in IMPORTS and name not in PHASES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            run = spec.loader.exec_module

            def exec_module(module: Any) -> None:
                start = time.time()
                try:
                    run(module)
                finally:
                    if name in IMPORTS:
                        self.add(IMPORTS[name], start, time.time())
                self.patch(module, PHASES.get(name, []))

            spec.loader.exec_module = exec_module
        return spec

    def patch(self, module: Any, names: list[tuple[str, str]]) -> None:
        for dotted, label in names:
            owner_name, _, attr = dotted.rpartition(".")
            owner = getattr(module, owner_name, None) if owner_name else module
            raw = owner.__dict__.get(attr) if owner is not None else None
            if raw is None or getattr(raw, "_traced", False):
                continue
            kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
            timed = self.timed(raw.__func__ if kind else raw, label)
            setattr(owner, attr, kind(timed) if kind else timed)

    def timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            out = fn(*args, **kwargs)
            # a poll is marked only when it returned a finished attempt
            if label != "polled" or (isinstance(out, tuple) and len(out) == 2 and out[1]):
                self.add(label, start, time.time())
            return out

        call._traced = True  # type: ignore[attr-defined]
        return call


def trace_child(out: str, argv: list[str]) -> int:
    """The `reslab` command `argv`, traced into the JSON file `out`."""
    entered = time.time()
    trace = _Trace()
    sys.meta_path.insert(0, trace)
    start = time.time()
    from reslab.orchestrator.cli import main

    trace.add("CLI import", start, time.time())
    sys.argv = ["reslab", *argv]  # as the `reslab` script runs it: `sys.exit(main())`
    code = 1
    try:
        code = main()
    finally:
        Path(out).write_text(json.dumps({"entered": entered, "returned": time.time(), "spans": trace.spans}))
    return code


# ----------------------------------------------------------------------------- analysis


def own_times(spans: list[tuple[str, float, float, int]]) -> dict[str, float]:
    """Seconds per label, each span less the spans nested in it in the same thread."""
    own: dict[str, float] = {}
    for thread in {s[3] for s in spans}:
        stack: list[tuple[str, float, float]] = []
        for label, start, end, _ in sorted((s for s in spans if s[3] == thread), key=lambda s: (s[1], -s[2])):
            while stack and start >= stack[-1][2]:
                stack.pop()
            own[label] = own.get(label, 0.0) + (end - start)
            if stack:
                own[stack[-1][0]] -= end - start
            stack.append((label, start, end))
    return own


def covered(spans: list[tuple[str, float, float, int]]) -> float:
    """Seconds during which at least one span runs, in any thread."""
    total, reach = 0.0, float("-inf")
    for _, start, end, _ in sorted(spans, key=lambda s: s[1]):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def phases(trace: dict[str, Any], popen: float, exited: float, training: float) -> dict[str, float]:
    """The rows of one command (`ROWS`) from its trace, its start and end times, and its training s."""
    spans = [tuple(s) for s in trace["spans"] if s[0] != "polled" and s[0] != "submitted"]
    marks = {s[0]: s for s in trace["spans"] if s[0] in ("submitted", "polled")}
    if "submitted" in marks and "polled" in marks:  # the Ray task: submit to the poll that returned it
        sub, done = marks["submitted"], marks["polled"]
        spans.append((TASK, sub[1], done[2], sub[3]))
    own = own_times(spans)  # type: ignore[arg-type]
    own[TASK if TASK in own else SETUP] = own.get(TASK if TASK in own else SETUP, 0.0) - training
    own["training"] = training
    own["python start"] = trace["entered"] - popen
    own["interpreter exit"] = exited - trace["returned"]
    own["total"] = exited - popen
    own[OUTSIDE] = own["total"] - training
    own["rest"] = own["total"] - own["python start"] - own["interpreter exit"] - covered(spans)  # type: ignore[arg-type]
    return own


# ----------------------------------------------------------------------------- the parent


def _training_s(summary: Path) -> float:
    """The step loop's wall seconds (its evaluations and checkpoints included) from a summary.json."""
    return float(json.loads(summary.read_text())["summary"]["wall_time_s"])


def measure(command: str, steps: int, root: Path, env: dict[str, str]) -> dict[str, float]:
    """One traced `reslab run` (a fresh workspace under `root`) or `reslab train`: its rows."""
    root.mkdir(parents=True)
    trace_file = root / "trace.json"
    if command == "run":
        spec = root / "study.yaml"
        spec.write_text(STUDY.format(steps=steps))
        argv = ["run", str(spec), "--workspace", str(root / "ws")]
    else:
        argv = ["train", "--preset", "tiny", "--steps", str(steps), "--out", str(root / "run"), "--no-resume",
                "--summary-json", str(root / "summary.json")]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trace", str(trace_file), *argv]
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    popen = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    exited = time.time()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"bench_fixed_cost: `reslab {' '.join(argv)}` exited {proc.returncode}:\n"
                         f"{proc.stdout[-3000:]}")
    summaries = [root / "summary.json"] if command == "train" else \
        sorted((root / "ws" / "runs").glob("*/*/summary.json"))
    if len(summaries) != 1:
        raise SystemExit(f"bench_fixed_cost: expected one run summary under {root}, found {len(summaries)}")
    rows = phases(json.loads(trace_file.read_text()), popen, exited, _training_s(summaries[0]))
    rows[CPU] = after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime
    return rows


def _commands(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in ("run", "train") for n in names):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a comma-separated subset of run,train")
    return names


def _code(text: str) -> tuple[str, str]:
    label, sep, path = text.partition("=")
    if not sep or not label.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: LABEL=PYTHONPATH (an empty PYTHONPATH "
                                         "measures the reslab this Python imports)")
    return label.strip(), path


def print_table(results: dict[tuple[str, str], list[dict[str, float]]], steps: int) -> None:
    """Rows: the phases; columns: each (command, code) measured, the median of each cell."""
    columns = list(results)
    heads = {"run": f"`reslab run` ({steps} steps)", "train": f"`reslab train --steps {steps}`"}
    print("| phase, s | " + " | ".join(f"{heads[c]}{', ' + code if code else ''}" for c, code in columns) + " |")
    print("|---|" + "---:|" * len(columns))

    def cell(column: tuple[str, str], row: str) -> str:
        values = [r.get(row) for r in results[column]]
        return "-" if None in values else f"{statistics.median(values):.2f}"

    for row, where in ROWS:
        if any(c in where.split() for c, _ in columns):
            print(f"| {row} | " + " | ".join(cell(col, row) if col[0] in where.split() else "" for col in columns)
                  + " |")
    for row, bold in (("total", True), (OUTSIDE, True), (CPU, False)):
        cells = [cell(col, row) for col in columns]
        print(f"| {f'**{row}**' if bold else row} | "
              + " | ".join(f"**{c}**" if bold else c for c in cells) + " |")


def _environment(pythonpath: str) -> dict[str, str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--trace":
        sys.exit(trace_child(sys.argv[2], sys.argv[3:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=at_least(1), default=3, help="timed runs per command; medians are printed")
    ap.add_argument("--warmup", type=at_least(0), default=1, help="untimed runs per command first (default 1)")
    ap.add_argument("--steps", type=at_least(1), default=2, help="training steps of each run (default 2)")
    ap.add_argument("--commands", type=_commands, default=["run", "train"], help="run,train (default both)")
    ap.add_argument("--code", type=_code, action="append", metavar="LABEL=PYTHONPATH",
                    help="measure the reslab this PYTHONPATH imports, as column LABEL; repeatable, the codes take "
                         "turns in every repeat (default: the reslab this Python imports)")
    ap.add_argument("--load", action="store_true", help="run `python -c 'while True: pass'` beside every command")
    args = ap.parse_args()
    codes = args.code or [("", "")]

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    where = "; ".join(f"{label or 'code'}: {where_is_reslab(path)}" for label, path in codes)
    print(f"{len(os.sched_getaffinity(0))} CPUs, load before {os.getloadavg()[0]:.2f}"
          f"{', beside a CPU-bound process' if hog else ', no added load'}; median of {args.repeats} (after "
          f"{args.warmup} warm-up); {where}\n", flush=True)
    results: dict[tuple[str, str], list[dict[str, float]]] = {(c, label): [] for c in args.commands
                                                              for label, _ in codes}
    try:
        with tempfile.TemporaryDirectory(prefix="reslab-bench-fixed-") as tmp:
            for i in range(args.warmup + args.repeats):
                for c in args.commands:
                    for n, (label, path) in enumerate(codes):
                        rows = measure(c, args.steps, Path(tmp) / f"{c}-{n}-{i}", _environment(path))
                        if i >= args.warmup:
                            results[(c, label)].append(rows)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    print_table(results, args.steps)
    print(f"\nload after {os.getloadavg()[0]:.2f}")


def where_is_reslab(pythonpath: str) -> str:
    """The folder `reslab.orchestrator` is imported from with this PYTHONPATH."""
    probe = "import reslab.orchestrator as o; print(list(o.__path__)[0])"
    out = subprocess.run([sys.executable, "-c", probe], env=_environment(pythonpath), capture_output=True, text=True)
    return out.stdout.strip() or f"? ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'no output'})"


if __name__ == "__main__":
    main()
