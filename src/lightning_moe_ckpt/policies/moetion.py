"""MoEtion (``checkpoint=moetion``): the ``S`` experts per layer with the most tokens since
their last save.

The choice after step ``t`` uses the counters as of step ``t-1`` (a
:class:`~lightning_moe_ckpt.planning.popularity.HostMirror` copy, so choosing never waits
for the device), ties to the lower expert index. After a recovery every expert that lost
tokens is *stale*: it gets a +10% capacity boost (``checkpoint.capacity_boost``), and each
token routed to it repays ``boost`` of a token of its deficit until the deficit is repaid.
What it shares with MoC-System: :mod:`.partial`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.planning.popularity import HostMirror, expert_name
from lightning_moe_ckpt.planning.schedule import OperatorSpec, expert_position
from lightning_moe_ckpt.policies.partial import PartialPlanner

__all__ = ["MoEtionPlanner"]


class MoEtionPlanner(PartialPlanner):
    """MoEtion: non-experts + the ``S`` experts per layer with most tokens since last save."""

    name = "moetion"

    def __init__(self, specs: Sequence[OperatorSpec], *, experts_per_layer: int = 1,
                 capacity_boost: float = 0.10, n_layers: int | None = None,
                 n_experts: int | None = None) -> None:
        require(0 < capacity_boost <= 1,
                f"{fmt('checkpoint.capacity_boost', capacity_boost)} must be in (0, 1]")
        super().__init__(specs, experts_per_layer, n_layers, n_experts)
        self.capacity_boost_fraction = capacity_boost
        self._owed: torch.Tensor | None = None  # [L, E] lost tokens still to repay
        self._mirror = HostMirror()  # counters as of the previous plan, on the host

    @override
    def observe(self, iteration: int, hard_counts: torch.Tensor,
                soft_counts: torch.Tensor) -> None:
        counts = self._count(hard_counts)
        if self._owed is None:
            self._owed = torch.zeros_like(counts)
        owed = self._owed.to(counts.device)
        # A boosted expert takes `boost` more tokens per routed token until repaid.
        self._owed = owed.sub_(counts * self.capacity_boost_fraction).clamp_(min=0.0)

    @override
    def plan(self, iteration: int) -> CapturePlan | None:
        if self.shape[1] == 0:
            return CapturePlan(iteration, self.layout.non_experts, (), iteration, 0, 1, None)
        known = self._mirror.read()
        if known is None:
            known = torch.zeros(self.shape, dtype=torch.float64)
        # Stable descending sort: equal deficits keep expert order (lower index first).
        order = torch.sort(known, dim=1, descending=True, stable=True).indices
        plan = self._capture(iteration, order[:, : self.experts_per_layer], iteration, 0, 1)
        if self._since_save is not None:
            self._mirror.publish(self._since_save)
        return plan

    @override
    def on_recovery(self, iteration: int) -> None:
        """Experts restored from older saves become stale and owe their lost tokens."""
        lost = self._book_lost()
        if lost is not None and self._since_save is not None:
            self._owed = lost if self._owed is None else self._owed.add_(lost)
            self._mirror.publish(self._since_save)

    def capacity_factors(self) -> torch.Tensor:
        """Capacity multiplier per expert ``[L, E]`` (``1 + boost`` while stale), on the
        counters' device: usable by the model without a host sync."""
        if self._owed is None:
            return torch.ones(self.shape, dtype=torch.float64)
        return 1.0 + self.capacity_boost_fraction * (self._owed > 0).to(torch.float64)

    def capacity_boost(self, name: str) -> float:
        """Capacity multiplier of one expert (a host copy)."""
        position = expert_position(name)
        if position is None:
            raise KeyError(f"{name!r} is not a routed expert")
        return float(self.capacity_factors()[position])

    def stale_experts(self) -> tuple[str, ...]:
        """Experts still repaying tokens lost at a recovery (a host copy)."""
        if self._owed is None:
            return ()
        return tuple(expert_name(layer, expert)
                     for layer, expert in (self._owed.cpu() > 0).nonzero().tolist())

    @override
    def state_dict(self) -> dict[str, Any]:
        # The published counters are what the next choice uses; reading them back waits
        # only for the copy issued at the previous plan.
        return {**self._base_state(), "known": self._mirror.read(),
                "owed": None if self._owed is None else self._owed.detach().clone()}

    @override
    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._load_base(d)
        self._owed = None if d["owed"] is None else d["owed"].detach().clone()
        self._mirror.clear()
        if d["known"] is not None:
            self._mirror.publish(d["known"])
