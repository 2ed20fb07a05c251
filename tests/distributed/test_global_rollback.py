"""Failure injection with global rollback (gloo, multi-process): after the failed ranks'
state is destroyed, every rank converts the common persisted window (the failed ones
fetch theirs from replicas) and replays; the result is bitwise the fault-free run's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.workloads import distributed_run, make_settings, rollback_check

pytestmark = pytest.mark.distributed

WINDOW, STEPS = 3, 11


@pytest.mark.parametrize(("layout", "precision", "fail_step", "failed"), [
    ((2, 1, 1), "32", 7, [1]),            # mid-window, last stage lost
    ((2, 1, 2), "bf16-master", 5, [0]),   # expert-parallel stage 0 rank lost
    ((1, 1, 2), "32", 2, [1]),            # inside the first window: initial state
    ((2, 2, 1), "32", 9, [0, 3]),         # two simultaneous failures, different stages
], ids=["pp2-mid", "pp2ep2-bf16", "ep2-first-window", "pp2dp2-two-failures"])
def test_global_rollback_is_bitwise(layout: tuple[int, int, int], precision: str,
                                    fail_step: int, failed: list[int]) -> None:
    settings = make_settings(*layout, precision=precision, steps=STEPS)
    world = settings.layout.world_size
    golden_state, golden_losses = run_distributed(world, distributed_run, settings)
    result = run_distributed(world, rollback_check, settings, WINDOW, fail_step, failed)
    for rank, facts in enumerate(result["ranks"]):
        assert facts["destroyed"] == (rank in failed)  # the failure fired where injected
        assert facts["window_start"] < fail_step and facts["replayed"] >= 0
    assert result["losses"] == golden_losses
    state = result["state"]
    for section in ("model", "compute"):
        for name, tensor in golden_state[section].items():
            assert torch.equal(state[section][name], tensor), (section, name)
    for name, entries in golden_state["optimizer"].items():
        for key, tensor in entries.items():
            assert torch.equal(state["optimizer"][name][key], tensor), (name, key)
    if fail_step < WINDOW:
        assert {f["window_start"] for f in result["ranks"]} == {-1}
