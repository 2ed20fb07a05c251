"""FSDP2 for the built-in model, and re-forming an FSDP2 model's process groups.

:func:`apply_fsdp` is the built-in model's parallelize function for ``parallel.dp_shard``
(torchtitan's ``apply_fsdp``): ``fully_shard`` on the embedding, on every decoder layer and
on the output head over the ``dp_shard`` mesh, so every parameter, and with it its
optimizer state, is a DTensor sharded on dim 0. A shard group holds the same stage and the
same experts, so an expert's parameters are sharded over ranks that all route to it.
Reductions are plain sums (``set_gradient_divide_factor(1)`` with
``set_force_sum_reduction_for_comms``): the executor divides once by the
number of data shards, as it does for replicated data parallelism.

:func:`release_fsdp_groups` and :func:`reattach_fsdp_groups` are a survivor's side of a
rank replacement: the interrupted iteration's FSDP state is dropped, the broken process
groups are let go, and once the new generation's groups exist (built in the order a new
process builds them, so they carry the same names) every FSDP parameter group takes them.
The sharded parameters, their optimizer state and the device mesh stay the same objects:
DTensors find their groups by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.fsdp import FSDPModule, fully_shard

from lightning_moe_ckpt.models.transformer import MoETransformer

__all__ = ["apply_fsdp", "fsdp_roots", "has_separate_reduce_scatter_group", "reattach_fsdp_groups",
           "release_fsdp_groups", "shard_units"]


def apply_fsdp(model: MoETransformer, mesh: DeviceMesh) -> None:
    """Shard ``model`` (one rank's part of the built-in model) over ``mesh`` in place.

    Args:
        model: The rank's part: its embedding, layers and head, whichever it holds.
        mesh: The one-dimensional ``dp_shard`` mesh of the rank's shard group.
    """
    shard_units([model.embed, *model.layers.values(), model.head], mesh)


def shard_units(units: list[nn.Module | None], mesh: DeviceMesh) -> None:
    """``fully_shard`` each of ``units`` over ``mesh``, its gradients reduced by plain sums.

    Args:
        units: The modules to shard, each its own FSDP unit (``None`` entries skipped: a
            part this rank does not hold).
        mesh: The one-dimensional ``dp_shard`` mesh of the rank's shard group.
    """
    for unit in units:
        if unit is None:
            continue
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
        sharded = unit
        assert isinstance(sharded, FSDPModule)
        # A plain sum (no pre/post-division, no PREMUL_SUM, which gloo lacks).
        sharded.set_gradient_divide_factor(1.0)
        sharded.set_force_sum_reduction_for_comms(True)


def fsdp_roots(module: nn.Module) -> Iterator[FSDPModule]:
    """The root FSDP modules under ``module`` (those a forward initialized already).

    Args:
        module: A model some of whose submodules ``fully_shard`` wrapped.

    Yields:
        Every FSDP module that is the root of its tree.
    """
    for sub in module.modules():
        if isinstance(sub, FSDPModule) and sub._get_fsdp_state()._is_root:
            yield sub


def release_fsdp_groups(module: nn.Module, mesh: DeviceMesh) -> None:
    """Drop the iteration a failure interrupted and every reference to the broken groups.

    Args:
        module: The sharded model.
        mesh: The device mesh its DTensors live on (its registry is emptied).
    """
    for root in fsdp_roots(module):
        root.reset_iter_state()  # the interrupted iteration's collectives are dropped
    for group in _param_groups(module):  # and the gradients its backward began
        for param in group.fsdp_params:
            param.unsharded_accumulated_grad = None
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
    for info in _mesh_infos(module):  # the broken groups close once unreferenced
        for name in ("shard_process_group", "replicate_process_group"):
            if hasattr(info, name):
                setattr(info, name, None)
    mesh._get_root_mesh()._pg_registry.clear()


def reattach_fsdp_groups(module: nn.Module, mesh: DeviceMesh, formed: DeviceMesh) -> None:
    """Point ``module``'s FSDP state at the new generation's process groups.

    Args:
        module: The sharded model.
        mesh: The device mesh its DTensors live on.
        formed: The same mesh built anew over the new default group, in the order a new
            process builds it.

    Raises:
        RuntimeError: The groups were created in another order than at start-up (their
            names differ), so the DTensors would find no group or the wrong one.
    """
    root = mesh._get_root_mesh()
    if list(formed._get_root_mesh()._dim_group_names) != list(root._dim_group_names):
        raise RuntimeError(
            f"the re-formed device mesh's process groups are named "
            f"{formed._get_root_mesh()._dim_group_names}, the live mesh's "
            f"{root._dim_group_names}: process groups were created in another order than "
            "at start-up")
    for name in root._dim_group_names:
        root._pg_registry[name] = _resolve_process_group(name)
    for info in _mesh_infos(module):
        if hasattr(info, "shard_process_group"):
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        if hasattr(info, "replicate_process_group"):
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)


def has_separate_reduce_scatter_group(module: nn.Module) -> bool:
    """Whether any FSDP module under ``module`` reduces over a group of its own
    (``set_separate_reduce_scatter_group``), which a re-formed job would not rebuild.

    Args:
        module: A model some of whose submodules ``fully_shard`` wrapped.

    Returns:
        ``True`` when one does.
    """
    return any(getattr(info, "reduce_scatter_process_group", None) is not None
               for info in _mesh_infos(module))


def _mesh_infos(module: nn.Module) -> Iterator[Any]:
    """Every FSDP mesh info under ``module``, once: those of its parameter groups and of
    their parameters (each holds the process groups it was built with)."""
    seen: set[int] = set()
    for group in _param_groups(module):
        infos = [group.mesh_info, group.post_forward_mesh_info]
        for param in group.fsdp_params:
            infos += [param.mesh_info, param.post_forward_mesh_info]
        for info in infos:
            if info is not None and id(info) not in seen:
                seen.add(id(info))
                yield info


def _param_groups(module: nn.Module) -> Iterator[Any]:
    """The FSDP parameter groups under ``module``."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            yield from sub._get_fsdp_state()._fsdp_param_groups
