"""What the partial-expert baselines share: MoC-System (:mod:`.moc`) and MoEtion
(:mod:`.moetion`).

Both snapshot every iteration the master state of every non-expert operator (embedding,
attention blocks, gates, shared experts, head) plus a few routed experts per layer, and
keep per-expert last-save bookkeeping. An expert missing from the snapshot a recovery
restores comes back from its last save, losing the updates of the tokens routed to it
since ("lost tokens"). Token counters live on the device: :meth:`observe` adds the
iteration's hard counts without a host sync, a plan zeroes the saved experts' counters
through a mask sent asynchronously, and host copies are taken only at recovery or when a
metric is asked for. At a recovery (:meth:`on_recovery`) the tokens routed to each expert
since its last save are booked as lost: the partial restore brings every expert back from
its newest save, so exactly those updates are gone. Both policies report the tokens lost
at the latest recovery and MoC's proportion of lost tokens over the run. Their restore
rule is ``partial_restore``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.planner import BasePlanner, CapturePlan, expert_layout
from lightning_moe_ckpt.planning.schedule import OperatorSpec


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host (pinned staging on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class PartialPlanner(BasePlanner):
    """Shared bookkeeping: layout, last saves, device token counters, lost tokens."""

    restore_rule = "partial_restore"  # stale experts are restored, not replayed
    experts_per_layer: int

    def __init__(self, specs: Sequence[OperatorSpec], experts_per_layer: int,
                 n_layers: int | None, n_experts: int | None) -> None:
        self.layout = expert_layout([spec.name for spec in specs], n_layers, n_experts)
        experts = self.layout.n_experts
        require(isinstance(experts_per_layer, int) and experts_per_layer >= 1
                and (experts == 0 or experts_per_layer <= experts),
                f"{fmt('checkpoint.experts_per_layer', experts_per_layer)} must be an integer "
                f"in [1, n_experts={experts}]")
        self.experts_per_layer = experts_per_layer
        self.shape = (self.layout.n_layers, experts)
        self.last_saved: dict[str, int] = {}  # expert name -> iteration of its last save
        self._since_save: torch.Tensor | None = None  # [L, E] tokens since last save
        self._lost: torch.Tensor | None = None  # [L] lost tokens over all recoveries
        self._total: torch.Tensor | None = None  # [L] tokens routed
        self._last_lost: torch.Tensor | None = None  # tokens lost at the latest recovery

    def _counter(self, like: torch.Tensor) -> torch.Tensor:
        if tuple(like.shape) != self.shape:
            raise ValueError(f"routing counts have shape {tuple(like.shape)}, expected "
                             f"[layers, experts] = {list(self.shape)}")
        if self._since_save is None:
            self._since_save = torch.zeros(self.shape, dtype=torch.float64, device=like.device)
        elif self._since_save.device != like.device:
            self._since_save = self._since_save.to(like.device)
        return self._since_save

    def _count(self, hard_counts: torch.Tensor) -> torch.Tensor:
        """Add an iteration's counts to the counters (on their device); returns them."""
        since = self._counter(hard_counts)
        counts = hard_counts.detach().to(torch.float64)
        since.add_(counts)
        if self._total is None or self._lost is None:
            self._total = torch.zeros(self.shape[0], dtype=torch.float64, device=since.device)
            self._lost = torch.zeros_like(self._total)
        self._total = self._total.to(since.device).add_(counts.sum(dim=1))
        self._lost = self._lost.to(since.device)
        return counts

    def _book_lost(self) -> torch.Tensor | None:
        """A recovery restored every expert from its last save: the tokens routed to it
        since are lost. Books them, zeroes the counters, returns them ``[L, E]``."""
        if self._since_save is None:
            self._last_lost = None
            return None
        lost = self._since_save.clone()
        if self._lost is not None:
            self._lost.add_(lost.sum(dim=1))
        self._since_save.zero_()
        self._last_lost = lost.sum()
        return lost

    def lost_tokens(self) -> int:
        """Token assignments lost at the latest recovery, all layers (a host copy)."""
        return 0 if self._last_lost is None else round(float(self._last_lost))

    def lost_token_portion(self) -> float:
        """PLT: per layer, tokens lost at recoveries over tokens routed; mean over layers
        that routed any (a host copy)."""
        if self._lost is None or self._total is None:
            return 0.0
        lost, total = self._lost.cpu(), self._total.cpu()
        routed = total > 0
        if not bool(routed.any()):
            return 0.0
        return float((lost[routed] / total[routed]).mean())

    def _capture(self, iteration: int, chosen: torch.Tensor, window_start: int,
                 window_index: int, window: int) -> CapturePlan:
        """Plan for chosen expert indices ``[L, k]``: zero their counters, record saves."""
        mask = torch.zeros(self.shape, dtype=torch.bool).scatter_(1, chosen, True)
        if self._since_save is not None:
            self._since_save.masked_fill_(_to_device(mask, self._since_save.device), 0.0)
        names = []
        for layer, expert in mask.nonzero().tolist():
            name = self.layout.experts.get(layer, {}).get(expert)
            if name is not None:
                names.append(name)
                self.last_saved[name] = iteration
        return CapturePlan(iteration, self.layout.non_experts + tuple(names), (),
                           window_start, window_index, window, None)

    def _base_state(self) -> dict[str, Any]:
        since = None if self._since_save is None else self._since_save.detach().clone()
        return {"experts_per_layer": self.experts_per_layer,
                "last_saved": dict(self.last_saved), "since_save": since,
                "lost": None if self._lost is None else self._lost.detach().clone(),
                "total": None if self._total is None else self._total.detach().clone()}

    def _load_base(self, d: dict[str, Any]) -> None:
        self.experts_per_layer = int(d["experts_per_layer"])
        self.last_saved = dict(d["last_saved"])
        since = d["since_save"]
        self._since_save = None if since is None else since.detach().clone()
        lost, total = d.get("lost"), d.get("total")
        self._lost = None if lost is None else lost.detach().clone()
        self._total = None if total is None else total.detach().clone()
