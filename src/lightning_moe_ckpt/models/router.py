"""Top-k softmax router with a sequence-wise load-balancing loss and popularity counters.

The router is the *gate* operator of an MoE layer. Besides routing it accumulates, per
training iteration, the two popularity signals the checkpoint schedule orders experts by:
hard counts (tokens routed to each expert) and soft counts (summed gate probabilities).
They are accumulated on the device without host syncs and read/reset once per iteration.

The auxiliary load-balancing loss is the Switch/GShard product ``E * sum_e f_e * P_e``
computed per sequence and averaged over sequences (DeepSeek-V3's sequence-wise form).
Because it is a mean of per-sequence terms it decomposes exactly over any split of the
batch into micro-batches and data-parallel shards, so every parallel layout optimises the
same objective as the single-process run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class RouterOutput(NamedTuple):
    """Routing decision for ``B x S`` tokens."""

    weights: torch.Tensor  # [B, S, k] combine weights (renormalised over the top-k), fp32
    indices: torch.Tensor  # [B, S, k] chosen expert ids, int64
    aux_loss: torch.Tensor  # scalar, sequence-wise load-balancing loss (fp32)


class TopKRouter(nn.Module):
    """Linear gate, softmax over experts, top-k selection."""

    hard_counts: torch.Tensor
    soft_counts: torch.Tensor

    def __init__(self, d_model: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.proj = nn.Linear(d_model, n_experts, bias=False)
        # Non-persistent: popularity is training telemetry, not model state.
        self.register_buffer("hard_counts", torch.zeros(n_experts), persistent=False)
        self.register_buffer("soft_counts", torch.zeros(n_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> RouterOutput:
        """Route ``x`` of shape ``[B, S, D]``."""
        logits = self.proj(x)
        probs = F.softmax(logits.float(), dim=-1)  # [B, S, E]
        top_probs, indices = probs.topk(self.top_k, dim=-1)
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True)

        one_hot = F.one_hot(indices, self.n_experts).sum(dim=2).float()  # [B, S, E]
        with torch.no_grad():
            self.hard_counts += one_hot.sum(dim=(0, 1))
            self.soft_counts += probs.detach().sum(dim=(0, 1))
        seq_len = x.shape[1]
        fraction = one_hot.sum(dim=1) / (seq_len * self.top_k)  # [B, E], not differentiable
        mean_prob = probs.mean(dim=1)  # [B, E]
        aux = (self.n_experts * (fraction * mean_prob).sum(dim=-1)).mean()
        return RouterOutput(weights, indices, aux)

    def reset_counts(self) -> None:
        """Zero the popularity counters (called once per iteration by the training loop)."""
        self.hard_counts.zero_()
        self.soft_counts.zero_()
