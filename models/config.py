"""Run configuration: frozen, keyword-only dataclasses with strict loading from plain dicts.

A run is a pure function of its `RunConfig`. Everything here is plain data (no torch), so the
spec layer can validate, canonicalise and hash it. `load(cls, data, where)` is the one strict
loader: an unknown key, a wrong type or a bad value raises `ConfigError` naming the field path
and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from reslab.models.errors import ConfigError


# ----------------------------------------------------------------------------- strict loading


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        args = typing.get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` and return it in canonical form (tuples for lists)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(exc)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {value!r}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where}: {value!r} is not allowed; expected {_type_name(tp)}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return load(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `6e-4` as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported annotation {tp!r} at {where}")


def load(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(fields)}"
        )
    kwargs = {name: coerce(hints[name], data[name], f"{where}.{name}") for name in fields if name in data}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # a dataclass's own __post_init__ check
        raise ConfigError(f"{where}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """Plain, JSON-ready form of a config (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in sorted(obj.items())}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> str:
    return json.dumps(to_dict(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """`{"model.d_model": 64, ...}`: the dotted form used for MLflow params and grid axes."""
    out: dict[str, Any] = {}
    data = to_dict(obj) if not isinstance(obj, dict) else obj
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def set_path(data: dict, dotted: str, value: Any) -> dict:
    """Return a deep copy of `data` with `dotted` (e.g. `optim.lr`) set to `value`."""
    out = json.loads(json.dumps(data))
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a mapping")
    node[leaf] = value
    return out


# ----------------------------------------------------------------------------- the run config


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder shape. `preset` fills every field left at None; explicit fields win.

    Presets: see `models.presets.PRESETS`. `vocab_size` None means: from the tokenizer.
    """

    preset: str = "tiny"
    d_model: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    qk_norm: bool = False


@dataclass(frozen=True, kw_only=True)
class ResidualConfig:
    """The residual pathway: a registered variant name plus its knobs (checked against the variant)."""

    name: str = "prenorm"
    options: dict[str, Any] = field(default_factory=dict)
    impl: typing.Literal["auto", "reference", "triton"] = "auto"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """`corpus`: `stdlib` (the interpreter's own standard library source, offline) or the path
    of a directory written by `reslab data prepare`."""

    corpus: str = "stdlib"
    tokenizer: typing.Literal["byte", "bpe"] = "byte"
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.05
    include_tests: bool = False


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_scope: typing.Literal["matrices", "all"] = "matrices"
    grad_clip: float = 1.0
    batch_size: int = 16
    grad_accum: int = 1


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    seed: int = 1
    data_seed: int | None = None
    eval_every: int = 50
    eval_batches: int = 8
    tail_k: int = 3
    log_every: int = 10
    checkpoint_every: int = 0
    device: str = "auto"
    dtype: typing.Literal["auto", "float32", "bfloat16"] = "auto"
    compile: bool = False
    diagnostics: bool = True
    # a state_dict (models.convert) loaded over the init; a resumed run's checkpoint supersedes it
    init_from: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def data_seed(self) -> int:
        return self.train.seed if self.train.data_seed is None else self.train.data_seed


def validate_run_config(cfg: RunConfig, where: str = "config") -> RunConfig:
    """Semantic checks beyond types; returns the config with residual knobs resolved to defaults."""
    from reslab.models.presets import resolve_model
    from reslab.models.residual import resolve_residual

    resolve_model(cfg.model, vocab_size=cfg.model.vocab_size or 256, where=f"{where}.model")
    residual = resolve_residual(cfg.residual, where=f"{where}.residual")
    o, t, d = cfg.optim, cfg.train, cfg.data
    checks = [
        (o.lr > 0, "optim.lr", "must be > 0"),
        (0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]"),
        (o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0"),
        (o.batch_size >= 1, "optim.batch_size", "must be >= 1"),
        (o.grad_accum >= 1, "optim.grad_accum", "must be >= 1"),
        (o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)"),
        (0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2", "must be in [0, 1)"),
        (t.steps >= 1, "train.steps", "must be >= 1"),
        (t.eval_every >= 1, "train.eval_every", "must be >= 1"),
        (t.eval_batches >= 1, "train.eval_batches", "must be >= 1"),
        (t.tail_k >= 1, "train.tail_k", "must be >= 1"),
        (t.log_every >= 1, "train.log_every", "must be >= 1"),
        (t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0 (0: only at the end)"),
        (0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)"),
        (d.bpe_vocab_size >= 260, "data.bpe_vocab_size", "must be >= 260"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise ConfigError(f"{where}.{name}: {rule}")
    return dataclasses.replace(cfg, residual=residual)
