"""The `reslab` command line: one module per command group, each command parses its flags, calls
one library function and formats what it returns.

    train.py       train, variants, convert
    check.py       check (a variant and an implementation against the variant contract)
    generate.py    generate (text from a finished run's checkpoint)
    data.py        data prepare
    study.py       validate, plan, run, status
    tune.py        tune (an Optuna search per arm; `plan`/`run --from-tune` read its result)
    jobs.py        submit (a study's driver as a Ray job on a cluster)
    results.py     compare, verdict, export, report
    evals.py       eval (downstream tasks of a study's finished runs)
    power.py       power
    dashboard.py   dashboard
    completion.py  completion bash|zsh
    args.py        flag types (every check of one flag) and the flags commands share
    common.py      what commands share beyond a flag: loading a study's runs, the workspace a read
                   names, the cluster and `--from-tune` flag groups, the execution flags declared
                   once for run, tune and submit, and the one set-up of options, workspace, backend
                   and tracker for run and tune (commands import it, never each other)

`main` maps every `ReslabError` to its `exit_code` with a one-line message (the user-facing
summary of flags and exit codes is `_DESCRIPTION`, shown by `--help`); a closed output pipe
(`reslab status | head`) ends quietly with 0.

Imports of the study spec (it loads the variant registry, hence torch), ray, mlflow, pandas and
scipy sit inside the command functions: each costs a second or more, and `--help`, `--version` and
`completion` (run at every shell start) need none of them.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import os
import sys
from typing import Any, NoReturn

from reslab.common.errors import ReslabError
from reslab.common.io import collector_paused
from reslab.orchestrator.cli import (
    check,
    completion,
    dashboard,
    data,
    evals,
    generate,
    jobs,
    jsonout,
    power,
    results,
    study,
    train,
    tune,
)

_DESCRIPTION = """Ablation studies of the Transformer residual pathway: train one run, or run a
seed-paired study on Ray tracked in MLflow and compare its arms.

Study commands share --workspace (default $RESLAB_WORKSPACE or ./reslab-runs; read commands print
the one they read and never create it), --storage URI (run storage on a path, s3:// or gs://, where
run directories live durably and every node resumes from; default $RESLAB_STORAGE, else none; the
workspace then keeps a copy of the records), --tracking-uri (default $MLFLOW_TRACKING_URI or the
workspace's mlflow.db) and --set FIELD=VALUE overrides of every run (they change run ids: pass the
same ones to plan, status, compare and export).

Exit codes: 0 success, 1 a run failed, 2 a usage, spec, config, backend or tracking error,
130 interrupted."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (the line kept for `--json`'s error document)."""

    last_error: str | None = None

    def error(self, message: str) -> NoReturn:
        _Parser.last_error = f"{self.prog}: error: {message} (see `{self.prog} --help`)"
        self.exit(2, _Parser.last_error + "\n")


class _Version(argparse.Action):
    """`--version`: the installed package's version, read only when asked (importlib.metadata
    costs a tenth of a second at every start otherwise)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        import importlib.metadata

        print(f"reslab {importlib.metadata.version('reslab')}")
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="reslab", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action=_Version, help="show the installed reslab's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    train.register(sub)
    check.register(sub)
    generate.register(sub)
    data.register(sub)
    study.register(sub)
    tune.register(sub)
    jobs.register(sub)
    results.register(sub)
    evals.register(sub)
    power.register(sub)
    dashboard.register(sub)
    completion.register(sub, parser)
    return parser


def _quiet_closed_pipe() -> int:
    """`reslab status | head`: the reader left; end quietly, as `cat` does, with 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 0


def _quiet_teardown() -> None:
    """The last exit handler of a command run as its process: once the command and every other exit handler
    have written what they write, stderr goes to /dev/null for the interpreter's teardown when triton is loaded,
    whose bindings' leak report (nanobind's, at the very end, of the objects `gc.freeze` kept) would follow a
    one-line refusal; nanobind's own switch (`set_leak_warnings`) is not exposed by triton. Triton silences its
    own compile workers' teardown the same way (`triton._compile_warmup_pool`)."""
    if "triton._C.libtriton" not in sys.modules:
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: this process's own command line) and return its exit code.

    Run as the process's command (no `argv`: the `reslab` script, `python -m reslab.orchestrator.cli`),
    the interpreter's last garbage collections at exit skip every object the command left (`gc.freeze`
    after the other exit handlers): with torch, scipy and mlflow loaded they took 1-3 s on 2 cores,
    and the process ends right after them (bench/bench_fixed_cost.py, "interpreter exit"). For the same
    reason a command that reads a whole study pauses the cyclic collector for good there: collecting the
    cycles its readouts leave took 0.6 s after `compare` of 10^5 runs, 1.5 s after `report` (issue 39).
    In-process callers (`argv` given) get the collector back as it was (`collector_paused`).
    Objects left uncollected that way include triton's (torch._dynamo and lm-eval import it), and nanobind,
    which triton's bindings use, reports each as "leaked" after the interpreter ends: 31 lines after a one-line
    refusal (issue 52, item 8). `_quiet_teardown` runs after the freeze and closes stderr to that report.
    """
    if argv is None:
        atexit.register(_quiet_teardown)  # handlers run last-registered first: this one after the freeze
        atexit.register(gc.freeze)
    args = _parse(sys.argv[1:] if argv is None else argv)
    reads_study = getattr(args, "reads_study", False)
    as_json = getattr(args, "json", False)
    if reads_study and argv is None:
        gc.disable()
    try:
        with collector_paused() if reads_study else contextlib.nullcontext(), \
                jsonout.json_mode() if as_json else contextlib.nullcontext():
            code = args.func(args)
        sys.stdout.flush()
        return code
    except ReslabError as exc:
        print("reslab: error: " + " ".join(str(exc).split("\n")), file=sys.stderr)  # one line, whatever the source
        if as_json:
            jsonout.emit_error(args.command, exc, exc.exit_code)
        return exc.exit_code
    except BrokenPipeError:
        return _quiet_closed_pipe()
    except KeyboardInterrupt:
        print("reslab: interrupted", file=sys.stderr)
        if as_json:
            jsonout.emit_error(args.command, "interrupted", 130, kind="interrupted")
        return 130


def _parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; a usage error under `--json` also prints its `reslab.error/1` document."""
    _Parser.last_error = None
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None) and jsonout.wants_json(argv):
            command = next((a for a in argv if not a.startswith("-")), None)
            jsonout.emit_error(command, _Parser.last_error or "usage error", 2, kind="usage")
        raise
