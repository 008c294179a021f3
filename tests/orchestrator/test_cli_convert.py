"""`reslab convert`: prenorm checkpoint -> gated Delta Block that computes the same logits, then trains."""

from __future__ import annotations

import json

import torch

from reslab.models.backbone import build_model
from reslab.models.config import RunConfig, load
from reslab.orchestrator.cli import main

TINY = ["--preset", "tiny", "--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.seq_len=32", "--set", "optim.batch_size=4", "--set", "train.eval_every=3",
        "--set", "train.eval_windows=4", "--set", "cost.measure=false"]


def test_convert_then_continue_training(tmp_path, capsys):
    assert main(["train", *TINY, "--steps", "3", "--out", str(tmp_path / "pre")]) == 0
    out = tmp_path / "delta"
    code = main(["convert", str(tmp_path / "pre" / "checkpoint.pt"), "--residual", "delta_block",
                 "--opt", "gate=learnable_alpha", "--opt", "num_blocks=2", "--out", str(out), "--steps", "3"])
    assert code == 0
    cfg = load(RunConfig, json.loads((out / "run_config.json").read_text()))
    assert cfg.residual.name == "delta_block" and cfg.train.init_from == str(out / "init_from.pt")
    # the converted weights compute the source's logits exactly (zero output gate)
    src = torch.load(tmp_path / "pre" / "checkpoint.pt", weights_only=True)
    src_cfg = load(RunConfig, json.loads(src["config"]))
    idx = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    before = build_model(src_cfg.model, src_cfg.residual, vocab_size=257)
    before.load_state_dict(src["model"])
    after = build_model(cfg.model, cfg.residual, vocab_size=257)
    after.load_state_dict(torch.load(out / "init_from.pt", weights_only=True))
    assert torch.equal(before(idx).logits, after(idx).logits)
    assert (out / "run" / "checkpoint.pt").exists()
    assert "initialised from" in capsys.readouterr().out


def test_convert_rejects_bad_input(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing.pt"), "--residual", "delta_block", "--out", str(tmp_path)]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["train", *TINY, "--residual", "attnres", "--steps", "1", "--out", str(tmp_path / "a")]) == 0
    assert main(["convert", str(tmp_path / "a" / "checkpoint.pt"), "--residual", "delta_block",
                 "--out", str(tmp_path / "b")]) == 2
    assert "conversion starts from 'prenorm'" in capsys.readouterr().err
