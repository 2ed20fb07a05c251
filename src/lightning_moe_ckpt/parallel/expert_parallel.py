"""Expert parallelism: all-to-all token dispatch and combine over the ``ep`` group.

Each rank of the expert-parallel group owns a contiguous block of every MoE layer's
experts. :class:`ExpertParallelDispatch` replaces :meth:`MoELayer.run_experts`:

1. exchange per-expert token counts (one small ``all_to_all_single``) so every rank knows
   how many tokens it will receive from each source for each of its experts;
2. send each destination rank the contiguous slice of expert-sorted tokens for its block
   (differentiable ``all_to_all_single_autograd``, works on gloo and NCCL);
3. regroup the received tokens expert-major, run each local expert once on its slice
   (even an empty one, so active experts always get a gradient), restore source-major
   order and send the outputs back with the reverse split sizes.

The caller's expert-sorted order is preserved, so combine and capacity logic in
:class:`~lightning_moe_ckpt.models.moe.MoELayer` are unchanged from single-process.
The counts must be on the host to size the collectives (gloo's ``all_to_all_single``
takes its split sizes as integers): under expert parallelism, one host sync per layer and
micro-batch, as in torchtitan's non-grouped expert path. Local experts run as grouped
matrix products (:func:`~lightning_moe_ckpt.models.moe.grouped_experts`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol
from torch import nn

from lightning_moe_ckpt.models.moe import Expert, MoELayer, grouped_experts


def all_to_all_autograd(tensor: torch.Tensor, output_splits: list[int],
                        input_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` with explicit split sizes (gloo and NCCL)."""
    out = fcol.all_to_all_single_autograd(tensor, output_splits, input_splits, group)
    return fcol.wait_tensor(out) if isinstance(out, fcol.AsyncCollectiveTensor) else out


def exchange_with_owners(tokens: torch.Tensor, send_counts: torch.Tensor,
                         group: dist.ProcessGroup, per_rank: int,
                         run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                         ) -> torch.Tensor:
    """Send expert-sorted ``tokens`` (``send_counts[e]`` rows for global expert ``e``,
    experts in contiguous blocks of ``per_rank`` per rank) to their experts' owners, run
    ``run_local(rows expert-major, rows per local expert)`` there and return its outputs
    to the senders, in the caller's row order (collective over ``group``)."""
    if torch.is_grad_enabled() and not tokens.requires_grad:
        # Frozen replay can leave this rank's tokens without a grad path (first stage,
        # everything before the layer frozen) while a peer's experts are active: the
        # backward all-to-alls must still run here, or the peers' collectives hang.
        tokens = tokens.detach().requires_grad_()
    ep_size = dist.get_world_size(group)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # recv[s][j]: tokens source s sends for my j-th local expert.
    recv = recv_counts.view(ep_size, per_rank)
    input_splits: list[int] = send_counts.view(ep_size, per_rank).sum(dim=1).tolist()
    output_splits: list[int] = recv.sum(dim=1).tolist()
    received = all_to_all_autograd(tokens, output_splits, input_splits, group)

    # Received rows come in (source, expert) blocks; a stable sort on the block's
    # (expert, source) key makes them expert-major without a per-token Python loop.
    blocks = torch.arange(ep_size * per_rank, device=tokens.device)
    expert_major_key = (blocks % per_rank) * ep_size + blocks // per_rank
    row_key = torch.repeat_interleave(expert_major_key, recv_counts,
                                      output_size=sum(output_splits))
    permutation = torch.argsort(row_key, stable=True)
    outputs = run_local(received[permutation], recv.sum(dim=0))
    source_major = outputs.new_empty(outputs.shape).index_copy(0, permutation, outputs)
    return all_to_all_autograd(source_major, input_splits, output_splits, group)


class ExpertParallelDispatch:
    """Callable standing in for ``MoELayer.run_experts`` on one expert-parallel rank."""

    def __init__(self, layer: MoELayer, group: dist.ProcessGroup, local_experts: range) -> None:
        self.experts: nn.ModuleDict = layer.experts
        self.n_experts = layer.n_experts
        self.group = group
        self.local_experts = local_experts

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``MoELayer.run_experts`` over the ``ep`` group: ``tokens`` expert-sorted,
        ``counts`` rows per expert and then the dropped slots (outputs zero)."""
        # The one host read of the layer: how many rows the experts take.
        kept = int(counts[: self.n_experts].sum())
        outputs = exchange_with_owners(tokens[:kept], counts[: self.n_experts], self.group,
                                       len(self.local_experts), self._run_local)
        if kept == tokens.shape[0]:
            return outputs
        dropped = outputs.new_zeros(tokens.shape[0] - kept, *outputs.shape[1:])
        return torch.cat([outputs, dropped])

    def _run_local(self, tokens: torch.Tensor, expert_sizes: torch.Tensor) -> torch.Tensor:
        experts = [cast(Expert, self.experts[str(e)]) for e in self.local_experts]
        return grouped_experts(tokens, expert_sizes, experts)


def disable_expert_parallel(model: nn.Module) -> None:
    """Undo :func:`enable_expert_parallel`: every MoE layer runs its own experts again and
    nothing of ``model`` references the expert-parallel group."""
    for module in model.modules():
        if isinstance(module, MoELayer) and "run_experts" in vars(module):
            del module.run_experts


def enable_expert_parallel(model: nn.Module, group: dist.ProcessGroup,
                           local_experts: range) -> None:
    """Route every MoE layer of ``model`` through the expert-parallel dispatch."""
    for module in model.modules():
        if isinstance(module, MoELayer):
            module.run_experts = ExpertParallelDispatch(  # type: ignore[method-assign]
                module, group, local_experts)
