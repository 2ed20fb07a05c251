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

from lightning_moe_ckpt.parallel.expert_parallel import all_to_all_autograd


class ExpertShard(nn.Module):
    """Marks a fused experts module holding experts ``[first_expert, first_expert +
    local_experts)`` of ``global_experts``; operator discovery names its slices by their
    global expert ids."""

    first_expert: int
    local_experts: int
    global_experts: int
    ep_group: dist.ProcessGroup

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, slots = top_k_index.shape
        if torch.is_grad_enabled() and not hidden_states.requires_grad:
            # Frozen replay can leave this rank's tokens without a grad path while a peer's
            # experts are active: the backward all-to-alls must run here too, or they hang.
            hidden_states = hidden_states.detach().requires_grad_()
        expert_of_slot = top_k_index.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        counts = torch.bincount(expert_of_slot, minlength=self.global_experts)
        # One host sync per layer and micro-batch: the split sizes size the collectives.
        send_counts = counts.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        ep_size = self.global_experts // self.local_experts
        per_rank = self.local_experts
        recv = recv_counts.view(ep_size, per_rank)
        input_splits: list[int] = send_counts.view(ep_size, per_rank).sum(dim=1).tolist()
        output_splits: list[int] = recv.sum(dim=1).tolist()
        expert_sizes = recv.sum(dim=0)
        sent = hidden_states[order // slots]
        received = all_to_all_autograd(sent, output_splits, input_splits, self.ep_group)
        # Received rows come in (source, expert) blocks; a stable sort on the block's
        # (expert, source) key makes them expert-major without a per-token Python loop.
        blocks = torch.arange(ep_size * per_rank, device=received.device)
        expert_major_key = (blocks % per_rank) * ep_size + blocks // per_rank
        row_key = torch.repeat_interleave(expert_major_key, recv_counts.to(received.device),
                                          output_size=sum(output_splits))
        permutation = torch.argsort(row_key, stable=True)
        local_index = torch.repeat_interleave(
            torch.arange(per_rank, device=received.device), expert_sizes.to(received.device),
            output_size=sum(output_splits)).unsqueeze(1)
        ones = torch.ones(local_index.shape, dtype=top_k_weights.dtype,
                          device=received.device)
        routed = received[permutation]
        outputs = super().forward(routed, local_index, ones)
        if routed.shape[0] == 0 and routed.requires_grad:
            # Nothing routed here: the output is empty but must stay on the graph, or
            # this rank would skip the backward all-to-all its peers run.
            outputs = outputs + routed
        source_major = outputs.new_empty(outputs.shape).index_copy(0, permutation, outputs)
        returned = all_to_all_autograd(source_major, input_splits, output_splits,
                                       self.ep_group)
        slot_out = returned.new_empty(returned.shape).index_copy(0, order, returned)
        weights = top_k_weights.reshape(tokens, slots, 1).to(slot_out.dtype)
        return (slot_out.view(tokens, slots, -1) * weights).sum(dim=1)


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
