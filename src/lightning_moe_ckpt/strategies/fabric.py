"""``MoEParallelStrategy`` for Lightning Fabric (expert + pipeline + data parallel).

Usage::

    fabric = L.Fabric(strategy=MoEParallelStrategy(pp=2, ep=2), devices=4, accelerator="cpu")
    fabric.launch()
    engine = fabric.strategy.build_engine(settings)

One machine: ``devices=N`` re-runs the script N-1 times through Lightning's subprocess
launcher. Several machines: start the script under ``torchrun`` or SLURM as for any
Lightning job; the launcher then creates no processes. The launcher is always attached
(as ``DDPStrategy`` does) so every process gets the same torch thread count, which CPU
bitwise reproducibility depends on. Layout errors are raised in ``Fabric(...)``, before any
process is started. Gradient sync is done by the engine, so modules are not wrapped.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.parallel.model_plans import ParallelizeFn
from lightning_moe_ckpt.strategies.common import (
    STRATEGY_NAME,
    assign_world_ranks,
    barrier,
    broadcast_object,
    connect,
    register,
)
from lightning_moe_ckpt.strategies.core import MoEParallelCore
from lightning_moe_ckpt.strategies.user_model import SplitModelParallelism, UserModelSplit
from lightning_moe_ckpt.targets.user_loop import clip_by_total_norm
from lightning_moe_ckpt.training.engine import EngineProvider, TrainingEngine
from lightning_moe_ckpt.training.settings import TrainingSettings
from lightning_moe_ckpt.training.staged_executor import LossFn

__all__ = ["STRATEGY_NAME", "MoEParallelStrategy"]


class MoEParallelStrategy(ParallelStrategy, SplitModelParallelism, EngineProvider):
    """Fabric strategy over a pp x dp x dp_shard x ep mesh: the built-in model's
    :class:`TrainingEngine`, or a user's model split by a plan (:meth:`parallelize`).

    Args:
        pp: Pipeline stages.
        dp: Data-parallel replicas; ``"auto"``: what ``pp x dp_shard x ep`` leaves of the
            world size.
        ep: Expert-parallel ranks; must divide the model's experts.
        schedule: The pipeline schedule, ``"1f1b"`` or ``"interleaved_1f1b"``.
        process_group_backend: The process groups' backend (``"gloo"``, ``"nccl"``);
            ``None``: the default for the device.
        timeout: Timeout of the default process group's collectives (outside the
            supervisor).
        recovery_timeout_s: Under the supervisor: its hang timeout (``recovery.timeout_s``),
            from which the collective timeout is derived (a third of it).
        microbatches: Micro-batches per batch of a user's model split by a plan.
        parallelize_fn: Splits a user's model for which the library has no built-in plan:
            ``(model, mesh) -> StagedModel``; ``None``: the built-in plans.
        dp_shard: Data-parallel ranks over which FSDP2 shards the built-in model's
            parameters and optimizer state (a shard group); ``1``: replicated only.

    Raises:
        ConfigError: An unknown ``schedule``, ``microbatches`` or ``dp_shard`` below 1.
    """

    def __init__(self, pp: int = 1, dp: int | str = "auto", ep: int = 1,
                 schedule: str = "1f1b", process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 recovery_timeout_s: float = 60.0, microbatches: int = 1,
                 parallelize_fn: ParallelizeFn | None = None, dp_shard: int = 1) -> None:
        super().__init__()
        self.core = MoEParallelCore(pp, dp, ep, schedule, dp_shard)
        self.user_model = UserModelSplit(self.core, microbatches, parallelize_fn)
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        # Under the supervisor: the hang timeout the collective timeout is derived from.
        self.recovery_timeout_s = recovery_timeout_s

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Machines in the job."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this machine."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of one pipeline reads the same shard; shards are a stage's ranks.
        return {"num_replicas": self.core.data_shards, "rank": self.core.data_shard}

    @override
    def build_engine(self, settings: TrainingSettings) -> TrainingEngine:
        """This rank's training engine (call after ``fabric.launch()``)."""
        return self.core.build_engine(settings, self.root_device)

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Prune a user's ``model`` in place to this rank's pipeline stage and expert shard
        (call after ``fabric.launch()``, before creating the optimizer); returns it."""
        return self.user_model.split(model).model

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: LossFn) -> torch.Tensor:
        """One batch of the parallelized model (``[B, S]`` ids and targets of this rank's
        data shard) in ``microbatches`` micro-batches through the pipeline schedule, its
        gradients synchronised; returns the mean loss over the global batch. Then step
        the optimizer as usual (``optimizer.step()``)."""
        loss = self.user_model.forward_backward(inputs, targets, loss_fn, self.root_device)
        assert self.user_model.executor is not None
        self.user_model.executor.reduce_gradients()
        return loss

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer,
                            max_norm: float | int, norm_type: float | int = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        if self.user_model.staged is None:
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type,
                                               error_if_nonfinite)
        if norm_type != 2.0:
            raise ConfigError(f"clip_gradients(norm_type={norm_type}) of a model split by "
                              "MoEParallelStrategy: only the L2 norm spans the ranks")
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        total = self.user_grad_norm()
        clip_by_total_norm(grads, total, float(max_norm))
        return total

    @override
    def _configure_launcher(self) -> None:
        self.core.resolve(self.num_nodes * self.num_processes)
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                   self.num_processes, self.num_nodes)

    def _set_world_ranks(self) -> None:
        assign_world_ranks(self.cluster_environment, self.node_rank, self.num_processes,
                           self.num_nodes, self.local_rank)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        connect(self)

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        return module

    @override
    def module_to_device(self, module: nn.Module) -> None:
        module.to(self.root_device)

    @override
    def all_reduce(self, tensor: torch.Tensor, group: Any | None = None,
                   reduce_op: Any | None = "mean") -> torch.Tensor:
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(cls, strategy_registry)
