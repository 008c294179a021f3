"""Hostile and broken input: a corpus of malformed study files and bad command lines.

Every study file goes through `reslab validate` (its time and its Python memory peak measured
by tracemalloc), `reslab plan` and the library (`load_study` + `expand`); every command line
through `reslab.orchestrator.cli.main` in-process. Each must end in a one-line error that names
the field or flag (the substring each case asserts), exit code 2, no traceback, within
`CASE_CPU_SECONDS` and `CASE_MEMORY_MB`, and a read command creates no workspace. A few cases run as
subprocesses under an address-space limit (`resource.setrlimit`), as a user would run them.

Work is bounded by what load does not change: the CPU time a case takes (this process's, or the child's from
`getrusage(RUSAGE_CHILDREN)`), its memory, never wall time, which a busy machine stretches tenfold (issue 52,
item 22). A child process has a wall-clock deadline only as a safety net, and is killed and reaped when it
passes it, so nothing it started outlives the test.

The corpus is generated here rather than checked in: most cases are one-line changes of a valid
study, which reads better as the change than as 100 files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import resource
import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reslab.common.errors import ReslabError
from reslab.experiments import expand, load_study
from reslab.orchestrator.cli import main

ROOT = Path(__file__).resolve().parents[1]
CASE_CPU_SECONDS = 10.0  # CPU seconds of one case (about 0.1 s): a bound that load does not stretch
CHILD_CPU_SECONDS = 30.0  # CPU seconds of a fresh interpreter refusing a bad input (imports torch, ray: ~5-10 s)
CHILD_WALL_DEADLINE_S = 600  # a hung child's safety net, not a budget
CASE_MEMORY_MB = 64

GOOD = """\
study: fuzz
base:
  model: {preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}
  optim: {batch_size: 4, lr: 3.0e-3}
  train: {steps: 6}
arms:
  control: prenorm
  attnres: {residual: attnres}
seeds: 2
comparisons:
  - {name: main, control: control, treatments: [attnres], exploratory: true}
