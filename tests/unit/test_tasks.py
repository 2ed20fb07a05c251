"""A launcher's task under the supervisor: its monitor reports how it ended and kills it
on request; its place in the job comes from the launcher's environment."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.protocol import EXIT_CONFIG
from lightning_moe_ckpt.failures.supervisor import Supervisor
from lightning_moe_ckpt.failures.tasks import (
    KILLED,
    JobLayout,
    LauncherTask,
    TaskProcess,
    TaskStartError,
    launcher_task,
)
from tests.conftest import REPO, alive, job_channel

TASK = """
import os, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from lightning_moe_ckpt.failures.protocol import ControlChannel
from lightning_moe_ckpt.failures.tasks import LauncherTask, register, watch_in_parent
address, task, code = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
node = int(sys.argv[4]) if len(sys.argv) > 4 else 0
watch_in_parent(address, task, os.environ["MOE_JOB_SECRET"])
if code == -2:  # killed before it registered
    os.kill(os.getpid(), 9)
host, port = address.rsplit(":", 1)
store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
register(ControlChannel(store, os.environ["MOE_JOB_SECRET"]), LauncherTask(task, 8, node, 0))
if code < 0:
    time.sleep(60)  # until the supervisor has it killed
os._exit(code)
"""


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=30))


def _start(store: TCPStore | int, task: int, code: int, node: int = 0
           ) -> subprocess.Popen[bytes]:
    port = store if isinstance(store, int) else store.port
    return subprocess.Popen([sys.executable, "-c", TASK, f"127.0.0.1:{port}", str(task),
                             str(code), str(node)], cwd=REPO)


def _await_end(process: TaskProcess) -> int:
    deadline = time.monotonic() + 60
    while (code := process.poll()) is None:
        assert time.monotonic() < deadline, "the monitor never reported the task gone"
        time.sleep(0.05)
    return code


def test_the_monitor_reports_the_exit_code_and_exits_as_the_task_did(store: TCPStore) -> None:
    launched = _start(store, 3, 7)
    try:
        process = TaskProcess(job_channel(store), 3)  # waits for the registration
        assert process.pid != launched.pid  # the training process is the monitor's child
        assert _await_end(process) == 7
        assert launched.wait(timeout=30) == 7  # the launcher sees the task's own code
        assert not alive(process.pid)
    finally:
        launched.kill()


def test_a_kill_request_kills_the_task_by_its_pid(store: TCPStore) -> None:
    launched = _start(store, 5, -1)
    try:
        process = TaskProcess(job_channel(store), 5)
        assert process.poll() is None and alive(process.pid)
        process.kill()
        assert process.wait() == KILLED
        assert launched.wait(timeout=30) == 128 + 9
        assert not alive(process.pid)
    finally:
        launched.kill()


def test_a_task_reads_its_place_from_slurm() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_NODEID": "2",
           "SLURM_LOCALID": "1"}
    assert launcher_task(env) == LauncherTask(5, 6, 2, 1)
    assert launcher_task({}) is None
    with pytest.raises(ConfigError, match="SLURM_NODEID='x'"):
        launcher_task({**env, "SLURM_NODEID": "x"})


def test_a_shape_that_does_not_fit_the_tasks_is_refused() -> None:
    assert JobLayout(4, spares=1, spare_nodes=1).tasks(ranks_per_node=2) == 7
    with pytest.raises(ValueError, match="started 6 tasks; the job needs 7"):
        Supervisor((), 4, spares=1, spare_nodes=1, ranks_per_node=2, launcher_tasks=6)
    with pytest.raises(ValueError, match="no command"):
        Supervisor(["python", "train.py"], 4, launcher_tasks=4)


def _supervise_two_tasks(startup_timeout_s: float
                         ) -> tuple[int, threading.Thread, list[int]]:
    """A supervisor of two launcher tasks (one per node) running in a thread: its store's
    port, the thread, and the list its exit code lands in."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    supervisor = Supervisor((), 2, timeout_s=30, ranks_per_node=1, launcher_tasks=2,
                            store_port=port, startup_timeout_s=startup_timeout_s)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(supervisor.run()))
    thread.start()
    time.sleep(0.5)  # the store is up
    return port, thread, result


def test_tasks_not_placed_in_blocks_stop_the_job_naming_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two nodes of one rank, but both tasks report node 0 (as a cyclic distribution
    of a bigger job would place them): the supervisor refuses and stops them."""
    port, thread, result = _supervise_two_tasks(startup_timeout_s=60)
    launched = [_start(port, task, -1, node=0) for task in range(2)]
    try:
        thread.join(timeout=120)
        assert result == [EXIT_CONFIG]
        assert "task 1 on node 0" in caplog.text and "--distribution=block" in caplog.text
        assert [p.wait(timeout=30) for p in launched] == [128 + 9, 128 + 9]  # stopped
    finally:
        for process in launched:
            process.kill()


def test_a_task_killed_before_it_registers_stops_the_job_at_once_naming_it(
        caplog: pytest.LogCaptureFixture) -> None:
    """Task 1 is killed between its monitor's start and its registration: its monitor's
    report is seen at once (not at the 600 s startup timeout), the job stops, naming it,
    and task 0, which registered, is stopped too."""
    port, thread, result = _supervise_two_tasks(startup_timeout_s=600)
    launched = [_start(port, 0, -1, node=0), _start(port, 1, -2, node=1)]
    try:
        thread.join(timeout=120)
        assert result == [1]
        assert "task 1 ended (killed by signal 9) before it registered" in caplog.text
        assert [p.wait(timeout=30) for p in launched] == [128 + 9, 128 + 9]
    finally:
        for process in launched:
            process.kill()


def test_a_task_that_never_registers_is_named_at_the_startup_timeout(
        store: TCPStore) -> None:
    with pytest.raises(TaskStartError, match=r"task 3 did not register within 0\.2 s "
                                             r"\(--startup-timeout-s\)"):
        TaskProcess(job_channel(store), 3, timeout_s=0.2)


def test_a_task_whose_monitor_is_gone_counts_as_killed_after_a_wait(
        store: TCPStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its machine vanished with its monitor: nothing reports it gone, and a kill request
    goes unanswered; ``wait`` gives up and calls it killed."""
    monkeypatch.setattr("lightning_moe_ckpt.failures.tasks._WAIT_S", 0.5)
    job_channel(store).set_record("task/9", {"pid": 999999999, "node": 4, "host": "lost"})
    process = TaskProcess(job_channel(store), 9)
    process.kill()
    assert process.poll() is None
    assert process.wait() == KILLED and process.poll() == KILLED


def test_without_a_shape_from_task_0_the_supervisor_says_what_to_check(
        caplog: pytest.LogCaptureFixture) -> None:
    supervisor = Supervisor((), 0, launcher_tasks=2, startup_timeout_s=0.5)
    assert supervisor.run() == 1
    assert "task 0 sent no job shape within 0.5 s" in caplog.text
    assert "MOE_STORE=127.0.0.1:" in caplog.text and "--workers" in caplog.text
