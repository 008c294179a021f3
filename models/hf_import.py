"""Start a run from a local Hugging Face checkpoint: `train.init_from: hf:<directory>`.

The directory holds a Llama or Qwen3 causal LM as `transformers` saves it: `config.json` and
`*.safetensors`. Its config fixes the model's shape (`hf_model_config` fills it into the run's
`model` section, and refuses an explicit field of the study that differs, naming both); its
tensors map one to one onto the backbone (`hf_state_dict`):

    model.embed_tokens                      -> embed            (lm_head -> lm_head when untied)
    model.layers.i.self_attn.{q,k,v,o}_proj -> sublayers.2i.{q,k,v,o}_proj   (GQA: n_kv_heads)
    model.layers.i.self_attn.{q,k}_norm     -> sublayers.2i.{q,k}_norm       (Qwen3: model.qk_norm)
    model.layers.i.mlp.{gate,up,down}_proj  -> sublayers.2i+1.{gate,up,down}_proj
    model.layers.i.input_layernorm          -> norms.2i
    model.layers.i.post_attention_layernorm -> norms.2i+1
    model.norm                              -> final_norm

No permutation: HF's `rotate_half` RoPE is the half-split layout of `models.layers.Rotary`, and
both RMSNorms compute in float32 and scale by the weight. The residual pathway's own parameters
keep their init, so a variant that declares an `Identity` with prenorm (zero-query attnres,
delta_attnres, delta_block with gate="learnable_alpha", gate_init=0, ...) computes the pretrained
model's logits at step 0 (tests/models/test_hf_import.py holds them to 1e-5 in float32).

Refused, each as a one-line `ConfigError`: another architecture, attention or MLP biases, an
activation other than SiLU, a RoPE scaling (only the default rope_type is implemented), Qwen3's
sliding window, and any tensor left unmapped or missing.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

import torch

from reslab.models.config import ConfigError, ModelConfig
from reslab.models.presets import ModelShape

PREFIX = "hf:"
MAKE_COMMAND = "python -m reslab.models.hf_import"  # writes the tiny checkpoint of a CPU study (`__main__` below)
ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# ModelConfig fields a checkpoint's config.json fixes; the study's explicit value must agree
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "head_dim")
# fields with a non-null default: overwritten from the checkpoint unless the study changed them
VALUE_FIELDS = ("rope_theta", "norm_eps", "qk_norm", "tie_embeddings")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ATTN = {f"self_attn.{n}.weight": f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
_MLP = {f"mlp.{n}.weight": f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}


def hf_path(init_from: str | None) -> Path | None:
    """The checkpoint directory of an `hf:` init_from, else None."""
    if init_from is None or not init_from.startswith(PREFIX):
        return None
    return Path(init_from[len(PREFIX):]).expanduser()


def _read_config(path: Path, where: str) -> dict[str, Any]:
    file = path / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        make = f"; for a CPU study, write a tiny one offline: {MAKE_COMMAND} {path} Qwen3ForCausalLM" \
            if isinstance(exc, FileNotFoundError) else ""
        raise ConfigError(f"{where}: {PREFIX}{path} has no readable config.json ({type(exc).__name__}); "
                          f"expected a Hugging Face checkpoint directory (config.json + *.safetensors){make}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: {file} is not a JSON object")
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{where}: {PREFIX}{path} has no *.safetensors file; save the model with safetensors")
    return data


def _rope_theta(cfg: dict[str, Any], where: str) -> float:
    """rope_theta of the default RoPE; a RoPE scaling is refused (not implemented)."""
    params = cfg.get("rope_parameters") or {}   # newer transformers nest rope_theta here
    scaling = cfg.get("rope_scaling") or {}
    for spec in (params, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"{where}: the checkpoint's RoPE scaling rope_type={kind!r} is not implemented; "
                              "allowed: the default RoPE (no rope_scaling)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


@functools.lru_cache(maxsize=8)
def _checkpoint_fields(path: Path, mtime_ns: int, where: str) -> tuple[tuple[str, Any], ...]:
    cfg = _read_config(path, where)
    arch = cfg.get("architectures") or []
    if len(arch) != 1 or arch[0] not in ARCHITECTURES:
        raise ConfigError(f"{where}: architectures={arch} is not supported; allowed: {', '.join(ARCHITECTURES)}")
    refused = [(k, v) for k, v in (("attention_bias", cfg.get("attention_bias", False)),
                                   ("mlp_bias", cfg.get("mlp_bias", False)),
                                   ("use_sliding_window", cfg.get("use_sliding_window", False))) if v]
    if refused or cfg.get("hidden_act", "silu") != "silu":
        what = f"{refused[0][0]}={refused[0][1]}" if refused else f"hidden_act={cfg.get('hidden_act')!r}"
        raise ConfigError(f"{where}: the checkpoint's {what} is not supported; allowed: no attention/MLP bias, "
                          "no sliding window, hidden_act 'silu'")
    heads = int(cfg["num_attention_heads"])
    fields = {
        "d_model": int(cfg["hidden_size"]), "n_layers": int(cfg["num_hidden_layers"]), "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads), "ffn_hidden": int(cfg["intermediate_size"]),
        "vocab_size": int(cfg["vocab_size"]), "head_dim": int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        "rope_theta": _rope_theta(cfg, where), "norm_eps": float(cfg["rms_norm_eps"]),
        "qk_norm": arch[0] == "Qwen3ForCausalLM", "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }
    return tuple(fields.items())


def checkpoint_fields(path: Path, where: str) -> dict[str, Any]:
    """The ModelConfig fields the checkpoint's config.json fixes (ConfigError for what is not supported)."""
    try:
        mtime = (path / "config.json").stat().st_mtime_ns
    except OSError:
        mtime = 0
    try:
        return dict(_checkpoint_fields(path, mtime, where))
    except KeyError as exc:
        raise ConfigError(f"{where}: {path / 'config.json'} lacks {exc.args[0]!r}; "
                          "expected a Llama/Qwen3 config.json") from None


