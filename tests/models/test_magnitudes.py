"""Magnitudes across depth (models/magnitudes.py): the recorded RMS and gradient norms against an independent
computation (forward hooks on the sublayers and norms, `torch.autograd.grad` of the same step's objective), the
summaries' formulas, and a run's records and summary."""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch

from reslab.models.config import CostConfig, ModelConfig, OptimConfig, ResidualConfig, RunConfig, TrainConfig
from reslab.models.magnitudes import MagnitudeRecorder, magnitude_record, route_max_late, summary_of
from reslab.models.training import Trainer, evaluate, train

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(name: str = "prenorm", steps: int = 4, **train_kw) -> RunConfig:
    return RunConfig(
        model=ModelConfig(preset="tiny", d_model=32, n_layers=2, n_heads=2, ffn_hidden=64, seq_len=32),
        residual=ResidualConfig(name=name),
        optim=OptimConfig(batch_size=4, warmup_steps=2, grad_accum=2, grad_clip=0.05),
        train=TrainConfig(steps=steps, eval_every=2, eval_windows=6, eval_batch_size=4, log_every=2, seed=5,
                          **train_kw),
        cost=CostConfig(measure=False),
    )


@pytest.mark.parametrize("name", ["prenorm", "attnres"])
def test_recorded_rms_equals_forward_hooks(name):
    """The eval windows' RMS per site, read off forward hooks: the pre-norm's input is what the sublayer reads
    (`sublayer_input`), the sublayer's output is u; pooled over every token and channel of the 6 windows (two
    batches of 4 and 2 rows)."""
    trainer = Trainer(tiny(name))
    model = trainer.model
    seen: dict[tuple[str, int], list[torch.Tensor]] = {}

    def keep(kind, site):
        def hook(module, args, output):
            seen.setdefault((kind, site), []).append((args[0] if kind == "in" else output).detach().double())
        return hook

    handles = [n.register_forward_hook(keep("in", s)) for s, n in enumerate(model.norms)]
    handles += [m.register_forward_hook(keep("out", s)) for s, m in enumerate(model.sublayers)]
    recorder = MagnitudeRecorder(4)
    loss = evaluate(model, trainer.val_batches, trainer.device, trainer.autocast, magnitudes=recorder)
    for h in handles:
        h.remove()
    assert math.isfinite(loss) and model.magnitudes is None
    in_rms, out_rms, layer_out = recorder.rms()

    def rms(tensors):
        flat = torch.cat([t.flatten() for t in tensors])
        return float(flat.square().mean().sqrt())

    assert len(seen[("in", 0)]) == 2  # both batches
    assert in_rms == pytest.approx([rms(seen[("in", s)]) for s in range(4)], rel=1e-5)
    assert out_rms == pytest.approx([rms(seen[("out", s)]) for s in range(4)], rel=1e-5)
    assert layer_out == pytest.approx([rms(seen[("out", 2 * i)] + seen[("out", 2 * i + 1)]) for i in range(2)],
                                      rel=1e-5)


