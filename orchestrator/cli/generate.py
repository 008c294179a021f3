"""`generate`: continue text prompts with a finished run's model (`models.generation.generate_text`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from reslab.models.config import ConfigError
from reslab.orchestrator.cli.args import add_storage_arg, non_negative_float, positive_int, sampling_seed, torch_threads


def find_run(spec: str, workspace_arg: str | None, storage: str | None) -> Path:
    """The run directory `--run` names: a directory (or its checkpoint.pt), `STUDY/RUN_ID` or a bare run id of
    the workspace, pulled from run storage first when storage is ahead of the workspace's copy."""
    from reslab.models.checkpoint import CHECKPOINT_NAME
    from reslab.orchestrator.durability.storage import pull_if_ahead
    from reslab.orchestrator.durability.workspace import Workspace

    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.name == CHECKPOINT_NAME:  # a run's checkpoint.pt names its run
        return path.parent
    workspace = Workspace.at(workspace_arg, storage)
    parts = Path(spec).parts
    if len(parts) == 2:
        study, run_id = parts
    elif len(parts) == 1:
        studies = sorted(d.parent.name for d in (workspace.root / "runs").glob(f"*/{spec}") if d.is_dir())
        if not studies and (stored := workspace.run_storage()) is not None:
            local = sorted(d.name for d in (workspace.root / "runs").glob("*") if d.is_dir())
            studies = [s for s in local if spec in stored.run_ids(s)]
        if not studies:
            raise ConfigError(f"generate --run: no run {spec!r} in workspace {workspace.root}; allowed: a run "
                              "directory, STUDY/RUN_ID, or the id of a run in the workspace (`reslab status SPEC` "
                              "lists them)")
        study, run_id = studies[0], spec
    else:
        raise ConfigError(f"generate --run: {spec!r} is not a directory; allowed: a run directory, STUDY/RUN_ID "
                          "or a run id")
    rd = workspace.run_dir(study, run_id)
    stored = workspace.run_storage()
    if stored is not None and pull_if_ahead(stored.run(study, run_id), rd):
        print(f"pulled run {study}/{run_id} from run storage {stored} into {rd.path}", file=sys.stderr)
    if not rd.path.is_dir():
        raise ConfigError(f"generate --run: no run {study}/{run_id} in workspace {workspace.root}"
                          + (f" or run storage {stored}" if stored is not None else ""))
    return rd.path


def cmd_generate(args: argparse.Namespace) -> int:
    from reslab.models.checkpoint import newer_checkpoint
    from reslab.models.generation import generate_text
    from reslab.orchestrator.attempt.threads import default_threads, set_threads

    run_dir = find_run(args.run, args.workspace, args.storage)
    checkpoint = newer_checkpoint(run_dir)
    if checkpoint is None:
        raise ConfigError(f"generate --run: {run_dir} has no checkpoint (checkpoint.pt or a committed "
                          "checkpoint.dcp step); allowed: a run that has trained, with its run directory")
    set_threads(args.threads or default_threads())
    out = generate_text(checkpoint, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, stop=args.stop, device=args.device)
    cfg = out.config
    if out.step < cfg.train.steps:
        print(f"note: {checkpoint} is at step {out.step} of {cfg.train.steps}: the run has not finished",
              file=sys.stderr)
    print(f"# {cfg.residual.name} at step {out.step} ({checkpoint}), {out.device}, up to {out.max_new_tokens} new "
          f"tokens, " + (f"temperature {args.temperature:g}" if args.temperature else "greedy"), file=sys.stderr)
    for i, (prompt, text) in enumerate(zip(args.prompt, out.continuations, strict=True)):
        if len(args.prompt) > 1:
            print(f"--- prompt {i + 1}: {prompt!r}")
        print(text)
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="continue text prompts with a finished run's model")
    p.add_argument("--run", required=True, metavar="RUN",
                   help="the run: its directory (or its checkpoint.pt), STUDY/RUN_ID, or a run id of the workspace")
    p.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                   help="a prompt, repeatable (all decode as one left-padded batch); '' starts a new document")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N",
                   help="new tokens per prompt (default: 64, or what the model's context leaves if less)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T", help="0 (default): greedy")
    p.add_argument("--top-k", type=positive_int, metavar="K", help="sample among the K likeliest tokens only")
    p.add_argument("--seed", type=sampling_seed, default=0, help="the sampling seed, 0 to 2^63-1 (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end each continuation before this text, repeatable (end-of-text always stops)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if available), cpu, cuda, cuda:1 ...")
    p.add_argument("--threads", type=torch_threads,
                   help="torch CPU threads, at most the CPUs this process may use (default: half of them, 1 to 4)")
    p.add_argument("--workspace", help="the workspace a STUDY/RUN_ID or run id is in (default: $RESLAB_WORKSPACE "
                                       "or ./reslab-runs)")
    add_storage_arg(p)
    p.set_defaults(func=cmd_generate)
