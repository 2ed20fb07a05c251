"""Users' own MoE models under pipeline and expert parallelism, through a plan.

A Hugging Face Qwen3-MoE takes the built-in plan; a torchtitan-style grouped-experts model
brings its own ``parallelize_fn``. Pure pipeline layouts read the same tokens and sum
micro-batch gradients in the same order as the single-process run: bitwise. Expert-parallel
layouts average over data shards in another association order (and combine an expert's
top-k outputs in another order), so they match to rounding: parameters and Adam moments
within ``rtol=1e-4, atol=1e-6`` after 3 steps (observed differences below 1e-7), losses
within ``rtol=1e-5``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from tests.anymodel.models import grouped_experts_moe, qwen3_moe
from tests.distributed.harness import run_distributed
from tests.distributed.staged_workloads import (
    parallelize_grouped_experts,
    split_under_dp_shard,
    train_staged,
)

pytestmark = pytest.mark.distributed

STEPS = 3


def _assert_states(reference: dict[str, Any], got: dict[str, Any], bitwise: bool) -> None:
    assert got["state"].keys() == reference["state"].keys()
    # Operators keep their layout-independent names: expert shards by global expert id.
    assert got["operators"] == reference["operators"]
    for name, tensors in reference["state"].items():
        assert got["state"][name].keys() == tensors.keys(), name
        for key, expected in tensors.items():
            actual = got["state"][name][key]
            assert actual.shape == expected.shape, (name, key)
            if bitwise:
                assert torch.equal(actual, expected), (name, key)
            else:
                torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-6)
    if bitwise:
        assert torch.equal(got["losses"], reference["losses"])
    else:
        torch.testing.assert_close(got["losses"], reference["losses"], rtol=1e-5, atol=0)
    # The run trained: no parameter is still at its initial value by accident of a no-op.
    assert not torch.equal(reference["losses"][0], reference["losses"][-1])


@cache
def _qwen_reference(shards: int) -> dict[str, Any]:
    """The single-process run of ``shards`` data shards (shared by the tests)."""
    result: dict[str, Any] = run_distributed(1, train_staged, qwen3_moe, 1, 1, STEPS, None,
                                             shards)
    return result


def test_hf_qwen3_moe_pipeline_equals_the_single_process_run_bitwise() -> None:
    reference = _qwen_reference(1)
    _assert_states(reference, run_distributed(2, train_staged, qwen3_moe, 2, 1, STEPS),
                   bitwise=True)


@pytest.mark.parametrize(("pp", "ep"), [(1, 2), (2, 2)], ids=["ep2", "pp2xep2"])
def test_hf_qwen3_moe_expert_parallel_matches_to_rounding(pp: int, ep: int) -> None:
    reference = _qwen_reference(2)
    got = run_distributed(pp * ep, train_staged, qwen3_moe, pp, ep, STEPS)
    _assert_states(reference, got, bitwise=False)


@pytest.mark.parametrize(("pp", "ep"), [(1, 1), (2, 1), (1, 2)], ids=["dp_shard2", "pp2",
                                                                     "ep2"])
def test_hf_qwen3_moe_sharded_over_dp_shard_matches_to_rounding(pp: int, ep: int) -> None:
    """``dp_shard=2``: the built-in plan shards every decoder layer, the embedding, the
    final norm and ``lm_head`` with FSDP2; each rank reads its own data shard."""
    reference = _qwen_reference(2 * ep)
    got = run_distributed(pp * 2 * ep, train_staged, qwen3_moe, pp, ep, STEPS, None, None, 2)
    _assert_states(reference, got, bitwise=False)


def test_a_parallelize_fn_that_shards_nothing_is_refused_under_dp_shard() -> None:
    message = run_distributed(2, split_under_dp_shard, grouped_experts_moe,
                              parallelize_grouped_experts)
    assert "parallel.dp_shard=2, but the plan for GroupedExpertsLM sharded no parameter" \
        in message, message
    assert "mesh['dp_shard']" in message


def test_grouped_experts_model_trains_through_its_parallelize_fn() -> None:
    reference = run_distributed(1, train_staged, grouped_experts_moe, 1, 1, STEPS,
                                parallelize_grouped_experts, 2)
    got = run_distributed(4, train_staged, grouped_experts_moe, 2, 2, STEPS,
                          parallelize_grouped_experts)
    _assert_states(reference, got, bitwise=False)
