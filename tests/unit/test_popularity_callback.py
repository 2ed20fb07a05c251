"""The PopularityMonitor callback: popularity shares from the routing of real iterations."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from lightning_moe_ckpt.callbacks import PopularityMonitor
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config


def test_hard_shares_match_routed_token_counts() -> None:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"global_batch": 8, "max_steps": 4}}))
    engine = TrainingEngine.local(settings)
    tracker = PopularityMonitor("hard")
    tracker.attach(engine)
    totals = torch.zeros(4, 8)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, 256, (2, 4, 17), generator=generator)
        totals += engine.train_iteration(tokens[..., :-1], tokens[..., 1:]).expert_load
    shares = tracker.shares()
    expected = totals.double() / totals.double().sum(dim=1, keepdim=True)
    torch.testing.assert_close(shares, expected)
    stats = tracker.layer_statistics()
    assert stats["popularity/layer0_top_share"] == float(expected[0].max())
    assert 0.0 < stats["popularity/layer2_entropy"] <= 1.0
    restored = PopularityMonitor("hard")
    restored.load_state_dict(tracker.state_dict())
    restored.attach(TrainingEngine.local(settings))
    torch.testing.assert_close(restored.shares(), shares)
