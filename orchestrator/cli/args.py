"""Flag types, the flags several commands share, and SIGTERM handling for long commands.

Every check of a single flag lives in its argparse `type=` callable, so a bad value fails while
parsing with one line that names the flag (`argument --steps: expected an integer >= 1, got '0'`).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

MAX_VALUE_CHARS = 10_000


def parse_assignment(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` of `--set` and `--opt`; the value is read as a YAML scalar (3e-4, true, [1, 2]).

    A value YAML reads as null without spelling null (`--set data.corpus=`) stays the text. Values
    are bounded like study files: at most `MAX_VALUE_CHARS`, no anchors (an alias bomb), no deeper
    nesting than Python's recursion allows.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. optim.lr=3e-4), got {text[:80]!r}")
    if len(text) > MAX_VALUE_CHARS:
        raise argparse.ArgumentTypeError(f"{key[:80]}: longer than {MAX_VALUE_CHARS} characters")
    try:
        if any(isinstance(token, yaml.AnchorToken) for token in yaml.scan(raw)):
            raise argparse.ArgumentTypeError(f"{key}: YAML anchors (&name) are not allowed in a value")
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise argparse.ArgumentTypeError(f"{key}: the value is nested too deeply") from None
    return key, raw if value is None and raw not in ("null", "~") else value


def _number(kind: type, minimum: float, inclusive: bool, maximum: float | None = None) -> Callable[[str], Any]:
    low = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
    top = f"{maximum}" if kind is int or maximum is None else f"{maximum:.15g}"
    bound = low if maximum is None else f"from {minimum:g} to {top}" if inclusive else f"{low} and <= {top}"
    noun = "an integer" if kind is int else "a number"

    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {bound}, got {text[:80]!r}") from None
        if (not math.isfinite(value) or value < minimum or (not inclusive and value == minimum)
                or (maximum is not None and value > maximum)):
            raise argparse.ArgumentTypeError(f"expected {noun} {bound}, got {text[:80]!r}")
        return value

    check.__name__ = f"{kind.__name__} {bound}"
    return check


positive_int = _number(int, 1, inclusive=True)
non_negative_int = _number(int, 0, inclusive=True)
positive_float = _number(float, 0, inclusive=False)
non_negative_float = _number(float, 0, inclusive=True)

# Bounds on counts and durations that no real use comes near; above them a value is a typo or hostile.
MAX_GPUS_PER_RUN = 1024  # as the study's `resources.gpus_per_run`
MAX_CLUSTER_GPUS = 1_000_000  # past the largest clusters built (~10^5 GPUs)
MAX_RESTARTS = 1000  # --retries, --rank-restarts: each one costs an attempt's start-up
MAX_OUTAGE_S = 7 * 24 * 3600.0  # --outage-timeout: a week; a driver that waits longer waits for nothing
cluster_gpus = _number(int, 1, inclusive=True, maximum=MAX_CLUSTER_GPUS)
whole_gpus = _number(int, 1, inclusive=True, maximum=MAX_GPUS_PER_RUN)
restarts = _number(int, 0, inclusive=True, maximum=MAX_RESTARTS)
outage_seconds = _number(float, 0, inclusive=True, maximum=MAX_OUTAGE_S)
MAX_SIMULATION_REPS = 10_000  # `power --reps`: 200 reps of a gates plan take ~30 s on 2 cores; 10^4, hours
simulation_reps = _number(int, 1, inclusive=True, maximum=MAX_SIMULATION_REPS)


MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed; as the configs' train.seed
sampling_seed = _number(int, 0, inclusive=True, maximum=MAX_SEED)


def torch_threads(text: str) -> int:
    """`--threads`: from 1 to the CPUs this process may use. Past them a thread only waits for a core (torch's
    threads meet at every barrier: `attempt.threads`), and 10^6 of them crash the process and stop the machine
    from forking."""
    return _number(int, 1, inclusive=True, maximum=len(os.sched_getaffinity(0)))(text)


def gpus_per_run(text: str) -> float:
    """`--gpus-per-run`: a share of one GPU below 2 (runs share it), or a whole number of GPUs, one rank each,
    up to `MAX_GPUS_PER_RUN`; what `loop.ExecutionOptions` accepts, refused here under the flag's name."""
    allowed = (f"a number of GPUs from 0 to {MAX_GPUS_PER_RUN}: below 2 any share of one GPU, from 2 a whole "
               "number (one rank each)")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 <= value <= MAX_GPUS_PER_RUN and (value < 2 or value.is_integer())):
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text[:80]!r}")
    return value


def unit_interval(text: str) -> float:
    """A share: from 0 to 1, both included."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text[:80]!r}")
    return value


def probability(text: str) -> float:
    """An alpha level: strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1 (exclusive), got {text!r}")
    return value


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port 0..65535, got {text!r}")
    return value


def output_dir(text: str) -> str:
    """A directory a command writes into: an existing directory, or one it can create."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a writable directory")
    return text


def add_workspace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workspace", help="workspace root (default: $RESLAB_WORKSPACE or ./reslab-runs)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or the "
                                          "workspace's mlflow.db)")


def add_storage_arg(p: argparse.ArgumentParser) -> None:
    """`--storage`: the run storage (`orchestrator.durability.storage`); checked when the workspace is opened."""
    p.add_argument("--storage", metavar="URI",
                   help="run storage: where run directories live durably, a path or a URI pyarrow opens "
                        "(s3://bucket/prefix?endpoint_override=host:port&scheme=http, gs://bucket/prefix, "
                        "file:///path; credentials from AWS_*/GOOGLE_*); default $RESLAB_STORAGE, else none "
                        "(run directories only in the workspace)")


def add_study_args(p: argparse.ArgumentParser) -> None:
    """SPEC, `--set`, the workspace, the run storage and the lease timeout: what every study command reads."""
    p.add_argument("spec", metavar="SPEC", help="study YAML file, e.g. experiments/quickstart.yaml")
    p.add_argument("--set", action="append", type=parse_assignment, default=[], metavar="FIELD=VALUE",
                   help="override a config field in every run, repeatable (changes run ids)")
    add_workspace_args(p)
    add_storage_arg(p)
    add_limit_args(p)


def add_limit_args(p: argparse.ArgumentParser, pass_through: bool = False) -> None:
    """`--lease-timeout` and `--max-runs` (every study command; `submit` passes them on to its job,
    `pass_through`: no default, so only what is given goes on)."""
    p.add_argument("--lease-timeout", type=positive_float, default=None if pass_through else 120.0,
                   help="seconds without heartbeat after which a RUNNING run counts as abandoned")
    p.add_argument("--max-runs", type=positive_int,
                   help="allow a study of up to this many runs (overrides its `limits: {max_runs: N}`; default 5000)")


def sharding(text: str) -> str:
    """`--sharding`: ddp or fsdp, else one line naming what is allowed."""
    if text not in ("ddp", "fsdp"):
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: ddp, fsdp")
    return text


def interrupt_on_sigterm() -> None:
    """SIGTERM ends a long command like Ctrl-C (cleanup runs, exit 130) instead of killing it."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
