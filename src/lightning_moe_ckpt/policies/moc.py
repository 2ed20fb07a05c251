"""MoC-System (``checkpoint=moc``): ``K`` experts per layer in round-robin order.

Layer ``l`` starts at expert ``l K mod E``, so any ``ceil(E/K)`` consecutive snapshots
cover every expert; that round is the plan's window. Its metric is MoC's proportion of
lost tokens (PLT): lost tokens over all tokens routed, averaged over MoE layers. After each
recovery, if PLT exceeds ``checkpoint.lost_token_budget`` (3.75%), ``K`` doubles
(Dynamic-K), up to every expert. What it shares with MoEtion: :mod:`.partial`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.planning.schedule import OperatorSpec
from lightning_moe_ckpt.policies.partial import PartialPlanner

__all__ = ["MoCPlanner"]


class MoCPlanner(PartialPlanner):
    """MoC-System: non-experts + ``K`` experts per layer, round-robin, Dynamic-K."""

    name = "moc"

    def __init__(self, specs: Sequence[OperatorSpec], *, experts_per_layer: int = 1,
                 lost_token_budget: float = 0.0375, n_layers: int | None = None,
                 n_experts: int | None = None) -> None:
        require(0 < lost_token_budget < 1,
                f"{fmt('checkpoint.lost_token_budget', lost_token_budget)} must be in (0, 1)")
        super().__init__(specs, experts_per_layer, n_layers, n_experts)
        self.initial_k = experts_per_layer
        self.lost_token_budget = lost_token_budget
        self.shift = 0  # experts every layer's cursor advanced so far
        self.round_start: int | None = None
        self._next: int | None = None

    @property
    def rounds(self) -> int:
        """Snapshots that cover every expert once: ``ceil(E / K)``."""
        return max(1, math.ceil(self.shape[1] / self.experts_per_layer))

    @override
    def observe(self, iteration: int, hard_counts: torch.Tensor,
                soft_counts: torch.Tensor) -> None:
        self._count(hard_counts)

    @override
    def plan(self, iteration: int) -> CapturePlan | None:
        if (self._next != iteration or self.round_start is None
                or iteration - self.round_start >= self.rounds):
            self.round_start = iteration
        self._next = iteration + 1
        layers, experts = self.shape
        if experts == 0:
            return CapturePlan(iteration, self.layout.non_experts, (), iteration, 0, 1, None)
        k = self.experts_per_layer
        start = torch.arange(layers).unsqueeze(1) * self.initial_k + self.shift
        chosen = (start + torch.arange(k).unsqueeze(0)) % experts
        self.shift += k
        return self._capture(iteration, chosen, self.round_start,
                             iteration - self.round_start, self.rounds)

    @override
    def on_recovery(self, iteration: int) -> None:
        """Book the tokens lost by experts restored from older saves; Dynamic-K."""
        self._book_lost()
        self._next = None  # the next plan starts a new round
        experts = self.shape[1]
        if self.lost_token_portion() > self.lost_token_budget and self.experts_per_layer < experts:
            self.experts_per_layer = min(experts, 2 * self.experts_per_layer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "initial_k": self.initial_k, "shift": self.shift,
                "round_start": self.round_start, "next": self._next}

    @override
    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._load_base(d)
        self.initial_k, self.shift = int(d["initial_k"]), int(d["shift"])
        self.round_start, self._next = d["round_start"], d["next"]
