"""`train.init_from: hf:<dir>`: a Llama / Qwen3 checkpoint saved by `transformers` maps onto the backbone.

The reference is `transformers` itself: a tiny randomly initialised LlamaForCausalLM (untied head)
and Qwen3ForCausalLM (tied, qk-norm, head_dim apart from d_model // n_heads) are saved and reloaded,
and every variant that declares it computes prenorm at init must give the HF model's logits to
1e-5 in float32.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reslab.models.backbone import build_model
from reslab.models.config import (
    ConfigError,
    CostConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.hf_import import load_hf_weights, write_tiny_checkpoint
from reslab.models.residual import variants
from reslab.models.resolve import validate_run_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ARCHS = {"llama-untied": ("LlamaForCausalLM", False), "qwen3-tied": ("Qwen3ForCausalLM", True)}
# every variant with its options that claims to compute prenorm at init (models/residual/*.py `identities`)
PRENORM_AT_INIT = [("prenorm", {})] + [
    (name, dict(identity.options)) for name, cls in sorted(variants().items())
    for identity in vars(cls).get("identities", ()) if identity.equals == "prenorm" and not identity.equals_options]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    arch, tied = ARCHS[request.param]
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch, tied=tied, seed=7)


def hf_logits(path, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def converted(path, name, options):
    cfg = RunConfig(model=ModelConfig(seq_len=32), residual=ResidualConfig(name=name, options=options),
                    train=TrainConfig(init_from=f"hf:{path}"))
    cfg = validate_run_config(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.residual, vocab_size=cfg.model.vocab_size, impl="reference").eval()
    load_hf_weights(model, path)
    return model


def test_every_prenorm_identity_gives_the_pretrained_logits(checkpoint):
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    want = hf_logits(checkpoint, ids)
    failures = []
    for name, options in PRENORM_AT_INIT:
        with torch.no_grad():
            got = converted(checkpoint, name, options)(ids).logits
        err = (got - want).abs().max().item()
        if not err <= 1e-5:
            failures.append(f"{name} {options}: max |diff| {err:.2e}")
    assert len(PRENORM_AT_INIT) > 5  # attnres, delta_attnres, delta_block, ... declare it
    assert not failures, failures


def test_the_shape_comes_from_config_json(checkpoint):
    cfg = validate_run_config(RunConfig(train=TrainConfig(init_from=f"hf:{checkpoint}")))
    hf = json.loads((checkpoint / "config.json").read_text())
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_hidden, m.vocab_size) == (
        hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"],
        hf["intermediate_size"], hf["vocab_size"])
    assert m.tie_embeddings == hf["tie_word_embeddings"]
    assert m.qk_norm == (hf["architectures"] == ["Qwen3ForCausalLM"])
    assert validate_run_config(cfg) == cfg  # idempotent: the run id does not move on a second validation


def test_a_study_shape_that_does_not_fit_is_one_line_naming_both(checkpoint):
    cfg = RunConfig(model=ModelConfig(d_model=128), train=TrainConfig(init_from=f"hf:{checkpoint}"))
    with pytest.raises(ConfigError, match=r"model\.d_model: 128 does not fit .* gives 64") as info:
        validate_run_config(cfg)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("edit, match", [
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_an_unsupported_checkpoint_config_is_refused(tmp_path, edit, match):
    path = write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    data = json.loads((path / "config.json").read_text())
    data.pop("rope_parameters", None) if "rope_scaling" in edit else None
    (path / "config.json").write_text(json.dumps({**data, **edit}))
    with pytest.raises(ConfigError, match=match):
        validate_run_config(RunConfig(train=TrainConfig(init_from=f"hf:{path}")))


def test_an_unmapped_or_missing_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", tied=False)
    file = path / "model.safetensors"
    state = load_file(str(file))
    model = converted(path, "prenorm", {})
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, str(file))
    with pytest.raises(ConfigError, match=r"q_proj\.bias of .* maps onto no backbone parameter"):
        load_hf_weights(model, path)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(file))
    with pytest.raises(ConfigError, match=r"missing \['lm_head.weight'\]"):
        load_hf_weights(model, path)


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _garble_header(file):
    data = bytearray(file.read_bytes())
    data[8:16] = b"not json"
    file.write_bytes(bytes(data))


def _resave(edit):
    def apply(file):
        from safetensors.torch import load_file, save_file

        save_file(edit(load_file(str(file))), str(file))

    return apply


# (damage to the Llama checkpoint's model.safetensors, the message validate_run_config gives): issue 52, item 5
DAMAGES = {
    "truncated": (_truncate, r"model.safetensors is damaged: its tensors take [\d,]+ bytes after the header, the "
                             r"file holds [\d,]+ \(truncated\)"),
    "header-not-json": (_garble_header, "model.safetensors is damaged: its header is not JSON"),
    "empty": (lambda f: f.write_bytes(b""), r"is damaged: its header length \(-1 bytes\)"),
    "a-bias": (_resave(lambda s: {**s, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
               r"tensor model.layers.0.self_attn.q_proj.bias of hf:.* maps onto no backbone parameter"),
    "wrong-shape": (_resave(lambda s: {**s, "model.layers.2.mlp.up_proj.weight": torch.zeros(160, 32)}),
                    r"tensor model.layers.2.mlp.up_proj.weight of hf:.* has shape \[160, 32\], its config.json gives "
                    r"\[160, 64\]"),
    "a-layer-missing": (_resave(lambda s: {k: v for k, v in s.items() if ".layers.2." not in k}),
                        r"lacks 9 tensor\(s\) its config.json needs: model.layers.2.self_attn.q_proj.weight, "),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_checkpoint_is_refused_from_its_header(tmp_path, damage):
    """Issue 52, item 5: what the worker's load would fail on, after the run was submitted, is refused by
    `validate_run_config` (validate, run) from the safetensors header alone, one line naming the file."""
    path = write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", tied=False)
    cfg = RunConfig(train=TrainConfig(init_from=f"hf:{path}"))
    validate_run_config(cfg)
    edit, match = DAMAGES[damage]
    edit(path / "model.safetensors")
    with pytest.raises(ConfigError, match=r"^config.train.init_from: .*" + match) as err:
        validate_run_config(cfg)
    assert "\n" not in str(err.value)


def test_a_damaged_tokenizer_is_one_line(tmp_path):
    """Issue 52, item 5: a tokenizer.json cut short raised the tokenizers library's bare Exception (a 76-line
    traceback in `reslab validate`)."""
    path = write_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM")
    tokenizer = path / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:3000])
    cfg = RunConfig(data=DataConfig(tokenizer="hf"), train=TrainConfig(init_from=f"hf:{path}"))
    with pytest.raises(ConfigError, match=r"^config.data.tokenizer: hf: .* holds no tokenizer transformers can load "
                                          r"\(Exception: EOF while parsing") as err:
        validate_run_config(cfg)
    assert "\n" not in str(err.value)


def hf_run(path, name="prenorm", options=None, **train_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(seq_len=32), residual=ResidualConfig(name=name, options=options or {}),
        data=DataConfig(corpus="stdlib"), optim=OptimConfig(batch_size=2, warmup_steps=1, lr=1e-3),
        train=TrainConfig(steps=3, eval_every=3, eval_windows=4, log_every=1, seed=3, init_from=f"hf:{path}",
                          diagnostics=False, magnitudes=False, **train_kw),
        cost=CostConfig(measure=False))


def test_a_converted_run_trains_from_the_pretrained_loss(tmp_path):
    """Continue training a few steps; the first step's loss, before any update, is the HF model's on that batch."""
    from reslab.models.training import Trainer

    path = write_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM")
    trainer = Trainer(hf_run(path, "delta_block", {"gate": "learnable_alpha", "gate_init": 0.0}, data_offset=6),
                      resume=False)
    x, y = trainer.dataset.train_samples(6, 2, 32, trainer.cfg.data_seed)  # data_offset: the stream starts at 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    result = trainer.fit()
    first = result.history["train"][0]["train_loss"]
    assert first == pytest.approx(want, abs=1e-4)
    assert all(torch.isfinite(torch.tensor(e["train_loss"])) for e in result.history["train"])
    assert result.history["train"][-1]["train_loss"] != first  # the weights moved


def test_data_offset_shifts_the_sample_stream(tmp_path):
    """Step s of a run with data_offset N trains samples N + s*B..: a continuation of an N/B-step run."""
    from reslab.models.training import Trainer

    path = write_tiny_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    seen: list[int] = []
    trainer = Trainer(hf_run(path, data_offset=4), resume=False)
    real = trainer.dataset.train_samples

    def recording(first, count, seq_len, data_seed):
        seen.append(first)
        return real(first, count, seq_len, data_seed)

    trainer.dataset.train_samples = recording  # type: ignore[method-assign]
    trainer.forward_backward(0)
    trainer.forward_backward(1)
    assert seen == [4, 6]
    with pytest.raises(ConfigError, match="train.data_offset"):
        validate_run_config(dataclasses.replace(trainer.cfg, train=dataclasses.replace(trainer.cfg.train,
                                                                                        data_offset=-1)))


def test_the_shipped_study_loads_with_the_checkpoint_it_names(tmp_path):
    """experiments/delta_from_pretrained.yaml with the tiny checkpoint its header writes (here under tmp_path)."""
    from pathlib import Path

    from reslab.experiments.expand import expand
    from reslab.experiments.spec import load_study

    path = write_tiny_checkpoint(tmp_path / "tiny-qwen3", "Qwen3ForCausalLM")
    spec = Path(__file__).parents[2] / "experiments" / "delta_from_pretrained.yaml"
    assert "python -m reslab.models.hf_import ~/.cache/reslab/hf/tiny-qwen3" in spec.read_text()
    study = load_study(spec, overrides=[("train.init_from", f"hf:{path}")])
    runs = expand(study)
    assert len(runs) == 3 * 3 and {r.config.model.d_model for r in runs} == {64}


def test_a_missing_checkpoint_is_said_once_with_the_command_that_makes_one(tmp_path, monkeypatch, capsys):
    """Issue 52, item 16: the shipped study before its checkpoint exists: one error naming every arm once and the
    offline command; that command (run here as `python -m` runs it) says what it wrote and how a study uses it."""
    import runpy
    import sys
    from pathlib import Path

    from reslab.experiments.spec import load_study

    spec = Path(__file__).parents[2] / "experiments" / "delta_from_pretrained.yaml"
    missing = tmp_path / "tiny-qwen3"
    with pytest.raises(ConfigError) as err:
        load_study(spec, overrides=[("train.init_from", f"hf:{missing}")])
    text = str(err.value)
    assert "arms.control, arms.delta_attnres and arms.delta_block: train.init_from: hf:" in text
    assert text.count("config.json") == 2 and text.count("no readable") == 1  # said once, not per arm
    assert text.endswith(f"write a tiny one offline: python -m reslab.models.hf_import {missing} Qwen3ForCausalLM")
    monkeypatch.setattr(sys, "argv", ["hf_import", str(missing), "Qwen3ForCausalLM"])
    runpy.run_module("reslab.models.hf_import", run_name="__main__")
    assert f"a study starts from it with train.init_from: hf:{missing}" in capsys.readouterr().out
    assert len(load_study(spec, overrides=[("train.init_from", f"hf:{missing}")]).arms) == 3
