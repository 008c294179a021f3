"""The serving cost a run measures after training (`models.serving`) and its config (`cost`)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from reslab.common.metrics import COST_METRICS, METRICS
from reslab.models.backbone import build_model
from reslab.models.config import (
    ConfigError,
    CostConfig,
    ModelConfig,
    OptimConfig,
    ResidualConfig,
    RunConfig,
    TrainConfig,
)
from reslab.models.presets import resolve_model
from reslab.models.resolve import validate_run_config
from reslab.models.serving import flops_per_token
from reslab.models.training import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SERVING = ("prefill_tps", "decode_tps", "decode_tps_batch", "decode_state_bytes", "decode_step_bytes",
           "decode_peak_mem_mb", "flops_per_token")
SHAPE = dict(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32)


def tiny_run(name: str = "block_attnres", **cost) -> RunConfig:
    return RunConfig(
        model=ModelConfig(**SHAPE),
        residual=ResidualConfig(name=name, options={"block_size": 2} if name == "block_attnres" else {}),
        optim=OptimConfig(batch_size=4, warmup_steps=1),
        train=TrainConfig(steps=2, eval_every=2, eval_windows=4, log_every=1, seed=3, diagnostics=False),
        cost=CostConfig(decode_batch=3, repeats=2, **cost),
    )


@pytest.fixture(scope="module")
def trained():
    lines: list[str] = []
    trainer = Trainer(tiny_run(), log=lines.append)
    return trainer, trainer.fit(), lines


def test_a_trained_run_records_every_serving_cost(trained):
    trainer, result, lines = trained
    assert set(SERVING) <= set(COST_METRICS) and set(SERVING) <= set(METRICS)
    for name in SERVING:
        value = result.summary[name]
        assert math.isfinite(value) and value > 0, name
    cost = result.info["cost"]
    assert (cost["decode_batch"], cost["prompt_tokens"], cost["new_tokens"], cost["repeats"]) == (3, 16, 16, 2)
    assert cost["machine"]["threads"] == 1 and cost["machine"]["name"].endswith("1 thread")
    [line] = [x for x in lines if x.startswith("serving cost:")]
    assert "tok/s (batch 3)" in line and "B/token" in line
    # the state is the model's own declaration, by what it grows with: per cached token the keys and values
    # of 2 layers x 2 heads x head dim 16 in float32 (by hand), per row the pathway's state of the token in
    # flight (Block AttnRes, blocks of 2 over 4 sites: 3 sources of d 32 and 5 routes x 3 float32 scores)
    model = trainer.model
    state = cost["state_bytes"]
    assert result.summary["decode_state_bytes"] == state["kv"] == 2 * 2 * 2 * 16 * 4
    assert result.summary["decode_step_bytes"] == state["pathway"] + state["carry"] == (3 * 32 + 5 * 3) * 4
    assert model.decode_state_bytes().per_row == result.summary["decode_step_bytes"]
    assert result.summary["flops_per_token"] == flops_per_token(model.shape, trainer.counts["total"])
    # on a CPU the peak is computed: the model's bytes plus the batch's decode state, its KV grown to under
    # twice the 16 + 16 slots a row fills
    params = sum(p.numel() for p in model.parameters()) * 4
    kv_used = 3 * state["kv"] * 32
    assert (params + kv_used) / 2**20 < result.summary["decode_peak_mem_mb"] < (params + 2 * kv_used) / 2**20
    assert trainer.model.training  # measuring leaves the model as it found it


def test_the_summary_with_the_cost_is_the_one_the_final_checkpoint_returns(tmp_path):
    cfg = dataclasses.replace(tiny_run("prenorm"), cost=CostConfig(decode_batch=2, repeats=1, new_tokens=4))
    first = Trainer(cfg, tmp_path).fit()
    again = Trainer(cfg, tmp_path).fit()  # resumed from the final checkpoint: nothing trains or measures
    assert again.summary == first.summary and again.info["cost"] == first.info["cost"]


def test_measure_false_records_no_cost():
    cfg = dataclasses.replace(tiny_run("prenorm"), cost=CostConfig(measure=False, prompt_tokens=64))
    lines: list[str] = []
    result = Trainer(cfg, log=lines.append).fit()
    assert not set(SERVING) & set(result.summary) and "cost" not in result.info
    assert {"val_loss", "tokens_per_s", "params_total"} <= set(result.summary)
    assert result.summary["params_active"] == result.summary["params_total"]  # dense: every parameter is active
    assert not [x for x in lines if x.startswith("serving cost:")]


def test_flops_per_token_against_a_hand_count():
    shape = resolve_model(ModelConfig(**SHAPE), vocab_size=257)  # vocabulary padded to 320
    model = build_model(ModelConfig(**SHAPE), ResidualConfig(name="prenorm"), vocab_size=257)
    # embedding (= the tied LM head) 320 x 32; per layer q, k, v, o 4 x 32 x 32, SwiGLU 3 x 32 x 64, two
    # norm gains of 32; the final norm's 32
    params = 320 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
    assert model.param_counts()["total"] == params == 30880
    # 2 N, plus QK^T and AV: 2 x 2 x (heads x head_dim = 32) x 32 keys per layer, 2 layers
    assert flops_per_token(shape, params) == 2 * 30880 + 2 * 2 * 2 * 32 * 32 == 69952


def test_flops_per_token_is_the_forward_third_of_the_training_budget():
    from reslab.experiments.budget import backbone_params, train_flops

    for preset in ("tiny", "gpt2-124m", "100m"):
        shape = resolve_model(ModelConfig(preset=preset), vocab_size=50304)
        n = backbone_params(shape) + 1234  # a pathway's extra parameters count as any other
        assert train_flops(shape, n, 1000) == pytest.approx(3 * 1000 * flops_per_token(shape, n), rel=1e-12)


def test_flops_per_token_matches_torchs_count_of_a_full_context_forward():
    """torch's FLOP counter over a forward at the full context: every matmul (2 x its parameters per
    token, the LM head included) and both attention products of the full S x S scores (torch's own SDPA
    count, mapped onto the CPU's attention kernel, which the counter leaves out); it does not count the
    elementwise norm gains, which the formula counts as 2 FLOPs per parameter."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    def cpu_sdpa(query, key, value, *_args, out_shape=None, **_kwargs) -> int:
        return sdpa_flop_count(query, key, value)  # the counter passes shapes

    model = build_model(ModelConfig(**SHAPE), ResidualConfig(name="prenorm"), vocab_size=257)
    idx = torch.zeros(2, 32, dtype=torch.long)
    cpu_attention = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa}
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter, torch.no_grad():
        model(idx)
    norms = model.param_counts()["norms"]
    expected = flops_per_token(model.shape, model.param_counts()["total"]) - 2 * norms
    assert counter.get_total_flops() / idx.numel() == pytest.approx(expected, rel=1e-9)


