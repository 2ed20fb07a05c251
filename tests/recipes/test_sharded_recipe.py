"""``parallel.dp_shard`` in the training recipe: the built-in model sharded by FSDP2 over a
shard group, composed with expert and pipeline parallelism, trains through an injected
failure and a real SIGKILL and ends bitwise equal to its fault-free run. (Its fault-free
equivalence to the single-process run, to rounding, is in
``tests/distributed/test_equivalence.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.recipes.test_real_failures import (
    _assert_bitwise,
    _assert_paused_ran_nothing,
    _assert_replaced,
)
from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHARD_EP = ("parallel.dp_shard=2", "parallel.ep=2", "checkpoint.window=3",
            "trainer.max_steps=12")
PP_SHARD = ("api=fabric", "parallel.pp=2", "parallel.dp_shard=2", "parallel.microbatches=4",
            "trainer.max_steps=12", "checkpoint.window=3", "recovery.timeout_s=60")


def _run(out: Path, *overrides: str) -> dict[str, Any]:
    result = run_recipe(out, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    return metrics


def test_an_injected_failure_under_dp_shard_and_ep_recovers_bitwise(tmp_path: Path) -> None:
    """The issue's command: ``parallel.dp_shard=2 parallel.ep=2``, rank 2 fails at step 9
    (mid-window). Every rank holds half of its stage's parameters and optimizer state, so
    a snapshot holds half the bytes of the same layout with replicated ``parallel.dp=2``."""
    golden = _run(tmp_path / "golden", *SHARD_EP)
    metrics = _run(tmp_path / "failed", *SHARD_EP, "faults=at",
                   "faults.events=[{step: 9, rank: 2}]")
    assert metrics["layout"]["dp_shard"] == 2
    assert metrics["failures_injected"] == 1
    (recovery,) = metrics["recoveries"]
    assert recovery["failed_step"] == 9 and recovery["failed_ranks"] == [2]
    assert recovery["lost_tokens"] == 0 and recovery["window"] == 3
    # One stage: its shard groups take part in every collective, so every rank rolls back.
    assert recovery["ranks_rolled_back"] == [0, 1, 2, 3]
    assert recovery["iterations_replayed"] >= 1
    assert metrics["loss"] == golden["loss"]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "failed" / "final_state.pt")
    # Rank 0's shard group is {0, 2}: its two replicas go to ranks 1 and 3.
    assert metrics["replica_peers"] == [1, 3]
    replicated = _run(tmp_path / "replicated", "parallel.dp=2", *SHARD_EP[1:])
    ratio = metrics["snapshot_bytes_per_iter"] / replicated["snapshot_bytes_per_iter"]
    assert ratio <= 0.55, ratio


def test_a_durable_checkpoint_of_local_shards_resumes_and_recovers_bitwise(
        tmp_path: Path) -> None:
    """Each rank writes its local shards into the durable checkpoint (plain tensors, read
    back without a device mesh). Every rank failing at once falls back to it, and a new run
    started from it with ``ckpt_path`` ends bitwise equal to the uninterrupted run."""
    common = (*SHARD_EP, "trainer.precision=bf16-master", "checkpoint.durable_every=7")
    everyone = ", ".join(f"{{step: 11, rank: {rank}}}" for rank in range(4))
    golden = _run(tmp_path / "golden", *common)
    assert [Path(p).name for p in golden["durable_checkpoints"]] == ["step=7.ckpt"]
    metrics = _run(tmp_path / "all_failed", *common, "faults=at",
                   f"faults.events=[{everyone}]")
    (recovery,) = metrics["recoveries"]
    assert recovery["window_start"] == 7 and recovery["iterations_replayed"] == 4
    assert metrics["loss"] == golden["loss"]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "all_failed" / "final_state.pt")
    checkpoint = golden["durable_checkpoints"][0]
    resumed = _run(tmp_path / "resumed", *SHARD_EP, "trainer.precision=bf16-master",
                   f"ckpt_path='{checkpoint}'")
    assert resumed["loss"] == golden["loss"][7:]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "resumed" / "final_state.pt")


def test_a_real_kill_under_pp_and_dp_shard_recovers_the_shard_group_bitwise(
        tmp_path: Path) -> None:
    """``parallel.pp=2 parallel.dp_shard=2`` under the supervisor: rank 3 (stage 1) is
    SIGKILLed at step 9. Its shard group (stage 1's ranks 2 and 3) rolls back; the
    replacement takes its shards from its replicas; stage 0 pauses."""
    _kill_rank_3_of_stage_1(tmp_path, PP_SHARD, step=9)


def _kill_rank_3_of_stage_1(tmp_path: Path, common: tuple[str, ...], step: int) -> None:
    """SIGKILL rank 3 at ``step`` under ``pp=2 dp_shard=2``: it is replaced, stage 1's
    shard group (ranks 2 and 3) rolls back while stage 0 pauses, and the run ends bitwise
    equal to the unkilled one."""
    golden = tmp_path / "golden"
    _run(golden, *common)
    out = tmp_path / "killed"
    result = run_recipe(out, *common, "faults=at", "faults.kind=kill",
                        f"faults.events=[{{step: {step}, rank: 3}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(out, 3, "exit -9", world=4)
    _assert_bitwise(golden, out, metrics)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == step and recovery["ranks_rolled_back"] == [2, 3]
    _assert_paused_ran_nothing(recovery, world=4)


HF_SHARD = ("model=hf_qwen3_moe", "parallel.dp_shard=2", "trainer.max_steps=10",
            "checkpoint.window=3")


def test_hugging_face_model_under_dp_shard_and_ep_recovers_an_injected_failure_bitwise(
        tmp_path: Path) -> None:
    """The Hugging Face plan shards a Qwen3-MoE's layers, embedding, norm and head over
    ``dp_shard`` on top of its experts over ``ep``: rank 1 fails at step 7."""
    golden = _run(tmp_path / "golden", *HF_SHARD, "parallel.ep=2")
    metrics = _run(tmp_path / "failed", *HF_SHARD, "parallel.ep=2", "faults=at",
                   "faults.events=[{step: 7, rank: 1}]")
    assert metrics["failures_injected"] == 1
    (recovery,) = metrics["recoveries"]
    assert recovery["failed_ranks"] == [1] and recovery["lost_tokens"] == 0
    assert recovery["iterations_replayed"] == 3
    assert metrics["loss"] == golden["loss"]
    assert_states_equal(tmp_path / "golden" / "final_state.pt",
                        tmp_path / "failed" / "final_state.pt")


def test_hugging_face_model_under_pp_and_dp_shard_survives_a_real_kill_bitwise(
        tmp_path: Path) -> None:
    _kill_rank_3_of_stage_1(tmp_path, (*HF_SHARD, "parallel.pp=2", "parallel.microbatches=4",
                                       "recovery.timeout_s=60"), step=7)
