"""experiments/budget.py: parameter counts against the built model (torch numel), FLOPs against
torch's own FlopCounterMode, and the shipped GPU studies against their headers and Chinchilla."""

import re
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from reslab.experiments import expand, load_study
from reslab.experiments.budget import (
    CHINCHILLA_TOKENS_PER_PARAM,
    backbone_params,
    check_budget,
    gpu_hours,
    residual_params,
    run_budget,
    study_budget,
    train_flops,
)
from reslab.models.backbone import build_model
from reslab.models.config import ConfigError, DataConfig, ModelConfig, ResidualConfig, RunConfig, TrainConfig
from reslab.models.data.corpus import Document
from reslab.models.data.prepare import RECIPES, prepare
from reslab.models.data.tokenizer import ByteTokenizer
from reslab.models.presets import resolve_model

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RESLAB_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("preset,residual", [
    ("tiny", "prenorm"), ("tiny", "attnres"), ("tiny", "dar"), ("tiny", "hyper_connections"),
    ("small", "prenorm"), ("small", "mhar"),
])
def test_param_count_matches_the_built_model(preset, residual):
    cfg = RunConfig(model=ModelConfig(preset=preset), residual=ResidualConfig(name=residual))
    shape = resolve_model(cfg.model, vocab_size=300)
    model = build_model(cfg.model, cfg.residual, vocab_size=300)
    assert backbone_params(shape) + residual_params(cfg, shape) == sum(p.numel() for p in model.parameters())


def test_flops_match_torch_flop_counter():
    """One prenorm training step (forward + backward) on the math SDPA path, counted by torch:
    its matmuls are exactly 6 N T less the RMSNorm gains (parameters without a matmul) plus the
    attention's 12 L d S T."""
    cfg = ModelConfig(preset="tiny")
    shape = resolve_model(cfg, vocab_size=257)
    torch.manual_seed(0)
    model = build_model(cfg, ResidualConfig(name="prenorm"), vocab_size=257)
    batch = 3
    idx = torch.randint(0, 257, (batch, shape.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx, idx).loss.backward()
    tokens = batch * shape.seq_len
    norm_gains = (2 * shape.n_layers + 1) * shape.d_model
    expected = train_flops(shape, backbone_params(shape), tokens) - 6 * norm_gains * tokens
    assert counter.get_total_flops() == expected


def test_gpu_hours_and_bad_mfu():
    # 989 TFLOP/s at 40% for one hour
    assert gpu_hours(989e12 * 0.4 * 3600) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="mfu: must be in"):
        gpu_hours(1.0, mfu=0)


def _local_corpus(name: str, n_docs: int = 40) -> int:
    from reslab.models.data.prepare import cache_root

    docs = [Document(f"d{i}", f"document {i} " * 20) for i in range(n_docs)]
    meta = prepare(docs, cache_root() / "corpora" / name, tokenizer=ByteTokenizer(), val_fraction=0.2,
                   source_description="test")
    return meta.n_train_tokens


def test_passes_and_max_epochs():
    n_train = _local_corpus("local")
    base = RunConfig(data=DataConfig(corpus="local"), train=TrainConfig(steps=20))
    meta_tokens = 20 * base.optim.batch_size * base.optim.grad_accum * 128  # tiny: seq_len 128
    from reslab.models.data.prepare import prepared_meta

    b = run_budget(base, "arm", prepared_meta(base.data))
    assert b.tokens == meta_tokens and b.corpus_tokens == n_train
    assert b.passes == pytest.approx(meta_tokens / n_train) and b.passes > 1 and b.over_budget
    with pytest.raises(ConfigError, match=r"arm: data.max_epochs: .* passes over corpus 'local' .* above "
                                          r"data.max_epochs=1; .* set data.max_epochs: "):
        check_budget([(b, 1)], require_prepared=False)
    allowed = RunConfig(data=DataConfig(corpus="local", max_epochs=b.passes * 1.01), train=TrainConfig(steps=20))
    check_budget([(run_budget(allowed, "arm", prepared_meta(allowed.data)), 1)], require_prepared=True)

    missing = RunConfig(data=DataConfig(corpus="nowhere"))
    unknown = run_budget(missing, "arm", None)
    assert unknown.passes is None and not unknown.over_budget
    check_budget([(unknown, 1)], require_prepared=False)
    with pytest.raises(ConfigError, match="data.corpus: 'nowhere' is not prepared .*reslab data prepare"):
        check_budget([(unknown, 1)], require_prepared=True)


def _header_hours(path: Path) -> float:
    text = path.read_text()
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    found = re.findall(r"([\d,.]+) GPU-hours", header)
    assert found, f"{path.name}: the header states no GPU-hours"
    return float(found[-1].replace(",", ""))


GPU_STUDIES = sorted(p for p in EXPERIMENTS.glob("*.yaml") if "fineweb-edu" in p.read_text())


def test_the_gpu_studies_are_the_shipped_set():
    assert {p.stem for p in GPU_STUDIES} >= {
        "attnres_vs_prenorm", "head_sweep", "routing_ablation", "block_vs_full", "delta_vs_cumulative",
        "rd_value_route", "dar_routing_ablations",
    }


@pytest.mark.parametrize("path", GPU_STUDIES, ids=lambda p: p.stem)
def test_shipped_gpu_study_is_chinchilla_on_fineweb(path):
    """100m/350m presets, about 20 tokens per parameter of the preset's prenorm (a widened,
    parameter-matched control keeps its baseline's budget), one pass at most over what the
    FineWeb-Edu recipe prepares, and the header's GPU-hours equal to what `reslab plan` prints."""
    study = load_study(path)
    runs = expand(study)
    budgets = study_budget(runs)
    first_runs = list({(r.arm, r.grid_key): r for r in reversed(runs)}.values())[::-1]
    assert len(first_runs) == len(budgets)
    recipe_tokens = float(re.search(r"--tokens (\S+)", RECIPES["fineweb-edu-10bt"]).group(1))
    for (b, _), run in zip(budgets, first_runs, strict=True):
        cfg = run.config
        assert cfg.data.corpus == "fineweb-edu-10bt" and cfg.data.max_epochs == 1, b.label
        assert cfg.model.preset in ("100m", "350m"), b.label
        shape = resolve_model(ModelConfig(preset=cfg.model.preset), vocab_size=cfg.data.bpe_vocab_size)
        per_param = b.tokens / backbone_params(shape)
        assert abs(per_param - CHINCHILLA_TOKENS_PER_PARAM) < 0.5, f"{b.label}: {per_param:.1f} tokens per parameter"
        assert b.tokens <= recipe_tokens, b.label
    total = sum(b.gpu_hours * n for b, n in budgets)
    assert _header_hours(path) == pytest.approx(total, rel=0.01, abs=0.6), path.name
    assert len(study.seeds) >= 6


def test_run_prepares_the_stdlib_corpus_to_count_its_passes():
    """plan leaves the stdlib corpus unprepared (passes unknown); run's check prepares it into the
    cache, as the first run would, and then knows the passes exactly."""
    runs = expand(load_study(EXPERIMENTS / "quickstart.yaml"))
    assert all(b.passes is None for b, _ in study_budget(runs))
    budgets = study_budget(runs, prepare_stdlib_corpus=True)
    b, n = budgets[0]
    assert n == 3 and b.corpus == "stdlib" and b.tokens == 200 * 16 * 128
    assert 0 < b.passes < 0.1 and b.passes == b.tokens / b.corpus_tokens
    assert [x.passes for x, _ in study_budget(runs)] == [x.passes for x, _ in budgets]  # now cached