def test_cost_lengths_fit_the_context_by_default():
    def lengths(seq_len: int, **cost) -> tuple[int | None, int | None]:
        cfg = RunConfig(model=ModelConfig(preset="tiny", seq_len=seq_len), cost=CostConfig(**cost))
        c = validate_run_config(cfg).cost
        return c.prompt_tokens, c.new_tokens

    assert lengths(128) == (32, 16) and lengths(32) == (16, 16) and lengths(16) == (8, 8)
    assert lengths(128, prompt_tokens=100, new_tokens=28) == (100, 28)
    assert lengths(8, measure=False, prompt_tokens=40) == (40, None)  # nothing is measured: nothing to fit
    resolved = validate_run_config(RunConfig())
    assert validate_run_config(resolved) == resolved  # resolving twice changes nothing (the run id)


@pytest.mark.parametrize(("cost", "message"), [
    ({"decode_batch": 0}, "config.cost.decode_batch: must be from 1 to 4096 (got 0)"),
    ({"decode_batch": 10**9}, "config.cost.decode_batch: must be from 1 to 4096 (got 1000000000)"),  # issue 52
    ({"repeats": 0}, "config.cost.repeats: must be from 1 to 100 (got 0)"),
    ({"repeats": 10**9}, "config.cost.repeats: must be from 1 to 100 (got 1000000000)"),
    ({"prompt_tokens": 0}, "config.cost.prompt_tokens: 0 is not allowed; allowed: >= 1"),
    ({"new_tokens": -2}, "config.cost.new_tokens: -2 is not allowed; allowed: >= 1"),
    ({"prompt_tokens": 100, "new_tokens": 29}, "config.cost: prompt_tokens=100 + new_tokens=29 is 129 tokens, over "
                                               "the model's context seq_len=128"),
    ({"new_tokens": 128}, "config.cost: prompt_tokens=0 + new_tokens=128"),
])
def test_bad_cost_config_is_one_line(cost, message):
    with pytest.raises(ConfigError) as err:
        validate_run_config(RunConfig(cost=CostConfig(**cost)))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_decode_batch_no_device_holds_is_refused_by_arithmetic():
    """Issue 52, item 3: the batched prefill's KV cache (seq_len slots a row) and logits, 2 bytes an element, past
    an H200's 141 GB. Reference by hand: 2 (K, V) x 32 layers x 32 heads x 128 dims x 4096 slots = 2^30 elements a
    row, plus 32 prompt tokens x 256 vocab; at most 141e9 / (2 (2^30 + 8192)) = 65 rows."""
    from reslab.models.config import ModelConfig

    model = ModelConfig(preset="tiny", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, seq_len=4096)
    validate_run_config(RunConfig(model=model, cost=CostConfig(decode_batch=65)))
    with pytest.raises(ConfigError, match=r"^config.cost.decode_batch: 66 rows decoded together need at least 142 GB"
                                          r".* allowed: at most 65 rows for this model"):
        validate_run_config(RunConfig(model=model, cost=CostConfig(decode_batch=66)))
    validate_run_config(RunConfig(model=model, cost=CostConfig(decode_batch=4096, measure=False)))


