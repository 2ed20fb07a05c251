"""Sharded data parallelism (FSDP2): a user's LightningModule that calls ``fully_shard`` in
``configure_model`` under Lightning's ``ModelParallelStrategy`` is protected by adding
``SparseCheckpointing``: each rank snapshots its local shards, and a failure of rank 1
mid-window, injected or real (SIGKILL, under the supervisor), recovers every shard
bitwise."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.bounded import run_bounded
from tests.conftest import REPO, alive
from tests.forked import run_python

FAIL_AT = 7  # windows of 3 start at 0, 3, 6, 9: the failure strikes mid-window


SUPERVISED_TIMEOUT_S = 30.0  # the supervisor's hang timeout (--timeout-s)


def _run(out: Path, fail_at: int | str | None = None, ddp: bool = False,
         supervised: bool = False) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    module = "tests.sharded.fsdp_workload"
    command = ["-m", module, str(out), *([] if fail_at is None else [str(fail_at)]),
               *(["--ddp"] if ddp else [])]
    if supervised:  # the supervisor starts both workers, forked with their imports done
        command = ["-m", "lightning_moe_ckpt.supervise", "--fork-workers", "--preload",
                   module, "--workers", "2", "--timeout-s", str(SUPERVISED_TIMEOUT_S),
                   "--status", str(out / "workers.json"), *command]
    done = run_python(command, env=env, cwd=REPO, ranks=1 if supervised else 2,
                      timeout_s=300)
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
        # The replay scaled the gradients by the clip coefficients the failed run logged.
        assert got["clip_during_replay"] and all(c < 1.0 for c in got["clip_during_replay"])
        _assert_same_shards(got, want, rank)
        assert got["losses"].keys() == want["losses"].keys()
        for step, loss in want["losses"].items():
            assert torch.equal(got["losses"][step], loss), (rank, step)
        # Each rank holds half of every sharded tensor: half the bytes per snapshot.
        assert got["snapshot_bytes_per_iter"] <= 0.6 * unsharded[rank]["snapshot_bytes_per_iter"]
    # Whole experts per rank: the fused expert tensors are split between the ranks.
    experts = [sorted(o for o in failed[r]["operators"] if ".experts." in o) for r in range(2)]
    assert experts[0] and experts[1] and not set(experts[0]) & set(experts[1])


def _assert_same_shards(got: dict[str, Any], want: dict[str, Any], rank: int) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, shard in want["params"].items():
        assert torch.equal(got["params"][name], shard), (rank, name)
    assert got["optimizer"].keys() == want["optimizer"].keys()
    for name, state in want["optimizer"].items():
        for key, value in state.items():
            assert torch.equal(got["optimizer"][name][key], value), (rank, name, key)


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The run no failure interrupts."""
    return _run(tmp_path_factory.mktemp("sharded") / "reference")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["kill", "kill_in_forward", "kill_in_backward"],
                         ids=["as-the-step-begins", "mid-forward", "mid-backward"])
def test_a_rank_killed_mid_window_is_replaced_and_every_shard_recovers_bitwise(
        tmp_path: Path, unkilled: list[dict[str, Any]], kind: str) -> None:
    """Under the supervisor rank 1 SIGKILLs itself at step 7 (mid-window): as the step
    begins, or inside a decoder layer's forward or backward while rank 0 is in the same
    pass. A new process takes rank 1, Lightning's ModelParallelStrategy forms its groups,
    and it recovers its shards from rank 0's replicas, while rank 0 keeps its process,
    drops its interrupted iteration and re-forms its groups around its live sharded model.
    Both end bitwise equal to the unkilled run."""
    killed = _run(tmp_path / "killed", f"{FAIL_AT}:{kind}", supervised=True)
    view = json.loads((tmp_path / "killed" / "workers.json").read_text())
    (replacement,) = view["replacements"]
    assert replacement["rank"] == 1 and replacement["cause"] == "exit -9"
    assert not alive(replacement["dead_pid"])  # the fault fired: that process is gone
    assert killed[1]["pid"] == replacement["new_pid"]
    assert view["worker_pids"]["0"] == [killed[0]["pid"]]  # the survivor kept its process
    for rank in range(2):
        got, want = killed[rank], unkilled[rank]
        assert got["sharded"] and got["sharded"] == want["sharded"]
        (recovery,) = got["real_recoveries"]
        assert recovery["failed_step"] == FAIL_AT and recovery["failed_ranks"] == [1]
        assert recovery["replacement"] == (rank == 1)
        assert recovery["ranks_rolled_back"] == [0, 1]  # the shard group rolls back
        assert recovery["iterations_replayed"] >= 1
        _assert_same_shards(got, want, rank)
        # Losses: every step of the survivor's; the replacement's from where it joined.
        steps = [step for step in want["losses"] if rank == 0 or step >= FAIL_AT]
        assert sorted(got["losses"]) == sorted(steps)
        for step in steps:
            assert torch.equal(got["losses"][step], want["losses"][step]), (rank, step)