def check_context(path: Path, seq_len: int, where: str) -> None:
    """ConfigError when the run's context is longer than the checkpoint was trained for
    (`max_position_embeddings`): RoPE past it is extrapolation the model never saw."""
    limit = _read_config(path, where).get("max_position_embeddings")
    if limit is not None and seq_len > int(limit):
        raise ConfigError(f"{where}.model.seq_len: {seq_len} is over the checkpoint's max_position_embeddings "
                          f"{limit} ({path / 'config.json'}); allowed: seq_len <= {limit}")


@functools.lru_cache(maxsize=8)
def _hf_tokenizer_size(path: Path, mtime_ns: int) -> int:
    """The tokenizer's size, loaded once per directory and version whatever run asks (a study validates
    every run; a failure is not cached and is raised again with the asking run's field)."""
    from reslab.models.data.tokenizer import HFTokenizer

    return HFTokenizer(path).vocab_size


def check_hf_tokenizer(tokenizer_path: str, vocab_size: int | None, where: str) -> None:
    """ConfigError unless the `hf` tokenizer in `tokenizer_path` loads (transformers installed, tokenizer
    files present) and each of its ids has a row in the checkpoint's embedding (`vocab_size` rows; a
    checkpoint may pad its embedding past the tokenizer, as Qwen3 does, never the other way)."""
    path = Path(tokenizer_path).expanduser()
    try:
        mtime = max((p.stat().st_mtime_ns for p in path.iterdir()), default=0)
    except OSError:
        raise ConfigError(f"{where}: hf: {path} is not a directory holding a tokenizer") from None
    try:
        size = _hf_tokenizer_size(path, mtime)
    except ConfigError as exc:
        raise ConfigError(f"{where}{str(exc).removeprefix('data.tokenizer')}") from None
    if vocab_size is not None and size > vocab_size:
        raise ConfigError(f"{where}: the hf tokenizer in {path} has {size} ids but the model's embedding has "
                          f"{vocab_size} rows (model.vocab_size); allowed: a tokenizer whose ids fit the checkpoint's")


def hf_model_config(model: ModelConfig, init_from: str, where: str) -> ModelConfig:
    """`model` with the checkpoint's shape filled in; ConfigError naming both values where the
    study's explicit field does not fit the checkpoint."""
    path = hf_path(init_from)
    assert path is not None
    fields = checkpoint_fields(path, f"{where}.train.init_from")
    defaults = ModelConfig()
    for name, value in fields.items():
        mine = getattr(model, name)
        set_by_study = mine is not None if name in SHAPE_FIELDS else mine != getattr(defaults, name)
        if set_by_study and mine != value:
            raise ConfigError(f"{where}.model.{name}: {mine!r} does not fit train.init_from {init_from}, whose "
                              f"config.json gives {value!r}; leave model.{name} unset or set it to {value!r}")
    return dataclasses.replace(model, **fields)


# bytes per element of the dtypes a safetensors header names (the format's own list)
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def _damaged(file: Path, what: str) -> ConfigError:
    return ConfigError(f"{file} is damaged: {what}; save or download the checkpoint again")


