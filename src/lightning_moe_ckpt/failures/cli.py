"""The supervisor's command line, ``python -m lightning_moe_ckpt.supervise``: run a
training script under the supervisor.

::

    python -m lightning_moe_ckpt.supervise --workers 4 train.py [script arguments]
    python -m lightning_moe_ckpt.supervise --workers 4 --spares 1 -m my_package.train ...

As ``torchrun`` does on one machine, the supervisor starts one process per rank with
``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set, so the script's Trainer (``devices`` equal
to the worker count) runs as an externally launched job. Unlike ``torchrun`` it hosts the
job's store itself and replaces a worker that exits, is killed or hangs (silent for
``--timeout-s``), while every other worker keeps running: ``SparseCheckpointing`` in the
script recovers the replaced rank's state from its peers (see
:mod:`~lightning_moe_ckpt.failures.supervisor` and
:mod:`~lightning_moe_ckpt.failures.join`).
``--timeout-s`` must equal the strategy's ``recovery_timeout_s`` (both default to 60);
``--status`` names a JSON file with the store address and every worker's pid, rewritten
whenever a process changes. ``--fork-workers`` forks the workers, replacements and spares
from a fork server that imported torch and Lightning once, and the modules named with
``--preload MODULE`` (:mod:`~lightning_moe_ckpt.failures.forked_workers`). The exit code
is 0 once every worker finished its training and exited cleanly. End the script with
``torch.distributed.destroy_process_group()``: a worker that leaves with process groups
alive can abort at interpreter exit, and a worker failing after its training ended is
reported (exit code 1), not replaced.

On several machines the launcher starts the processes and the supervisor starts none::

    python -m lightning_moe_ckpt.supervise --launcher-tasks 24 --ranks-per-node 8 \
        --host "$(hostname)" --port 29400 &
    MOE_STORE=$(hostname):29400 srun --kill-on-bad-exit=0 python train.py ...

It hosts the job's store and hands failed ranks to spare tasks
(:mod:`~lightning_moe_ckpt.failures.tasks`, docs/guides/cluster.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_moe_ckpt.core.nodes import launcher_node_size
from lightning_moe_ckpt.failures.protocol import PREEMPT_GRACE_S
from lightning_moe_ckpt.failures.supervisor import Supervisor, report_of


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_moe_ckpt.supervise",
        description="Run a training script's workers and replace those that fail.")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes to start, one per rank (the job's world size); with "
                             "--launcher-tasks, default: the shape task 0 sends")
    parser.add_argument("--launcher-tasks", type=int, default=None, metavar="N",
                        help="start nothing: a launcher (srun) starts N tasks, the ranks "
                             "first, then the spare nodes' tasks, then the spares; this "
                             "process hosts their store (--host, --port) and replaces failed "
                             "ranks by spare tasks")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the host name the workers reach the store at (default "
                             "127.0.0.1)")
    parser.add_argument("--port", type=int, default=0,
                        help="the store's port (default: a free one; a launcher's tasks "
                             "are told it in MOE_STORE=host:port)")
    parser.add_argument("--spares", type=int, default=0,
                        help="warm spare processes started with the job (default 0)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="ranks each node runs (node n: ranks n*R..n*R+R-1), for "
                             "replica placement and node faults; default: one node (with "
                             "--launcher-tasks: SLURM's tasks per node)")
    parser.add_argument("--spare-nodes", type=int, default=0,
                        help="spare nodes started with the job, --ranks-per-node warm spares "
                             "each; one takes over a node whose ranks all failed (default 0)")
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="a worker silent this long is hung and killed; equal to the "
                             "strategy's recovery_timeout_s (default 60)")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0,
                        help="with --launcher-tasks: how long the tasks have to start and "
                             "register (default 600); a task that ends before it registers "
                             "stops the job at once, naming it")
    parser.add_argument("--max-restarts", type=int, default=3,
                        help="replacements before the job gives up (default 3)")
    parser.add_argument("--preempt-grace-s", type=float, default=None,
                        help="after a SIGTERM to the job (a preemption): how long the "
                             "workers have to commit a durable checkpoint and exit before "
                             "they are killed (default 20; with --launcher-tasks and no "
                             "--workers, task 0's setting)")
    parser.add_argument("--fork-workers", action="store_true",
                        help="fork the workers, replacements and spares from a fork server "
                             "that imported torch, Lightning and --preload once, instead of "
                             "starting fresh interpreters (not for a script that initialises "
                             "CUDA when imported)")
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE",
                        help="with --fork-workers: a module the fork server imports besides "
                             "torch and Lightning (one the script imports; repeatable)")
    parser.add_argument("--status", type=Path, default=None,
                        help="JSON file with the store address and every worker's pid")
    parser.add_argument("-m", dest="module", default=None,
                        help="run a module as a script (as python -m does)")
    parser.add_argument("script", nargs=argparse.REMAINDER,
                        help="the script (or, with -m, the module's arguments)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Supervise the job ``argv`` describes; returns its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.launcher_tasks is not None:
        return _host_launcher_tasks(parser, args)
    if args.workers is None or args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    if args.spares < 0 or args.max_restarts < 0 or args.timeout_s <= 0:
        parser.error(f"--spares={args.spares} and --max-restarts={args.max_restarts} must be "
                     f">= 0 and --timeout-s={args.timeout_s} > 0")
    if args.ranks_per_node is not None and (args.ranks_per_node < 1
                                            or args.workers % args.ranks_per_node):
        parser.error(f"--ranks-per-node={args.ranks_per_node} must be >= 1 and divide "
                     f"--workers={args.workers}")
    if args.spare_nodes < 0 or (args.spare_nodes and args.ranks_per_node is None):
        parser.error(f"--spare-nodes={args.spare_nodes} must be >= 0 and needs "
                     "--ranks-per-node")
    if args.preload and not args.fork_workers:
        parser.error(f"--preload={args.preload} needs --fork-workers")
    if args.module is None and not args.script:
        parser.error("name the training script (or -m MODULE)")
    command = ([sys.executable, "-m", args.module, *args.script] if args.module is not None
               else [sys.executable, *args.script])
    supervisor = Supervisor(command, args.workers, args.timeout_s, args.max_restarts,
                            args.spares, status_path=args.status,
                            fork_workers=args.fork_workers, preload=args.preload,
                            ranks_per_node=args.ranks_per_node, spare_nodes=args.spare_nodes,
                            preempt_grace_s=_grace(parser, args))
    return _report(supervisor)


def _host_launcher_tasks(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Supervise the tasks a launcher starts (``--launcher-tasks``)."""
    if args.script or args.module or args.fork_workers:
        parser.error("with --launcher-tasks the launcher runs the script: name none here "
                     "(and no --fork-workers)")
    if args.startup_timeout_s <= 0:
        parser.error(f"--startup-timeout-s={args.startup_timeout_s} must be > 0")
    if args.launcher_tasks < 1 or args.workers == 0:
        parser.error(f"--launcher-tasks={args.launcher_tasks} must be >= 1 and "
                     f"--workers={args.workers} >= 1 when given")
    try:
        supervisor = Supervisor((), args.workers or 0, args.timeout_s, args.max_restarts,
                                args.spares, status_path=args.status,
                                ranks_per_node=(args.ranks_per_node
                                                or launcher_node_size()),
                                spare_nodes=args.spare_nodes,
                                launcher_tasks=args.launcher_tasks, store_host=args.host,
                                store_port=args.port, preempt_grace_s=_grace(parser, args),
                                startup_timeout_s=args.startup_timeout_s)
    except ValueError as error:
        parser.error(str(error))
    return _report(supervisor)


def _grace(parser: argparse.ArgumentParser, args: argparse.Namespace) -> float:
    """``--preempt-grace-s``, checked (default 20 s)."""
    if args.preempt_grace_s is None:
        return PREEMPT_GRACE_S
    if args.preempt_grace_s <= 0:
        parser.error(f"--preempt-grace-s={args.preempt_grace_s} must be > 0")
    return float(args.preempt_grace_s)


def _report(supervisor: Supervisor) -> int:
    """Run ``supervisor``; print its replacements; its exit code."""
    code = supervisor.run()
    for replacement in report_of(supervisor.replacements):
        line = (f"supervisor: generation {replacement['generation']}: rank "
                f"{replacement['rank']} ({replacement['cause']}) pid {replacement['dead_pid']} "
                f"replaced by pid {replacement['new_pid']}")
        print(line, file=sys.stderr)  # noqa: T201  (the command's result)
    return code