@pytest.mark.distributed
def test_under_a_launcher_a_spare_node_takes_the_killed_rank_and_every_shard_recovers_bitwise(
        tmp_path: Path, unkilled: list[dict[str, Any]]) -> None:
    """The same module on two nodes of one rank and a spare node, started as ``srun``
    starts tasks (``recipes/cluster.py``) beside the supervisor: rank 1 SIGKILLs itself
    at step 7, the spare node's task takes its rank and recovers its shards from rank 0's
    replicas, and both end bitwise equal to the unkilled run."""
    out = tmp_path / "cluster"
    out.mkdir()
    supervisor = ["--workers=2", "--spare-nodes=1", f"--timeout-s={SUPERVISED_TIMEOUT_S}",
                  f"--status={out / 'workers.json'}"]
    done = run_bounded(
        [sys.executable, str(REPO / "recipes" / "cluster.py"), "--nodes", "3",
         "--ranks-per-node", "1", *(f"--supervisor-arg={arg}" for arg in supervisor), "--",
         "-m", "tests.sharded.fsdp_workload", str(out), f"{FAIL_AT}:kill"],
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        timeout_s=300, terminate_first=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    view = json.loads((out / "workers.json").read_text())
    (replacement,) = view["replacements"]
    assert replacement["rank"] == 1 and replacement["cause"] == "exit -9"
    assert replacement["spare_node"] == 0 and [replacement["new_pid"]] == view[
        "spare_node_pids"][0]
    killed = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert killed[1]["pid"] == replacement["new_pid"]
    assert view["worker_pids"]["0"] == [killed[0]["pid"]]  # the survivor kept its process
    for rank in range(2):
        _assert_same_shards(killed[rank], unkilled[rank], rank)
        (recovery,) = killed[rank]["real_recoveries"]
        assert recovery["failed_step"] == FAIL_AT and recovery["failed_ranks"] == [1]


@pytest.mark.distributed
def test_a_stopped_job_of_a_sharded_module_resumes_by_itself_bitwise(
        tmp_path: Path, unkilled: list[dict[str, Any]]) -> None:
    """The sharded module with a durable checkpoint every 3 steps (a DCP directory of
    each rank's shards under Lightning's ModelParallelStrategy, committed by its
    manifest): rank 1 is killed at step 7 with no replacement allowed, so the job ends
    with the no-spare code; the same command started again resumes from the newest
    committed checkpoint (step 6) by itself and every shard ends bitwise equal to the
    unkilled run."""
    from lightning_moe_ckpt.failures.protocol import EXIT_NO_SPARE
    from lightning_moe_ckpt.recovery.manifest import committed_steps

    out = tmp_path / "job"
    out.mkdir()
    module = "tests.sharded.fsdp_workload"
    command = ["-m", "lightning_moe_ckpt.supervise", "--fork-workers", "--preload", module,
               "--workers", "2", "--max-restarts", "0", "--timeout-s",
               str(SUPERVISED_TIMEOUT_S), "-m", module, str(out), f"{FAIL_AT}:kill",
               "--durable"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    first = run_python(command, env=env, cwd=REPO, ranks=1, timeout_s=300)
    assert first.returncode == EXIT_NO_SPARE, first.stdout[-2000:] + first.stderr[-3000:]
    assert committed_steps(out / "durable") == [3, 6]
    assert (out / "durable" / "step=6.ckpt" / ".metadata").is_file()  # DCP's own layout
    second = run_python(command, env=env, cwd=REPO, ranks=1, timeout_s=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    resumed = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in range(2):
        assert resumed[rank]["resumed_from"] == str(out / "durable" / "step=6.ckpt")
        assert resumed[rank]["fired"] == 0  # the fault struck the first run only
        _assert_same_shards(resumed[rank], unkilled[rank], rank)
