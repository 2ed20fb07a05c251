"""``MoEParallelStrategy`` for the Lightning Trainer (expert + pipeline + data parallel).

Usage::

    trainer = L.Trainer(strategy=MoEParallelStrategy(pp=2, ep=2), devices=4,
                        accelerator="cpu", use_distributed_sampler=False)
    trainer.fit(MoELanguageModule(settings))

The LightningModule must use manual optimization: Lightning's automatic optimization runs
``training_step``, then ``zero_grad``, then ``backward``, which would wipe the gradients a
pipeline schedule produced inside ``training_step`` (and non-last stages have no loss to
return). :class:`~lightning_moe_ckpt.training.MoELanguageModule` does so: each
``training_step`` runs one full iteration through the engine that its ``configure_model``
obtains from :meth:`MoEParallelStrategy.build_engine`. Data loaders come from the module's
own seekable sampler, sharded by :attr:`MoEParallelCore.data_shard`; pass
``use_distributed_sampler=False`` (Lightning's injected sampler would shuffle). Launching
works as for the Fabric strategy: ``devices=N`` on one machine, torchrun/SLURM across
machines.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning_utilities.core.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_moe_ckpt.core.operators import local_tensor, shard_like
from lightning_moe_ckpt.failures.join import JoiningLoader
from lightning_moe_ckpt.failures.protocol import is_replacement
from lightning_moe_ckpt.failures.rendezvous import await_assignment
from lightning_moe_ckpt.parallel.model_plans import ParallelizeFn
from lightning_moe_ckpt.parallel.plan_selection import check_user_model
from lightning_moe_ckpt.strategies.common import (
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
from lightning_moe_ckpt.training.pipeline_module import PipelineTrainable
from lightning_moe_ckpt.training.settings import TrainingSettings


class MoEParallelStrategy(ParallelStrategy, SplitModelParallelism, EngineProvider):
    """Trainer strategy running a :class:`TrainingEngine` per rank over a
    pp x dp x dp_shard x ep mesh.

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
        # A warm spare of a supervised job waits here, its imports and configuration done,
        # until the supervisor hands it a failed rank (which sets this process's rank).
        if not await_assignment():
            sys.exit(0)  # the job ended without needing this spare
        self.core = MoEParallelCore(pp, dp, ep, schedule, dp_shard)
        # A user's PipelineTrainable module: its model split by a plan, run by the
        # staged executor in ``microbatches`` micro-batches per batch.
        self.user_model = UserModelSplit(self.core, microbatches, parallelize_fn)
        self._pipeline_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] | None = None
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        # Under the supervisor: the hang timeout the collective timeout is derived from.
        self.recovery_timeout_s = recovery_timeout_s
        # A replacement joining a running job: the Trainer's own start-up collectives
        # (log directory, barriers) stay local, since the survivors are recovering and
        # will not mirror them; it joins their collectives at its recovery.
        self.joining_running_job = is_replacement()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        """Processes on this machine."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always distributed (read by Lightning's data connector)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.core.data_shards, "rank": self.core.data_shard}

    @override
    def build_engine(self, settings: TrainingSettings) -> TrainingEngine:
        """This rank's training engine (called from the module's ``configure_model``)."""
        return self.core.build_engine(settings, self.root_device)

    @override
    def _configure_launcher(self) -> None:
        self.core.resolve(self.num_nodes * self.num_processes)
        assert self.cluster_environment is not None
        self._launcher = _CheckingLauncher(self, self.cluster_environment,
                                           self.num_processes, self.num_nodes)

    def check_before_launch(self, module: object) -> None:
        """Reject a user's module the layout cannot take (no plan and no
        ``parallelize_fn``, experts not divisible by ``ep``, fewer decoder layers than
        stages), naming the setting, before any process starts."""
        if isinstance(module, PipelineTrainable):
            check_user_model(module.parallel_model(), self.user_model.parallelize_fn,
                             pp=self.core.pp, ep=self.core.ep)

    def set_world_ranks(self) -> None:
        """Global rank and world size from node rank, local rank and process count."""
        assign_world_ranks(self.cluster_environment, self.node_rank, self.num_processes,
                           self.num_nodes, self.local_rank)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        connect(self)

    def rank_checkpoint_path(self, path: str | Path) -> Path:
        """This rank's file inside a (directory-shaped) checkpoint ``path``."""
        return Path(path) / f"rank{self.global_rank:05d}.ckpt"

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        # Every rank holds different stages, experts and shards: each writes its own file
        # into the checkpoint directory (same layout required to resume), a sharded
        # tensor as its local shard (plain tensors: read back without its device mesh).
        checkpoint = apply_to_collection(checkpoint, DTensor, local_tensor)
        checkpoint["moe_parallel_layout"] = self._layout_record()
        self.checkpoint_io.save_checkpoint(checkpoint, self.rank_checkpoint_path(filepath),
                                           storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        path = self.rank_checkpoint_path(checkpoint_path)
        if not path.is_file():
            raise FileNotFoundError(f"ckpt_path={str(checkpoint_path)!r} has no file for rank "
                                    f"{self.global_rank} ({path.name}); it must come from a "
                                    "run with the same parallel layout")
        checkpoint: dict[str, Any] = self.checkpoint_io.load_checkpoint(
            path, weights_only=weights_only)
        layout = {"dp_shard": 1, **checkpoint.get("moe_parallel_layout", {})}
        expected = self._layout_record()
        if layout != expected:
            raise ValueError(f"ckpt_path={str(checkpoint_path)!r} was written with layout "
                             f"{layout}, this run uses {expected}")
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        module = self.lightning_module
        assert module is not None
        live = module.state_dict()
        state = {key: shard_like(value, live[key]) if key in live else value
                 for key, value in checkpoint["state_dict"].items()}
        module.load_state_dict(state, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        super().load_optimizer_state_dict(checkpoint)
        for optimizer in self.optimizers:  # a torch optimizer's state of sharded parameters
            for param, state in optimizer.state.items():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim():
                        state[key] = shard_like(value, param)

    def _layout_record(self) -> dict[str, Any]:
        """The layout a checkpoint is written in, which a resume must use too."""
        return self.core.layout_record(self.world_size)

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        self.checkpoint_io.remove_checkpoint(self.rank_checkpoint_path(filepath))

    @override
    def setup(self, trainer: L.Trainer) -> None:
        module = self.lightning_module
        if isinstance(module, PipelineTrainable):
            self.user_model.split(module.parallel_model())
            self._route_clipping()
        super().setup(trainer)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A user's model is split into this rank's stage in :meth:`setup`: a checkpoint
        (which holds the stage) is loaded into it after that, not into the whole model."""
        return isinstance(self.lightning_module, PipelineTrainable)

    def _route_clipping(self) -> None:
        """``gradient_clip_val`` clips by the norm over every stage and expert shard (a
        SparseCheckpointing target reroutes it again, to log the coefficient)."""
        plugin = self.precision_plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: int | float) -> None:
            grads = [p.grad for p in plugin.main_params(optimizer) if p.grad is not None]
            clip_by_total_norm(grads, self.user_grad_norm(), float(clip_val))

        # An instance attribute: only this strategy's plugin is rerouted.
        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @property
    @override
    def replaces_failed_ranks(self) -> bool:
        return True

    @override
    def release_user_model(self) -> None:
        self.user_model.release()

    @override
    def reform_user_model(self) -> None:
        self.user_model.reform(self.root_device)

    @override
    def warm_up_user_model(self, sample_batch: Any) -> None:
        module = self.lightning_module
        assert isinstance(module, PipelineTrainable)
        inputs, _ = module.split_batch(self.batch_to_device(sample_batch))
        self.user_model.warm_up(module.microbatch_loss, inputs, self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        if (self.joining_running_job and self.user_model.staged is not None
                and module is not None and module.trainer.training):
            # A replacement's train loader starts where the job resumes.
            return JoiningLoader(dataloader, lambda: module.trainer.num_training_batches)
        return dataloader

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None,
                       **kwargs: Any) -> Any:
        step = super().optimizer_step
        guard = self.iteration_guard
        if guard is None:
            return step(optimizer, closure, model, **kwargs)
        return guard.guarded(lambda: step(optimizer, closure, model, **kwargs))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.joining_running_job = False  # from its first batch on, in step with all

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        if self.user_model.staged is None or not isinstance(module, PipelineTrainable):
            return super().training_step(*args, **kwargs)
        inputs, targets = module.split_batch(args[0])
        loss = self.user_model.forward_backward(inputs, targets, module.microbatch_loss,
                                                self.root_device)
        # Lightning zeroes gradients between the training step and backward: the
        # schedule's gradients are handed back in backward().
        assert self.user_model.executor is not None
        self._pipeline_grads = [(param, param.grad)
                                for param, _ in self.user_model.executor.trainable]
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        if self._pipeline_grads is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        grads, self._pipeline_grads = self._pipeline_grads, None
        for param, grad in grads:
            param.grad = grad
        assert self.user_model.executor is not None
        self.user_model.executor.reduce_gradients()
        return closure_loss

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor) and not self.joining_running_job:
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        if not self.joining_running_job:
            barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self.joining_running_job else broadcast_object(obj, src)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register(cls, strategy_registry)


class _CheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher, checking the module given to ``fit`` against the
    layout before it starts the other processes."""

    def __init__(self, strategy: MoEParallelStrategy, *args: Any) -> None:
        super().__init__(*args)
        self.strategy = strategy

    @override
    def launch(self, function: Any, *args: Any, trainer: L.Trainer | None = None,
               **kwargs: Any) -> Any:
        self.strategy.check_before_launch(args[0] if args else None)  # fit(module, ...)
        return super().launch(function, *args, trainer=trainer, **kwargs)
