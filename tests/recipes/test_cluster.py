"""Several nodes on one machine: ``recipes/cluster.py`` starts the tasks as ``srun`` would
(one process group per node) beside the supervisor, which hosts the store in a process of
its own. A node lost at once (every rank on it SIGKILLs itself), a lost rank, and a job
that runs out of spares: each ends bitwise equal to the run without the failure."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from lightning_moe_ckpt.failures.protocol import EXIT_NO_SPARE
from lightning_moe_ckpt.recovery.manifest import committed_steps
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


# Windows of 3 start at steps 0, 3, 6, 9, ...; a durable checkpoint every 4 steps is taken
# at global steps 4, 8, 12, 16. The failures below strike at each position of the window
# 6..8 and on either side of the checkpoint of step 8 (iteration 7 runs before it, 8 after
# it), and training goes on for two more checkpoints (12, 16) after the recovery.
DURABLE = ("checkpoint.durable_every=4",)


@pytest.mark.parametrize(("node", "step"), [(1, 7), (0, 8)],
                         ids=["last-stage-before-a-checkpoint", "rank-0s-node-after-one"])
def test_a_lost_node_is_taken_over_by_the_spare_node_bitwise(
        tmp_path: Path, golden: Path, node: int, step: int) -> None:
    """pp=2 x dp=2 on nodes 0 and 1 (node n runs stage n), node 2 the spare: every rank of
    node ``node`` is SIGKILLed at ``step``. The spare node's tasks take its ranks, rank for
    rank, their windows come from replicas on the other node, every rank takes the next
    durable checkpoints at the same steps, and the job ends bitwise equal to the run
    without the failure (losing rank 0's node too: the store is not in a training rank)."""
    result = run_cluster(tmp_path, 3, *PP2_DP2, *DURABLE, "parallel.spare_nodes=1",
                         "faults=at", "faults.kind=kill",
                         f"faults.events=[{{step: {step}, node: {node}}}]")
    assert result.returncode == 0, result.stderr[-4000:]
    lost = [2 * node, 2 * node + 1]
    metrics = _replaced(tmp_path, lost)
    replacements = sorted(metrics["replacements"], key=lambda r: r["rank"])
    assert [(r["node"], r["spare_node"]) for r in replacements] == [(node, 0), (node, 0)]
    assert sorted(r["new_pid"] for r in replacements) == sorted(metrics["spare_node_pids"][0])
    (recovery,) = metrics["real_recoveries"]
    assert recovery["failed_step"] == step and recovery["failed_ranks"] == lost
    sources = {(fetch["rank"], fetch["holder"] // 2) for fetch in recovery["windows_from"]}
    assert sources == {(rank, 1 - node) for rank in lost}  # replicas on the other node
    assert committed_steps(tmp_path / "durable") == [12, 16]
    assert_states_equal(golden / "final_state.pt", tmp_path / "final_state.pt")


def test_a_lost_rank_is_taken_over_by_a_spare_task_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """Node 2's two tasks are single spares; rank 1 alone is SIGKILLed at step 6, the
    first of a window."""
    result = run_cluster(tmp_path, 3, *PP2_DP2, *DURABLE, "parallel.spares=2", "faults=at",
                         "faults.kind=kill", "faults.events=[{step: 6, rank: 1}]")
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = _replaced(tmp_path, [1])
    (replacement,) = metrics["replacements"]
    assert replacement["new_pid"] in metrics["spare_pids"]
    assert committed_steps(tmp_path / "durable") == [12, 16]
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


def _guide_script() -> str:
    """The SLURM batch script of docs/guides/cluster.md, as written there."""
    text = (REPO / "docs" / "guides" / "cluster.md").read_text()
    section = text[text.index("## SLURM"):]
    body = section[section.index("```bash\n") + len("```bash\n"):]
    return body[:body.index("\n```")] + "\n"


def _stand_ins(bin_dir: Path, requeues: Path) -> None:
    """``srun`` (recipes/cluster.py --tasks-only), ``scontrol`` (records a requeue) and
    ``hostname`` (this machine's loopback address) for the batch script."""
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f"""#!{sys.executable}
import os, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args.pop(0)  # srun's own options
if args and args[0] == "python":
    args.pop(0)
os.execv(sys.executable, [sys.executable, {str(CLUSTER)!r}, "--tasks-only",
         "--nodes", os.environ["SLURM_NNODES"],
         "--ranks-per-node", os.environ["SLURM_NTASKS_PER_NODE"], "--", *args])
""")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {requeues}\n')
    (bin_dir / "hostname").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)


def _sbatch(job_dir: Path, nodes: int, per_node: int, job_id: str, *args: str
            ) -> subprocess.CompletedProcess[str]:
    """The guide's script run as SLURM would run the batch step of job ``job_id``, in
    ``job_dir`` (the submission directory), with the recipe's settings as its arguments."""
    script = job_dir / "train.sbatch"
    if not script.exists():
        script.write_text(_guide_script())
        for name in ("recipes", "conf"):
            (job_dir / name).symlink_to(REPO / name)
        _stand_ins(job_dir / "bin", job_dir / "requeues.txt")
    env = {**os.environ, "PATH": f"{job_dir / 'bin'}:{Path(sys.executable).parent}:"
                                 f"{os.environ['PATH']}",
           "SLURM_JOB_ID": job_id, "SLURM_NNODES": str(nodes),
           "SLURM_NTASKS": str(nodes * per_node), "SLURM_NTASKS_PER_NODE": str(per_node),
           "MOE_PORT": str(_free_port()), "HYDRA_FULL_ERROR": "1"}
    return run_bounded(["bash", str(script), "trainer.progress_bar=false", *args], env=env,
                       cwd=job_dir)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


HF_PP2 = ("model=hf_qwen3_moe", "parallel.pp=2", "parallel.microbatches=2",
          "trainer.max_steps=10", "checkpoint.window=3", "recovery.timeout_s=60")
FABRIC_PP2 = ("api=fabric", "parallel.pp=2", "parallel.microbatches=2",
              "trainer.max_steps=10", "checkpoint.window=3", "recovery.timeout_s=60")


@pytest.mark.parametrize(("layout", "per_node", "lost_at"), [
    (PP2_DP2, 2, 10), (HF_PP2, 1, 7), (FABRIC_PP2, 1, 7)],
    ids=["builtin", "hf_qwen3_moe", "fabric"])
def test_the_guides_slurm_script_requeues_a_job_with_no_spare_left_and_it_resumes_bitwise(
        tmp_path: Path, golden: Path, layout: tuple[str, ...], per_node: int,
        lost_at: int) -> None:
    """The batch script of the cluster guide, as written, on two nodes with no spare:
    node 1 is lost, the job ends with the no-spare code and the script requeues it; run
    again as the requeued job (the same job id, so the same out_dir), it resumes from the
    newest committed durable checkpoint by itself, the fault does not strike again, and
    the job ends bitwise equal to the run without the failure."""
    reference = golden
    if layout is not PP2_DP2:
        reference = tmp_path / "golden"
        result = run_recipe(reference, *layout)
        assert result.returncode == 0, result.stderr[-4000:]
    job_dir = tmp_path / "submitted"
    job_dir.mkdir()
    command = (*layout, "checkpoint.durable_every=3", "faults=at", "faults.kind=kill",
               f"faults.events=[{{step: {lost_at}, node: 1}}]")
    first = _sbatch(job_dir, 2, per_node, "4242", *command)
    assert first.returncode == EXIT_NO_SPARE, first.stderr[-4000:] + first.stdout[-2000:]
    assert "no spare task is left" in first.stderr
    assert (job_dir / "requeues.txt").read_text().split() == ["requeue", "4242"]
    out = job_dir / "outputs" / "train" / "job-4242"
    assert not (out / "final_state.pt").exists()
    second = _sbatch(job_dir, 2, per_node, "4242", *command)
    assert second.returncode == 0, second.stderr[-4000:] + second.stdout[-2000:]
    assert ("resuming from the newest committed durable checkpoint outputs/train/job-4242/durable"
            in second.stderr)
    assert (job_dir / "requeues.txt").read_text().split() == ["requeue", "4242"]  # once
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["failures_injected"] == 0
    assert_states_equal(reference / "final_state.pt", out / "final_state.pt")


def test_tasks_that_do_not_fit_the_job_stop_it_at_once_with_the_numbers(
        tmp_path: Path) -> None:
    """Four tasks for four ranks and a spare node of two: the supervisor refuses the
    shape, every task stops on it (a configuration error, not replaced)."""
    from lightning_moe_ckpt.failures.protocol import EXIT_CONFIG

    result = run_cluster(tmp_path, 2, *PP2_DP2, "parallel.spare_nodes=1")
    assert result.returncode == EXIT_CONFIG, result.stderr[-4000:]
    assert "the launcher started 4 tasks; the job needs 6" in result.stderr
    assert "replaced" not in result.stderr


FORGED = {"kill/1": "1", "gone/1": "1", "exit/1": "0", "generation": "7",
          "spare/0": '{"rank": 1, "generation": 7, "master_port": 1}', "preempt": "1"}


def test_a_client_without_the_job_secret_cannot_drive_the_job(tmp_path: Path,
                                                               golden: Path) -> None:
    """While the job trains, a client that reaches the store port but holds no secret
    asks the monitor to kill task 1, reports task 1 gone, opens generation 7, hands spare
    0 a rank and preempts the job: every message is ignored and logged, and the job ends
    bitwise as if nothing happened. The store answers on ``--host`` alone."""
    from lightning_moe_ckpt.failures.protocol import STATUS_KEY, heartbeat_key

    port, out = _free_port(), tmp_path / "out"
    supervisor, tasks, logs = _start_job(tmp_path, port, "parallel.spare_nodes=1")
    try:
        foreign = _foreign_client(port, supervisor)
        view = json.loads(foreign.get(STATUS_KEY))
        while int(foreign.add(heartbeat_key(1, view["ranks"]["1"]), 0)) < 4:
            assert supervisor.poll() is None
            time.sleep(0.02)
        for key, value in FORGED.items():
            foreign.set(key, value)
        with pytest.raises(OSError):  # not on another address of this machine
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
        assert supervisor.wait(timeout=300) == 0, _tail(logs)
        assert tasks.wait(timeout=60) == 0, _tail(logs)
    finally:
        _end(tasks, supervisor)
    text = _tail(logs, 10**7)
    for key in FORGED.keys() - {"exit/1"}:  # an exit code is read only after a sealed gone
        assert f"a message '{key}'=" in text and "is not sealed with the job's secret" in text
    metrics = _replaced(out, [])
    assert metrics["replacements"] == [] and metrics["failures_injected"] == 0
    assert_states_equal(golden / "final_state.pt", out / "final_state.pt")


def _start_job(tmp_path: Path, port: int, *overrides: str, supervisor_args: Sequence[str] = ()
               ) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes], dict[str, Any]]:
    """The supervisor on ``port`` (127.0.0.1) and ``recipes/cluster.py --tasks-only`` for
    three nodes of two tasks, as a batch script starts them (their own secret), training
    ``PP2_DP2`` with ``overrides`` into ``tmp_path/out``; their logs in ``tmp_path``."""
    env = {**os.environ, "MOE_STORE": f"127.0.0.1:{port}", "HYDRA_FULL_ERROR": "1",
           "MOE_JOB_SECRET": os.urandom(32).hex()}
    logs = {name: (tmp_path / f"{name}.log").open("w+") for name in ("supervisor", "tasks")}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "lightning_moe_ckpt.supervise", "--launcher-tasks", "6",
         "--ranks-per-node", "2", "--host", "127.0.0.1", "--port", str(port),
         *supervisor_args], env=env, stderr=logs["supervisor"], cwd=REPO)
    tasks = subprocess.Popen(
        [sys.executable, str(CLUSTER), "--nodes", "3", "--ranks-per-node", "2",
         "--tasks-only", "--", str(TRAIN), f"out_dir={tmp_path / 'out'}",
         "trainer.progress_bar=false", *PP2_DP2, *overrides],
        env=env, stderr=logs["tasks"], cwd=REPO)
    return supervisor, tasks, logs


