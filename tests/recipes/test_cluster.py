"""Several nodes on one machine: ``recipes/cluster.py`` starts the tasks as ``srun`` would
(one process group per node) beside the supervisor, which hosts the store in a process of
its own. A node lost at once (every rank on it SIGKILLs itself), a lost rank, and a job
that runs out of spares: each ends bitwise equal to the run without the failure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lightning_moe_ckpt.failures.supervisor import EXIT_NO_SPARE
from tests.bounded import run_bounded
from tests.conftest import REPO, alive
from tests.recipes.test_train_recipe import TRAIN, assert_states_equal, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

CLUSTER = REPO / "recipes" / "cluster.py"
LAYOUT = ("parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2",
          "trainer.max_steps=16", "checkpoint.window=3")
PP2_DP2 = (*LAYOUT, "recovery.timeout_s=60")


def run_cluster(out: Path, nodes: int, *overrides: str, cluster_args: Sequence[str] = ()
                ) -> subprocess.CompletedProcess[str]:
    """``python recipes/cluster.py --nodes NODES --ranks-per-node 2 [cluster_args] --
    recipes/train.py ...`` in bounded time: on overrun it is sent SIGTERM (it ends the
    supervisor and every node's process group), then its own group is killed."""
    command = [sys.executable, str(CLUSTER), "--nodes", str(nodes), "--ranks-per-node", "2",
               *cluster_args, "--", str(TRAIN), f"out_dir={out}", "trainer.progress_bar=false",
               *overrides]
    return run_bounded(command, env={**os.environ, "HYDRA_FULL_ERROR": "1"},
                       terminate_first=True)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    result = run_recipe(out, *PP2_DP2)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _replaced(out: Path, lost: list[int], cause: str = "exit -9") -> dict[str, Any]:
    """Every rank of ``lost`` failed of ``cause`` and was taken over by a spare task;
    every other rank kept its process; no process of the job is left."""
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    assert metrics["launcher_tasks"] is True
    replacements = sorted(metrics["replacements"], key=lambda r: r["rank"])
    assert [(r["rank"], r["cause"]) for r in replacements] == [(r, cause) for r in lost]
    assert all(r["warm_spare"] and r["generation"] == 1 for r in replacements)
    pids = metrics["worker_pids"]
    for rank in range(4):
        if rank in lost:
            (r,) = (r for r in replacements if r["rank"] == rank)
            assert pids[str(rank)] == [r["dead_pid"], r["new_pid"]]
        else:
            assert len(pids[str(rank)]) == 1, pids  # the survivors kept their processes
    assert not any(alive(pid) for rank_pids in pids.values() for pid in rank_pids)
    return metrics


@pytest.mark.parametrize("node", [1, 0], ids=["last-stage", "the-node-of-rank-0"])
def test_a_lost_node_is_taken_over_by_the_spare_node_bitwise(
        tmp_path: Path, golden: Path, node: int) -> None:
    """pp=2 x dp=2 on nodes 0 and 1 (node n runs stage n), node 2 the spare: every rank of
    node ``node`` is SIGKILLed at step 13. The spare node's tasks take its ranks, rank for
    rank, their windows come from replicas on the other node, and the job ends bitwise
    equal to the run without the failure (losing rank 0's node too: the store is not in
    a training rank)."""
    result = run_cluster(tmp_path, 3, *PP2_DP2, "parallel.spare_nodes=1", "faults=at",
                         "faults.kind=kill", f"faults.events=[{{step: 13, node: {node}}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    lost = [2 * node, 2 * node + 1]
    metrics = _replaced(tmp_path, lost)
    replacements = sorted(metrics["replacements"], key=lambda r: r["rank"])
    assert [(r["node"], r["spare_node"]) for r in replacements] == [(node, 0), (node, 0)]
    assert sorted(r["new_pid"] for r in replacements) == sorted(metrics["spare_node_pids"][0])
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == 13 and recovery["failed_ranks"] == lost
    sources = {(fetch["rank"], fetch["holder"] // 2) for fetch in recovery["windows_from"]}
    assert sources == {(rank, 1 - node) for rank in lost}  # replicas on the other node
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")


def test_a_lost_rank_is_taken_over_by_a_spare_task_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """Node 2's two tasks are single spares; rank 1 alone is SIGKILLed at step 13."""
    result = run_cluster(tmp_path, 3, *PP2_DP2, "parallel.spares=2", "faults=at",
                         "faults.kind=kill", "faults.events=[{step: 13, rank: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced(tmp_path, [1])
    (replacement,) = metrics["replacements"]
    assert replacement["new_pid"] in metrics["spare_pids"]
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")


def test_a_hung_node_is_killed_by_its_monitors_and_taken_over_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """Both ranks of node 1 stop making progress at step 7 (their processes live on):
    their heartbeats stop, after the hang timeout the supervisor has their monitors
    kill them, and the spare node takes them over."""
    result = run_cluster(tmp_path, 3, *LAYOUT, "recovery.timeout_s=30",
                         "parallel.spare_nodes=1", "faults=at", "faults.kind=hang",
                         "faults.events=[{step: 7, node: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced(tmp_path, [2, 3], cause="hang")
    assert {r["spare_node"] for r in metrics["replacements"]} == {0}
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")


PP2_DP2_DURABLE = (*PP2_DP2[:3], "trainer.max_steps=12", "checkpoint.window=3",
                   "checkpoint.durable_every=3", "recovery.timeout_s=60")


def test_a_lost_node_without_a_spare_ends_the_job_and_the_same_command_resumes_it_bitwise(
        tmp_path: Path) -> None:
    """Two nodes, no spare: node 1 is lost at step 10 and the job ends with the
    documented exit code; the same command run again resumes from the newest complete
    durable checkpoint by itself, the fault does not strike again, and the job ends
    bitwise equal to the run without the failure."""
    golden = run_recipe(tmp_path / "golden", *PP2_DP2_DURABLE)
    assert golden.returncode == 0, golden.stderr[-4000:]
    job = tmp_path / "job"
    command = (*PP2_DP2_DURABLE, "faults=at", "faults.kind=kill",
               "faults.events=[{step: 10, node: 1}]")
    first = run_cluster(job, 2, *command)
    assert first.returncode == EXIT_NO_SPARE, first.stderr[-4000:]
    assert "no spare task is left" in first.stderr
    assert not (job / "final_state.pt").exists()
    second = run_cluster(job, 2, *command)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resuming from the newest committed durable checkpoint" in second.stderr
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["failures_injected"] == 0 and metrics["replacements"] == []
    assert_states_equal(tmp_path / "golden" / "final_state.pt", job / "final_state.pt")


def test_a_preempted_job_commits_the_step_it_stops_at_and_resumes_from_it_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """SIGTERM to the supervisor and every task once rank 0 begins step 3 (as SLURM
    preempts), SIGKILL 30 s later: every rank stops at the same step, commits a durable
    checkpoint of it (the only one: the cadence would take none before step 100) and
    exits with the preempted code; the same command started again resumes from it and
    ends bitwise equal to the run never preempted."""
    from lightning_moe_ckpt.failures.supervisor import EXIT_PREEMPTED
    from lightning_moe_ckpt.recovery.manifest import committed_steps

    command = (*PP2_DP2, "checkpoint.durable_every=100")
    preempted = run_cluster(tmp_path, 2, *command, cluster_args=("--preempt-at-step", "3"))
    assert preempted.returncode == EXIT_PREEMPTED, preempted.stderr[-4000:]
    (step,) = committed_steps(tmp_path / "durable")
    assert 3 <= step < 16
    assert f"preempted at step {step}: its part of the durable checkpoint" in preempted.stderr
    assert not (tmp_path / "final_state.pt").exists()
    resumed = run_cluster(tmp_path, 2, *command)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from the newest committed durable checkpoint {tmp_path / 'durable'}" \
           f"/step={step}.ckpt" in resumed.stderr
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")


@pytest.mark.parametrize("spares", [2, 0], ids=["with-a-spare", "no-spare"])
def test_a_sigterm_to_one_worker_is_its_failure(tmp_path: Path, golden: Path,
                                                spares: int) -> None:
    """A SIGTERM to rank 1 alone (an OOM killer, a node agent) is not a preemption: the
    supervisor kills the rank and a spare task takes it over (the job ends bitwise), or,
    with no spare, the job ends with the no-spare code (a committed checkpoint is left)."""
    command = (*PP2_DP2, f"parallel.spares={spares}", "checkpoint.durable_every=4",
               "faults=at", "faults.kind=sigterm", "faults.events=[{step: 9, rank: 1}]")
    result = run_cluster(tmp_path, 3 if spares else 2, *command)
    assert "rank 1 (pid" in result.stderr and "alone received a SIGTERM" in result.stderr
    if spares:
        assert result.returncode == 0, result.stderr[-4000:]
        _replaced(tmp_path, [1], cause="sigterm")
        assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")
    else:
        assert result.returncode == EXIT_NO_SPARE, result.stderr[-4000:]


def test_tasks_that_do_not_fit_the_job_stop_it_at_once_with_the_numbers(
        tmp_path: Path) -> None:
    """Four tasks for four ranks and a spare node of two: the supervisor refuses the
    shape, every task stops on it (a configuration error, not replaced)."""
    from lightning_moe_ckpt.failures.supervisor import EXIT_CONFIG

    result = run_cluster(tmp_path, 2, *PP2_DP2, "parallel.spare_nodes=1")
    assert result.returncode == EXIT_CONFIG, result.stderr[-4000:]
    assert "the launcher started 4 tasks; the job needs 6" in result.stderr
    assert "replaced" not in result.stderr
