"""The `reslab` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from models.config import ConfigError, RunConfig, load, set_path, to_dict


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
    from models.config import validate_run_config
    from models.training import train

    cfg = validate_run_config(run_config_from_args(args), where=args.config or "config")
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    result = train(cfg, run_dir=args.out, log=print, resume=not args.no_resume)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps({"summary": result.summary, "info": result.info}, indent=2))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from models.data import prepare_from_cli

    meta = prepare_from_cli(
        args.inputs, fmt=args.format, out_dir=args.out, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, text_field=args.text_field, val_fraction=args.val_fraction,
    )
    print(json.dumps(meta if isinstance(meta, dict) else to_dict(meta), indent=2, default=str))
    return 0


def cmd_variants(args: argparse.Namespace) -> int:
    from models.config import ModelConfig
    from models.presets import resolve_model
    from models.residual import variants

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reslab", description=__doc__)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"reslab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("reslab: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
