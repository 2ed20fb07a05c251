"""Ranks per node come from the launcher, so that replicas land on other nodes."""

from __future__ import annotations

import pytest

from lightning_moe_ckpt.core.nodes import launcher_node_size, launcher_ranks_per_node
from lightning_moe_ckpt.errors import ConfigError


def test_the_launcher_says_how_many_ranks_share_a_node() -> None:
    assert launcher_ranks_per_node(4, {}) == 4  # what the caller knows
    assert launcher_ranks_per_node(0, {}) == 1
    assert launcher_ranks_per_node(8, {"LOCAL_WORLD_SIZE": "2"}) == 2  # torchrun
    assert launcher_ranks_per_node(8, {"SLURM_NTASKS_PER_NODE": "4"}) == 4
    assert launcher_ranks_per_node(8, {"SLURM_STEP_TASKS_PER_NODE": "2(x3)"}) == 2
    assert launcher_ranks_per_node(8, {"SLURM_STEP_TASKS_PER_NODE": "3,2"}) == 3
    # The supervisor's --ranks-per-node (nodes of several ranks on one machine) comes first.
    assert launcher_ranks_per_node(8, {"MOE_RANKS_PER_NODE": "2", "LOCAL_WORLD_SIZE": "8"}) == 2
    assert launcher_node_size({}) is None


@pytest.mark.parametrize(("key", "value"), [("LOCAL_WORLD_SIZE", "0"), ("MOE_RANKS_PER_NODE", "-2"),
                                            ("LOCAL_WORLD_SIZE", "two"),
                                            ("SLURM_NTASKS_PER_NODE", "x")])
def test_a_malformed_launcher_variable_is_named(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}="):
        launcher_ranks_per_node(8, {key: value})
