"""`reslab generate`: text from a finished run's checkpoint, found by its directory, STUDY/RUN_ID or run id."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from reslab.models.backbone import build_model
from reslab.models.checkpoint import CHECKPOINT_NAME
from reslab.models.config import RunConfig, load
from reslab.models.data.tokenizer import ByteTokenizer
from reslab.models.decoding import GenerateOptions
from reslab.orchestrator.cli import main

TINY = ["--preset", "tiny", "--set", "model.d_model=32", "--set", "model.n_layers=2", "--set", "model.n_heads=2",
        "--set", "model.seq_len=32", "--set", "optim.batch_size=4", "--set", "train.eval_every=3",
        "--set", "train.eval_windows=4", "--set", "cost.measure=false"]
RUN_ID = "block_attnres-0123456789ab"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A workspace holding one finished tiny Block AttnRes run, `study/RUN_ID`."""
    root = tmp_path_factory.mktemp("generate")
    run = root / "runs" / "study" / RUN_ID
    assert main(["train", *TINY, "--residual", "block_attnres", "--opt", "block_size=2", "--steps", "3",
                 "--out", str(run)]) == 0
    return root


def expected(workspace, prompts: list[str], new: int) -> list[str]:
    """The continuations `Decoder.generate` makes from the checkpoint, decoded by the byte tokenizer."""
    ckpt = torch.load(workspace / "runs" / "study" / RUN_ID / CHECKPOINT_NAME, weights_only=True)
    cfg = load(RunConfig, json.loads(ckpt["config"]))
    model = build_model(cfg.model, cfg.residual, vocab_size=257)
    model.load_state_dict(ckpt["model"])
    tok = ByteTokenizer()
    outs = model.eval().generate([tok.encode(p) for p in prompts], GenerateOptions(max_new_tokens=new,
                                                                                    stop_tokens=(256,), pad_id=256))
    return [tok.decode(ids[:ids.index(256)] if 256 in ids else ids) for ids in outs]  # cut at end-of-text


def test_generate_prints_each_continuation(workspace, capsys):
    run = workspace / "runs" / "study" / RUN_ID
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--prompt", "def f(x):", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    [want] = expected(workspace, ["def f(x):"], 12)
    assert out == want + "\n" and len(want) > 0
    assert "block_attnres at step 3" in err and "greedy" in err
    # two prompts decode as one left-padded batch: each continuation is the one it gets alone
    assert main(["generate", "--run", str(run), "--prompt", "import os", "--prompt", "x", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    a, b = expected(workspace, ["import os"], 6)[0], expected(workspace, ["x"], 6)[0]
    assert out == f"--- prompt 1: 'import os'\n{a}\n--- prompt 2: 'x'\n{b}\n"


def test_a_run_is_found_by_study_and_id_by_id_alone_or_by_its_checkpoint(workspace, capsys):
    outs = []
    for spec in (f"study/{RUN_ID}", RUN_ID, str(workspace / "runs" / "study" / RUN_ID / CHECKPOINT_NAME)):
        assert main(["generate", "--run", spec, "--workspace", str(workspace), "--prompt", "class",
                     "--max-new-tokens", "5"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] == expected(workspace, ["class"], 5)[0] + "\n"


def test_sampling_is_reproducible_by_seed(workspace, capsys):
    run = str(workspace / "runs" / "study" / RUN_ID)
    args = ["generate", "--run", run, "--prompt", "def", "--max-new-tokens", "20", "--temperature", "1.5",
            "--top-k", "20"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("reslab: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_one_line_and_exit_2(workspace, tmp_path, capsys):
    run = str(workspace / "runs" / "study" / RUN_ID)
    err = _one_line_error(capsys, ["generate", "--run", run, "--prompt", "x" * 40])
    assert "prompt 1 is 40 tokens; the model's context is seq_len=32" in err
    err = _one_line_error(capsys, ["generate", "--run", run, "--prompt", "x" * 20, "--max-new-tokens", "20"])
    assert "a prompt of 20 tokens plus max_new_tokens=20 is 40 tokens, over the model's context seq_len=32" in err
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, ["generate", "--run", str(tmp_path / "empty"), "--prompt", "x"])
    assert "has no checkpoint" in err
    err = _one_line_error(capsys, ["generate", "--run", "nope-000000000000", "--workspace", str(workspace),
                                   "--prompt", "x"])
    assert "no run 'nope-000000000000' in workspace" in err
    err = _one_line_error(capsys, ["generate", "--run", "study/nope", "--workspace", str(workspace), "--prompt", "x"])
    assert "no run study/nope in workspace" in err


def test_a_checkpoint_of_other_code_names_what_differs(workspace, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(workspace / "runs" / "study" / RUN_ID, other)
    ckpt = torch.load(other / CHECKPOINT_NAME, weights_only=True)
    del ckpt["model"]["final_norm.weight"]
    ckpt["model"]["pathway.renamed"] = torch.zeros(3)
    ckpt["model"]["embed.weight"] = ckpt["model"]["embed.weight"][:, :16]
    torch.save(ckpt, other / CHECKPOINT_NAME)
    err = _one_line_error(capsys, ["generate", "--run", str(other), "--prompt", "x"])
    assert ("does not match this code's block_attnres model (missing from the checkpoint: final_norm.weight; not in "
            "the model: pathway.renamed; shapes (checkpoint vs model): embed.weight [320, 16] vs [320, 32])") in err
    (other / CHECKPOINT_NAME).write_bytes(b"not a checkpoint")
    err = _one_line_error(capsys, ["generate", "--run", str(other), "--prompt", "x"])
    assert "cannot be read" in err
