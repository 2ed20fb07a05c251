"""A stand-in for ``srun`` on one machine, to run a several-node job in tests.

::

    python recipes/cluster.py --nodes 3 --ranks-per-node 2 -- recipes/train.py \\
        parallel.pp=2 parallel.dp=2 parallel.spare_nodes=1 faults=at faults.kind=kill \\
        'faults.events=[{step: 13, node: 1}]'

It does what a SLURM batch script with ``srun --kill-on-bad-exit=0`` does (see
docs/guides/cluster.md):

1. starts the supervisor as the job's store host, a process of its own on the "head
   node" (``python -m lightning_moe_ckpt.supervise --launcher-tasks N*M --ranks-per-node
   M --port P``), which takes the job's shape (ranks, spare nodes, spares) from task 0;
2. starts ``--nodes`` x ``--ranks-per-node`` tasks running ``python SCRIPT ARGS``, each with
   the environment srun gives a task (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_NODEID``,
   ``SLURM_LOCALID``, ``SLURM_NNODES``, ``SLURM_NTASKS_PER_NODE``, ``SLURMD_NODENAME``, ...)
   and ``MOE_STORE=127.0.0.1:P``; each node's tasks form a process group of their own, as
   one machine's processes would;
3. lets a failed task end alone (the others go on, as with ``--kill-on-bad-exit=0``), and
   exits with the supervisor's exit code (the job's) once it ended; tasks still running
   then are ended by their node's process group (SIGTERM, then SIGKILL).

A fault of kind ``kill`` with a ``node`` target makes every rank of that node kill itself
(``faults.events=[{step: S, node: K}]``), as a machine that dies would take them.

``--preempt-at-step S`` preempts the job as SLURM does: once rank 0 begins iteration ``S``
(its heartbeat in the job store says so), SIGTERM goes to the supervisor and to every task,
and ``--preempt-grace-s`` seconds later (SLURM's ``KillWait``, 30 by default) SIGKILL to
whatever still runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

POLL_S = 0.1
GRACE_S = 30.0  # how long tasks may take to leave once the supervisor ended
KILL_WAIT_S = 30.0  # SLURM's default time from a preemption's SIGTERM to its SIGKILL


def _free_port() -> int:
    """A port free now, for the supervisor's store (the supervisor binds it at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def task_environment(task: int, nodes: int, per_node: int, store: str, job_id: str
                     ) -> dict[str, str]:
    """What srun gives task ``task`` of a ``nodes`` x ``per_node`` step (block layout),
    with the supervisor's store at ``store`` (host:port)."""
    node = task // per_node
    return {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0",
            "SLURM_JOB_NAME": "cluster", "SLURM_PROCID": str(task),
            "SLURM_NTASKS": str(nodes * per_node), "SLURM_NNODES": str(nodes),
            "SLURM_NODEID": str(node), "SLURM_LOCALID": str(task % per_node),
            "SLURM_NTASKS_PER_NODE": str(per_node),
            "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})",
            "SLURMD_NODENAME": f"node{node}", "MOE_STORE": store}


class _Preemption:
    """SIGTERM to the job once rank 0 begins iteration ``step``, SIGKILL ``grace_s`` later."""

    def __init__(self, port: int, step: int, grace_s: float) -> None:
        self.port, self.step, self.grace_s = port, step, grace_s
        self.store: Any = None  # the job store, once the supervisor listens
        self.kill_at: float | None = None

    def due(self) -> bool:
        """Whether rank 0 has begun iteration ``step`` (once: then it is not due again)."""
        from torch.distributed import TCPStore

        from lightning_moe_ckpt.failures.protocol import STATUS_KEY, heartbeat_key

        if self.kill_at is not None:
            return False
        if self.store is None:  # a client made before the server listens backs off long
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return False
            self.store = TCPStore("127.0.0.1", self.port, is_master=False,
                                  timeout=datetime.timedelta(seconds=30))
        try:
            if not self.store.check([STATUS_KEY]):
                return False
            pid = json.loads(self.store.get(STATUS_KEY))["ranks"]["0"]
            begun = int(self.store.add(heartbeat_key(0, pid), 0))  # iterations begun
        except RuntimeError:  # the supervisor ended meanwhile
            return False
        return begun > self.step


