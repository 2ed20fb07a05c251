"""MoE feed-forward layer: router, separately freezable experts, optional shared experts.

Each routed expert is its own module under ``experts.<global id>`` so that it can be
frozen on its own and so that its name does not change when expert parallelism keeps
only a contiguous block of experts on a rank. Token dispatch is sort-based (torchtitan
style): assignments are grouped by expert, the experts run as grouped matrix products
(``torch._grouped_mm``) over their slices, whose boundaries stay on the device, and the
outputs are scattered back and combined over the k slots in a fixed order, so the result
does not depend on how experts are placed. Nothing in the forward reads a device value on
the host (no ``.tolist()``, ``.item()`` or ``nonzero``): on a GPU the training stream never
waits behind a snapshot's device-to-host copy to learn a split size. The experts stay
separate modules (one operator each, frozen on their own); their weights are stacked for
each forward, a copy of the experts' weights per layer and micro-batch, against one host
sync per layer and micro-batch without it.

Capacity (``capacity_factor``) is applied per sequence: each expert accepts at most
``ceil(cf * S * k / E)`` assignments of a sequence, first choices of every token before
second choices. Dropped assignments contribute nothing and the token passes through the
residual. Per-sequence capacity makes dropping independent of micro-batching and of
data/expert parallelism. ``capacity_scale`` (``[E]``, set from outside, e.g. MoEtion's
boost for experts restored stale after a failure) multiplies each expert's capacity:
``ceil(cf * scale_e * S * k / E)``; it stays on the device, and a scale of one gives
exactly the unscaled capacity.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe_ckpt.models.router import TopKRouter


class Expert(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def grouped_experts(tokens: torch.Tensor, counts: torch.Tensor, experts: list[Expert],
                    trailing_zeros: bool = False) -> torch.Tensor:
    """``experts[e]`` on rows ``counts[:e].sum() ..`` of ``tokens`` (``counts[e]`` rows each),
    as three grouped matrix products with the group boundaries on the device. With
    ``trailing_zeros`` the rows after the last expert's (``counts`` has one more entry)
    form one more group with zero weights: its outputs, and its gradients, are zeros."""
    rows = len(experts) + int(trailing_zeros)
    offsets = torch.cumsum(counts[:rows], dim=0).to(torch.int32)
    w1 = _stacked([e.w1.weight for e in experts], trailing_zeros)  # [G, hidden, d]
    w3 = _stacked([e.w3.weight for e in experts], trailing_zeros)
    w2 = _stacked([e.w2.weight for e in experts], trailing_zeros)  # [G, d, hidden]
    # x @ W.T per group: exactly what each expert's nn.Linear computes on its slice.
    gate = torch._grouped_mm(tokens, w1.transpose(1, 2), offs=offsets)
    up = torch._grouped_mm(tokens, w3.transpose(1, 2), offs=offsets)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)


def _stacked(weights: list[torch.Tensor], trailing_zeros: bool) -> torch.Tensor:
    if trailing_zeros:
        weights = [*weights, weights[0].new_zeros(weights[0].shape)]
    return torch.stack(weights)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the layer output whose backward also seeds ``d aux / d aux = coef``.

    This injects the load-balancing gradient inside the layer's own backward (as
    Megatron's aux-loss scaler does), so it works unchanged when the model is split into
    pipeline stages whose loss only exists on the last stage.
    """

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, coef: float) -> Any:
        ctx.coef = coef
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        aux_grad = torch.full(ctx.aux_shape, ctx.coef, dtype=ctx.aux_dtype,
                              device=grad_output.device)
        return grad_output, aux_grad, None


