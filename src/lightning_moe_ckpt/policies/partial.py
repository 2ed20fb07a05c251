"""Partial-expert baselines: MoC-System (round-robin K experts) and MoEtion (top-S by deficit).

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
at the latest recovery and MoC's proportion of lost tokens over the run.

* **MoC** (``checkpoint=moc``): ``K`` experts per layer in round-robin order, interleaved
  across layers (layer ``l`` starts at expert ``l K mod E``), so any ``ceil(E/K)``
  consecutive snapshots cover every expert; that round is the plan's window. Its metric
  is MoC's proportion of lost tokens (PLT): lost tokens over all tokens routed, averaged
  over MoE layers. After each recovery, if PLT exceeds ``checkpoint.lost_token_budget``
  (3.75%), ``K`` doubles (Dynamic-K), up to every expert.
* **MoEtion** (``checkpoint=moetion``): the ``S`` experts per layer with the most tokens
  since their last save. The choice after step ``t`` uses the counters as of step
  ``t-1`` (a :class:`~lightning_moe_ckpt.planning.popularity.HostMirror` copy, so
  choosing never waits for the device), ties to the lower expert index. After a recovery
  every expert that lost tokens is *stale*: it gets a +10% capacity boost
  (``checkpoint.capacity_boost``), and each token routed to it repays ``boost`` of a
  token of its deficit until the deficit is repaid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.planner import BasePlanner, CapturePlan, expert_layout
from lightning_moe_ckpt.planning.popularity import HostMirror, expert_name
from lightning_moe_ckpt.planning.schedule import OperatorSpec, expert_position


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without blocking the host (pinned staging on CUDA)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class _PartialPlanner(BasePlanner):
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


class MoCPlanner(_PartialPlanner):
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


class MoEtionPlanner(_PartialPlanner):
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