def run(nodes: int, per_node: int, command: Sequence[str], supervisor_args: Sequence[str] = (),
        preempt_at_step: int | None = None, preempt_grace_s: float = KILL_WAIT_S,
        job_id: str | None = None, tasks_only: bool = False) -> int:
    """Run ``command`` as ``nodes`` x ``per_node`` tasks beside the supervisor; returns
    the supervisor's exit code (``128 + SIGKILL`` when a preemption's grace ran out).
    ``tasks_only``: start the tasks alone, as ``srun`` in a batch script that started the
    supervisor itself (``MOE_STORE`` in the environment); returns the tasks' largest exit
    code, as srun does."""
    job = job_id if job_id is not None else os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    if tasks_only:
        return _run_tasks(nodes, per_node, command, os.environ["MOE_STORE"], job)
    from lightning_moe_ckpt.failures.protocol import job_secret

    # The job's secret, for the supervisor and every task (in the environment, as a batch
    # script exports it): control messages without it are ignored.
    job_secret(create=True)
    port = _free_port()
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "lightning_moe_ckpt.supervise",
         "--launcher-tasks", str(nodes * per_node), "--ranks-per-node", str(per_node),
         "--port", str(port), *supervisor_args])
    tasks: list[subprocess.Popen[bytes]] = []
    groups: list[int] = []  # each node's process group
    try:
        _start_tasks(nodes, per_node, command, f"127.0.0.1:{port}", job, tasks, groups)
        preemption = (None if preempt_at_step is None
                      else _Preemption(port, preempt_at_step, preempt_grace_s))
        while supervisor.poll() is None:
            if preemption is not None and preemption.due():
                print(f"cluster: preempting the job at step {preempt_at_step} (SIGTERM to the "
                      f"supervisor and every task; SIGKILL in {preempt_grace_s:g} s)",
                      file=sys.stderr)
                supervisor.send_signal(signal.SIGTERM)
                for group in groups:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(group, signal.SIGTERM)
                preemption.kill_at = time.monotonic() + preempt_grace_s
            if (preemption is not None and preemption.kill_at is not None
                    and time.monotonic() > preemption.kill_at):
                print("cluster: the preemption's grace ran out: SIGKILL", file=sys.stderr)
                return 128 + int(signal.SIGKILL)  # _end kills what is left
            if all(t.poll() is not None for t in tasks):  # nobody left to supervise
                time.sleep(GRACE_S / 3)
                if supervisor.poll() is None:
                    print("cluster: every task ended and the supervisor did not; ending "
                          f"it (pid {supervisor.pid})", file=sys.stderr)
                    supervisor.terminate()
                    supervisor.wait(GRACE_S)
                    return 1
            time.sleep(POLL_S)
        deadline = time.monotonic() + GRACE_S
        while any(t.poll() is None for t in tasks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return int(supervisor.returncode)
    finally:
        _end(supervisor, tasks, groups)


def _start_tasks(nodes: int, per_node: int, command: Sequence[str], store: str, job: str,
                 tasks: list[subprocess.Popen[bytes]], groups: list[int]) -> None:
    """Start every task, each node's in a process group of its own."""
    for task in range(nodes * per_node):
        first = task % per_node == 0
        process = subprocess.Popen([sys.executable, *command],
                                   env=task_environment(task, nodes, per_node, store, job),
                                   process_group=0 if first else groups[-1])
        if first:
            groups.append(process.pid)
        tasks.append(process)


def _run_tasks(nodes: int, per_node: int, command: Sequence[str], store: str, job: str
               ) -> int:
    """The tasks alone (``--tasks-only``): their largest exit code once all ended."""
    tasks: list[subprocess.Popen[bytes]] = []
    groups: list[int] = []

    def pass_on(number: int, frame: object) -> None:  # as srun passes a signal to its tasks
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, number)

    signal.signal(signal.SIGTERM, pass_on)
    try:
        _start_tasks(nodes, per_node, command, store, job, tasks, groups)
        codes = [task.wait() for task in tasks]
        return max((128 - code if code < 0 else code) for code in codes)
    finally:
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)


