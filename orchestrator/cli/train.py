"""Single runs: `train`, `variants` and `convert`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

from reslab.models.config import ConfigError, to_dict
from reslab.orchestrator.cli.args import add_storage_arg, output_dir, parse_assignment, positive_int, torch_threads

_SHORTCUTS = {"preset": "model.preset", "residual": "residual.name", "seed": "train.seed", "steps": "train.steps",
              "impl": "residual.impl", "device": "train.device", "corpus": "data.corpus"}


def _overrides(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The shortcut flags, then `--opt` knobs, then `--set` fields: later ones win."""
    out = [(path, getattr(args, flag)) for flag, path in _SHORTCUTS.items() if getattr(args, flag) is not None]
    out += [(f"residual.options.{knob}", value) for knob, value in args.opt]
    return out + args.set


def cmd_train(args: argparse.Namespace) -> int:
    from reslab.experiments.spec import load_run_config
    from reslab.models.training import train
    from reslab.orchestrator.attempt.threads import default_threads, set_threads

    cfg = load_run_config(args.config, _overrides(args))
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
        return 0
    set_threads(args.threads or default_threads())
    result = train(cfg, run_dir=args.out, log=print, resume=not args.no_resume)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps({"summary": result.summary, "info": result.info}, indent=2))
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """prenorm checkpoint -> a routing variant with the same function at step 0, then train on."""
    from reslab.experiments.spec import load_run_config
    from reslab.models.config import ResidualConfig
    from reslab.models.convert import convert_checkpoint
    from reslab.models.training import train

    checkpoint = _checkpoint(args)
    try:
        conversion = convert_checkpoint(checkpoint, ResidualConfig(name=args.residual, options=dict(args.opt)),
                                        args.out)
    except ValueError as exc:
        raise ConfigError(f"convert: {exc}") from None
    config_path = Path(args.out) / "run_config.json"
    print(f"converted {checkpoint} -> {args.residual}: weights {conversion.weights}, config {config_path}")
    if args.steps is None:
        print(f"continue training with: reslab train --config {config_path} --out {Path(args.out) / 'run'}")
        return 0
    cfg = load_run_config(None, [("train.steps", args.steps), *args.set], base=conversion.config)
    train(cfg, run_dir=Path(args.out) / "run", log=print)
    return 0


def _checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint to convert: a file, or with run storage a run, `STUDY/RUN_ID` or the workspace's
    `runs/STUDY/RUN_ID/checkpoint.pt`, pulled into the workspace first when storage is ahead of the
    workspace's copy (`orchestrator.durability.storage`)."""
    from reslab.orchestrator.durability.storage import CHECKPOINT, pull_if_ahead
    from reslab.orchestrator.durability.workspace import Workspace

    path = Path(args.checkpoint)
    workspace = Workspace.at(args.workspace, args.storage)
    storage = workspace.run_storage()
    if storage is None or (path.is_file() and not path.resolve().is_relative_to(workspace.root / "runs")):
        if not path.is_file():
            raise ConfigError(f"convert: no such checkpoint {args.checkpoint}")
        return path
    parts = path.parts[:-1] if path.name == CHECKPOINT else path.parts
    if len(parts) < 2:
        raise ConfigError(f"convert: {args.checkpoint!r} names no run; with --storage give STUDY/RUN_ID or "
                          f".../runs/STUDY/RUN_ID/{CHECKPOINT}")
    study, run_id = parts[-2], parts[-1]
    stored, rd = storage.run(study, run_id), workspace.run_dir(study, run_id)
    if pull_if_ahead(stored, rd):
        print(f"pulled run {study}/{run_id} from run storage {storage} into {rd.path}")
    if not (rd.path / CHECKPOINT).is_file():
        raise ConfigError(f"convert: run {study}/{run_id} has no {CHECKPOINT} in run storage {storage} or in "
                          f"{rd.path}")
    return rd.path / CHECKPOINT