"""


def changed(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


def nested_block(depth: int) -> str:
    keys = "".join("  " * (i + 1) + f"k{i}:\n" for i in range(depth))
    return "study: deep\nbase:\n" + keys + "  " * (depth + 1) + "x: 1\n"


def alias_bomb(width: int, levels: int) -> str:
    items = ", ".join(['"lol"'] * width)
    lines = [f"a0: &a0 [{items}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


LONG = "x" * 5000

SEED_LIST = "seeds: a list of seeds is not allowed: seeds come from the design"  # issue 55 item 4

# (case id, file content (str or bytes; a Path-valued callable for special files), expected substring)
STUDIES: list[tuple[str, str | bytes, str]] = [
    # bytes and YAML syntax
    ("binary", bytes(range(256)) * 64, "not UTF-8 text"),
    ("latin1", "study: caf\xe9\n".encode("latin-1"), "not UTF-8 text"),
    ("nul-byte", "study: a\x00b\n", "invalid YAML"),
    ("empty", "", "top level: expected a mapping"),
    ("scalar", "42\n", "top level: expected a mapping"),
    ("list-top", "- a\n- b\n", "top level: expected a mapping"),
    ("unclosed", "arms: [unclosed\n", "invalid YAML at line"),
    ("tab-indent", "base:\n\tmodel: 1\n", "invalid YAML at line"),
    ("bad-indent", "study: a\n  base: 1\n b: 2\n", "invalid YAML at line"),
    ("duplicate-key", GOOD + "seeds: 3\n", "duplicate key 'seeds'"),
    ("alias-bomb", alias_bomb(9, 9), "through its aliases"),
    ("alias-bomb-wide", alias_bomb(30, 4), "through its aliases"),
    ("many-aliases", "a: &a 1\nb: [" + ", ".join(["*a"] * 150) + "]\n", "more than 100 aliases"),
    ("recursive-alias", "study: r\nbase: &b {x: *b}\n", "refers to the node that contains it"),
    ("brackets-100k", "study: b\nbase: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested deeper than 50"),
    ("braces-deep", "base: " + "{a: " * 200 + "1" + "}" * 200 + "\n", "nested deeper than 50"),
    ("block-deep", nested_block(80), "nested deeper than 50"),
    ("huge-file", GOOD + "# " + "x" * 300_000 + "\n", "larger than 256 KiB"),
    ("python-tag", "study: !!python/object/apply:os.system [echo hi]\n", "invalid YAML"),
    ("unhashable-key", "? [a, b]\n: 1\n", "invalid YAML"),
    ("binary-tag-name", changed("study: fuzz", "study: !!binary aGVsbG8="), "study: a bytes (b'hello') is not allowed"),
    ("set-seeds", changed("seeds: 2", "seeds: !!set {1, 2}"), "seeds: a set ({1, 2}) is not allowed"),
    ("date-in-grid", GOOD + "grid:\n  optim.lr: [2001-01-01]\n", "grid.optim.lr[0]: a date"),
    ("int-key", changed("optim: {batch_size: 4", "optim: {1: 2, batch_size: 4"), "base.optim: key 1 is not a string"),
    ("null-key", changed("optim: {batch_size: 4", "optim: {~: 2, batch_size: 4"), "base.optim: key None"),
    # top level and names
    ("unknown-top-key", GOOD + "seed: 3\n", "unknown key(s) 'seed'"),
    ("many-unknown-keys", GOOD + "".join(f"junk{i}: 1\n" for i in range(500)), "and 495 more"),
    ("name-5000", changed("study: fuzz", f"study: {LONG}"), "at most 100"),
    ("name-slash", changed("study: fuzz", "study: ../../etc"), "study: study name '../../etc'"),
    ("name-newline", changed("study: fuzz", 'study: "a\\nb"'), "study: study name"),
    ("name-number", changed("study: fuzz", "study: 12.5"), "study: study name 12.5"),
    ("description-huge", changed("study: fuzz", f"study: fuzz\ndescription: {'d' * 20_000}"), "description:"),
    ("description-list", changed("study: fuzz", "study: fuzz\ndescription: [a]"), "description:"),
    ("base-list", "study: b\nbase: [1]\narms: {control: prenorm}\nseeds: 1\n", "base: expected a run config mapping"),
    ("base-seed", changed("train: {steps: 6}", "train: {steps: 6, seed: 3}"), "base.train.seed"),
    # arms
    ("arms-missing", changed("arms:\n  control: prenorm\n  attnres: {residual: attnres}\n", ""), "arms:"),
    ("arms-empty", changed("arms:\n  control: prenorm\n  attnres: {residual: attnres}\n", "arms: {}\n"), "arms:"),
    ("arms-list", changed("arms:\n  control: prenorm\n  attnres: {residual: attnres}\n", "arms: [a]\n"), "arms:"),
    ("arm-name-space", changed("  control: prenorm", "  bad name: prenorm"), "arms: arm name 'bad name'"),
    ("arm-name-long", changed("  control: prenorm", f"  {'a' * 200}: prenorm"), "at most 100"),
    ("arm-int", changed("  control: prenorm", "  control: 5"), "arms.control"),
    ("arm-unknown-key", changed("attnres: {residual: attnres}", "attnres: {residual: attnres, lr: 1}"),
     "arms.attnres: unknown key(s) 'lr'"),
    ("arm-seed", changed("attnres: {residual: attnres}", "attnres: {residual: attnres, train: {seed: 1}}"),
     "arms.attnres.train.seed"),
    ("arm-unknown-variant", changed("attnres: {residual: attnres}", "attnres: {residual: nosuchvariant}"),
     "arms.attnres.residual.name"),
    ("arm-knob-inf", changed("attnres: {residual: attnres}",
                             "attnres: {residual: {name: block_attnres, options: {block_size: .inf}}}"),
     "arms.attnres.residual.options.block_size: inf is not allowed"),
    ("same-config", changed("attnres: {residual: attnres}", "attnres: {residual: prenorm}"),
     "resolves to the same config"),
    # seeds and limits
    ("seeds-missing", changed("seeds: 2\n", ""), "seeds: missing"),
    ("seeds-zero", changed("seeds: 2", "seeds: 0"), "seeds: a count must be >= 1"),
    ("seeds-negative", changed("seeds: 2", "seeds: -3"), "seeds: a count must be >= 1"),
    ("seeds-1e8", changed("seeds: 2", "seeds: 100000000"), "seeds: 100000000 seeds, over the limit of 5000 runs"),
    ("seeds-2**63-1", changed("seeds: 2", "seeds: 9223372036854775807"), "over the limit of 5000 runs"),
    ("seeds-2**70", changed("seeds: 2", f"seeds: {2**70}"), f"seeds: {2**70} is out of range"),
    ("seeds-expression", changed("seeds: 2", "seeds: 2**63-1"), "seeds: expected a count"),
    ("seeds-float", changed("seeds: 2", "seeds: 2.5"), "seeds: expected a count"),
    ("seeds-bool", changed("seeds: 2", "seeds: true"), "seeds: expected a count"),
    ("seeds-list-negative", changed("seeds: 2", "seeds: [0, -1]"), SEED_LIST),
    ("seeds-list-huge-value", changed("seeds: 2", f"seeds: [0, {2**64}]"), f"seeds[1]: {2**64} is out of range"),
    ("seeds-list-dup", changed("seeds: 2", "seeds: [1, 1]"), SEED_LIST),
    ("seeds-replicate-negative", changed("seeds: 2", "seeds: {count: 2, replicate: -1}"),
     "seeds.replicate: expected a replicate number from 0"),
    ("seeds-replicate-long", changed("seeds: 2", "seeds: {count: 11, replicate: 3}\nlimits: {max_runs: 10}"),
     "seeds: 11 seeds, over the limit of 10 runs"),
    ("grid-1000x1000", GOOD + "grid:\n  optim.lr: [" + ", ".join(f"{i + 1}.0e-5" for i in range(1000))
     + "]\n  optim.warmup_steps: [" + ", ".join(map(str, range(1000))) + "]\n",
     "grid: 2 arms x 1000000 grid points x 2 seeds = 4000000 runs, over the limit of 5000 runs"),
    ("grid-axis-long", GOOD + "grid:\n  optim.warmup_steps: [" + ", ".join(map(str, range(11))) + "]\n"
     "limits: {max_runs: 10}\n", "grid.optim.warmup_steps: 11 values, over the limit of 10 runs"),
    ("grid-unknown-field", GOOD + "grid:\n  optim.lrr: [1.0e-3]\n", "grid: 'optim.lrr': unknown field optim.lrr"),
    ("grid-residual-name", GOOD + "grid:\n  residual.name: [attnres]\n", "grid.residual.name"),
    ("grid-not-list", GOOD + "grid:\n  optim.lr: 1.0e-3\n", "grid.optim.lr: expected a non-empty list"),
    ("grid-dup", GOOD + "grid:\n  optim.warmup_steps: [1, 2, 1]\n", "grid.optim.warmup_steps: value(s) [1] repeat"),
    ("grid-nan", GOOD + "grid:\n  optim.lr: [.nan]\n", "grid.optim.lr[0]: nan is not allowed"),
    ("limits-string", GOOD + "limits: lots\n", "limits: expected a mapping"),
    ("limits-zero", GOOD + "limits: {max_runs: 0}\n", "limits.max_runs: expected an integer from 1 to 1000000"),
    ("limits-huge", GOOD + "limits: {max_runs: 1000000000000}\n", "limits.max_runs: expected an integer from 1"),
    ("limits-unknown", GOOD + "limits: {max_seeds: 3}\n", "limits: unknown key(s) 'max_seeds'"),
    ("limits-too-low", GOOD + "limits: {max_runs: 3}\n", "2 arms x 1 grid points x 2 seeds = 4 runs, over the limit"),
    # values
    ("lr-inf", changed("lr: 3.0e-3", "lr: .inf"), "base.optim.lr: inf is not allowed"),
    ("lr-minus-inf", changed("lr: 3.0e-3", "lr: -.inf"), "base.optim.lr: -inf is not allowed"),
    ("lr-nan", changed("lr: 3.0e-3", "lr: .nan"), "base.optim.lr: nan is not allowed"),
    ("lr-nan-text", changed("lr: 3.0e-3", "lr: nan"), "base.optim.lr: 'nan' is not allowed"),
    ("lr-1e400-text", changed("lr: 3.0e-3", "lr: 1e400"), "base.optim.lr: '1e400' is not allowed"),
    ("lr-huge-int", changed("lr: 3.0e-3", f"lr: {10**400}"), "base.optim.lr: 1000000"),
    ("lr-string", changed("lr: 3.0e-3", "lr: fast"), "base.optim.lr: expected a number, got 'fast'"),
    ("steps-1e30", changed("steps: 6", "steps: 1.0e+30"), "base.train.steps: expected an integer, got 1e+30"),
    ("steps-10**30", changed("steps: 6", f"steps: {10**30}"), f"base.train.steps: {10**30} is out of range"),
    ("steps-zero", changed("steps: 6", "steps: 0"), "train.steps: must be >= 1"),
    ("batch-negative", changed("batch_size: 4", "batch_size: -1"), "optim.batch_size: must be >= 1"),
    ("device-banana", changed("steps: 6", "steps: 6, device: banana"), "train.device: 'banana' is not a device"),
    ("device-cuda-99999", changed("steps: 6", "steps: 6, device: 'cuda:99999'"), "train.device: 'cuda:99999'"),
    ("device-list", changed("steps: 6", "steps: 6, device: [cpu]"), "base.train.device: expected a string"),
    ("init-from-passwd", changed("steps: 6", "steps: 6, init_from: /etc/passwd"),
     "train.init_from: /etc/passwd is not a checkpoint torch loads with weights_only=True"),
    ("init-from-missing", changed("steps: 6", "steps: 6, init_from: /no/such/weights.pt"),
     "train.init_from: /no/such/weights.pt cannot be read"),
    ("init-from-dir", changed("steps: 6", "steps: 6, init_from: /etc"), "train.init_from: /etc is not a file"),
    ("preset-unknown", changed("preset: tiny", "preset: enormous"), "model.preset"),
    ("impl-unknown", changed("attnres: {residual: attnres}", "attnres: {residual: {name: attnres, impl: cuda}}"),
     "residual.impl"),
    # comparisons
    ("cmp-not-list", GOOD[: GOOD.index("comparisons:")] + "comparisons: {x: 1}\n", "comparisons: expected a list"),
    ("cmp-control-missing-arm", changed("control: control, treatments", "control: nobody, treatments"),
     "comparisons[0].control: 'nobody' is not an arm"),
    ("cmp-metric", changed("treatments: [attnres]", "treatments: [attnres], metric: accuracy"),
     "comparisons[0].metric"),
    ("cmp-name-long", changed("name: main", f"name: {LONG}"), "comparisons[0].name"),
    # contrasts: weights whose sums overflow or vanish, and one contrast declared twice (issue 35, item 8)
    ("contrast-weights-1e308", GOOD + "contrasts:\n  - {name: big, weights: {control: 1.0e+308, attnres: 1.0e+308}}\n",
     "contrasts[0].weights.control: expected a non-zero number from 1e-06 to 1e+06 in size"),
    ("contrast-weights-pm-1e308", GOOD + "contrasts:\n  - {weights: {control: -1.0e+308, attnres: 1.0e+308}}\n",
     "contrasts[0].weights.control: expected a non-zero number from 1e-06 to 1e+06"),
    ("contrast-weights-1e-300", GOOD + "contrasts:\n  - {weights: {control: -1.0e-300, attnres: 1.0e-300}}\n",
     "contrasts[0].weights.control: expected a non-zero number from 1e-06"),
    ("contrast-1000-identical", GOOD + "contrasts:\n" + "  - {weights: {control: -1, attnres: 1}}\n" * 1000,
     "contrasts[1]: 'contrast-1' tests what contrasts[0] 'contrast-0' tests"),
    ("contrast-scaled-duplicate", GOOD + "contrasts:\n  - {name: a, weights: {control: -1, attnres: 1}, margin: 0.01}\n"
     "  - {name: b, weights: {attnres: 2, control: -2}, margin: 0.02}\n",
     "contrasts[1]: 'b' tests what contrasts[0] 'a'"),
    # models no machine holds, refused by arithmetic before a tensor is allocated (item 7)
    ("ladder-d-model-1e12", GOOD + "ladder:\n  model.d_model: [32, 1000000000000]\n",
     "arms.control at grid point model.d_model=1000000000000: model: 8e+24 parameters (d_model 1,000,000,000,000, 2 "
     "layers, vocab 256) need 1.28e+14 TB to train"),
    ("layers-1e9", changed("n_layers: 2", "n_layers: 1000000000"), "model.n_layers: 1,000,000,000 layers; allowed: at "
     "most 10,000"),
    ("vocab-1e13", changed("seq_len: 32}", "seq_len: 32, vocab_size: 10000000000000}"), "need"),
    # issue 52, item 3: the cost measurement after training, bounded and sized before anything trains
    ("cost-decode-batch-1e9", changed("train: {steps: 6}", "train: {steps: 6}\n  cost: {decode_batch: 1000000000}"),
     "arms.control and arms.attnres: cost.decode_batch: must be from 1 to 4096 (got 1000000000)"),
    ("cost-repeats-1e9", changed("train: {steps: 6}", "train: {steps: 6}\n  cost: {repeats: 1000000000}"),
     "arms.control and arms.attnres: cost.repeats: must be from 1 to 100 (got 1000000000)"),
    # issue 52, item 6: a preset's MoE refused with pipeline stages, as an explicit model.moe is
    ("pipeline-preset-moe", changed("preset: tiny, d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64",
                                    "preset: tiny-moe") + "resources: {gpus_per_run: 2, pipeline_stages: 2}\n",
     "arms.control.model.preset: tiny-moe is MoE: an MoE model with pipeline_stages is not supported"),
    ("cost-decode-kv-8tb", changed("d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, seq_len: 32}",
                                   "d_model: 4096, n_layers: 32, n_heads: 32, n_kv_heads: 32, ffn_hidden: 64, "
                                   "seq_len: 4096}\n  cost: {decode_batch: 4096}"),
     "arms.control and arms.attnres: cost.decode_batch: 4,096 rows decoded together need at least 8,796 GB"),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """`reslab ARGV` in this process: (exit code, stdout, stderr); argparse's exit counts as a return."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, expect: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reslab"), err
    assert "error" in lines[0] and expect in lines[0], err
    assert len(lines[0]) < 1000, lines[0]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    for case, content, _ in STUDIES:
        path = root / f"{case}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    (root / "good.yaml").write_text(GOOD)
    # valid to validate (a corpus may be prepared later), refused by run
    (root / "corpus-etc.yaml").write_text(changed("optim:", "data: {corpus: ../../etc}\n  optim:"))
    (root / "is-a-dir.yaml").mkdir()
    (root / "evals-unknown.yaml").write_text(GOOD + "evals: {tasks: [nosuchtask_xyz]}\n")
    (root / "needs-gpus.yaml").write_text(GOOD + f"resources: {{gpus_per_run: {_absent_gpus()}}}\n")
    # a search: `reslab tune` makes the same checks as `reslab run` before anything is written
    (root / "tune.yaml").write_text(GOOD + "tune: {trials: 2, seed: 100, space: {optim.lr: {type: float, low: 1.0e-4, "
                                    "high: 1.0e-2, log: true}}}\n")
    return root