def test_grad_norms_equal_autograd_of_the_step():
    """The step's gradient before clipping (clip 0.05 would change it; grad_accum 2: both micro-batches), per
    sublayer, per pre-norm and per layer, against `torch.autograd.grad` of the same objective on a copy of the
    model taken before the step. Only an eval step computes it."""
    cfg = tiny("attnres", steps=3)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_every=2))
    trainer = Trainer(cfg)
    trainer.train_step(0)  # done = 1: no eval follows, nothing computed
    assert trainer.grad_sums is None
    clone = copy.deepcopy(trainer.model)
    names, params = zip(*clone.named_parameters(), strict=True)
    total = [torch.zeros_like(p) for p in params]
    for start in (8, 12):  # step 1's two micro-batches of 4 (global batch 8)
        x, y = trainer.dataset.train_samples(start, 4, trainer.seq_len, cfg.data_seed)
        out = clone(x, y)
        objective = out.loss if out.aux_loss is None else out.loss + out.aux_loss
        for acc, g in zip(total, torch.autograd.grad(objective / 2, params, allow_unused=True), strict=True):
            if g is not None:
                acc += g
    grads = dict(zip(names, total, strict=True))

    def norm(prefix):
        return math.sqrt(sum(float(g.double().square().sum()) for n, g in grads.items() if n.startswith(prefix)))

    trainer.train_step(1)  # done = 2: an eval step
    sums = trainer.grad_sums
    assert sums is not None and sums.shape == (2, 4)
    sites = [norm(f"sublayers.{s}.") for s in range(4)]
    norms = [norm(f"norms.{s}.") for s in range(4)]
    assert sums[0].sqrt().tolist() == pytest.approx(sites, rel=1e-4)
    assert sums[1].sqrt().tolist() == pytest.approx(norms, rel=1e-4)
    assert sum(sites) > 0.05  # the clip bound: what was recorded is the gradient before clipping
    record, scalars = magnitude_record(MagnitudeRecorder(4), sums)
    layers = [math.sqrt(sites[2 * i] ** 2 + sites[2 * i + 1] ** 2 + norms[2 * i] ** 2 + norms[2 * i + 1] ** 2)
              for i in range(2)]
    assert record["grad_norm"] == pytest.approx(sites, rel=1e-4)
    assert record["layer_grad_norm"] == pytest.approx(layers, rel=1e-4)
    assert scalars["mag/grad_norm/l01"] == pytest.approx(layers[1], rel=1e-4)
    assert record["grad_cv"] == pytest.approx(float(np.std(layers) / np.mean(layers)), rel=1e-4)  # numpy: ddof 0
    assert math.isnan(record["growth"]) and "mag/growth" not in scalars  # nothing recorded: no growth


def test_summaries_formulas():
    """growth = the last layer's pooled output RMS over the first's; grad_cv with numpy's ddof-0 SD; route_max_late
    over the multi-source sites with 3 s >= 4 L (L = 3: sites 4, 5 and the readout 6)."""
    rec = MagnitudeRecorder(6)
    for site, (x, u) in enumerate([(1.0, 2.0), (3.0, 4.0), (5.0, 1.0), (1.0, 1.0), (2.0, 6.0), (1.0, 8.0)]):
        rec.add(site, torch.full((2, 3), x), torch.full((2, 3), u))
    record, scalars = magnitude_record(rec, torch.tensor([[1.0, 4.0, 9.0, 16.0, 25.0, 36.0], [0.0] * 6]))
    assert record["in_rms"] == pytest.approx([1, 3, 5, 1, 2, 1])
    assert record["layer_out_rms"] == pytest.approx([math.sqrt((4 + 16) / 2), 1.0, math.sqrt((36 + 64) / 2)])
    assert record["growth"] == pytest.approx(math.sqrt(50) / math.sqrt(10))
    assert record["stream_growth"] == pytest.approx(1 / 5)  # in_rms[5] / in_rms[2]: the state after layer 1
    layers = [math.sqrt(5), math.sqrt(25), math.sqrt(61)]
    assert record["grad_cv"] == pytest.approx(float(np.std(layers) / np.mean(layers)))
    assert set(scalars) >= {"mag/in_rms/s05", "mag/out_rms/l02", "mag/grad_norm/s00", "mag/growth", "mag/grad_cv"}
    routing = {"sites": [{"site": s, "sources": 1 if s == 0 else s + 1, "max_weight": w}
                         for s, w in enumerate([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])]}
    assert route_max_late(routing, 3) == pytest.approx((0.6 + 0.5 + 0.4) / 3)
    assert route_max_late({}, 3) is None and route_max_late(None, 3) is None
    assert summary_of({"mag/growth": 2.0, "mag/grad_cv": math.nan}) == {"growth": 2.0}


def test_a_run_records_magnitudes_at_every_eval_and_summarises_them(tmp_path):
    result = train(tiny("attnres"))
    evals = result.history["eval"]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert {"mag/out_rms/s03", "mag/in_rms/s00", "mag/grad_norm/l01", "mag/growth", "mag/grad_cv",
                "route_max_late"} <= set(e)
    assert result.summary["growth"] == evals[-1]["mag/growth"]
    assert result.summary["grad_cv"] == evals[-1]["mag/grad_cv"]
    assert result.summary["route_max_late"] == evals[-1]["route_max_late"]
    off = train(dataclasses.replace(tiny("prenorm"), train=dataclasses.replace(tiny().train, magnitudes=False)))
    assert not any(k.startswith("mag/") for k in off.history["eval"][-1])
    # prenorm does not route either
    assert {"growth", "stream_growth", "grad_cv", "route_max_late"}.isdisjoint(off.summary)
