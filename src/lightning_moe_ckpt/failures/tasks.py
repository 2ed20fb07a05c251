"""Tasks a launcher started (``srun``), watched through the job store.

On several machines the supervisor starts no process: SLURM (or ``recipes/cluster.py``,
its stand-in on one machine) starts one task per rank and the spare tasks, and the
supervisor runs beside them as the job's store host (on the batch script's host, not in
a training rank). Each task splits in two when it joins (:func:`watch_in_parent`): the
child goes on as the training process and registers under ``task/<id>`` (its
``SLURM_PROCID``) with its pid and node; the parent, the process the launcher started,
becomes its **monitor** on the same machine. The monitor

* writes the task's exit code (``exit/<id>``, negative for the signal that killed it) and
  then ``gone/<id>`` the moment it ends, however it ends;
* kills it (SIGKILL, by its pid) when the supervisor asks (``kill/<id>``): a hang becomes
  a death, and a job that ends stops its tasks;
* passes a scheduler's SIGTERM on, and exits as the task did.

A machine that dies takes its monitors with it: the supervisor then sees its tasks'
heartbeats stop, and after the hang timeout they count as failed. :class:`TaskProcess`
is the supervisor's handle on one task; it answers ``poll``, ``kill`` and ``wait`` as a
local process would, so the supervisor's loop does not tell the two apart.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.protocol import (
    ControlChannel,
    exit_key,
    gone_key,
    kill_key,
    task_key,
)

__all__ = ["JobLayout", "LauncherTask", "TaskProcess", "TaskStartError", "launcher_task",
           "register", "watch_in_parent"]

KILLED = -int(signal.SIGKILL)  # a task whose machine is gone (as Popen reports a kill)
_MONITOR_POLL_S = 0.1
_WAIT_S = 5.0  # how long a kill request waits for the monitor's report


@dataclass(frozen=True)
class JobLayout:
    """The shape of a job whose tasks a launcher started: the first ``world_size`` tasks
    are its ranks, the next ``spare_nodes`` x ranks-per-node its spare nodes, then
    ``spares`` single spares."""

    world_size: int
    spares: int = 0
    spare_nodes: int = 0
    timeout_s: float = 60.0
    max_restarts: int = 3
    preempt_grace_s: float = 20.0
    durable_dir: str | None = None  # "" when the job takes no durable checkpoints

    def tasks(self, ranks_per_node: int) -> int:
        """How many tasks the launcher must start for it."""
        return self.world_size + self.spare_nodes * ranks_per_node + self.spares


@dataclass(frozen=True)
class LauncherTask:
    """This process as one task of a launcher's job step."""

    task: int  # SLURM_PROCID
    tasks: int  # SLURM_NTASKS
    node: int  # SLURM_NODEID
    local: int  # SLURM_LOCALID


def launcher_task(environ: Mapping[str, str] | None = None) -> LauncherTask | None:
    """This process's task as SLURM (or its stand-in) describes it; None outside one.

    Raises:
        ConfigError: A SLURM variable that is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    if "SLURM_PROCID" not in env:
        return None
    values = []
    for key, default in (("SLURM_PROCID", None), ("SLURM_NTASKS", None),
                         ("SLURM_NODEID", "0"), ("SLURM_LOCALID", "0")):
        value = env.get(key, default)
        if value is None or not value.isdigit():
            raise ConfigError(f"{key}={value!r} (from the launcher) must be a non-negative "
                              "integer")
        values.append(int(value))
    return LauncherTask(*values)


def register(channel: ControlChannel, task: LauncherTask) -> None:
    """Announce this process as ``task`` (pid, node, host) to the supervisor."""
    channel.set_record(task_key(task.task), {"pid": os.getpid(), "node": task.node,
                                              "host": socket.gethostname()})


def watch_in_parent(address: str, task: int, secret: str) -> None:
    """Split this process in two: the child returns and goes on as the task (the training
    script, its imports done); the parent, the process the launcher started, becomes the
    task's monitor and never returns. The monitor waits for the child, writes its exit
    code (negative: the signal that ended it) and then ``gone/<task>``, kills it when
    ``kill/<task>`` is set, passes SIGTERM and SIGINT (a scheduler's cancel) on to it, and
    exits as it did, so the launcher sees the task's own outcome. Its messages are sealed
    with the job's ``secret``, and a kill request not sealed with it is ignored."""
    host, port = address.rsplit(":", 1)
    child = os.fork()
    if child == 0:
        return
    code = 1
    try:  # the monitor runs nothing more of the script: it leaves by os._exit
        def pass_on(number: int, frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(child, number)

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, pass_on)
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        channel = ControlChannel(store, secret)
        status = None
        while status is None:
            done, waited = os.waitpid(child, os.WNOHANG)
            if done:
                status = waited
            elif channel.read(kill_key(task)) is not None:
                os.kill(child, signal.SIGKILL)
            else:
                time.sleep(_MONITOR_POLL_S)
        code = os.waitstatus_to_exitcode(status)
        channel.set(exit_key(task), str(code))
        channel.set(gone_key(task), "1")
    except BaseException:  # the store is gone: so is the job
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    finally:
        os._exit(code if code >= 0 else 128 - code)


class TaskStartError(RuntimeError):
    """A launcher's task ended before it registered, or did not register in time."""


class TaskProcess:
    """The supervisor's handle on a task a launcher started (module docstring).

    Args:
        channel: The job's store, its messages sealed.
        task: The task's id (``SLURM_PROCID``).
        timeout_s: How long to wait for it to register (None: as long as it takes).

    Raises:
        TaskStartError: Its monitor reported it gone before it registered (seen within
            a poll, not at the timeout), or ``timeout_s`` passed.
    """

    def __init__(self, channel: ControlChannel, task: int,
                 timeout_s: float | None = None) -> None:
        self.channel, self.task = channel, task
        info = _registration(channel, task, timeout_s)
        self.pid: int = info["pid"]
        self.node: int = info["node"]
        self.host: str | None = info.get("host")
        self._code: int | None = None
        # Its end was never reported (its machine did not answer): it may still run.
        self.unconfirmed = False

    def poll(self) -> int | None:
        """Its exit code once its monitor reported it gone, else None."""
        if self._code is None and self.channel.read(gone_key(self.task)) is not None:
            code = self.channel.read(exit_key(self.task))
            self._code = KILLED if code is None else int(code)
        return self._code

    def kill(self) -> None:
        """Ask its monitor to kill it (SIGKILL)."""
        if self._code is None:
            self.channel.set(kill_key(self.task), "1")

    def wait(self) -> int:
        """Its exit code; ``KILLED`` when no monitor reported within a few seconds (its
        machine is gone)."""
        deadline = time.monotonic() + _WAIT_S
        while self.poll() is None:
            if time.monotonic() > deadline:
                self._code = KILLED
                self.unconfirmed = True
                break
            time.sleep(_MONITOR_POLL_S)
        assert self._code is not None
        return self._code


def _registration(channel: ControlChannel, task: int,
                  timeout_s: float | None) -> dict[str, Any]:
    """Task ``task``'s registration, once it is there (see :class:`TaskProcess`)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while (registration := channel.read_record(task_key(task))) is None:
        if channel.read(gone_key(task)) is not None:
            code = int(channel.read(exit_key(task)) or KILLED)
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise TaskStartError(f"task {task} ended ({how}) before it registered")
        if deadline is not None and time.monotonic() > deadline:
            raise TaskStartError(f"task {task} did not register within {timeout_s:g} s "
                                 "(--startup-timeout-s): was it started, with MOE_STORE set?")
        time.sleep(_MONITOR_POLL_S)
    return registration