def test_the_corpus_is_as_large_as_the_issue_asks():
    assert len(STUDIES) >= 60 and len(COMMANDS) >= 46
    assert len({c for c, _, _ in STUDIES}) == len(STUDIES)


def test_the_good_study_passes(corpus_dir, tmp_path, capsys):
    """The bounds leave valid input alone: the exact run limit, merge keys and a real state_dict."""
    assert len(expand(load_study(corpus_dir / "good.yaml"))) == 4
    for extra in ([], ["--max-runs", "4"]):
        code, out, err = run_cli(["validate", str(corpus_dir / "good.yaml"), *extra], capsys)
        assert code == 0 and "-> 4 runs" in out, err
    weights = tmp_path / "init_from.pt"
    torch.save({"w": torch.zeros(2)}, weights)
    text = GOOD.replace("train: {steps: 6}", f"train: &t {{steps: 6, init_from: {weights}}}")
    (tmp_path / "ok.yaml").write_text(text + "limits: {max_runs: 4}\n")
    assert all(r.config.train.init_from == str(weights) for r in expand(load_study(tmp_path / "ok.yaml")))


@pytest.mark.parametrize(("case", "expect"), [(c, e) for c, _, e in STUDIES], ids=[c for c, _, _ in STUDIES])
def test_malformed_study(case, expect, corpus_dir, tmp_path, capsys):
    path = corpus_dir / f"{case}.yaml"
    tracemalloc.start()
    started = time.process_time()
    try:
        code, _, err = run_cli(["validate", str(path)], capsys)
        seconds = time.process_time() - started
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert_one_line_error(code, err, expect)
    assert err.startswith(f"reslab: error: {path}: "), err
    assert seconds < CASE_CPU_SECONDS and peak_mb < CASE_MEMORY_MB, (seconds, peak_mb)

    workspace = tmp_path / "ws"
    code, _, err = run_cli(["plan", str(path), "--workspace", str(workspace)], capsys)
    assert_one_line_error(code, err, expect)
    assert not workspace.exists()


