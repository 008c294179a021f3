"""Run configuration: frozen, keyword-only dataclasses with strict loading from plain dicts.

A run is a pure function of its `RunConfig`. Everything here is plain data (no torch), so the
spec layer can validate, canonicalise and hash it. `load(cls, data, where)` is the one strict
loader: an unknown key, a wrong type or a bad value raises `ConfigError` naming the field path
and what is allowed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import json
import math
import re
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any

from reslab.common.errors import ConfigError
from reslab.models.typed_load import MISSING, coerce_annotated, same_shape, shown


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


# Integers travel into torch, numpy and SQLite, which all stop at 64 bits.
INT_MAX = 2**63 - 1
def check_plain(value: Any, where: str) -> None:
    """`value` must be plain config data: mappings with string keys, lists, strings, booleans,
    null, integers within 64 bits and finite numbers (YAML's dates, sets and binary are refused)."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, dict):
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{at}: key {shown(key)} is not a string; keys are field names")
                stack.append((sub, f"{at}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((sub, f"{at}[{i}]") for i, sub in enumerate(item))
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ConfigError(f"{at}: {item} is not allowed; expected a finite number")
        elif isinstance(item, int) and not isinstance(item, bool):
            if abs(item) > INT_MAX:
                raise ConfigError(f"{at}: {shown(item)} is out of range; integers must lie within +-(2**63-1)")
        elif item is not None and not isinstance(item, (str, bool)):
            raise ConfigError(
                f"{at}: a {type(item).__name__} ({shown(item)}) is not allowed; "
                "expected a number, string, boolean, null, list or mapping"
            )


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Check `value` against the annotation `tp` and return it in canonical form (tuples for lists)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        check_plain(value, where)
        return value
    if origin is typing.Annotated:  # a field's bounds and messages (models.typed_load.Rule)
        return coerce_annotated(tp, value, where, coerce)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(tp):  # before a dataclass arm, which reads null as {}
            return None
        for arg in typing.get_args(tp):
            with contextlib.suppress(ConfigError):
                return coerce(arg, value, where)
        for arg in typing.get_args(tp):  # a mapping or list for the arm of its shape: that arm's own message
            if same_shape(arg, value):
                coerce(arg, value, where)
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {shown(value)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{where}: expected null, got {shown(value)}")
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{where}: {shown(value)} is not allowed; expected {_type_name(tp)}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(coerce(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {shown(value)}")
        check_plain(value, where)
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is not Any:  # typed values: each checked at its own key's path
            return {k: coerce(args[1], v, f"{where}.{k}") for k, v in value.items()}
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return load(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {shown(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            check_plain(value, where)
            return value
        raise ConfigError(f"{where}: expected an integer, got {shown(value)}")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) <= 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads `6e-4` as a string
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {shown(value)}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: {shown(value)} is not allowed; expected a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {shown(value)}")
    raise TypeError(f"unsupported annotation {tp!r} at {where}")


def did_you_mean(name: str, allowed: typing.Iterable[str]) -> str:
    """`'name'`, with the closest allowed name when one is close: `'stepz' (did you mean 'steps'?)`."""
    close = difflib.get_close_matches(name[:200], list(allowed), n=1)
    return repr(name) + (f" (did you mean {close[0]!r}?)" if close else "")


# (dataclass, old key) -> what replaced it, for a one-line error that says how to update a file
RENAMED = {
    ("TrainConfig", "eval_batches"): "eval_windows: the validation windows each eval scores, now the same for every "
                                     "batch size (eval_batches x optim.batch_size before; the chunking is "
                                     "eval_batch_size, default optim.batch_size)",
}


# (dataclass, old key) -> (the field that picks the kind, the kind, the mapping the knob moved to, its name there):
# optim's flat knobs before issue 50, read with one deprecation line (`moved_keys`)
MOVED = {
    ("OptimConfig", f"muon_{knob}"): ("name", "muon", "options", knob)
    for knob in ("adjust_lr", "momentum", "nesterov", "ns_steps")
} | {
    ("OptimConfig", knob): ("schedule", "wsd", "schedule_options", knob)
    for knob in ("cooldown_fraction", "cooldown_shape")
}


class DeprecatedField(FutureWarning):
    """A config key of an older spelling, read where it moved (`MOVED`)."""


# the warnings registry of `moved_keys`: each message shown once a process, however many arms repeat the key
_SHOWN: dict[Any, Any] = {}


def moved_keys(cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with each key `MOVED` names for `cls` moved to its new place, with one `DeprecatedField` line per
    key a process (the line names the section, `optim.muon_momentum`, not each arm's copy of it); a knob of a
    kind the data does not pick (a Muon knob beside `name: adamw`) was read by nothing then and is dropped."""
    moved = [key for key in data if (cls.__name__, key) in MOVED]
    if not moved:
        return data
    out, section = {**data}, where.rsplit(".", 1)[-1]
    for key in moved:
        selector, kind, target, knob = MOVED[cls.__name__, key]
        value = out.pop(key)
        picked = out.get(selector, next(f.default for f in dataclasses.fields(cls) if f.name == selector))
        if picked == kind:
            out[target] = {**(out.get(target) or {}), knob: value}
        message = (f"{section}.{key}: deprecated, write {section}.{target}.{knob} (with {section}.{selector}: "
                   f"{kind})" + ("" if picked == kind else f"; ignored beside {section}.{selector}: {picked}"))
        # an explicit location without source: the warning is the one line, not a line of this file under it
        warnings.warn_explicit(message, DeprecatedField, "reslab config", 0, registry=_SHOWN)
    return out


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A dataclass's resolved annotations and its init fields: resolving the annotations is most of a `load`
    (every RunSpec of a study is loaded: 10^6 runs; issue 39), and a class's do not change."""
    return typing.get_type_hints(cls, include_extras=True), {f.name: f for f in dataclasses.fields(cls) if f.init}


# `load`'s `where` for a document's top level: its fields' paths are their bare names (`seeds`, `arms.x`)
TOP = "top level"
# unknown keys named in one error; the rest are counted
NAMED_KEYS = 5


def _unknown(data: dict, fields: typing.Collection[str], where: str) -> str:
    """`unknown key(s) 'a', 'stepz' (did you mean 'steps'?) and 3 more; allowed: ...`, in the mapping's order."""
    unknown = [k for k in data if k not in fields]
    named = ", ".join(shown(k) + did_you_mean(str(k), fields).removeprefix(repr(str(k))) for k in unknown[:NAMED_KEYS])
    more = f" and {len(unknown) - NAMED_KEYS} more" if len(unknown) > NAMED_KEYS else ""
    return f"{where}: unknown key(s) {named}{more}; allowed: {', '.join(fields) or '(none)'}"


def load(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types. A required field left out
    says its `typed_load.missing` text; `where` `TOP` gives the fields their bare names."""
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {shown(data)}")
    hints, fields = _schema(cls)
    data = moved_keys(cls, data, where)
    for key in data:
        if (cls.__name__, key) in RENAMED:
            raise ConfigError(f"{where}.{key}: renamed; use {RENAMED[cls.__name__, key]}")
    if any(key not in fields for key in data):
        raise ConfigError(_unknown(data, fields, where))
    at = "" if where == TOP else f"{where}."
    for name, f in fields.items():
        if name not in data and MISSING in f.metadata:
            raise ConfigError(f"{at}{name}: missing; {f.metadata[MISSING]}")
    kwargs = {name: coerce(hints[name], data[name], f"{at}{name}") for name in fields if name in data}
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
    out = copy.deepcopy(data)
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {part!r} is not a mapping")
    node[leaf] = value
    return out


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts FFN in place of the dense SwiGLU (`models.layers.MoE`).

    `experts` routed SwiGLU experts of `expert_hidden` width (null: the shape's ffn_hidden), `top_k` of them per
    token, plus `shared_experts` always-on experts (one SwiGLU of shared_experts x expert_hidden). `every`: the
    Transformer layers l with (l + 1) % every == 0 are MoE (1: all). `score`: the router's gate, softmax over the
    experts or a per-expert sigmoid (DeepSeek-V3); either way the chosen top-k scores are renormalised to sum to 1.
    `balance`: `aux`, the Switch/GShard loss aux_coef x E x sum_i f_i P_i (f_i the fraction of routed slots that
    chose expert i, P_i its mean normalised score), or `bias`, DeepSeek-V3's auxiliary-loss-free balancing (a
    per-expert bias added to the scores only to choose experts, moved by `bias_update_rate` x sign(mean load - load)
    before every optimizer step). `z_loss_coef`: the router z-loss coef x mean logsumexp(logits)^2 (0: off).
    Dropless: every token reaches its top_k experts, no capacity and no dropping.
    """

    experts: int = 8
    top_k: int = 2
    shared_experts: int = 0
    expert_hidden: int | None = None
    every: int = 1
    score: typing.Literal["softmax", "sigmoid"] = "softmax"
    balance: typing.Literal["aux", "bias"] = "aux"
    aux_coef: float = 0.01
    bias_update_rate: float = 0.001
    z_loss_coef: float = 0.0


def check_moe(moe: MoEConfig, where: str = "model.moe") -> None:
    """One-line ConfigErrors for the MoE knobs' ranges."""
    checks = [
        (moe.experts >= 1, "experts", f"must be >= 1, got {moe.experts}"),
        (1 <= moe.top_k <= moe.experts, "top_k", f"{moe.top_k} is not allowed; allowed: 1..experts ({moe.experts})"),
        (moe.shared_experts >= 0, "shared_experts", f"must be >= 0, got {moe.shared_experts}"),
        (moe.expert_hidden is None or moe.expert_hidden >= 1, "expert_hidden",
         f"must be >= 1 or null (the shape's ffn_hidden), got {moe.expert_hidden}"),
        (moe.every >= 1, "every", f"must be >= 1 (1: every layer is MoE), got {moe.every}"),
        (moe.aux_coef >= 0, "aux_coef", f"must be >= 0, got {moe.aux_coef}"),
        (moe.bias_update_rate >= 0, "bias_update_rate", f"must be >= 0, got {moe.bias_update_rate}"),
        (moe.z_loss_coef >= 0, "z_loss_coef", f"must be >= 0, got {moe.z_loss_coef}"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise ConfigError(f"{where}.{name}: {rule}")


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
    # attention head width; None: d_model // n_heads (Qwen3 sets it apart from the width)
    head_dim: int | None = None
    # the LM head reuses the embedding matrix; false: a separate `lm_head` (an untied pretrained model)
    tie_embeddings: bool = True
    # a mixture-of-experts FFN (MoEConfig); null: the preset's (dense for every preset but the *-moe ones)
    moe: MoEConfig | None = None


@dataclass(frozen=True, kw_only=True)
class ResidualConfig:
    """The residual pathway: a registered variant name plus its knobs (checked against the variant)."""

    name: str = "prenorm"
    options: dict[str, Any] = field(default_factory=dict)
    # fla, liger, flash_attn_res: the field's kernels (kernels/field, the extra `kernels`)
    impl: typing.Literal["auto", "reference", "triton", "fla", "liger", "flash_attn_res"] = "auto"


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """`corpus`: `stdlib` (the interpreter's own standard library source, offline), the name of a
    corpus prepared into the cache (`fineweb-edu-10bt` is `$RESLAB_CACHE/corpora/fineweb-edu-10bt`,
    written by `reslab data prepare --corpus NAME`), or the path of a prepared directory (anything
    with a `/`). `max_epochs`: the most passes over the corpus's train split a run may make
    (steps x batch x grad_accum samples over the split's windows of seq_len, each seen once per
    epoch: `models.data.dataset`); validate, plan and run refuse a run above it, so memorisation
    is never mistaken for pretraining. `tokenizer`: `byte`, `bpe` (trained on the corpus's train
    split, `bpe_vocab_size` ids) or `hf`: a pretrained checkpoint's own tokenizer (`tokenizer_path`,
    by default the `train.init_from: hf:` directory; needs `transformers`, the eval extra)."""

    corpus: str = "stdlib"
    tokenizer: typing.Literal["byte", "bpe", "hf"] = "byte"
    bpe_vocab_size: int = 4096
    # the directory of an `hf` tokenizer (a Hugging Face checkpoint's tokenizer files); null: the directory of
    # `train.init_from: hf:<dir>`, which `models.resolve.validate_run_config` fills in
    tokenizer_path: str | None = None
    val_fraction: float = 0.05
    include_tests: bool = False
    max_epochs: float = 1.0


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
    # a registered optimizer (`models.optim`: adamw, muon, adafactor) and its knobs, a registered schedule
    # (cosine, wsd) and its knobs; the fields above are the ones every kind reads
    name: str = "adamw"
    options: dict[str, Any] = field(default_factory=dict)
    schedule: str = "cosine"
    schedule_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class DivergenceConfig:
    """When a run counts as diverged (it then ends FAILED with the reason, and is not retried).

    A non-finite training loss, gradient norm or validation loss always stops the run. On top of
    that, an evaluation whose `val_loss` exceeds `max_loss_ratio` times the initial loss (the first
    step's training loss, measured before any update) is a strike; `patience` strikes in a row end
    the run. `max_loss_ratio: null` turns the bound off. The defaults leave healthy runs alone: a
    learning run falls below its initial loss within the first eval, while a blown-up one (`lr: 5`
    on the tiny preset: val 14-33 against an initial 5.5) sits far above 1.5x.
    """

    max_loss_ratio: float | None = 1.5
    patience: int = 2


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    seed: int = 1
    data_seed: int | None = None
    eval_every: int = 50
    # validation windows scored at each eval, the same for every arm whatever its batch size;
    # `eval_batch_size` (default: optim.batch_size) only chunks them, for memory
    eval_windows: int = 128
    eval_batch_size: int | None = None
    # val_loss_tail averages the last `tail_k` evals; 1, the final eval, by default: averaging evals from
    # earlier in training added their higher loss without a steadier paired delta (bench/bench_tail_window.py)
    tail_k: int = 1
    log_every: int = 10
    checkpoint_every: int = 0
    device: str = "auto"
    dtype: typing.Literal["auto", "float32", "bfloat16"] = "auto"
    compile: bool = False
    diagnostics: bool = True
    # activation and gradient magnitudes across depth at every eval (models.magnitudes): the eval windows'
    # RMS per sublayer, the gradient norms of the step before; the summaries growth and grad_cv
    magnitudes: bool = True
    # effective depth (models.diagnostics): the first `deff_passages` validation passages, compared
    # with the debiased CKA (unbiased HSIC) or the paper's plug-in CKA, biased towards 1 when d >> N
    deff_passages: int = 64
    deff_cka: typing.Literal["debiased", "biased"] = "debiased"
    # a state_dict (models.convert) loaded over the init; a resumed run's checkpoint supersedes it
    init_from: str | None = None
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    # the run's first training sample in its data seed's stream: step s trains samples
    # data_offset + s * global_batch...; an arm continuing a checkpoint of N steps sets N * global_batch
    data_offset: int = 0


@dataclass(frozen=True, kw_only=True)
class CostConfig:
    """What serving the trained model costs, measured by the run after training (`models.serving`).

    `decode_batch` rows decode together for `decode_tps_batch` (and are the prefill's batch);
    `prompt_tokens` per prompt, then `new_tokens` greedy steps; each timing is the median of
    `repeats` after one warm-up. The lengths left at null fit the context: `new_tokens` 16, at most
    half of `seq_len`; `prompt_tokens` 32, at most what the new tokens leave (`cost_lengths`); set,
    prompt + new tokens must fit `seq_len`. `measure: false` records no cost metric at all (the
    summary has no such key; the runs table reads NaN, as for any metric a run did not record).
    """

    measure: bool = True
    decode_batch: int = 8
    prompt_tokens: int | None = None
    new_tokens: int | None = None
    repeats: int = 5


# the lengths a CostConfig left at null takes, before they are cut to fit the context
DEFAULT_PROMPT_TOKENS = 32
DEFAULT_NEW_TOKENS = 16
# Upper bounds of the measurement. decode_batch: 4096 rows is 4x the largest batch a serving engine decodes
# together by default (vLLM's max_num_seqs 1024 on an H100 class GPU); past it the figure describes no
# deployment. repeats: the figure is a median after one warm-up; at 100 repetitions its standard error is
# ~1.25 sigma / 10, and each repetition decodes new_tokens steps of the whole batch three times (prefill,
# one row, the batch), so a larger count only lengthens the run's end.
MAX_DECODE_BATCH = 4096
MAX_REPEATS = 100
# The largest memory one device holds (an H200's 141 GB): the measurement decodes on one device
# (`models.serving`), so a decode state past it cannot be measured anywhere (`models.resolve`).
LARGEST_DEVICE_BYTES = 141e9


def cost_lengths(cost: CostConfig, seq_len: int, where: str = "config") -> tuple[int | None, int | None]:
    """(prompt tokens, new tokens) of `cost` in a context of `seq_len` tokens, the nulls filled in (the
    class docstring); ConfigError when the ones set do not fit. `measure: false` leaves them as they are."""
    for name in ("prompt_tokens", "new_tokens"):
        value = getattr(cost, name)
        if value is not None and value < 1:
            raise ConfigError(f"{where}.cost.{name}: {value} is not allowed; allowed: >= 1, or null to fit the context")
    if not cost.measure:
        return cost.prompt_tokens, cost.new_tokens
    new = cost.new_tokens if cost.new_tokens is not None else min(DEFAULT_NEW_TOKENS, max(seq_len // 2, 1))
    prompt = cost.prompt_tokens if cost.prompt_tokens is not None else min(DEFAULT_PROMPT_TOKENS, seq_len - new)
    if prompt < 1 or prompt + new > seq_len:
        raise ConfigError(f"{where}.cost: prompt_tokens={prompt} + new_tokens={new} is {prompt + new} tokens, over "
                          f"the model's context seq_len={seq_len}; allowed: prompt_tokens + new_tokens <= {seq_len} "
                          "(or cost.measure: false)")
    return prompt, new


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cost: CostConfig = field(default_factory=CostConfig)

    @property
    def data_seed(self) -> int:
        return self.train.seed if self.train.data_seed is None else self.train.data_seed


# The devices a config may name; whether one exists is checked where the run starts
# (`models.training.pick_device`), since a study is often validated away from its GPUs.
DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:[0-9]{1,3})?)$")
# data.corpus: a cache name (models.data.prepare.corpus_path), or a path: anything with / or a leading ~
CORPUS_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.\-]*|~.*|.*/.*)$")


def check_run_config(cfg: RunConfig, where: str = "config") -> None:
    """Semantic checks of the plain fields beyond their types (ranges, formats). The model shape,
    the residual knobs and `train.init_from` need the registries: `models.resolve.validate_run_config`
    runs these checks together with those."""
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
        (t.eval_windows >= 1, "train.eval_windows", "must be >= 1"),
        (t.eval_batch_size is None or t.eval_batch_size >= 1, "train.eval_batch_size", "must be >= 1 or null"),
        (t.tail_k >= 1, "train.tail_k", "must be >= 1"),
        (t.deff_passages >= 4, "train.deff_passages", "must be >= 4 (the debiased CKA needs 4 passages)"),
        (t.log_every >= 1, "train.log_every", "must be >= 1"),
        (t.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0 (0: only at the end)"),
        (t.divergence.max_loss_ratio is None or t.divergence.max_loss_ratio > 1, "train.divergence.max_loss_ratio",
         "must be > 1 (a multiple of the initial loss) or null to turn the bound off"),
        (t.divergence.patience >= 1, "train.divergence.patience", "must be >= 1 (evaluations in a row)"),
        (1 <= cfg.cost.decode_batch <= MAX_DECODE_BATCH, "cost.decode_batch",
         f"must be from 1 to {MAX_DECODE_BATCH} (got {cfg.cost.decode_batch}); the rows decoded together"),
        (1 <= cfg.cost.repeats <= MAX_REPEATS, "cost.repeats",
         f"must be from 1 to {MAX_REPEATS} (got {cfg.cost.repeats}); timed repetitions, their median recorded"),
        (0 < d.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)"),
        (d.bpe_vocab_size >= 260, "data.bpe_vocab_size", "must be >= 260"),
        (d.max_epochs > 0, "data.max_epochs", "must be > 0 (passes over the corpus a run may make)"),
        (CORPUS_RE.match(d.corpus) is not None, "data.corpus",
         f"{d.corpus!r} is not allowed; use stdlib, a prepared corpus's name (letters, digits, _ . -) "
         "or a path with /"),
    ]
    checks += [
        (t.seed >= 0, "train.seed", f"must be >= 0 (got {t.seed}); a seed fixes the init and the data order"),
        (t.data_seed is None or t.data_seed >= 0, "train.data_seed", f"must be >= 0 or null (got {t.data_seed})"),
        (t.data_offset >= 0, "train.data_offset", f"must be >= 0 (got {t.data_offset}); a sample index"),
        (DEVICE_RE.match(t.device) is not None, "train.device",
         f"{shown(t.device)} is not a device; allowed: auto, cpu, mps, cuda, cuda:N"),
    ]
    for ok, name, rule in checks:
        if not ok:
            raise ConfigError(f"{where}.{name}: {rule}")