def cmd_variants(args: argparse.Namespace) -> int:
    """Extra parameters of each variant at a preset, as whole counts (total, and per layer)."""
    from reslab.models.config import ModelConfig
    from reslab.models.presets import resolve_model
    from reslab.models.residual import variants

    shape = resolve_model(ModelConfig(preset=args.preset), vocab_size=256)
    print(f"residual variants at preset {args.preset!r} (d={shape.d_model}, L={shape.n_layers}): "
          "extra parameters in all, per layer, knobs")
    for name, cls in variants().items():
        extra = cls(cls.Config(), shape).extra_params()
        about = "~" if extra % shape.n_layers else ""  # a per-depth parameter makes layers differ
        per_layer = f"{about}{round(extra / shape.n_layers):,}"
        knobs = ", ".join(f"{k}={v!r}" for k, v, _ in cls.knobs()) or "(no knobs)"
        print(f"  {name:<18} {f'+{extra:,}':>13} {per_layer:>10}/layer  {knobs}")
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with a run config (model/residual/data/optim/train)")
    p.add_argument("--preset", help="model preset: tiny, small, 100m, gpt2-124m, 350m")
    p.add_argument("--residual", help="residual variant name (see `reslab variants`)")
    p.add_argument("--opt", action="append", type=parse_assignment, default=[], metavar="KNOB=VALUE",
                   help="a residual knob, repeatable (e.g. --opt block_size=4)")
    p.add_argument("--seed", type=int, help="seed: fixes init and data order")
    p.add_argument("--steps", type=positive_int, help="optimizer steps")
    p.add_argument("--impl", choices=["auto", "reference", "triton", "fla", "liger", "flash_attn_res"],
                   help="routing implementation (fla, liger, flash_attn_res: the extra kernels)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--corpus", help="stdlib (default) or a directory from `reslab data prepare`")
    p.add_argument("--set", action="append", type=parse_assignment, default=[], metavar="FIELD=VALUE",
                   help="any config field by dotted path, repeatable (e.g. --set optim.lr=3e-4)")


def register(sub: Any) -> None:
    p = sub.add_parser("train", help="train one residual architecture")
    _add_run_args(p)
    p.add_argument("--out", type=output_dir, help="run directory: checkpoints go here and an existing one is resumed")
    p.add_argument("--no-resume", action="store_true", help="start from scratch even if --out has a checkpoint")
    p.add_argument("--summary-json", help="write the final summary to this file")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--threads", type=torch_threads,
                   help="torch CPU threads, at most the CPUs this process may use (default: half of them, 1 to 4)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("variants", help="list residual variants, their knobs and extra parameters")
    p.add_argument("--preset", default="gpt2-124m")
    p.set_defaults(func=cmd_variants)

    p = sub.add_parser("convert", help="convert a trained prenorm checkpoint into a routing variant")
    p.add_argument("checkpoint", help="a prenorm run's checkpoint.pt; with --storage, STUDY/RUN_ID of a run in it")
    p.add_argument("--workspace", help="with --storage: the workspace the run is pulled into (default: "
                                       "$RESLAB_WORKSPACE or ./reslab-runs)")
    add_storage_arg(p)
    p.add_argument("--residual", required=True, help="target variant, e.g. delta_attnres or delta_block")
    p.add_argument("--opt", action="append", type=parse_assignment, default=[], metavar="KNOB=VALUE",
                   help="a knob of the target, repeatable (e.g. --opt gate=learnable_alpha)")
    p.add_argument("--out", type=output_dir, required=True, help="directory for init_from.pt and run_config.json")
    p.add_argument("--steps", type=positive_int, help="continue training for this many steps (into OUT/run)")
    p.add_argument("--set", action="append", type=parse_assignment, default=[], metavar="FIELD=VALUE",
                   help="override a field of the new run")
    p.set_defaults(func=cmd_convert)