def test_the_library_raises_the_same_errors(corpus_dir):
    """`load_study` + `expand`, as a notebook calls them: a `ReslabError` for every case, never another type."""
    for case, _, expect in STUDIES:
        with pytest.raises(ReslabError, match=re.escape(expect)):
            expand(load_study(corpus_dir / f"{case}.yaml"))


def test_special_study_paths(corpus_dir, capsys):
    for name, expect in (("is-a-dir.yaml", "not a regular file"), ("missing.yaml", "no such study file")):
        code, _, err = run_cli(["validate", str(corpus_dir / name)], capsys)
        assert_one_line_error(code, err, expect)


def _missing_gpu() -> str:
    """A CUDA device this machine does not have."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def _absent_gpus() -> int:
    """GPUs per run this machine cannot give (1 without a GPU: a whole number from 2 means ranks)."""
    return torch.cuda.device_count() + 1


# (case id, argv with {good}/{dir} placeholders, expected substring); none of them may start training.
COMMANDS: list[tuple[str, list[str], str]] = [
    ("no-command", [], "the following arguments are required"),
    ("unknown-command", ["bogus"], "invalid choice: 'bogus'"),
    ("train-seed-negative", ["train", "--seed", "-1", "--steps", "1"], "train.seed: must be >= 0"),
    ("train-seed-text", ["train", "--seed", "abc"], "argument --seed"),
    ("train-seed-2**64", ["train", "--seed", str(2**64)], "train.seed"),
    ("train-steps-zero", ["train", "--steps", "0"], "argument --steps"),
    ("train-steps-1e30", ["train", "--steps", "1e30"], "argument --steps"),
    ("train-device-banana", ["train", "--device", "banana"], "train.device: 'banana' is not a device"),
    ("train-device-missing-gpu", ["train", "--device", _missing_gpu()], f"train.device: '{_missing_gpu()}' but"),
    ("train-device-cuda-99", ["train", "--device", "cuda:99"], "train.device: 'cuda:99' but"),
    ("train-impl-triton-cpu", ["train", "--impl", "triton", "--device", "cpu", "--residual", "attnres"],
     "residual.impl: triton needs a CUDA device"),
    ("train-impl-banana", ["train", "--impl", "banana"], "argument --impl: invalid choice"),
    ("train-config-binary", ["train", "--config", "{dir}/binary.yaml"], "not UTF-8 text"),
    ("train-config-missing", ["train", "--config", "{dir}/nope.yaml"], "--config"),
    ("train-config-list", ["train", "--config", "{dir}/list-top.yaml"], "expected a run config mapping"),
    ("train-config-bomb", ["train", "--config", "{dir}/alias-bomb.yaml"], "through its aliases"),
    ("train-config-deep", ["train", "--config", "{dir}/brackets-100k.yaml"], "nested deeper than 50"),
    ("train-set-inf", ["train", "--set", "optim.lr=.inf"], "--set optim.lr: inf is not allowed"),
    ("train-set-nan-text", ["train", "--set", "optim.lr=nan"], "--set optim.lr: 'nan' is not allowed"),
    ("train-set-text", ["train", "--set", "optim.lr=abc"], "--set optim.lr: expected a number"),
    ("train-set-unknown", ["train", "--set", "optim.lrr=1"], "unknown field optim.lrr"),
    ("train-set-no-equals", ["train", "--set", "optim.lr"], "expected KEY=VALUE"),
    ("train-set-date-knob", ["train", "--set", "residual.options.x=2001-01-01"], "a date"),
    ("train-set-steps-huge", ["train", "--set", f"train.steps={10**30}"], "out of range"),
    ("train-set-deep", ["train", "--set", "residual.options.x=" + "[" * 4000 + "]" * 4000], "nested too deeply"),
    ("train-set-long", ["train", "--set", "residual.options.x=" + "y" * 20_000], "longer than 10000 characters"),
    ("train-set-alias-bomb", ["train", "--set", "residual.options.x=[" + alias_bomb(9, 6).replace("\n", ", ")[:-2]
                              + "]"], "anchors (&name) are not allowed"),
    ("train-opt-text", ["train", "--residual", "block_attnres", "--opt", "block_size=abc"], "block_size"),
    ("train-residual-unknown", ["train", "--residual", "nosuchvariant"], "residual.name"),
    ("train-preset-unknown", ["train", "--preset", "enormous"], "model.preset"),
    ("train-init-from-passwd", ["train", "--set", "train.init_from=/etc/passwd"], "train.init_from: /etc/passwd"),
    ("train-corpus-etc", ["train", "--corpus", "../../etc"], "data.corpus"),
    ("compare-alpha-2", ["compare", "{good}", "--alpha", "2"], "argument --alpha"),
    ("compare-alpha-nan", ["compare", "{good}", "--alpha", "nan"], "argument --alpha"),
    ("compare-alpha-negative", ["compare", "{good}", "--alpha", "-0.1"], "argument --alpha"),
    ("export-format", ["export", "{good}", "--format", "pdf", "-o", "x"], "argument --format"),
    ("export-no-format", ["export", "{good}", "-o", "x"], "required: --format"),
    ("validate-no-spec", ["validate"], "required: SPEC"),
    ("validate-missing", ["validate", "{dir}/nope.yaml"], "no such study file"),
    ("validate-max-runs-zero", ["validate", "{good}", "--max-runs", "0"], "argument --max-runs"),
    ("validate-max-runs-low", ["validate", "{good}", "--max-runs", "2"], "over the limit of 2 runs"),
    ("validate-set-seed", ["validate", "{good}", "--set", "train.seed=3"], "--set train.seed"),
    ("validate-set-nan", ["validate", "{good}", "--set", "optim.lr=.nan"], "--set optim.lr: nan is not allowed"),
    ("plan-lease-negative", ["plan", "{good}", "--lease-timeout", "-5"], "argument --lease-timeout"),
    ("plan-lease-text", ["plan", "{good}", "--lease-timeout", "soon"], "argument --lease-timeout"),
    ("status-missing", ["status", "{dir}/nope.yaml"], "no such study file"),
    ("run-retries-negative", ["run", "{good}", "--retries", "-1"], "argument --retries"),
    ("run-cpus-zero", ["run", "{good}", "--cpus-per-run", "0"], "argument --cpus-per-run"),
    ("run-concurrency-zero", ["run", "{good}", "--max-concurrent", "0"], "argument --max-concurrent"),
    ("run-gpus-negative", ["run", "{good}", "--gpus-per-run", "-1"], "argument --gpus-per-run"),
    ("run-cpus-inf", ["run", "{good}", "--cpus-per-run", "inf"], "argument --cpus-per-run"),
    ("plan-lease-inf", ["plan", "{good}", "--lease-timeout", "inf"], "argument --lease-timeout"),
    ("run-address-banana", ["run", "{good}", "--address", "banana"], "--address 'banana': expected HOST:PORT"),
    ("run-address-dead", ["run", "{good}", "--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray cluster"),
    ("run-device-missing", ["run", "{good}", "--set", f"train.device={_missing_gpu()}"], "train.device"),
    ("run-impl-triton-cpu", ["run", "{good}", "--set", "residual.impl=triton", "--set", "train.device=cpu"],
     "residual.impl: triton needs a CUDA device"),
    ("run-bad-spec", ["run", "{dir}/lr-inf.yaml"], "base.optim.lr: inf is not allowed"),
    ("run-corpus-etc", ["run", "{dir}/corpus-etc.yaml"], "data.corpus: '../../etc' is not prepared"),
    ("tune-device-missing", ["tune", "{dir}/tune.yaml", "--set", f"train.device={_missing_gpu()}"], "train.device"),
    ("tune-impl-triton-cpu", ["tune", "{dir}/tune.yaml", "--set", "residual.impl=triton", "--set", "train.device=cpu"],
     "residual.impl: triton needs a CUDA device"),
    ("tune-address-dead", ["tune", "{dir}/tune.yaml", "--address", "127.0.0.1:1"], "--address 127.0.0.1:1: no Ray"),
    ("tune-gpus-negative", ["tune", "{dir}/tune.yaml", "--gpus-per-run", "-1"], "argument --gpus-per-run"),
    ("tune-no-block", ["tune", "{good}"], "tune: missing"),
    ("dashboard-port-high", ["dashboard", "--port", "70000"], "argument --port"),
    ("dashboard-port-zero", ["dashboard", "--port", "0"], "--port 0: expected a port from 1"),
    ("dashboard-port-text", ["dashboard", "--port", "http"], "argument --port"),
    ("dashboard-host-foreign", ["dashboard", "--host", "192.0.2.254", "--port", "5999"], "--host '192.0.2.254'"),
    ("variants-preset", ["variants", "--preset", "enormous"], "preset"),
    ("convert-missing", ["convert", "{dir}/nope.pt", "--residual", "delta_attnres", "--out", "{dir}/conv"],
     "no such checkpoint"),
    ("convert-passwd", ["convert", "/etc/passwd", "--residual", "delta_attnres", "--out", "{dir}/conv"],
     "/etc/passwd"),
    ("train-out-file", ["train", "--steps", "1", "--out", "/etc/passwd/run"],
     "argument --out: cannot write /etc/passwd/run"),
    ("convert-out-file", ["convert", "{dir}/nope.pt", "--residual", "delta_attnres", "--out", "{good}"],
     "argument --out"),
    ("data-prepare-vocab", ["data", "prepare", "{dir}", "--vocab-size", "-5", "--out", "{dir}/c"],
     "argument --vocab-size"),
    ("power-neither", ["power", "{good}"], "one of the arguments --sd --pilot --task-gain is required"),
    ("power-task-gain-negative", ["power", "{good}", "--task-gain", "-0.02"], "argument --task-gain"),
    ("power-task-gain-no-seed-sd", ["power", "{good}", "--task-gain", "0.02"], "--seed-sd: required with --task-gain"),
    ("power-item-share-over-one", ["power", "{good}", "--task-gain", "0.02", "--seed-sd", "0.01", "--item-share",
                                   "1.5"], "argument --item-share: expected a number from 0 to 1"),
    ("power-both", ["power", "{good}", "--sd", "0.1", "--pilot", "{good}"], "not allowed with argument"),
    ("power-reps-huge", ["power", "{good}", "--sd", "0.1", "--reps", "1000000000"],
     "argument --reps: expected an integer from 1 to 10000"),
    ("power-seed-negative", ["power", "{good}", "--sd", "0.1", "--seed", "-3"], "argument --seed: expected an integer"),
    # issue 35, items 6, 9, 10: bounds on counts and durations, each named by its flag
    ("plan-cluster-gpus-1e9", ["plan", "{good}", "--cluster-gpus", "1000000000"],
     "argument --cluster-gpus: expected an integer from 1 to 1000000, got '1000000000'"),
    ("plan-cluster-gpus-10**30", ["plan", "{good}", "--cluster-gpus", str(10**30)], "argument --cluster-gpus"),
    ("plan-cluster-gpus-1e30", ["plan", "{good}", "--cluster-gpus", "1e30"], "argument --cluster-gpus"),
    ("plan-gpus-per-run-huge", ["plan", "{good}", "--gpus-per-run", "100000"], "argument --gpus-per-run"),
    ("run-outage-1e300", ["run", "{good}", "--outage-timeout", "1e300"],
     "argument --outage-timeout: expected a number from 0 to 604800"),
    ("run-outage-inf", ["run", "{good}", "--outage-timeout", "inf"], "argument --outage-timeout"),
    ("run-rank-restarts-10**30", ["run", "{good}", "--rank-restarts", str(10**30)],
     "argument --rank-restarts: expected an integer from 0 to 1000"),
    ("run-retries-10**30", ["run", "{good}", "--retries", str(10**30)], "argument --retries"),
    ("run-gpus-2.5", ["run", "{good}", "--gpus-per-run", "2.5"],
     "argument --gpus-per-run: expected a number of GPUs from 0 to 1024"),
    ("run-gpus-huge", ["run", "{good}", "--gpus-per-run", "1e9"], "argument --gpus-per-run"),
    ("tune-gpus-2.5", ["tune", "{dir}/tune.yaml", "--gpus-per-run", "2.5"], "argument --gpus-per-run"),
    ("run-gpus-absent", ["run", "{good}", "--gpus-per-run", str(_absent_gpus())],
     f"--gpus-per-run: each run asks for {_absent_gpus()} GPU(s) but this machine has {torch.cuda.device_count()}"),
    ("tune-gpus-absent", ["tune", "{dir}/tune.yaml", "--gpus-per-run", str(_absent_gpus())],
     "--gpus-per-run: each run asks for"),
    ("run-resources-gpus-absent", ["run", "{dir}/needs-gpus.yaml"], "resources.gpus_per_run: each run asks for"),
    ("generate-unknown-run", ["generate", "--run", "nope-000000000000", "--prompt", "x"], "no run 'nope-000000000000'"),
    ("generate-etc", ["generate", "--run", "/etc", "--prompt", "x"], "/etc has no checkpoint"),
    ("generate-deep-path", ["generate", "--run", "a/b/c", "--prompt", "x"], "'a/b/c' is not a directory"),
    ("generate-temperature", ["generate", "--run", "x", "--prompt", "x", "--temperature", "-1"],
     "argument --temperature"),
    ("generate-no-prompt", ["generate", "--run", "x"], "--prompt"),
    ("eval-no-tasks", ["eval", "{good}"], "--tasks: "),
    ("eval-limit-zero", ["eval", "{good}", "--tasks", "reslab_next_line", "--limit", "0"], "argument --limit"),
    # issue 52, item 6: an evaluation device this machine lacks, a task name the harness does not know
    ("eval-device-cuda-99", ["eval", "{good}", "--tasks", "reslab_next_line", "--device", "cuda:99"],
     "--device: 'cuda:99' but this machine has"),
    ("eval-device-banana", ["eval", "{good}", "--tasks", "reslab_next_line", "--device", "banana"],
     "--device: 'banana' is not a device"),
    # issue 52, item 4: a thread count past the CPUs (10^6 crashed the process), a seed torch cannot take
    ("train-threads-1e6", ["train", "--threads", "1000000"],
     f"argument --threads: expected an integer from 1 to {len(os.sched_getaffinity(0))}, got '1000000'"),
    ("generate-threads-1e6", ["generate", "--run", "x", "--prompt", "x", "--threads", "1000000"],
     "argument --threads: expected an integer from 1 to"),
    ("generate-seed-10**30", ["generate", "--run", "x", "--prompt", "x", "--seed", str(10**30)],
     "argument --seed: expected an integer from 0 to 9223372036854775807"),
]


@pytest.mark.parametrize(("case", "argv", "expect"), COMMANDS, ids=[c for c, _, _ in COMMANDS])
def test_bad_command_line(case, argv, expect, corpus_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anything a command wrote by default would land here
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RESLAB_WORKSPACE", str(tmp_path / "ws"))
    # an existing workspace: `run` prestarts a local Ray only for a new one, and a refused command then
    # waits for that start to stop it (3-4 s, 20-30 s on a loaded machine; bench/RESULTS.md, issue 19)
    (tmp_path / "ws").mkdir()
    argv = [a.format(good=corpus_dir / "good.yaml", dir=corpus_dir) for a in argv]
    started = time.process_time()
    code, _, err = run_cli(argv, capsys)
    assert time.process_time() - started < 3 * CASE_CPU_SECONDS
    assert_one_line_error(code, err, expect)
    assert not any((tmp_path / "ws").iterdir())  # nothing recorded


HF_STUDY = GOOD.replace("d_model: 32, n_layers: 2, n_heads: 2, n_kv_heads: 2, ffn_hidden: 64, ", "").replace(
    "train: {steps: 6}", "train: {steps: 6, init_from: 'hf:CKPT'}")  # the checkpoint's config.json fixes the shape


def _cut(path: Path, name: str, keep: int) -> None:
    (path / name).write_bytes((path / name).read_bytes()[:keep])


# issue 52, item 5: a pretrained checkpoint damaged on disk (case id, damage, expected substring), refused by
# `validate` and `run` before anything is submitted, where each run failed in its worker after its retry
CHECKPOINTS: list[tuple[str, Callable[[Path], None], str]] = [
    ("safetensors-truncated", lambda p: _cut(p, "model.safetensors", 400_000),
     "model.safetensors is damaged: its tensors take 748,032 bytes after the header, the file holds 396,392"),
    ("safetensors-empty", lambda p: _cut(p, "model.safetensors", 0), "model.safetensors is damaged: its header"),
    ("tokenizer-truncated", lambda p: _cut(p, "tokenizer.json", 3000), "holds no tokenizer transformers can load"),
]


@pytest.mark.parametrize(("case", "damage", "expect"), CHECKPOINTS, ids=[c for c, _, _ in CHECKPOINTS])
def test_a_damaged_checkpoint_is_refused_before_anything_runs(case, damage, expect, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from reslab.models.hf_import import write_tiny_checkpoint

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ckpt = write_tiny_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM")
    damage(ckpt)
    spec = tmp_path / "hf.yaml"
    text = HF_STUDY.replace("CKPT", str(ckpt))
    spec.write_text(text.replace("  optim:", "  data: {tokenizer: hf}\n  optim:") if "tokenizer" in case else text)
    (tmp_path / "ws").mkdir()
    for argv in (["validate", str(spec)], ["run", str(spec), "--workspace", str(tmp_path / "ws")]):
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, expect)
        assert not any((tmp_path / "ws").iterdir())  # nothing recorded


@pytest.mark.slow  # the harness indexes its task registry: 10-30 s of CPU
def test_validate_checks_the_evals_task_names_as_run_does(corpus_dir, tmp_path, capsys, monkeypatch):
    """Issue 52, item 6: an unknown `evals.tasks` name passed `validate` (only `run` checked it)."""
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    code, _, err = run_cli(["validate", str(corpus_dir / "evals-unknown.yaml")], capsys)
    assert_one_line_error(code, err, "evals.tasks: 'nosuchtask_xyz' is not a task of lm-evaluation-harness")


def test_a_tracking_error_at_start_leaves_no_workspace_behind(corpus_dir, tmp_path, capsys, monkeypatch):
    """Issue 35, item 10: a store that does not answer is refused with one line, and the workspace folders the
    command made for it (`--workspace` a/ws, neither existing) are gone again."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, _, err = run_cli(["tune", str(corpus_dir / "tune.yaml"), "--workspace", str(tmp_path / "a" / "ws"),
                            "--tracking-uri", "http://127.0.0.1:1"], capsys)
    assert_one_line_error(code, err, "the MLflow tracking server at http://127.0.0.1:1 does not answer")
    assert not (tmp_path / "a").exists()


