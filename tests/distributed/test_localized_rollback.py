"""Localized rollback with upstream logging (gloo, multi-process): only the failed stage's
ranks replay, from the neighbours' logged activations and gradients; the other ranks run
no forward/backward during recovery; the result is bitwise the fault-free run's."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.workloads import distributed_run, localized_check, make_settings

pytestmark = pytest.mark.distributed

WINDOW, STEPS = 3, 11


@pytest.mark.parametrize(("layout", "precision", "fail_step", "failed"), [
    ((2, 1, 1), "32", 7, [1]),            # last stage fails mid-window
    ((2, 1, 1), "bf16-master", 8, [0]),   # first stage fails
    ((2, 1, 2), "32", 10, [2]),           # one rank of an expert-parallel stage fails
], ids=["pp2-last", "pp2-first-bf16", "pp2ep2"])
def test_localized_rollback_is_bitwise_and_pauses_the_rest(
        layout: tuple[int, int, int], precision: str, fail_step: int,
        failed: list[int]) -> None:
    settings = make_settings(*layout, precision=precision, steps=STEPS)
    world = settings.layout.world_size
    ep = layout[2]
    golden_state, golden_losses = run_distributed(world, distributed_run, settings)
    result = run_distributed(world, localized_check, settings, WINDOW, fail_step, failed)
    failed_stages = {rank // (layout[1] * ep) for rank in failed}
    for rank, facts in enumerate(result["ranks"]):
        assert facts["destroyed"] == (rank in failed)
        in_scope = rank // (layout[1] * ep) in failed_stages
        assert facts["in_scope"] == in_scope, rank
        if in_scope:
            assert facts["replay_calls"] > 0  # the scope replayed
        else:
            assert facts["paused_calls"] == 0  # paused: no forward/backward at all
    assert result["losses"] == golden_losses
    state = result["state"]
    for section in ("model", "compute"):
        for name, tensor in golden_state[section].items():
            assert torch.equal(state[section][name], tensor), (section, name)
    for name, entries in golden_state["optimizer"].items():
        for key, tensor in entries.items():
            assert torch.equal(state["optimizer"][name][key], tensor), (name, key)
