"""The tries' spending sequence and content keys (issue 55 item 4). References: the Basel sum pi^2 / 6 and partial
sums by brute force (math.fsum); the keys recomputed by hand with hashlib."""

from __future__ import annotations

import hashlib
import json
import math

import pytest

from reslab.results.comparison import Comparison
from reslab.results.sequential import SequentialDesign
from reslab.results.tries import comparison_key, design_words, row_keys, seedless, spent_alpha, study_try, try_id


def test_the_spending_sequence_sums_to_alpha_and_never_beyond():
    alpha = 0.05
    assert spent_alpha(alpha, 1) == pytest.approx(alpha * 6 / math.pi ** 2)  # 0.0304
    assert spent_alpha(alpha, 3) == pytest.approx(alpha / 9 * 6 / math.pi ** 2)
    partial = [math.fsum(spent_alpha(alpha, k) for k in range(1, n + 1)) for n in (1, 10, 1000, 100_000)]
    assert partial == sorted(partial) and partial[-1] <= alpha
    # the tail past n is below alpha * 6 / (pi^2 n) (the integral of 1 / x^2 from n): the sum reaches alpha
    assert alpha - partial[-1] <= alpha * 6 / (math.pi ** 2 * 100_000)
    with pytest.raises(ValueError, match="starts at 1"):
        spent_alpha(alpha, 0)


CFG = {"model": {"d_model": 32}, "residual": {"name": "prenorm"}, "train": {"steps": 6, "seed": 4}}
TRT = {**CFG, "residual": {"name": "attnres"}}


def test_a_key_is_the_seedless_configs_and_the_metric():
    by_hand = hashlib.sha256(json.dumps(
        {"control": seedless(CFG), "treatment": seedless(TRT), "metric": "val_loss_tail"}, sort_keys=True,
        separators=(",", ":")).encode()).hexdigest()
    assert comparison_key(CFG, TRT, "val_loss_tail") == by_hand
    assert seedless(CFG)["train"] == {"steps": 6} and CFG["train"]["seed"] == 4
    other_seed = {**TRT, "train": {"steps": 6, "seed": 9}}
    assert comparison_key(CFG, other_seed, "val_loss_tail") == by_hand
    assert comparison_key(CFG, TRT, "val_loss") != by_hand
    assert comparison_key(TRT, CFG, "val_loss_tail") != by_hand  # the control is a role


def test_a_try_is_its_seeds_and_design():
    assert try_id([0, 1, 2]) == study_try((0, 1, 2)) != try_id([0, 1, 3])
    design = SequentialDesign(2, 1, 3)
    assert study_try((0, 1, 2), design) != study_try((0, 1, 2))
    assert design_words(3, 1) == "3 seeds, replicate 1"
    assert design_words(3, 0, design) == "sequential (start 2, batch 1, max 3), replicate 0"


def test_a_pooled_row_is_keyed_over_its_strata():
    configs = {(arm, f"model.d_model={d},optim.lr={lr}"): {**CFG, "residual": {"name": arm}, "d": d, "lr": lr}
               for arm in ("c", "t") for d in (32, 64) for lr in (1, 2)}
    plain = Comparison(name="m", control="c", treatments=("t",))
    pooled = Comparison(name="p", control="c", treatments=("t",), pool=("optim.lr",))
    got = row_keys([plain, pooled], configs)
    assert len([k for k in got if k[0] == "m"]) == 4
    strata = sorted(got[("m", "t", f"model.d_model=32,optim.lr={lr}")] for lr in (1, 2))
    assert got[("p", "t", "model.d_model=32,optim.lr=*")] == hashlib.sha256(
        json.dumps(strata, separators=(",", ":")).encode()).hexdigest()
    assert set(k for k in got if k[0] == "p") == {("p", "t", "model.d_model=32,optim.lr=*"),
                                                  ("p", "t", "model.d_model=64,optim.lr=*")}