def _end(*processes: subprocess.Popen[bytes]) -> None:
    """End what is still running (cluster.py ends its nodes' groups on SIGTERM)."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_frozen_node_thawed_after_its_replacement_stops_and_the_job_ends_bitwise(
        tmp_path: Path, golden: Path) -> None:
    """Every process of node 1 (its two ranks and their monitors) is frozen (SIGSTOP),
    as a stalled machine is: the heartbeats stop, the supervisor's kill requests go
    unanswered, it gives up on them and the spare node takes over. Thawed (SIGCONT) once
    the job went on, the stale processes learn that they were replaced and stop within
    seconds, taking no part in the new generation; the job ends bitwise."""
    import signal

    from lightning_moe_ckpt.failures.protocol import STATUS_KEY, heartbeat_key

    port, status = _free_port(), tmp_path / "workers.json"
    supervisor, tasks, logs = _start_job(tmp_path, port, "recovery.timeout_s=20",
                                         "parallel.spare_nodes=1",
                                         supervisor_args=["--status", str(status)])
    frozen: list[int] = []
    try:
        store = _foreign_client(port, supervisor)
        view = json.loads(store.get(STATUS_KEY))
        while int(store.add(heartbeat_key(2, view["ranks"]["2"]), 0)) < 5:
            assert supervisor.poll() is None
            time.sleep(0.02)
        stale = [view["ranks"]["2"], view["ranks"]["3"]]
        monitors = [int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                    for pid in stale]
        frozen = stale + monitors
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 240
        while json.loads(store.get(STATUS_KEY))["ranks"]["2"] == stale[0]:
            assert supervisor.poll() is None and time.monotonic() < deadline, _tail(logs)
            time.sleep(0.2)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while any(_running(pid) for pid in frozen):
            assert time.monotonic() < deadline, [p for p in frozen if _running(p)]
            time.sleep(0.2)
        assert supervisor.wait(timeout=300) == 0, _tail(logs)
        tasks.wait(timeout=60)  # node 1's old tasks ended killed or fenced, as srun reports
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _end(tasks, supervisor)
    metrics = _replaced(tmp_path / "out", [2, 3], cause="hang")
    assert {r["spare_node"] for r in metrics["replacements"]} == {0}
    assert_states_equal(golden / "final_state.pt", tmp_path / "out" / "final_state.pt")


def _foreign_client(port: int, supervisor: subprocess.Popen[bytes]) -> Any:
    """A store client with no secret, once the job published its status."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from lightning_moe_ckpt.failures.protocol import STATUS_KEY

    deadline = time.monotonic() + 300
    while True:
        assert supervisor.poll() is None and time.monotonic() < deadline
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    while not store.check([STATUS_KEY]):
        assert supervisor.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return store


def _tail(logs: dict[str, Any], size: int = 4000) -> str:
    text = ""
    for log in logs.values():
        log.flush()
        log.seek(0)
        text += log.read()[-size:]
    return text
