"""`reslab validate/plan/run` and the token budget: plan prints tokens per run, passes over the
corpus and GPU-hours and never fails on them; validate and run refuse a run above
`data.max_epochs` (exit 2, nothing created), and run refuses a corpus that is not prepared."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reslab.models.data.corpus import Document
from reslab.models.data.prepare import PrepareOptions, cache_root, prepare
from reslab.models.data.tokenizer import ByteTokenizer
from reslab.orchestrator.cli import main

STUDY = """
study: budget
base:
  model: {{preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}}
  data: {{corpus: {corpus}}}
  optim: {{batch_size: 4}}
  train: {{steps: 100}}
arms:
  control: prenorm
  attnres: {{residual: attnres}}
seeds: 2
comparisons:
  - {{name: main, control: control, treatments: [attnres], exploratory: true}}
"""


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> int:
    """A byte-level corpus named `local` in the cache; returns its train tokens."""
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "cache"))
    docs = [Document(f"d{i}", f"document {i} " * 20) for i in range(40)]
    meta = prepare(docs, cache_root() / "corpora" / "local",
                   PrepareOptions(tokenizer=ByteTokenizer(), val_fraction=0.2, source_description="test"))
    return meta.n_train_tokens


def write(tmp_path, corpus_name: str):
    path = tmp_path / "budget.yaml"
    path.write_text(textwrap.dedent(STUDY.format(corpus=corpus_name)))
    return str(path)


def test_over_max_epochs(tmp_path, corpus, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # `auto` runs train on CPUs here
    spec = write(tmp_path, "local")
    ws = tmp_path / "ws"
    # an existing, empty workspace: `run` prestarts a local Ray only for a new one, which a refusal then waits
    # to stop (3-4 s; bench/RESULTS.md, issue 19); refused, it must stay empty
    ws.mkdir()
    passes = 100 * 4 / ((corpus - 1) // 32)  # samples over the split's windows of seq_len 32
    assert passes > 1

    assert main(["plan", spec, "--workspace", str(ws)]) == 0
    out = capsys.readouterr().out
    assert "12.80K" in out and f"{passes:.3g} > max" in out
    assert f"over budget: control makes {passes:.3g} passes over corpus 'local'" in out
    # a study that trains on CPUs is costed in FLOPs (issue 35, item 14); given GPUs, in GPU-hours
    assert "GPU-hours on one H100/H200" not in out and "GPU-h/run" not in out
    assert "total: 4 runs, " in out and "training FLOPs" in out and "trains on CPUs" in out
    assert main(["plan", spec, "--workspace", str(ws), "--gpus-per-run", "1"]) == 0
    assert "GPU-hours on one H100/H200" in capsys.readouterr().out

    for command in (["validate", spec], ["run", spec, "--workspace", str(ws)]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "data.max_epochs" in err and "corpus 'local'" in err, err
    assert not any(ws.iterdir())  # run refused before writing anything

    assert main(["validate", spec, "--set", f"data.max_epochs={passes * 1.01:.4f}"]) == 0
    assert f"corpus 'local': {corpus / 1e3:.2f}K train tokens; the longest run (control) makes {passes:.3g} passes" \
        in capsys.readouterr().out


def test_corpus_not_prepared(tmp_path, corpus, capsys):
    spec = write(tmp_path, "absent")
    # an existing, empty workspace: `run` prestarts a local Ray only for a new one, which a refusal then waits
    # to stop (3-4 s; bench/RESULTS.md, issue 19); refused, it must stay empty
    (tmp_path / "ws").mkdir()
    assert main(["plan", spec, "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    assert "unknown" in out and "corpus 'absent': not prepared (passes unknown); prepare it with: reslab data prepare" \
        in out
    assert main(["validate", spec]) == 0
    assert "corpus 'absent': not prepared; prepare it with: reslab data prepare" in capsys.readouterr().out
    assert main(["run", spec, "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert "data.corpus: 'absent' is not prepared" in err and "--corpus absent" in err
    assert not any((tmp_path / "ws").iterdir())


def test_shipped_gpu_study_plan_names_the_fineweb_command(tmp_path, corpus, capsys):
    spec = Path(__file__).resolve().parents[2] / "experiments" / "head_sweep.yaml"
    assert main(["plan", str(spec), "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    assert "8.22B" in out and "20.0" in out
    assert "reslab data prepare --hub HuggingFaceFW/fineweb-edu --name sample-10BT" in out


@pytest.mark.slow  # starts (and stops) a local Ray: 3-4 s, and imports reslab in a fresh process: ~3 s
def test_a_refusal_in_a_new_workspace_stops_the_ray_it_prestarted(tmp_path, corpus):
    """`run` in a workspace that does not exist yet starts a local Ray beside the study's load; a study
    that then fails its checks stops it and leaves nothing behind. In a process of its own: `run` prestarts no
    Ray in a process that already holds a session, as this one may (another file's, under `pytest -n`)."""
    spec = write(tmp_path, "absent")
    code = ("import sys, ray; from reslab.orchestrator.cli import main; "
            f"rc = main(['run', {spec!r}, '--workspace', {str(tmp_path / 'new')!r}]); "
            "print('ray initialized:', ray.is_initialized()); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2 and "data.corpus: 'absent' is not prepared" in proc.stderr, proc.stderr
    assert "ray initialized: False" in proc.stdout and not (tmp_path / "new").exists()


def test_grid_points_of_equal_budgets_are_one_row(tmp_path, corpus, capsys, monkeypatch):
    """Issue 52, item 9: a grid over settings that change no budget (the learning rate) printed one budget row per
    grid point, 1,000 identical rows for a 10^5-run grid; each arm's equal rows are one, the runs summed. A grid
    over the steps changes the budget: its rows stay."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    spec = write(tmp_path, "local")
    lrs = ", ".join(f"{i + 1}.0e-4" for i in range(50))
    Path(spec).write_text(Path(spec).read_text() + f"grid:\n  optim.lr: [{lrs}]\n  train.steps: [10, 20]\n")
    assert main(["plan", spec, "--workspace", str(tmp_path / "ws")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("budget "):out.index("total: ")].splitlines()[1:]
    assert len(table) == 4 and sum(line.startswith("control @ 50 grid points") for line in table) == 2, table
    assert " 100 " in table[0] and "total: 400 runs" in out  # 50 grid points x 2 seeds a row
