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
import json
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

__all__ = ["JobLayout", "LauncherTask", "TaskProcess", "TaskStartError", "launcher_task",
           "register", "watch_in_parent"]

KILLED = -int(signal.SIGKILL)  # a task whose machine is gone (as Popen reports a kill)
LAYOUT_KEY = "job/layout"  # the job's shape, from task 0 when the supervisor was not told
READY_KEY = "job/ready"  # the supervisor's answer to the tasks: the layout, or an error
_MONITOR_POLL_S = 0.1
_WAIT_S = 5.0  # how long a kill request waits for the monitor's report


def task_key(task: int) -> str:
    """Registration: ``{"pid", "node", "host"}`` of task ``task``."""
    return f"task/{task}"


def gone_key(task: int) -> str:
    """Set by a task's monitor once the task exited."""
    return f"gone/{task}"


def exit_key(task: int) -> str:
    """The exit code a task wrote before it left on its own."""
    return f"exit/{task}"


def kill_key(task: int) -> str:
    """Set by the supervisor: the task's monitor kills it."""
    return f"kill/{task}"


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


def register(store: TCPStore, task: LauncherTask) -> None:
    """Announce this process as ``task`` (pid, node, host) to the supervisor."""
    store.set(task_key(task.task), json.dumps({"pid": os.getpid(), "node": task.node,
                                               "host": socket.gethostname()}))


def watch_in_parent(address: str, task: int) -> None:
    """Split this process in two: the child returns and goes on as the task (the training
    script, its imports done); the parent, the process the launcher started, becomes the
    task's monitor and never returns. The monitor waits for the child, writes its exit
    code (negative: the signal that ended it) and then ``gone/<task>``, kills it when
    ``kill/<task>`` is set, passes SIGTERM and SIGINT (a scheduler's cancel) on to it, and
    exits as it did, so the launcher sees the task's own outcome."""
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
        status = None
        while status is None:
            done, waited = os.waitpid(child, os.WNOHANG)
            if done:
                status = waited
            elif store.check([kill_key(task)]):
                os.kill(child, signal.SIGKILL)
            else:
                time.sleep(_MONITOR_POLL_S)
        code = os.waitstatus_to_exitcode(status)
        store.set(exit_key(task), str(code))
        store.set(gone_key(task), "1")
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
        store: The job's store.
        task: The task's id (``SLURM_PROCID``).
        timeout_s: How long to wait for it to register (None: as long as it takes).

    Raises:
        TaskStartError: Its monitor reported it gone before it registered (seen within
            a poll, not at the timeout), or ``timeout_s`` passed.
    """

    def __init__(self, store: TCPStore, task: int, timeout_s: float | None = None) -> None:
        self.store, self.task = store, task
        info = _registration(store, task, timeout_s)
        self.pid: int = info["pid"]
        self.node: int = info["node"]
        self._code: int | None = None

    def poll(self) -> int | None:
        """Its exit code once its monitor reported it gone, else None."""
        if self._code is None and self.store.check([gone_key(self.task)]):
            self._code = int(self.store.get(exit_key(self.task)))
        return self._code

    def kill(self) -> None:
        """Ask its monitor to kill it (SIGKILL)."""
        if self._code is None:
            self.store.set(kill_key(self.task), "1")

    def wait(self) -> int:
        """Its exit code; ``KILLED`` when no monitor reported within a few seconds (its
        machine is gone)."""
        deadline = time.monotonic() + _WAIT_S
        while self.poll() is None:
            if time.monotonic() > deadline:
                self._code = KILLED
                break
            time.sleep(_MONITOR_POLL_S)
        assert self._code is not None
        return self._code


def _registration(store: TCPStore, task: int, timeout_s: float | None) -> dict[str, Any]:
    """Task ``task``'s registration, once it is there (see :class:`TaskProcess`)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not store.check([task_key(task)]):
        if store.check([gone_key(task)]):
            code = int(store.get(exit_key(task)))
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise TaskStartError(f"task {task} ended ({how}) before it registered")
        if deadline is not None and time.monotonic() > deadline:
            raise TaskStartError(f"task {task} did not register within {timeout_s:g} s "
                                 "(--startup-timeout-s): was it started, with MOE_STORE set?")
        time.sleep(_MONITOR_POLL_S)
    info: dict[str, Any] = json.loads(store.get(task_key(task)))
    return info
