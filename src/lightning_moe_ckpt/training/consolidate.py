"""Consolidate a run's dense state, keyed by layout-independent FQNs.

:func:`consolidated_state` (the built-in engine) and :func:`target_state` (any model and
torch optimizer) read one process's state; :func:`gather_consolidated_state` and
:func:`gather_target_state` put a distributed run's together on rank 0.

Every parameter is taken from exactly one of its replicas (the one at ``dp = 0`` and, for
non-expert parameters, ``ep = 0``); a parameter sharded over ``dp_shard`` is put together
from its shards first (``DTensor.full_tensor``, collective over its shard group). So the
result has the same keys and layout as the single-process ``final_state.pt`` and can be
compared with it tensor by tensor. Gathering
goes through ``gather_object`` on CPU copies, which suits the model sizes this file is
written for (tests and CPU runs); cluster-sized models use the durable DCP checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_moe_ckpt.core.collectives import gather_values
from lightning_moe_ckpt.core.layout import Coordinates
from lightning_moe_ckpt.core.operators import is_expert_parameter
from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess
from lightning_moe_ckpt.core.precision import MasterWeightAdamW
from lightning_moe_ckpt.training.distributed_executor import full_model_parameter_names
from lightning_moe_ckpt.training.engine import TrainingEngine
from lightning_moe_ckpt.training.staged_executor import expert_parameters


def consolidated_state(model: torch.nn.Module, optimizer: MasterWeightAdamW,
                       step: int) -> dict[str, Any]:
    """The dense training state keyed by parameter FQN, on the CPU (collective over each
    shard group when the model is sharded)."""
    compute = {name: _whole(p.detach()) for name, p in model.named_parameters()}
    master = {name: _whole(t) for name, t in optimizer.master_weights().items()}
    moments = {name: {k: _whole(v.detach()) for k, v in entries.items()}
               for name, entries in optimizer.optimizer_state().items()}
    return {"step": step, "model": master, "compute": compute, "optimizer": moments}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``tensor``, a sharded one's shards put together."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.cpu().clone()


def target_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 step: int) -> dict[str, Any]:
    """:func:`consolidated_state` of any model and torch optimizer (one process, or
    collective over each shard group when the model is sharded)."""
    access = OptimizerStateAccess(optimizer)
    compute = {name: _whole(p.detach()) for name, p in model.named_parameters()}
    master = {name: _whole(access.master(p).detach().float())
              for name, p in model.named_parameters()}
    moments = {name: {k: _whole(v.detach()) for k, v in state.items()}
               for name, p in model.named_parameters()
               if (state := access.state_of(p)) is not None}
    return {"step": step, "model": master, "compute": compute, "optimizer": moments}


def gather_target_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                        ep_group: dist.ProcessGroup) -> dict[str, Any] | None:
    """:func:`target_state` of a model split over the ranks (pipeline stages, expert
    shards), whole on rank 0 and ``None`` elsewhere: expert shards are concatenated in
    expert order over ``ep_group`` (collective)."""
    state = target_state(model, optimizer, step)
    shards = expert_parameters(model)
    for name in sorted(name for name, p in model.named_parameters() if id(p) in shards):
        state["model"][name] = _concatenated(state["model"][name], ep_group)
        state["compute"][name] = _concatenated(state["compute"][name], ep_group)
        for key, value in state["optimizer"].get(name, {}).items():
            if value.dim() > 0:  # moments, not the step count
                state["optimizer"][name][key] = _concatenated(value, ep_group)
    parts = gather_values(state, dst=0)
    if parts is None:
        return None
    merged: dict[str, Any] = {"step": step, "model": {}, "compute": {}, "optimizer": {}}
    for part in parts:
        for section in ("model", "compute", "optimizer"):
            merged[section].update(part[section])
    return merged


def _concatenated(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The ``group`` ranks' blocks of ``tensor`` along dim 0, in rank order."""
    blocks = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(blocks, tensor.contiguous(), group=group)
    return torch.cat(blocks)


def gather_consolidated_state(engine: TrainingEngine, coords: Coordinates,
                              step: int) -> dict[str, Any] | None:
    """The full dense state on rank 0 (``None`` on the other ranks)."""
    local = consolidated_state(engine.model, engine.optimizer, step)

    def owned(name: str) -> bool:
        return coords.dp == 0 and coords.dp_shard == 0 and (
            is_expert_parameter(name) or coords.ep == 0)

    mine = {section: {n: v for n, v in local[section].items() if owned(n)}
            for section in ("model", "compute", "optimizer")}
    gathered = gather_values(mine, dst=0)
    if gathered is None:
        return None
    merged: dict[str, Any] = {"step": step, "model": {}, "compute": {}, "optimizer": {}}
    for part in gathered:
        assert part is not None
        for section in ("model", "compute", "optimizer"):
            merged[section].update(part[section])
    order = full_model_parameter_names(engine.settings)
    for section in ("model", "compute", "optimizer"):
        merged[section] = {n: merged[section][n] for n in order if n in merged[section]}
    return merged
