"""Start test processes from multiprocessing's fork server, which imported torch, Lightning,
Hydra, ``transformers`` and the library once (:mod:`tests.distributed.preload`).

A fresh interpreter spends about ten seconds of CPU importing them, which is most of what a
short multi-process test costs on a 2-core machine. A forked process starts with them
imported, and with nothing else: the server has run no training, started no threads and
holds no process group.

:func:`run_python` runs a Python script's ranks this way, as ``torchrun`` would start them
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` set, so
Lightning sees an externally launched job), or one process that starts whatever it starts
itself (a supervisor and its workers). Each takes its environment's ``OMP_NUM_THREADS`` for
torch's threads, as a fresh interpreter and the supervisor's forked workers do. Each forked
process leads a process group of its own; a run that overruns is killed group by group, by
pid, and the test fails.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import wait
from pathlib import Path

import pytest

from lightning_moe_ckpt.failures.forked_workers import enter_process, run_as_main

PRELOAD = "tests.distributed.preload"
RUN_TIMEOUT_S = 480.0  # pytest-timeout is 600 s (pyproject.toml)

multiprocessing.set_forkserver_preload([PRELOAD])
_FORKSERVER = multiprocessing.get_context("forkserver")


def free_port() -> int:
    """An unused TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_as_main(command: Sequence[str], environment: dict[str, str], cwd: str, stdout: str,
                 stderr: str) -> None:
    """In the forked process: become ``python *command`` started in ``cwd`` with
    ``environment``, writing to the files ``stdout`` and ``stderr``."""
    os.setsid()  # its own group, so an overrun kills it with whatever it started
    enter_process(environment, cwd, stdout, stderr)
    run_as_main(command)


def _kill_group(pid: int, pidfd: int) -> None:
    """Kill the process group ``pid`` leads, or, before it made one, the process alone
    through its pidfd (the fork server reaps it, so its pid alone could name another)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)


def run_python(command: Sequence[str], *, env: Mapping[str, str], cwd: Path, ranks: int = 1,
               timeout_s: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """What ``python *command`` (``script *args`` or ``-m module *args``) on ``ranks``
    processes exits with and writes (the ranks' output together, stdout and stderr apart).
    The first rank to fail ends the others, as Lightning's launcher does; its exit code is
    the run's. Past ``timeout_s`` every process group of the run is killed and the test
    fails."""
    command = list(command)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        out.touch()
        err.touch()
        launch = ({} if ranks == 1 else
                  {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                   "WORLD_SIZE": str(ranks), "NODE_RANK": "0"})
        processes, pidfds = [], []
        try:
            for rank in range(ranks):
                identity = {} if ranks == 1 else {"RANK": str(rank), "LOCAL_RANK": str(rank)}
                process = _FORKSERVER.Process(
                    target=_run_as_main, name=f"rank {rank}",
                    args=(command, {**env, **launch, **identity}, str(cwd), str(out),
                          str(err)))
                process.start()
                processes.append(process)
                assert process.pid is not None
                pidfds.append(os.pidfd_open(process.pid))
            code = _await(processes, time.monotonic() + timeout_s)
        finally:
            for process, pidfd in zip(processes, pidfds, strict=True):  # what is left
                if process.exitcode is None:
                    assert process.pid is not None
                    _kill_group(process.pid, pidfd)
                process.join()
                os.close(pidfd)
        stdout, stderr = out.read_text(), err.read_text()
    if code is None:
        pytest.fail(f"{command} on {ranks} process(es) overran {timeout_s:g} s:\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, code, stdout, stderr)


def _await(processes: list[multiprocessing.process.BaseProcess], deadline: float) -> int | None:
    """0 once every process exited cleanly, the exit code of the first that did not, or
    None at ``deadline``."""
    running = list(processes)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        for sentinel in wait([p.sentinel for p in running], timeout=left):
            process = next(p for p in running if p.sentinel == sentinel)
            process.join()
            running.remove(process)
            if process.exitcode != 0:
                assert process.exitcode is not None
                return process.exitcode
    return 0
