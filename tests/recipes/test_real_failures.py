"""Real failures in the training recipe: the failing worker really dies (SIGKILL, exit,
an exception) or hangs; the supervisor replaces it with a new process, the survivors keep
their processes and state, and training ends bitwise equal to the fault-free run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore

from lightning_moe_ckpt.failures.protocol import heartbeat_key
from tests.conftest import REPO, alive
from tests.recipes.test_train_recipe import assert_states_equal, run_recipe

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

PP2 = ("api=fabric", "parallel.pp=2", "parallel.microbatches=2", "trainer.max_steps=10",
       "checkpoint.window=3", "recovery.timeout_s=30")


@pytest.fixture(scope="module")
def golden_pp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    result = run_recipe(out, *PP2)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _assert_replaced(out: Path, dead_rank: int, cause: str, world: int) -> dict[str, Any]:
    """Rank ``dead_rank`` died of ``cause`` and was replaced once (a new pid after the
    dead one); every other rank kept its process."""
    metrics = _replaced_ranks(out, {dead_rank: cause}, world)
    (replacement,) = metrics["replacements"]
    assert metrics["worker_pids"][str(dead_rank)] == [replacement["dead_pid"],
                                                      replacement["new_pid"]]
    return metrics


@pytest.mark.parametrize(("kind", "rank", "cause"), [
    ("kill", 1, "exit -9"),  # the last stage, SIGKILL
    ("exception", 0, "exit 1"),  # rank 0 (the first stage) raises in its training step
])
def test_dead_worker_is_replaced_and_training_ends_bitwise(
        tmp_path: Path, golden_pp2: Path, kind: str, rank: int, cause: str) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", f"faults.kind={kind}",
                        f"faults.events=[{{step: 7, rank: {rank}}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, rank, cause, world=2)
    _assert_bitwise(golden_pp2, tmp_path, metrics)
    # One node: rank 1 mapped rank 0's shared memory rather than copying it, and rank 0
    # holds its replicas of rank 1 (the dead process's, then the replacement's) the same way.
    assert metrics["replica_peers_mapping"] == [1] and metrics["replica_bytes"] == 0
    assert metrics["replica_mapped_bytes"] > 0


def test_a_worker_dying_while_warming_up_is_replaced_and_training_ends_bitwise(
        tmp_path: Path, golden_pp2: Path) -> None:
    """W is profiled (not forced) and rank 1 dies at step 1, before any rank has its
    profile: every rank warms up afresh with the replacement, so that they finish
    together and agree on W from the same iteration on."""
    result = run_recipe(tmp_path, *PP2, "checkpoint.window=null", "faults=at",
                        "faults.kind=kill", "faults.events=[{step: 1, rank: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 1, "exit -9", world=2)
    _assert_bitwise(golden_pp2, tmp_path, metrics)
    assert metrics["profile"] is not None and metrics["windows_taken"] > 1


def test_hung_worker_is_killed_within_the_timeout_and_replaced(
        tmp_path: Path, golden_pp2: Path) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", "faults.kind=hang",
                        "faults.events=[{step: 7, rank: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 1, "hang", world=2)
    _assert_bitwise(golden_pp2, tmp_path, metrics)


def test_no_replacement_left_stops_with_a_clear_error(tmp_path: Path) -> None:
    result = run_recipe(tmp_path, *PP2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 5, rank: 1}]", "recovery.max_restarts=0")
    assert result.returncode != 0
    assert "rank 1 (exit -9)" in result.stderr
    assert "recovery.max_restarts=0" in result.stderr


PP2_EP2 = ("api=fabric", "parallel.pp=2", "parallel.ep=2", "parallel.microbatches=4",
           "trainer.max_steps=16", "checkpoint.window=3", "recovery.timeout_s=60")


@pytest.fixture(scope="module")
def golden_pp2_ep2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden_pp2_ep2")
    result = run_recipe(out, *PP2_EP2)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def _assert_bitwise(golden: Path, out: Path, metrics: dict[str, Any]) -> None:
    """Final state and every loss equal to the fault-free run's. A replaced rank 0 wrote
    ``metrics.json`` with the losses from the step it joined on: those are compared."""
    golden_losses = json.loads((golden / "metrics.json").read_text())["loss"]
    losses = metrics["loss"]
    assert losses and losses == golden_losses[len(golden_losses) - len(losses):]
    assert_states_equal(golden / "final_state.pt", out / "final_state.pt")


def _assert_paused_ran_nothing(recovery: dict[str, Any], world: int) -> None:
    """Localized rollback: the ranks outside the failed stage paused, running no
    forward or backward pass while the failed stage recovered."""
    paused = recovery["paused_forward_backward"]
    rolled_back = set(recovery["ranks_rolled_back"])
    assert rolled_back and set(map(int, paused)) == set(range(world)) - rolled_back
    assert all(calls == 0 for calls in paused.values()), paused


def test_real_kill_in_pp2_ep2_recovers_localized_and_bitwise(
        tmp_path: Path, golden_pp2_ep2: Path) -> None:
    """The issue's own command: kill rank 3 at step 13 under pp=2 x ep=2."""
    failed = run_recipe(tmp_path, *PP2_EP2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 13, rank: 3}]")
    assert failed.returncode == 0, failed.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 3, "exit -9", world=4)
    _assert_bitwise(golden_pp2_ep2, tmp_path, metrics)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == 13 and recovery["ranks_rolled_back"] == [2, 3]
    _assert_paused_ran_nothing(recovery, world=4)
    # Rank 0 (stage 0) waits on stage 1's live rank 2, which learns of the failure first:
    # it must not wait out its collective timeout (recovery.timeout_s / 3 = 20 s), nor
    # rank 2's wait for a replication thread blocked on rank 0's (10 s).
    assert recovery["timings_s"]["detect"] < 5.0, recovery


