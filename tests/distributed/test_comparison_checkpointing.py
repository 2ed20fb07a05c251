"""A user's own periodic checkpointing (the benchmark's peers: Lightning's
``AsyncCheckpointIO`` and DCP's ``async_save``) across pipeline ranks: every rank saves
at the same ``k`` and a restart from the newest checkpoint every rank completed ends
bitwise equal to the fault-free run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.workloads import make_settings, peer_checkpointing_run, reference_run

pytestmark = pytest.mark.distributed

FAILURE_STEP = 7


def _tensors(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {name: tensor for key, inner in value.items()
                for name, tensor in _tensors(inner, f"{prefix}/{key}").items()}
    return {}


@pytest.mark.parametrize("policy", ["lightning", "dcp"])
def test_ranks_measuring_apart_save_at_one_k_and_restart_bitwise(policy: str,
                                                                 tmp_path: Path) -> None:
    settings = make_settings(2, 1, 1, steps=10)
    reference, _ = reference_run(settings)
    state, ranks = run_distributed(2, peer_checkpointing_run, settings, policy, str(tmp_path),
                                   FAILURE_STEP)
    # One k for the job, from the slower figures (rank 0's 1000 s iterations): without it
    # rank 1 would choose a k thousands of times larger, and rank 0's collectives after
    # its saves would wait for rank 1 in vain.
    assert ranks[0]["interval"] == ranks[1]["interval"] == 1
    for rank in ranks:
        (recovery,) = rank["recoveries"]  # the failure fired on every rank
        assert recovery["failed_step"] == FAILURE_STEP
        assert recovery["restored_step"] == FAILURE_STEP  # k = 1: the state it stopped in
    expected, got = _tensors(reference), _tensors(state)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
