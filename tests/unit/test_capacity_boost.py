"""MoEtion's capacity boost reaches the model: a per-expert ``capacity_scale`` on an MoE
layer lets a boosted expert accept more assignments, and a scale of ones changes nothing."""

from __future__ import annotations

import math

import torch

from lightning_moe_ckpt.models import MoELayer


def _layer() -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(d_model=8, n_experts=4, top_k=2, expert_hidden=16, capacity_factor=0.5)


def test_scale_of_ones_is_bitwise_the_unscaled_layer() -> None:
    layer, x = _layer(), torch.randn(3, 16, 8)
    plain = layer(x)
    dropped = layer.dropped_assignments.clone()
    layer.reset_stats()
    layer.capacity_scale = torch.ones(4, dtype=torch.float64)
    assert torch.equal(layer(x), plain)
    assert torch.equal(layer.dropped_assignments, dropped)


def test_boosted_expert_accepts_more() -> None:
    layer, x = _layer(), torch.randn(3, 16, 8)
    base = layer.capacity(16)
    assert base == math.ceil(0.5 * 16 * 2 / 4)
    layer(x)
    dropped = float(layer.dropped_assignments)
    assert dropped > 0  # capacity binds on this input
    layer.reset_stats()
    layer.capacity_scale = torch.full((4,), 1.1, dtype=torch.float64)
    scaled = layer.expert_capacities(16)
    assert scaled is not None and scaled.tolist() == [math.ceil(1.1 * 0.5 * 16 * 2 / 4)] * 4
    layer(x)
    assert float(layer.dropped_assignments) < dropped
    layer.reset_stats()
    layer.capacity_scale = torch.tensor([1.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    scaled = layer.expert_capacities(16)
    assert scaled is not None and scaled.tolist() == [base, base, 2 * base, base]
    layer(x)
    assert float(layer.dropped_assignments) <= dropped
