"""Lightning plumbing both ``MoEParallelStrategy`` classes share.

Fabric's and the Trainer's ``ParallelStrategy`` base classes differ in names and hook
signatures but not in what a pp x dp x ep strategy must do: assign global ranks from the
cluster environment, open the default process group and build the device mesh, broadcast
Python objects, synchronise, and register under one name. The two classes delegate here.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_moe_ckpt.failures.rendezvous import JobStore

STRATEGY_NAME = "moe_parallel"


def assign_world_ranks(environment: ClusterEnvironment | None, node_rank: int,
                       num_processes: int, num_nodes: int, local_rank: int) -> None:
    """Global rank and world size from node rank, local rank and processes per node."""
    if environment is not None:
        environment.set_global_rank(node_rank * num_processes + local_rank)
        environment.set_world_size(num_nodes * num_processes)
        rank_zero_only.rank = environment.global_rank()  # type: ignore[attr-defined]


def connect(strategy: Any) -> None:
    """Open the default process group (if needed) and build the strategy's mesh. Under
    the supervisor the group is formed on its store, in this process's generation."""
    backend = (strategy._process_group_backend
               or _get_default_process_group_backend_for_device(strategy.root_device))
    assert strategy.cluster_environment is not None
    job = JobStore.from_env(strategy.recovery_timeout_s)
    if job is not None:
        job.join(job.replaces if job.replaces is not None else job.generation, backend)
    else:
        _init_dist_connection(strategy.cluster_environment, backend, timeout=strategy._timeout)
    strategy.core.setup_mesh(strategy.root_device.type)


def barrier() -> None:
    """Synchronise all processes (no-op outside a process group)."""
    if _distributed_is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank."""
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def register(cls: type, strategy_registry: Any) -> None:
    """Register ``cls`` under :data:`STRATEGY_NAME` once."""
    if STRATEGY_NAME not in strategy_registry:
        strategy_registry.register(STRATEGY_NAME, cls,
                                   description="MoE expert + pipeline + data parallel")