def _end(supervisor: subprocess.Popen[bytes], tasks: Sequence[subprocess.Popen[bytes]],
         groups: Sequence[int]) -> None:
    """End what still runs: the supervisor by its pid, each node by its process group."""
    if supervisor.poll() is None:
        supervisor.kill()
        supervisor.wait()
    for number in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError):  # that node's have all ended
                os.killpg(group, number)
        deadline = time.monotonic() + 5.0
        while any(t.poll() is None for t in tasks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
    for task in tasks:
        task.wait()


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python recipes/cluster.py",
                                     description="Run a script as srun would on several "
                                                 "nodes, on this machine, beside the "
                                                 "supervisor.")
    parser.add_argument("--nodes", type=int, required=True, help="nodes to stand in for")
    parser.add_argument("--ranks-per-node", type=int, required=True,
                        help="tasks per node (srun --ntasks-per-node)")
    parser.add_argument("--supervisor-arg", action="append", default=[], metavar="ARG",
                        help="an argument for the supervisor (repeatable), e.g. "
                             "--supervisor-arg=--status=workers.json")
    parser.add_argument("--preempt-at-step", type=int, default=None, metavar="S",
                        help="preempt the job as SLURM does once rank 0 begins iteration S: "
                             "SIGTERM to the supervisor and every task, SIGKILL after "
                             "--preempt-grace-s")
    parser.add_argument("--preempt-grace-s", type=float, default=KILL_WAIT_S,
                        help="seconds from the preemption's SIGTERM to its SIGKILL "
                             f"(SLURM's KillWait; default {KILL_WAIT_S:g})")
    parser.add_argument("--job-id", default=None,
                        help="SLURM_JOB_ID of the tasks (default: a new one per run; give the "
                             "same one to stand in for a requeued job)")
    parser.add_argument("--tasks-only", action="store_true",
                        help="start the tasks alone, as srun in a batch script that started "
                             "the supervisor itself (MOE_STORE set); exit with their largest "
                             "exit code")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- SCRIPT [ARGS]: what each task runs with python")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nodes < 1 or args.ranks_per_node < 1:
        parser.error(f"--nodes={args.nodes} and --ranks-per-node={args.ranks_per_node} must "
                     "be >= 1")
    if not command:
        parser.error("name the script each task runs: -- SCRIPT [ARGS]")
    # A SIGTERM (a timeout, a cancel) ends the run through run()'s clean-up, which ends
    # the supervisor and every node's processes.
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    if args.preempt_at_step is not None and (args.preempt_at_step < 0
                                             or args.preempt_grace_s <= 0):
        parser.error(f"--preempt-at-step={args.preempt_at_step} must be >= 0 and "
                     f"--preempt-grace-s={args.preempt_grace_s} > 0")
    if args.tasks_only and ("MOE_STORE" not in os.environ or args.supervisor_arg
                            or args.preempt_at_step is not None):
        parser.error("--tasks-only starts no supervisor: it needs MOE_STORE=host:port of the "
                     "one the batch script started, and takes no --supervisor-arg or "
                     "--preempt-at-step")
    return run(args.nodes, args.ranks_per_node, command, args.supervisor_arg,
               args.preempt_at_step, args.preempt_grace_s, args.job_id, args.tasks_only)


if __name__ == "__main__":
    sys.exit(main())
