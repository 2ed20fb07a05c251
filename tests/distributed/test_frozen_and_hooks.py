"""Frozen operators under EP and PP, and the pipeline boundary hook (gloo, multi-process)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.workloads import (
    FROZEN,
    boundary_hook_check,
    frozen_step_check,
    make_settings,
)

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("precision", ["32", "bf16-master"])
def test_freezing_across_ep_and_pp_ranks(precision: str) -> None:
    # Clipping off: the global norm (hence the step of every active operator) would
    # otherwise depend on which operators are frozen.
    settings = make_settings(2, 1, 2, precision=precision, max_grad_norm=None)
    result = run_distributed(4, frozen_step_check, settings)
    ranks = result["ranks"]
    frozen_somewhere = sorted({name for r in ranks for name in r["frozen_here"]})
    assert frozen_somewhere == sorted(FROZEN)
    # Each EP rank of stage 0 holds half of layer 0's experts: 1 on ep rank 0, 6 on ep 1.
    assert "layers.0.moe.experts.1" in ranks[0]["frozen_here"]
    assert "layers.0.moe.experts.6" in ranks[1]["frozen_here"]
    assert all(r["n_frozen_params"] > 0 for r in ranks)
    for rank, report in enumerate(ranks):
        assert report["problems"] == [], (rank, report["problems"][:5])


@pytest.mark.parametrize("layout", [(2, 1, 1), (2, 1, 2)], ids=["pp2", "pp2ep2"])
def test_boundary_hook_sees_every_tensor_once(layout: tuple[int, int, int]) -> None:
    steps, microbatches = 2, 4
    settings = make_settings(*layout, steps=steps, microbatches=microbatches)
    ranks = run_distributed(settings.layout.world_size, boundary_hook_check, settings)["ranks"]
    ep = layout[2]
    for rank, report in enumerate(ranks):
        stage = rank // ep
        kind = "activation" if stage == 0 else "gradient"
        expected = {(kind, it, mb, stage) for it in range(steps) for mb in range(microbatches)}
        assert set(report["calls"]) == expected, rank
        assert all(count == 1 for count in report["calls"].values()), rank
    for rank, report in enumerate(ranks):
        peer = ranks[rank + ep] if rank < ep else ranks[rank - ep]  # same ep index, other stage
        for key, received in report["received"].items():
            sent = peer["sent"][key]
            assert len(sent) == len(received)
            for a, b in zip(sent, received, strict=True):
                assert a is not None and torch.equal(a, b), key
        assert len(report["received"]) == steps * microbatches
