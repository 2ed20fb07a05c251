"""Sharded data parallelism (FSDP2): a user's LightningModule that calls ``fully_shard`` in
``configure_model`` under Lightning's ``ModelParallelStrategy`` is protected by adding
``SparseCheckpointing``: each rank snapshots its local shards, and a failure of rank 1
mid-window recovers every shard bitwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO
from tests.forked import run_python

FAIL_AT = 7  # windows of 3 start at 0, 3, 6, 9: the failure strikes mid-window


def _run(out: Path, fail_at: int | None = None, ddp: bool = False) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    command = [str(REPO / "tests" / "sharded" / "fsdp_workload.py"), str(out),
               *([] if fail_at is None else [str(fail_at)]), *(["--ddp"] if ddp else [])]
    done = run_python(command, env=env, cwd=REPO, ranks=2, timeout_s=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_a_failed_rank_recovers_every_local_shard_bitwise(tmp_path: Path) -> None:
    reference = _run(tmp_path / "reference")
    failed = _run(tmp_path / "failed", FAIL_AT)
    unsharded = _run(tmp_path / "ddp", ddp=True)
    for rank in range(2):
        got, want = failed[rank], reference[rank]
        assert got["sharded"] and got["sharded"] == want["sharded"]  # FSDP2 sharded them
        assert got["fired"] == 1
        (recovery,) = got["recoveries"]
        assert recovery["ranks_rolled_back"] == [0, 1]  # the shard group rolls back
        assert got["frozen_during_replay"] and got["frozen_during_replay"][0] > 0
        assert got["params"].keys() == want["params"].keys()
        for name, shard in want["params"].items():
            assert torch.equal(got["params"][name], shard), (rank, name)
        assert got["optimizer"].keys() == want["optimizer"].keys()
        for name, state in want["optimizer"].items():
            for key, value in state.items():
                assert torch.equal(got["optimizer"][name][key], value), (rank, name, key)
        assert got["losses"].keys() == want["losses"].keys()
        for step, loss in want["losses"].items():
            assert torch.equal(got["losses"][step], loss), (rank, step)
        # Each rank holds half of every sharded tensor: half the bytes per snapshot.
        assert got["snapshot_bytes_per_iter"] <= 0.6 * unsharded[rank]["snapshot_bytes_per_iter"]
    # Whole experts per rank: the fused expert tensors are split between the ranks.
    experts = [sorted(o for o in failed[r]["operators"] if ".experts." in o) for r in range(2)]
    assert experts[0] and experts[1] and not set(experts[0]) & set(experts[1])
