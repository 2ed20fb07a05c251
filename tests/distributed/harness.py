"""Run a training function on N gloo CPU processes and collect rank 0's result.

Processes are started with ``torch.multiprocessing`` on a free loopback port; each runs
with one intra-op thread so several fit on a 2-core machine. They fork from
multiprocessing's fork server, which imported torch, Lightning and the library once
(:mod:`tests.distributed.preload`): a spawned process would import them again, seconds of
CPU for every rank of every run. Each rank gets the environment the test runs with, as a
spawned one would (the server's is the one of the first run). Rank 0 writes its result
with ``torch.save`` to a file the parent reads back; a process that raised exits non-zero
and fails the run, and a run that overruns is killed by its processes' pids.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.forked import free_port  # also sets the fork server's preload

RUN_TIMEOUT_S = 420.0  # below pytest-timeout's 600 s, so the ranks are ended here
COLLECTIVE_TIMEOUT_S = 300.0  # gloo's default is 30 minutes


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            out: str, environment: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    result = fn(*args)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    # Leave at once, the work done and saved: tearing gloo's groups down in interpreter
    # finalization occasionally aborts a process (SIGABRT, "terminate called without an
    # active exception"), which would fail a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(world: int, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` on ``world`` processes; returns what rank 0 returned. A run that
    has not ended after :data:`RUN_TIMEOUT_S` fails the test, its processes killed by pid
    (a rank stuck in a collective also gives up after :data:`COLLECTIVE_TIMEOUT_S`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pt")
        context = mp.start_processes(_worker, args=(world, free_port(), fn, args, out,
                                                    dict(os.environ)),
                                     nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    if process.is_alive():
                        os.kill(process.pid, signal.SIGKILL)
                    process.join()
                pytest.fail(f"{world} ranks of {fn.__name__} overran {RUN_TIMEOUT_S:g} s")
        return torch.load(out, weights_only=False)