class MoELayer(nn.Module):
    """Routed experts (+ optional shared experts) replacing the transformer's FFN."""

    dropped_assignments: torch.Tensor
    aux_loss_sum: torch.Tensor
    capacity_scale: torch.Tensor | None  # [E] per-expert capacity multiplier (None: ones)

    def __init__(self, d_model: int, n_experts: int, top_k: int, expert_hidden: int,
                 n_shared_experts: int = 0, capacity_factor: float | None = None,
                 aux_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.gate = TopKRouter(d_model, n_experts, top_k)
        self.experts = nn.ModuleDict({str(e): Expert(d_model, expert_hidden)
                                      for e in range(n_experts)})
        self.shared_experts: Expert | None = (
            Expert(d_model, expert_hidden * n_shared_experts) if n_shared_experts else None)
        self.register_buffer("dropped_assignments", torch.zeros(()), persistent=False)
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)
        self.capacity_scale = None

    def capacity(self, seq_len: int) -> int | None:
        """Per-sequence, per-expert capacity, or ``None`` when unlimited."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)

    def expert_capacities(self, seq_len: int) -> torch.Tensor | None:
        """Per-expert capacities ``[E]`` with ``capacity_scale`` applied, on the scale's
        device; ``None`` when capacity is unlimited or unscaled."""
        if self.capacity_factor is None or self.capacity_scale is None:
            return None
        base = self.capacity_factor * seq_len * self.top_k / self.n_experts
        return torch.ceil(self.capacity_scale.to(torch.float64) * base).to(torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        route = self.gate(x)
        expert_of_slot = route.indices.reshape(-1)  # token-major: slot a = token * k + j
        capacity: int | torch.Tensor | None = self.capacity(seq_len)
        if capacity is not None:
            scaled = self.expert_capacities(seq_len)
            if scaled is not None:
                capacity = scaled.to(route.indices.device, non_blocking=True)
            kept = self._within_capacity(route.indices, capacity).reshape(-1)
            # Dropped slots get the sentinel id E and sort past every real expert.
            expert_of_slot = torch.where(kept, expert_of_slot, self.n_experts)
        order = torch.argsort(expert_of_slot, stable=True)
        counts = torch.bincount(expert_of_slot, minlength=self.n_experts + 1)
        with torch.no_grad():
            self.dropped_assignments += counts[self.n_experts]
        tokens = x.reshape(-1, d_model)
        # Every slot, expert-sorted (dropped ones last): the shapes never depend on the
        # routing, so nothing needs a split size on the host.
        expert_out = self.run_experts(tokens[order // self.top_k], counts)
        slot_out = expert_out.new_empty(expert_out.shape).index_copy(0, order, expert_out)
        weights = route.weights.reshape(-1, self.top_k, 1).to(x.dtype)
        out = (slot_out.view(-1, self.top_k, d_model) * weights).sum(dim=1)
        out = out.view(batch, seq_len, d_model)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        with torch.no_grad():
            self.aux_loss_sum += route.aux_loss.detach()
        if self.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = _AttachAuxLoss.apply(out, route.aux_loss, self.aux_loss_coef)
        return out

    def run_experts(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run each expert on its contiguous slice of expert-sorted ``tokens``: ``counts``
        (``[E + 1]``, on the device) rows per expert, then the dropped slots, whose
        outputs are zeros.

        Every expert runs even on an empty slice so that an active expert always gets a
        (possibly zero) weight gradient: "no gradient" then means exactly "frozen".
        Expert parallelism replaces this method with an all-to-all dispatch.
        """
        experts = [cast(Expert, self.experts[str(e)]) for e in range(self.n_experts)]
        return grouped_experts(tokens, counts, experts, trailing_zeros=True)

    def _within_capacity(self, indices: torch.Tensor,
                         capacity: int | torch.Tensor) -> torch.Tensor:
        """Mask ``[B, S, k]`` of slots accepted by their expert's per-sequence capacity
        (one for all experts, or ``[E]``)."""
        batch, seq_len, top_k = indices.shape
        slot_major = indices.transpose(1, 2).reshape(batch, top_k * seq_len)
        one_hot = F.one_hot(slot_major, self.n_experts)
        position = (one_hot.cumsum(dim=1) * one_hot).sum(dim=-1) - 1
        limit = capacity if isinstance(capacity, int) else capacity[slot_major]
        kept = position < limit
        return kept.view(batch, top_k, seq_len).transpose(1, 2)

    def reset_stats(self) -> None:
        """Zero per-iteration telemetry (popularity, drops, aux loss)."""
        self.gate.reset_counts()
        self.dropped_assignments.zero_()
        self.aux_loss_sum.zero_()