@functools.lru_cache(maxsize=16)
def _safetensors_header(file: Path, size: int, mtime_ns: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(tensor name, shape) of every tensor `file` declares, read from its header (8 bytes of length, then JSON)
    without loading a tensor; ConfigError when the header, a tensor's byte range or the file's length do not
    agree, as in a truncated file."""
    try:
        with file.open("rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            text = f.read(n) if 0 < n <= min(MAX_HEADER_BYTES, size - 8) else None
    except OSError as exc:
        raise ConfigError(f"{file} cannot be read ({type(exc).__name__})") from None
    if text is None:
        raise _damaged(file, f"its header length ({n} bytes) does not fit the file's {size} bytes")
    try:
        header = json.loads(text)
    except ValueError:
        raise _damaged(file, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _damaged(file, "its header is not a JSON object")
    tensors, data_bytes, end = [], size - 8 - n, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (begin, stop) = tuple(int(d) for d in info["shape"]), info["data_offsets"]
            numel = functools.reduce(lambda a, b: a * b, shape, 1)
            ok = stop - begin == numel * _DTYPE_BYTES[info["dtype"]] and 0 <= begin <= stop
        except (KeyError, TypeError, ValueError):
            raise _damaged(file, f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if not ok:
            raise _damaged(file, f"tensor {name!r}'s bytes {begin}-{stop} do not hold its shape {list(shape)}")
        tensors.append((name, shape))
        end = max(end, stop)
    if end != data_bytes:
        raise _damaged(file, f"its tensors take {end:,} bytes after the header, the file holds {data_bytes:,} "
                             f"({'truncated' if end > data_bytes else 'trailing bytes'})")
    return tuple(tensors)


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors a backbone of `shape` loads (`_target`'s names), each with its shape: nn.Linear
    weights are [out, in]; lm_head only when the embeddings are untied."""
    d, v, hd, ffn = shape.d_model, shape.vocab_size, shape.head_dim, shape.ffn_hidden
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not shape.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    layer = {"self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
             "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q), "mlp.gate_proj.weight": (ffn, d),
             "mlp.up_proj.weight": (ffn, d), "mlp.down_proj.weight": (d, ffn), "input_layernorm.weight": (d,),
             "post_attention_layernorm.weight": (d,)}
    if shape.qk_norm:
        layer.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    for i in range(shape.n_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in layer.items()})
    return out


def check_hf_weights(path: Path, shape: ModelShape, where: str) -> None:
    """ConfigError, before anything is submitted, unless the checkpoint's *.safetensors headers are whole
    (`_safetensors_header`) and declare every tensor a backbone of `shape` loads, in its shape, and no tensor
    `_target` maps nowhere: what `load_hf_weights` would find in the worker, after the run started."""
    wanted, found = hf_tensor_shapes(shape), dict[str, tuple[int, ...]]()
    for file in sorted(path.glob("*.safetensors")):
        try:
            stat = file.stat()
        except OSError:
            raise ConfigError(f"{where}: {file} cannot be read") from None
        try:
            found.update(_safetensors_header(file, stat.st_size, stat.st_mtime_ns))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    for name, dims in found.items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and shape.tie_embeddings):
            continue
        if name not in wanted:
            raise ConfigError(f"{where}: tensor {name} of {PREFIX}{path} maps onto no backbone parameter (a bias, "
                              "or a layout other than Llama/Qwen3's)")
        if dims != wanted[name]:
            raise ConfigError(f"{where}: tensor {name} of {PREFIX}{path} has shape {list(dims)}, its config.json "
                              f"gives {list(wanted[name])}")
    missing = [name for name in wanted if name not in found]
    if missing:
        raise ConfigError(f"{where}: {PREFIX}{path} lacks {len(missing)} tensor(s) its config.json needs: "
                          f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")


def _target(name: str) -> str | None:
    """The backbone's key for an HF tensor name; None for one this mapping does not know."""
    fixed = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "final_norm.weight",
             "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    match = _LAYER.match(name)
    if match is None:
        return None
    layer, rest = int(match.group(1)), match.group(2)
    if rest in _ATTN:
        return f"sublayers.{2 * layer}.{_ATTN[rest]}"
    if rest in _MLP:
        return f"sublayers.{2 * layer + 1}.{_MLP[rest]}"
    norms = {"input_layernorm.weight": 2 * layer, "post_attention_layernorm.weight": 2 * layer + 1}
    return f"norms.{norms[rest]}.weight" if rest in norms else None


def hf_state_dict(path: Path, where: str = "train.init_from") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the backbone's names; ConfigError for a tensor left unmapped."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from rope_theta (models.layers.Rotary)
            key = _target(name)
            if key is None:
                raise ConfigError(f"{where}: tensor {name} of {PREFIX}{path} maps onto no backbone parameter "
                                  "(a bias, or a layout other than Llama/Qwen3's); nothing is loaded")
            state[key] = tensor
    return state


def load_hf_weights(model: torch.nn.Module, path: Path, where: str = "train.init_from") -> None:
    """Load the checkpoint into `model` (built from `hf_model_config`'s shape); only the residual
    pathway's own parameters may stay at their init. ConfigError for a missing or unmapped tensor."""
    state = hf_state_dict(path, where)
    if getattr(model, "lm_head", None) is None:
        state.pop("lm_head.weight", None)  # a tied checkpoint may store the head; it is the embedding
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and not k.startswith("pathway.")]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ConfigError(f"{where}: {PREFIX}{path} does not fit the model: missing {missing[:4] or 'nothing'}, "
                          f"unexpected {unexpected[:4] or 'nothing'}")
    wrong = [k for k, v in state.items() if v.shape != expected[k].shape]
    if wrong:
        k = wrong[0]
        raise ConfigError(f"{where}: tensor {k} of {PREFIX}{path} has shape {tuple(state[k].shape)}, the model "
                          f"expects {tuple(expected[k].shape)}")
    model.load_state_dict(state, strict=False)


