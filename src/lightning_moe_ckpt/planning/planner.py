"""The planner interface every checkpoint policy implements, and what planners share.

A planner answers, after each optimizer step ``t``, which operators' master state and
which operators' compute weights snapshot SS_t captures (a :class:`CapturePlan`), or that
there is none. :class:`BasePlanner` is the interface with its defaults and the
capabilities a policy declares (never probed); :class:`NonePlanner` is ``checkpoint=none``;
:class:`ExpertLayout` splits a model's operators into non-experts and routed experts, for
the planners that treat experts apart. The policies are in
:mod:`lightning_moe_ckpt.policies`, one module each, and its registry builds them by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.schedule import OperatorSpec, expert_position

__all__ = ["BasePlanner", "CapturePlan", "ExpertLayout", "NonePlanner", "Planner",
           "expert_layout"]


@dataclass(frozen=True)
class CapturePlan:
    """What snapshot SS_t captures."""

    iteration: int  # optimizer step t the snapshot is taken after
    master: tuple[str, ...]  # operators whose master state is captured
    compute: tuple[str, ...]  # operators whose compute weights only are captured
    window_start: int  # first iteration of the window/checkpoint this snapshot belongs to
    window_index: int  # position inside it (0..W-1); dense policies: 0
    window: int  # W (dense: 1)
    schedule: dict[str, Any] | None  # WindowSchedule.to_dict() for moevement, else None


RestoreRule = Literal["sparse_to_dense", "dense_rollback", "partial_restore"]


class BasePlanner:
    """A checkpoint policy's capture decisions, and the capabilities it declares.

    Defaults: telemetry ignored, nothing to save, recovery changes nothing, no profile
    wanted, no overhead feedback, every recovery exact (no partial restore), no expert
    capacity factors.
    """

    name = ""
    # Capabilities the coordinator, callbacks and recovery consult (never probed).
    wants_profile = False  # set_profile() takes the measured iteration time/bandwidth
    # How a failure is recovered (recovery implements each rule; a policy names its own):
    # "sparse_to_dense" converts a window and replays, only the failed stage's ranks where
    # the upstream log allows; "dense_rollback" rolls every rank back to the last dense
    # snapshot (from replicas, or from disk when snapshots persist there) and recomputes;
    # "partial_restore" restores each operator's newest save, stale experts included.
    restore_rule: RestoreRule = "sparse_to_dense"
    reorders = 0  # window reorders so far (moevement)
    interval: int | None = None  # dense policies' checkpoint interval in iterations
    experts_per_layer: int | None = None  # partial policies' K

    def plan(self, iteration: int) -> CapturePlan | None:
        """The snapshot to take after optimizer step ``iteration`` (None: no snapshot)."""
        raise NotImplementedError

    def observe(self, iteration: int, hard_counts: torch.Tensor,
                soft_counts: torch.Tensor) -> None:
        """Routing telemetry of ``iteration`` (``[layers, experts]`` device tensors)."""
        return None

    def on_recovery(self, iteration: int) -> None:
        """Training was restored to the state after step ``iteration``."""
        return None

    def set_profile(self, iteration_time_s: float, bandwidth_bytes_per_s: float) -> None:
        """Measured iteration time and device-to-host bandwidth (``wants_profile``)."""
        return None

    def update_specs(self, specs: Sequence[OperatorSpec]) -> None:
        """Byte sizes measured from the live optimizer (its state exists only after the
        first step); planners that size snapshots use them from the next window on."""
        return None

    def record_overhead(self, iteration_time_s: float, snapshot_time_s: float) -> None:
        """Measured cost of the last snapshot (dense policies adapt their interval)."""
        return None

    def capacity_factors(self) -> torch.Tensor | None:
        """Per-``[layer, expert]`` capacity factors for the next iteration, if any."""
        return None

    def lost_tokens(self) -> int:
        """Expert assignments whose update a partial restore lost (exact policies: 0)."""
        return 0

    def lost_token_portion(self) -> float:
        """The lost tokens as a portion of all assignments (exact policies: 0)."""
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue planning."""
        return {}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`."""
        return None


Planner = BasePlanner


@dataclass(frozen=True)
class ExpertLayout:
    """Operators split into non-experts and routed experts, and the counter shape."""

    non_experts: tuple[str, ...]  # kind != "expert": embed, attn, gate, shared_experts, head
    experts: Mapping[int, Mapping[int, str]]  # layer -> expert index -> name (known ones)
    n_layers: int  # rows of the routing counters (layer index = row)
    n_experts: int  # columns

    @property
    def names(self) -> tuple[str, ...]:
        """Every operator, non-experts first."""
        return self.non_experts + tuple(name for layer in sorted(self.experts)
                                        for _, name in sorted(self.experts[layer].items()))


def expert_layout(names: Sequence[str], n_layers: int | None = None,
                  n_experts: int | None = None) -> ExpertLayout:
    """Split ``names``; the counter shape defaults to what the expert names imply (pass the
    model's ``n_layers``/``n_experts`` when ``names`` are one pipeline stage's)."""
    non_experts: list[str] = []
    experts: dict[int, dict[int, str]] = {}
    for name in names:
        position = expert_position(name)
        if position is None:
            non_experts.append(name)
        else:
            experts.setdefault(position[0], {})[position[1]] = name
    layers = 1 + max(experts, default=-1)
    width = 1 + max((e for per_layer in experts.values() for e in per_layer), default=-1)
    n_layers = layers if n_layers is None else n_layers
    n_experts = width if n_experts is None else n_experts
    require(n_layers >= layers, f"{fmt('model.n_layers', n_layers)} is smaller than the "
                                f"operators imply ({layers})")
    require(n_experts >= width, f"{fmt('model.n_experts', n_experts)} is smaller than the "
                                f"operators imply ({width})")
    return ExpertLayout(tuple(non_experts), experts, n_layers, n_experts)


class NonePlanner(BasePlanner):
    """``checkpoint=none``: never snapshots."""

    name = "none"

    def __init__(self, specs: Sequence[OperatorSpec] = ()) -> None:
        del specs

    @override
    def plan(self, iteration: int) -> CapturePlan | None:
        return None
