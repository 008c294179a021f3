"""bench/traffic_model.py: its site counts against real models, its byte counts against brute force."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from reslab.models.backbone import build_model
from reslab.models.config import ModelConfig, ResidualConfig

_PATH = Path(__file__).resolve().parents[2] / "bench" / "traffic_model.py"
_spec = importlib.util.spec_from_file_location("traffic_model", _PATH)
traffic = importlib.util.module_from_spec(_spec)
sys.modules["traffic_model"] = traffic  # dataclasses look their module up there
_spec.loader.exec_module(traffic)


@pytest.mark.parametrize("name, options", [("attnres", {}), ("block_attnres", {"block_size": 3}),
                                           ("block_attnres", {"block_size": 4}), ("mhar", {"heads": 2})])
def test_site_sources_match_the_model(name, options):
    # the sources each routing site reads, as the model's routing recorder sees them
    model = build_model(ModelConfig(preset="tiny", d_model=16, n_layers=3, n_heads=2, ffn_hidden=32, seq_len=4),
                        ResidualConfig(name=name, options=options), vocab_size=16)
    stats = model.routing_stats(torch.zeros(1, 4, dtype=torch.long))
    seen = [len(stats.sites[key].weights) for key in sorted(stats.sites)]
    assert seen == traffic.site_sources(name, 3, options.get("block_size", 4))


def test_floor_and_today_against_brute_force():
    shape = traffic.Shape(rows=6, dim=10, heads=2, elem=2)
    ns = [1, 2, 4]
    plane = 6 * 10 * 2
    # floor: per site, N sources read forward and backward, N gradients written, out and dout
    floor = sum(n * plane * 3 + 2 * plane for n in ns)
    assert traffic.floor_bytes(ns, shape) == floor
    # today, one site: the kernels' (4N + 2) planes (kernels/depth_read/README.md), weights
    # [N, M, H] and inverse RMS [N, M] float32 written once and read in the backward (weights twice)
    n = 4
    small = 4 * 6 * (n * 2 + n) + 4 * 6 * (2 * n * 2 + n)
    assert traffic.design_bytes("today", [n], shape, n_written=0) == (4 * n + 2) * plane + small
    # autograd sums: a source read by K sites costs K - 1 in-place adds of 3 planes
    two_sites = traffic.design_bytes("today", [2, 2], shape, 0) - 2 * traffic.design_bytes("today", [2], shape, 0)
    assert two_sites == 2 * 3 * plane


def test_kept_design_within_issue_target_at_gpt2():
    shape = traffic.Shape(rows=16 * 1024, dim=768, heads=1, elem=2)
    ns = traffic.site_sources("attnres", 12)
    ratio = traffic.design_bytes(traffic.KEPT, ns, shape, n_written=25) / traffic.floor_bytes(ns, shape)
    assert ratio <= 1.3
    assert traffic.design_bytes("+inplace", ns, shape, 25) > traffic.design_bytes("today", ns, shape, 25)
