"""Expert parallelism for a user's *fused* experts module (HF transformers 5.x, torchtitan).

Hugging Face MoE models (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3 in transformers 5.x) and
torchtitan's ``GroupedExperts`` keep every routed expert of a layer in one module whose
parameters carry the experts on dim 0 and whose forward is
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
:func:`shard_fused_experts` keeps this rank's contiguous block of experts (the parameter
names do not change, only dim 0 shrinks) and turns the module into an
:class:`ExpertShard`, the way ``fully_shard`` turns a module into an ``FSDPModule``: a
subclass created on the fly, so the module's own expert math still runs.

The forward of a shard dispatches every ``(token, slot)`` assignment to the rank owning
its expert with the library's all-to-all (counts first, then the tokens, as
:mod:`~lightning_moe_ckpt.parallel.expert_parallel` does for the built-in model), runs the
module's own forward on the received tokens with one slot each and weight one (exact:
``x * 1.0 == x`` and each row is added once into zeros), sends the outputs back and
combines the ``k`` slots with the routing weights. Only the order of that final sum
differs from a single-process forward, so expert-parallel runs equal it to rounding.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lightning_moe_ckpt.core.discovery import ShardedExperts
from lightning_moe_ckpt.parallel.expert_parallel import exchange_with_owners


class ExpertShard(nn.Module, ShardedExperts):
    """Marks a fused experts module holding experts ``[first_expert, first_expert +
    local_experts)`` of ``global_experts``; operator discovery names its slices by their
    global expert ids."""

    ep_group: dist.ProcessGroup

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, slots = top_k_index.shape
        expert_of_slot = top_k_index.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        # One host sync per layer and micro-batch: the split sizes size the collectives.
        counts = torch.bincount(expert_of_slot, minlength=self.global_experts)
        returned = exchange_with_owners(hidden_states[order // slots], counts, self.ep_group,
                                        self.local_experts, self._run_local)
        slot_out = returned.new_empty(returned.shape).index_copy(0, order, returned)
        weights = top_k_weights.reshape(tokens, slots, 1).to(slot_out.dtype)
        return (slot_out.view(tokens, slots, -1) * weights).sum(dim=1)

    def _run_local(self, routed: torch.Tensor, expert_sizes: torch.Tensor) -> torch.Tensor:
        """The module's own forward over expert-major ``routed`` rows, one slot each with
        weight one (exact: ``x * 1.0 == x``, each row added once into zeros)."""
        local_index = torch.repeat_interleave(
            torch.arange(self.local_experts, device=routed.device), expert_sizes,
            output_size=routed.shape[0]).unsqueeze(1)
        ones = torch.ones(local_index.shape, dtype=routed.dtype, device=routed.device)
        outputs: torch.Tensor = super().forward(routed, local_index, ones)
        if routed.shape[0] == 0 and routed.requires_grad:
            # Nothing routed here: the output is empty but must stay on the graph, or
            # this rank would skip the backward all-to-all its peers run.
            outputs = outputs + routed
        return outputs


_SHARD_CLASSES: dict[type, type] = {}


def _shard_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``ExpertShard<cls>``: the shard's forward first, the module's own math underneath."""
    if cls not in _SHARD_CLASSES:
        _SHARD_CLASSES[cls] = type(f"ExpertShard{cls.__name__}", (ExpertShard, cls), {})
    return cast(type[nn.Module], _SHARD_CLASSES[cls])


def expert_count(module: nn.Module) -> int:
    """Experts held by a fused experts module (dim 0 of its own parameters)."""
    sizes = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() >= 1}
    if len(sizes) != 1:
        raise ValueError(f"{type(module).__name__} holds no parameters sharing an expert "
                         "dimension 0; it is not a fused experts module")
    return sizes.pop()


def set_expert_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Point every :class:`ExpertShard` of ``model`` at ``group``, the expert-parallel
    group formed anew after a failure; None drops the shards' reference to the broken one
    (a recovery does so before forming new groups: see
    :meth:`~lightning_moe_ckpt.strategies.core.MoEParallelCore.release_mesh`)."""
    for module in model.modules():
        if isinstance(module, ExpertShard):
            if group is None:
                vars(module).pop("ep_group", None)
            else:
                module.ep_group = group


def shard_fused_experts(module: nn.Module, group: dist.ProcessGroup) -> ExpertShard:
    """Keep this rank's block of ``module``'s experts and dispatch over ``group``.

    ``module`` must be a fused experts module (see the module docstring); its count
    attribute, if it has one the forward reads (HF's ``num_experts``), is the caller's to
    set to :attr:`ExpertShard.local_experts`.
    """
    total = expert_count(module)
    ep_size, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    if total % ep_size:
        raise ValueError(f"{total} experts are not divisible by parallel.ep={ep_size}")
    local = total // ep_size
    first = ep_rank * local
    for name, param in list(module.named_parameters(recurse=False)):
        block = param.detach()[first:first + local].clone()
        setattr(module, name, nn.Parameter(block, requires_grad=param.requires_grad))
    module.__class__ = _shard_class(type(module))
    shard = cast(Any, module)
    shard.first_expert, shard.local_experts, shard.global_experts = first, local, total
    shard.ep_group = group
    return cast(ExpertShard, module)