def test_validate_says_what_this_machine_would_refuse(corpus_dir, capsys):
    """Issue 35, item 12: a device this machine lacks is valid in a study (a cluster's workers may have it), so
    `validate` passes it, and says, as it does of an unprepared corpus, that `run` here would refuse it."""
    code, out, err = run_cli(["validate", str(corpus_dir / "good.yaml"), "--set", "train.device=cuda:99"], capsys)
    assert code == 0 and ": ok." in out, err
    assert "  this machine: train.device: 'cuda:99' but this machine has" in out
    assert "`reslab run` here refuses it" in out
    code, out, _ = run_cli(["validate", str(corpus_dir / "good.yaml")], capsys)
    assert code == 0 and "this machine" not in out


def _limited(mb: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mb * 2**20, mb * 2**20))

    return apply


def run_child(cmd: list[str], env: dict[str, str], preexec_fn=None) -> tuple[int, str, float]:
    """Run `cmd` in its own session: (exit code, stderr, CPU seconds it and the children it waited for used).
    Past `CHILD_WALL_DEADLINE_S` its whole process group is killed and reaped before the test fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=preexec_fn, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=CHILD_WALL_DEADLINE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{cmd[3:]} did not end within {CHILD_WALL_DEADLINE_S} s (killed)")
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever it left in its group goes with it
            os.killpg(proc.pid, signal.SIGKILL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return proc.returncode, stderr, cpu


# Run as a user would, in a fresh process whose address space is capped (torch alone maps ~1.5 GB).
SUBPROCESS_CASES = [
    ("seeds-1e8", ["validate", "{dir}/seeds-1e8.yaml"], "over the limit of 5000 runs"),
    ("alias-bomb", ["plan", "{dir}/alias-bomb.yaml", "--workspace", "{dir}/ws"], "through its aliases"),
    ("binary-config", ["train", "--config", "{dir}/binary.yaml"], "not UTF-8 text"),
    ("device-banana", ["train", "--device", "banana"], "train.device"),
    ("dead-address", ["run", "{good}", "--address", "127.0.0.1:1", "--workspace", "{dir}/ws"], "no Ray cluster"),
    # issue 52, item 8: lm-eval imports triton, whose bindings reported 31 "nanobind leaked" lines at exit
    ("eval-unknown-task-loads-triton", ["eval", "{good}", "--tasks", "nosuchtask", "--workspace", "{dir}/ws"],
     "evals.tasks: 'nosuchtask' is not a task"),
]


@pytest.mark.slow  # ~10-25 s each: a fresh interpreter imports torch (and ray for `run`)
@pytest.mark.parametrize(("case", "argv", "expect"), SUBPROCESS_CASES, ids=[c for c, _, _ in SUBPROCESS_CASES])
def test_bad_input_in_a_fresh_process(case, argv, expect, corpus_dir):
    if case.startswith("eval-") and importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed (pip install -e '.[eval]')")
    argv = [a.format(good=corpus_dir / "good.yaml", dir=corpus_dir) for a in argv]
    cmd = [sys.executable, "-c", "import sys; from reslab.orchestrator.cli import main; sys.exit(main())", *argv]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    code, stderr, cpu = run_child(cmd, env, preexec_fn=_limited(6144))
    assert cpu < CHILD_CPU_SECONDS, f"a bad input must fail in seconds of CPU, took {cpu:.1f} s"
    assert "Traceback" not in stderr, stderr
    assert_one_line_error(code, stderr, expect)
    assert not (corpus_dir / "ws").exists()