def test_cost_section_loads_strictly_from_a_mapping():
    from reslab.models.config import load

    cfg = load(RunConfig, {"cost": {"decode_batch": 4, "repeats": 3}})
    assert cfg.cost == CostConfig(decode_batch=4, repeats=3)
    with pytest.raises(ConfigError, match=r"config.cost: unknown key\(s\) 'batch'"):
        load(RunConfig, {"cost": {"batch": 4}})


# --- the paired step ratio and its interval (models.serving.paired_ratio) ----------------------------
def test_median_ranks_against_scipys_binomial():
    # reference: scipy.stats.binom; k is the largest rank with 2 P(Bin(n, 1/2) <= k - 1) <= 1 - level
    from scipy.stats import binom

    from reslab.models.serving import median_ranks

    for level in (0.8, 0.9, 0.95, 0.99):
        for n in range(1, 300):
            ks = [k for k in range(1, (n + 1) // 2 + 1) if 2 * binom.cdf(k - 1, n, 0.5) <= 1 - level + 1e-12]
            assert median_ranks(n, level) == (max(ks) if ks else None), (n, level)
    assert median_ranks(5) is None and median_ranks(6) == 1 and median_ranks(128) == 53


def test_median_interval_covers_at_its_level_by_enumeration():
    # brute force: each of n values falls below the median or above it with probability 1/2, independently;
    # over all 2^n patterns, [x_(k), x_(n+1-k)] holds the median when at least k fall below and k above
    from reslab.models.serving import median_ranks

    for n in range(6, 15):
        k = median_ranks(n, 0.95)
        assert k is not None

        def coverage(rank: int, n: int = n) -> float:
            return sum(1 for pattern in itertools.product((0, 1), repeat=n)
                       if rank <= sum(pattern) <= n - rank) / 2**n

        assert coverage(k) >= 0.95 and (k + 1 > (n + 1) // 2 or coverage(k + 1) < 0.95)


def test_paired_ratio_is_the_median_step_ratio_with_its_order_statistics():
    import statistics

    from reslab.models.serving import Interval, paired_ratio

    gen = torch.Generator().manual_seed(0)
    control = (1 + torch.rand(40, generator=gen)).tolist()
    treatment = (1 + torch.rand(40, generator=gen)).tolist()
    got = paired_ratio(control, treatment)
    ratios = sorted(c / t for c, t in zip(control, treatment, strict=True))
    # n = 40 at 0.95: ranks 14 and 27 (scipy: 2 binom.cdf(13, 40, 0.5) = 0.0385, 2 cdf(14) = 0.0807)
    assert got == Interval(statistics.median(ratios), ratios[13], ratios[26], 40, 0.95)
    assert got.verdict(got.low) == "holds" and got.verdict(got.high + 1e-9) == "misses"
    assert got.verdict((got.low + got.high) / 2) == "undecided"
    few = paired_ratio([1.0, 2.0], [1.0, 1.0])
    assert few.verdict(0.1) == "undecided" and "too few" in few.text()
    with pytest.raises(ConfigError, match="one of each per pair"):
        paired_ratio([1.0], [1.0, 2.0])


def test_step_seconds_counts_the_threads_cpu_not_its_waits():
    import time

    from reslab.models.serving import step_seconds

    wall, cpu = step_seconds(lambda: time.sleep(0.05), torch.device("cpu"))
    assert wall >= 0.05 and cpu < 0.02