def write_tiny_checkpoint(out: str | Path, arch: str = "Qwen3ForCausalLM", *, tied: bool = True,
                          vocab_size: int = 320, seed: int = 0) -> Path:
    """Write a tiny randomly initialised Llama or Qwen3 causal LM (`transformers`, the eval extra)
    to `out` as config.json + model.safetensors, with its tokenizer (`write_tiny_tokenizer`): the
    stand-in for a real checkpoint in a CPU study and in the tests. Qwen3's head_dim (32) is set apart
    from d_model // n_heads (16), as in Qwen3; rope_theta and rms_norm_eps differ from reslab's defaults, so a
    mapping that dropped them would show."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                  rope_theta=500.0, tie_word_embeddings=tied, attention_bias=False)
    if arch == "Qwen3ForCausalLM":
        config: Any = transformers.Qwen3Config(head_dim=32, **common)
    elif arch == "LlamaForCausalLM":
        config = transformers.LlamaConfig(mlp_bias=False, **common)
    else:
        raise ConfigError(f"arch: {arch!r} is not supported; allowed: {', '.join(ARCHITECTURES)}")
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).float().eval()
    with torch.no_grad():  # HF inits norms at 1: randomise them, so a mapping that swaps two is caught
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(out), safe_serialization=True)
    write_tiny_tokenizer(out, vocab_size)
    return Path(out)


def write_tiny_tokenizer(out: str | Path, vocab_size: int, documents: int = 64) -> None:
    """Save beside a tiny checkpoint the tokenizer it stands in for: a byte-level BPE of `vocab_size` ids
    (EOT `<|endoftext|>` its eos_token), trained locally with the `tokenizers` library on the first
    `documents` modules of this interpreter's standard library (no download), in the files
    `transformers.AutoTokenizer` reads (tokenizer.json + tokenizer_config.json)."""
    import itertools

    import transformers
    from tokenizers import Tokenizer as RustTokenizer

    from reslab.models.data.corpus import stdlib_documents
    from reslab.models.data.tokenizer import EOT_TEXT, train_bpe

    bpe = train_bpe(itertools.islice(stdlib_documents(False), documents), vocab_size)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(bpe.to_json()),
                                                eos_token=EOT_TEXT, pad_token=EOT_TEXT)
    fast.save_pretrained(str(out))


if __name__ == "__main__":  # python -m reslab.models.hf_import OUT [ARCH]: the tiny checkpoint of a CPU study
    import sys

    args = sys.argv[1:]
    if not 1 <= len(args) <= 2:
        sys.exit(f"usage: {MAKE_COMMAND} OUT_DIR [{'|'.join(ARCHITECTURES)}]")
    out = write_tiny_checkpoint(args[0], *args[1:])
    print(f"wrote a tiny randomly initialised {(args[1:] or ['Qwen3ForCausalLM'])[0]} (config.json, model.safetensors) "
          f"and its tokenizer to {out}; a study starts from it with train.init_from: hf:{out}")