def _replaced_ranks(out: Path, causes: dict[int, str], world: int) -> dict[str, Any]:
    """Every rank of ``causes`` died (its pid replaced); every other kept its process."""
    metrics: dict[str, Any] = json.loads((out / "metrics.json").read_text())
    replacements = metrics["replacements"]
    assert sorted((r["rank"], r["cause"]) for r in replacements) == sorted(causes.items())
    pids = metrics["worker_pids"]
    for r in replacements:
        assert r["new_pid"] != r["dead_pid"] and r["dead_pid"] in pids[str(r["rank"])]
    for rank in range(world):
        if rank not in causes:
            assert len(pids[str(rank)]) == 1, pids
    return metrics


@pytest.mark.parametrize(("node", "spare_nodes"), [(1, 1), (0, 0)],
                         ids=["last-stage-to-a-spare-node", "rank-0-to-new-processes"])
def test_a_lost_node_is_recovered_from_replicas_on_the_other_node_bitwise(
        tmp_path: Path, golden_pp2_ep2: Path, node: int, spare_nodes: int) -> None:
    """pp=2 x ep=2 on two nodes of two ranks (node n runs stage n): every rank of one node
    is SIGKILLed at step 13, a whole machine lost at once. Its windows come from replicas
    on the other node; a spare node takes over its ranks, rank for rank, or (none left)
    new processes do, rank 0 included. The surviving node's processes live on."""
    lost = [2 * node, 2 * node + 1]
    result = run_recipe(tmp_path, *PP2_EP2, "parallel.ranks_per_node=2",
                        f"parallel.spare_nodes={spare_nodes}", "faults=at", "faults.kind=kill",
                        f"faults.events=[{{step: 13, node: {node}}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced_ranks(tmp_path, dict.fromkeys(lost, "exit -9"), world=4)
    _assert_bitwise(golden_pp2_ep2, tmp_path, metrics)
    replacements = sorted(metrics["replacements"], key=lambda r: r["rank"])
    assert [r["node"] for r in replacements] == [node, node]
    assert {r["generation"] for r in replacements} == {1}  # one loss, one recovery
    if spare_nodes:  # the spare node's processes, started with the job, took the ranks
        assert [r["spare_node"] for r in replacements] == [0, 0]
        assert [r["new_pid"] for r in replacements] == metrics["spare_node_pids"][0]
    else:
        assert all(r["spare_node"] is None and not r["warm_spare"] for r in replacements)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == 13 and recovery["failed_ranks"] == lost
    assert recovery["ranks_rolled_back"] == lost  # the lost stage; the other one paused
    _assert_paused_ran_nothing(recovery, world=4)
    sources = {(fetch["rank"], fetch["holder"] // 2) for fetch in recovery["windows_from"]}
    assert sources == {(rank, 1 - node) for rank in lost}  # replicas on the other node


def test_two_workers_of_adjacent_stages_die_at_one_step(
        tmp_path: Path, golden_pp2_ep2: Path) -> None:
    """Rank 1 (stage 0) exits and rank 2 (stage 1) is killed in the same iteration: both
    stages roll back, the survivors' replicas supply both windows."""
    result = run_recipe(tmp_path, *PP2_EP2, "faults=at",
                        "faults.events=[{step: 7, rank: 1, kind: exit}, "
                        "{step: 7, rank: 2, kind: kill}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced_ranks(tmp_path, {1: "exit 1", 2: "exit -9"}, world=4)
    _assert_bitwise(golden_pp2_ep2, tmp_path, metrics)


def test_a_kill_during_a_recovery_widens_it_and_ends_bitwise(
        tmp_path: Path, golden_pp2_ep2: Path) -> None:
    """Rank 3 is killed at step 13; while the job recovers from it, rank 2 (its stage
    peer, a survivor) is killed too. The recovery starts over in the next generation
    with both failed, the paused stage still runs nothing."""
    result = run_recipe(tmp_path, *PP2_EP2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 13, rank: 3}, "
                        "{step: 13, rank: 2, phase: recovery}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced_ranks(tmp_path, {2: "exit -9", 3: "exit -9"}, world=4)
    assert {r["generation"] for r in metrics["replacements"]} == {1, 2}
    _assert_bitwise(golden_pp2_ep2, tmp_path, metrics)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_ranks"] == [2, 3] and recovery["attempts"] == 2
    _assert_paused_ran_nothing(recovery, world=4)


def test_a_recovery_that_hangs_is_ended_within_its_deadline_and_ends_bitwise(
        tmp_path: Path, golden_pp2_ep2: Path) -> None:
    """Rank 3 is killed at step 13; rank 2, a survivor, hangs in the recovery from it (a
    fetch that never returns, say). Its recovery makes no progress, so its heartbeat
    stops after the hang timeout and the supervisor ends it as hung one timeout later,
    while the others wait for the generation that brings its replacement. Under
    ``recovery.timeout_s=20``, a value whose third is no whole number of microseconds."""
    args = [a for a in PP2_EP2 if not a.startswith("recovery.timeout_s=")]
    result = run_recipe(tmp_path, *args, "recovery.timeout_s=20", "faults=at",
                        "faults.kind=kill", "faults.events=[{step: 13, rank: 3}, "
                        "{step: 13, rank: 2, phase: recovery, kind: hang}]")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "rank 2 (pid" in result.stderr and "the recovery made no progress" in result.stderr
    metrics = _replaced_ranks(tmp_path, {2: "hang", 3: "exit -9"}, world=4)
    _assert_bitwise(golden_pp2_ep2, tmp_path, metrics)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_ranks"] == [2, 3] and recovery["attempts"] == 2


def test_a_kill_between_the_optimizer_step_and_its_snapshot_recovers_bitwise(
        tmp_path: Path, golden_pp2: Path) -> None:
    """Rank 1 (last stage) is SIGKILLed right after optimizer step 6, before it takes
    SS_6. Step 6 starts a window (checkpoint.window=3): rank 0 starts the agreement on
    the next window's W, an all-reduce its peer never joins, without waiting for it and
    goes on into iteration 7, where its first send breaks. Rank 0 completed iteration 6,
    and the replacement's replay of it needs what rank 0 logged of that iteration (its
    clip coefficient)."""
    result = run_recipe(tmp_path, *PP2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 7, rank: 1, phase: snapshot_copy}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 1, "exit -9", world=2)
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == 7 and recovery["ranks_rolled_back"] == [1]
    assert recovery["iterations_replayed"] is None  # rank 0 paused: no report of its own
    _assert_bitwise(golden_pp2, tmp_path, metrics)


def test_rank_0_killed_while_it_replicates_is_replaced_by_a_warm_spare(
        tmp_path: Path, golden_pp2: Path) -> None:
    """Rank 0 (first stage) is SIGKILLed in its replication thread, between announcing
    SS_6 to its peer and sending it (SS_6 never reaches the peer); a warm
    spare started with the job takes rank 0."""
    result = run_recipe(tmp_path, *PP2, "parallel.spares=1", "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 7, rank: 0, phase: replication}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _assert_replaced(tmp_path, 0, "exit -9", world=2)
    (replacement,) = metrics["replacements"]
    assert replacement["warm_spare"] and metrics["spare_pids"] == [replacement["new_pid"]]
    _assert_bitwise(golden_pp2, tmp_path, metrics)


def _start_supervised(out: Path, *overrides: str, api: str = "fabric"
                      ) -> subprocess.Popen[str]:
    """The recipe under ``recovery.supervise=true`` as a user starts it: its process is
    the supervisor, writing the workers' pids to ``out/workers.json``."""
    layout = [o.replace("api=fabric", f"api={api}") for o in PP2]
    return subprocess.Popen(
        [sys.executable, str(REPO / "recipes" / "train.py"), f"out_dir={out}",
         "trainer.progress_bar=false", *layout, *overrides, "recovery.supervise=true"],
        cwd=REPO, env={**os.environ, "HYDRA_FULL_ERROR": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _await_iteration(process: subprocess.Popen[str], status: Path, rank: int,
                     beats: int) -> dict[str, Any]:
    """Wait (bounded) until ``rank``'s worker began its ``beats``-th iteration; returns
    the supervisor's status."""
    deadline = time.monotonic() + 300
    while not status.exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    view: dict[str, Any] = json.loads(status.read_text())
    host, port = view["store"].rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    while int(store.add(heartbeat_key(rank, view["ranks"][str(rank)]), 0)) < beats:
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    return view


def test_a_worker_killed_from_outside_is_replaced_under_recovery_supervise(
        tmp_path: Path, golden_pp2: Path) -> None:
    """No fault injected: the test itself sends SIGKILL to rank 1's pid once it runs its
    sixth iteration, as an out-of-memory killer or an operator would."""
    status = tmp_path / "workers.json"
    process = _start_supervised(tmp_path)
    pids: set[int] = set()
    try:
        view = _await_iteration(process, status, rank=1, beats=6)  # iteration 5 began
        victim = view["ranks"]["1"]
        pids.update(view["ranks"].values())
        os.kill(victim, signal.SIGKILL)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-4000:]
        assert not alive(victim)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if status.exists():
            pids.update(json.loads(status.read_text())["ranks"].values())
        for pid in pids:  # a worker orphaned by a failed test ends with it
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    metrics = _assert_replaced(tmp_path, 1, "exit -9", world=2)
    assert metrics.get("failures_injected", 0) == 0  # nothing was injected
    _assert_bitwise(golden_pp2, tmp_path, metrics)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (an exited orphan may linger as a zombie of init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(("signum", "api"), [(signal.SIGKILL, "trainer"),
                                             (signal.SIGTERM, "fabric")],
                         ids=["kill-trainer", "term-fabric"])
def test_workers_do_not_outlive_their_supervisor(tmp_path: Path, signum: int,
                                                 api: str) -> None:
    """The supervisor (the recipe's process under recovery.supervise=true) is killed, or
    cancelled with SIGTERM, mid-training: no worker trains on as an orphan."""
    status = tmp_path / "workers.json"
    process = _start_supervised(tmp_path, "trainer.max_steps=5000",  # minutes of training
                                api=api)
    workers: list[int] = []
    try:
        view = _await_iteration(process, status, rank=1, beats=3)  # training is under way
        workers = list(view["ranks"].values())
        assert view["supervisor"] == process.pid
        os.kill(process.pid, signum)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == (-signum if signum == signal.SIGKILL else 128 + signum)
        gone_by = time.monotonic() + 30
        while any(_running(pid) for pid in workers) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not any(_running(pid) for pid in workers), (workers, stderr[-3000:])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in workers:  # what a failed test left behind ends with it
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_trainer_api_kill_and_kill_of_rank_0_recover_bitwise(
        tmp_path: Path, golden_pp2: Path) -> None:
    """The Trainer API under the supervisor: rank 1 is killed at step 4 and rank 0 at step
    7; each replacement's Trainer resumes at the recovered step with its peers, and all
    validate together at step 5 (the Trainer decides that from its own counters)."""
    trainer_pp2 = [o.replace("api=fabric", "api=trainer") for o in PP2] + ["trainer.val_every=5"]
    result = run_recipe(tmp_path, *trainer_pp2, "faults=at", "faults.kind=kill",
                        "faults.events=[{step: 4, rank: 1}, {step: 7, rank: 0}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced_ranks(tmp_path, {0: "exit -9", 1: "exit -9"}, world=2)
    _assert_bitwise(golden_pp2, tmp_path, metrics)


PP2_DURABLE = ("api=trainer", "parallel.pp=2", "parallel.microbatches=2",
               "trainer.max_steps=12", "checkpoint.window=3", "checkpoint.durable_every=3",
               "recovery.timeout_s=30")


@pytest.fixture(scope="module")
def golden_durable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("golden_durable")
    result = run_recipe(out, *PP2_DURABLE)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


def test_no_replacement_left_ends_the_job_and_the_same_command_resumes_it_bitwise(
        tmp_path: Path, golden_durable: Path) -> None:
    """Rank 1 is killed at step 10 with no replacement allowed: the job ends with the
    documented code. The same command started again finds the newest committed durable
    checkpoint by itself, the fault that struck does not strike again, and training ends
    bitwise equal to the run without the failure."""
    from lightning_moe_ckpt.failures.protocol import EXIT_NO_SPARE

    job = tmp_path / "job"
    command = (*PP2_DURABLE, "faults=at", "faults.kind=kill",
               "faults.events=[{step: 10, rank: 1}]", "recovery.max_restarts=0")
    first = run_recipe(job, *command)
    assert first.returncode == EXIT_NO_SPARE, first.stderr[-4000:]
    assert "no replacement is left" in first.stderr
    struck = [json.loads(line)
              for line in (job / "faults_struck.jsonl").read_text().splitlines()]
    assert struck == [{"step": 10, "rank": 1, "phase": "optimizer", "kind": "kill"}]
    assert not (job / "final_state.pt").exists()
    second = run_recipe(job, *command)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resuming from the newest committed durable checkpoint" in second.stderr
    metrics = json.loads((job / "metrics.json").read_text())
    assert metrics["failures_injected"] == 0 and metrics["replacements"] == []
    assert_states_equal(golden_durable / "final_state.pt", job / "final_state.pt")
    losses = json.loads((golden_durable / "metrics.json").read_text())["loss"]
    assert metrics["loss"] == losses[-len(metrics["loss"]):]  # the resumed steps' losses


def test_a_rank_killed_while_writing_a_durable_checkpoint_leaves_it_uncommitted(
        tmp_path: Path, golden_durable: Path) -> None:
    """Rank 1 SIGKILLs itself halfway through writing its file of the checkpoint of step
    9, with no replacement allowed: that checkpoint is never taken for complete (no
    manifest; the newest committed is step 6), the job ends with the documented code, and
    the same command started again removes the torn files and resumes from step 6,
    bitwise."""
    from lightning_moe_ckpt.failures.protocol import EXIT_NO_SPARE
    from lightning_moe_ckpt.recovery.manifest import committed_steps

    job = tmp_path / "job"
    command = (*PP2_DURABLE, "faults=at", "faults.kind=kill",
               "faults.events=[{step: 7, rank: 1, phase: durable_write}]",
               "recovery.max_restarts=0")
    first = run_recipe(job, *command)
    assert first.returncode == EXIT_NO_SPARE, first.stderr[-4000:]
    durable = job / "durable"
    assert committed_steps(durable) == [3, 6]
    torn = sorted(p.name for p in (durable / "step=9.ckpt").iterdir())
    assert any(name.startswith(".rank00001.ckpt.tmp-") for name in torn), torn
    second = run_recipe(job, *command)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "not committed (no manifest" in second.stderr or "a write cut short" in second.stderr
    assert f"{durable / 'step=6.ckpt'}" in second.stderr
    assert committed_steps(durable) == [9, 12]
    assert_states_equal(golden_durable / "final_state.pt", job / "final_state.pt")
