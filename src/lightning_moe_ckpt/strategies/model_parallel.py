"""Real failures under Lightning's own ``ModelParallelStrategy`` (a model sharded by FSDP2).

A user's LightningModule that calls ``fully_shard`` in ``configure_model`` runs under
Lightning's ``ModelParallelStrategy``; under the supervisor, ``SparseCheckpointing`` lets
such a job replace a failed rank while the other ranks keep their processes, as
``TrainerMoEParallelStrategy`` does for a split model. :class:`ModelParallelReplacement`
is what stands in for the strategy there:

* **survivors** keep their live sharded model and optimizer. The module's FSDP state is
  reset (``FSDPModule.reset_iter_state``: the interrupted iteration's all-gathers and
  reductions are dropped, every parameter resharded), the default group of the new
  generation is formed, the device mesh's groups are built again in the order a new
  process builds them (so they get the same names), and every FSDP parameter group takes
  its process group from the mesh again. The sharded parameters, optimizer states and the
  mesh itself stay the same objects: DTensors find their groups by name.
* **a replacement** runs the user's script from the start: Lightning forms the default
  group on the generation's rendezvous store and builds the mesh; its start-up
  collectives (barriers, broadcasts, reductions of the Trainer) stay local until it has
  joined (:func:`keep_start_up_collectives_local`), since the survivors are recovering
  and do not mirror them; its train DataLoader starts where the job resumes.

Every optimizer step of the Trainer runs through the iteration guard, so a step a peer's
failure interrupted runs again once the job recovered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_moe_ckpt.core.target import RankReplacement
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.failures.join import JoiningLoader
from lightning_moe_ckpt.failures.protocol import is_replacement
from lightning_moe_ckpt.parallel.fsdp import (
    has_separate_reduce_scatter_group,
    reattach_fsdp_groups,
    release_fsdp_groups,
)

__all__ = ["ModelParallelReplacement", "keep_start_up_collectives_local",
           "restore_start_up_collectives"]


class ModelParallelReplacement(RankReplacement):
    """Replaces a failed rank of a job under Lightning's ``ModelParallelStrategy``.

    Args:
        strategy: The Trainer's strategy, its device mesh built (``setup`` or later).

    Raises:
        ConfigError: The module uses a separate reduce-scatter process group
            (``set_separate_reduce_scatter_group``), which is not re-formed.
    """

    def __init__(self, strategy: ModelParallelStrategy) -> None:
        self.strategy = strategy
        # A replacement reads its first batches from where the job resumes.
        self.joining = is_replacement()
        self._install()

    @property
    @override
    def replaces_failed_ranks(self) -> bool:
        return True

    @override
    def release_user_model(self) -> None:
        release_fsdp_groups(self._module(), self.strategy.device_mesh)

    @override
    def reform_user_model(self) -> None:
        mesh = self.strategy.device_mesh
        # The groups in the order a new process builds them (Lightning's mesh first), so
        # they get the names the live mesh, its sub-meshes and the DTensors look up.
        shape = tuple(int(size) for size in mesh.shape)
        formed = init_device_mesh(mesh.device_type, shape, mesh_dim_names=mesh.mesh_dim_names)
        reattach_fsdp_groups(self._module(), mesh, formed)

    @override
    def warm_up_user_model(self, sample_batch: Any) -> None:
        pass  # no pipeline: the first step is a step like any other

    def check(self) -> None:
        """Refuse at set-up what a re-formed job would not rebuild.

        Raises:
            ConfigError: A separate reduce-scatter process group, or a torch whose FSDP
                cannot reset an interrupted iteration.
        """
        if not hasattr(FSDPModule, "reset_iter_state"):
            raise ConfigError(
                f"torch {torch.__version__}: FSDPModule.reset_iter_state is missing, which "
                "a survivor needs to drop the iteration a failure interrupted; under the "
                "supervisor a model sharded by FSDP2 needs torch 2.13 or newer")
        if has_separate_reduce_scatter_group(self._module()):
            raise ConfigError(
                "set_separate_reduce_scatter_group(): under the supervisor the process "
                "groups are re-formed after a failure, and a separate reduce-scatter group "
                "is not; leave FSDP's default (the shard group)")

    def joined(self) -> None:
        """This process runs in step with the job from its first batch on."""
        self.joining = False
        restore_start_up_collectives()

    def _module(self) -> L.LightningModule:
        module = self.strategy.lightning_module
        assert module is not None
        return module

    def _install(self) -> None:
        """Route the strategy's optimizer steps through the iteration guard and, in a
        replacement, start its train DataLoader where the job resumes."""
        strategy = self.strategy
        optimizer_step = strategy.optimizer_step
        process_dataloader = strategy.process_dataloader

        def guarded_step(optimizer: Any, closure: Callable[[], Any], model: Any = None,
                         **kwargs: Any) -> Any:
            guard = self.iteration_guard
            if guard is None:
                return optimizer_step(optimizer, closure, model, **kwargs)
            return guard.guarded(lambda: optimizer_step(optimizer, closure, model, **kwargs))

        def joining_loader(dataloader: object) -> object:
            dataloader = process_dataloader(dataloader)
            trainer = self._module().trainer
            if self.joining and trainer.training:
                return JoiningLoader(dataloader, lambda: trainer.num_training_batches)
            return dataloader

        strategy.optimizer_step = guarded_step  # type: ignore[method-assign]
        strategy.process_dataloader = joining_loader  # type: ignore[method-assign]


_LOCAL_COLLECTIVES: dict[str, Callable[..., Any]] = {}  # the methods replaced, by name


def keep_start_up_collectives_local() -> None:
    """In a process replacing a failed rank: Lightning's ``ModelParallelStrategy`` keeps
    its barriers, broadcasts and reductions local until the process joined the job
    (:meth:`ModelParallelReplacement.joined`). The survivors are recovering, not starting
    a Trainer, so they would not mirror them. Called before the Trainer starts (from
    ``SparseCheckpointing``), as the first of these runs before any callback hook."""
    if _LOCAL_COLLECTIVES:
        return

    def barrier(self: ModelParallelStrategy, name: str | None = None) -> None:
        pass

    def broadcast(self: ModelParallelStrategy, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(self: ModelParallelStrategy, tensor: Any, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Any:
        return tensor

    for name, local in (("barrier", barrier), ("broadcast", broadcast), ("reduce", reduce)):
        _LOCAL_COLLECTIVES[name] = getattr(ModelParallelStrategy, name)
        setattr(ModelParallelStrategy, name, local)


def restore_start_up_collectives() -> None:
    """Undo :func:`keep_start_up_collectives_local` (the process joined, or its Trainer
    runs another strategy)."""
    for name, method in _LOCAL_COLLECTIVES.items():
        setattr(ModelParallelStrategy, name, method)
    _LOCAL_COLLECTIVES.clear()
