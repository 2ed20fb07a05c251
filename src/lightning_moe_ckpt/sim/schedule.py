"""MoEvement's sparse checkpoint schedule: operator order and window size (Algorithm 1).

Operators are ordered by ascending popularity (activation frequency; non-expert operators
see every token, so they come last) so that popular experts stay frozen longest during
sparse-to-dense conversion, where freezing saves the most work (paper §3.5). Each
snapshot ``i`` of a window captures the master state of slice ``i`` of that order and the
compute weights of every later slice (not yet captured). ``FindWindowSize`` picks the
largest slice (smallest window ``W``) whose largest snapshot still moves within the
per-iteration byte budget; with real, unequal operator sizes the first snapshot, which
carries every later slice's compute weights, is usually the binding one.
:func:`fixed_window` builds the schedule of a given ``W`` instead (a window measured on a
real run, for the simulator's calibration).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_moe_ckpt.errors import require
from lightning_moe_ckpt.sim.workload import OperatorCost


def order_operators(operators: Sequence[OperatorCost]) -> tuple[OperatorCost, ...]:
    """Ascending popularity; ties keep model order (stable sort)."""
    return tuple(sorted(operators, key=lambda op: op.activation))


def _snapshot_sizes(master: np.ndarray, compute: np.ndarray, per_snapshot: int) -> np.ndarray:
    starts = np.arange(0, master.size, per_snapshot)
    slice_master = np.add.reduceat(master, starts)
    slice_compute = np.add.reduceat(compute, starts)
    later_compute = compute.sum() - np.cumsum(slice_compute)
    return slice_master + later_compute


@dataclass(frozen=True)
class SparseSchedule:
    """A stage's window: operator order, operators per snapshot, per-GPU snapshot bytes."""

    order: tuple[OperatorCost, ...]
    per_snapshot: int  # O_active of Algorithm 1
    snapshot_bytes: tuple[float, ...]  # per GPU, one per snapshot of the window

    @property
    def window(self) -> int:
        return math.ceil(len(self.order) / self.per_snapshot)

    def frozen_after(self, snapshot: int) -> frozenset[str]:
        """Operators still frozen after loading snapshot ``snapshot`` during conversion."""
        return frozenset(op.name for op in self.order[(snapshot + 1) * self.per_snapshot:])

    @property
    def largest_bytes(self) -> float:
        return max(self.snapshot_bytes)

    @property
    def window_bytes(self) -> float:
        """Bytes of all snapshots of one window on one GPU (what recovery fetches)."""
        return float(sum(self.snapshot_bytes))


def find_window(operators: Sequence[OperatorCost], ranks: int,
                budget_bytes: float) -> SparseSchedule:
    """Algorithm 1 ``FindWindowSize`` over a stage's operators, each GPU holding ``1/ranks``
    of every operator. Falls back to one operator per snapshot if nothing fits (the
    resulting stall is the caller's to charge)."""
    order = order_operators(operators)
    master = np.array([op.master_state_bytes for op in order]) / ranks
    compute = np.array([op.compute_bytes for op in order]) / ranks
    sizes = _snapshot_sizes(master, compute, 1)
    per_snapshot = 1
    for active in range(len(order), 0, -1):
        candidate = _snapshot_sizes(master, compute, active)
        if candidate.max() <= budget_bytes:
            sizes, per_snapshot = candidate, active
            break
    return SparseSchedule(order, per_snapshot, tuple(float(s) for s in sizes))


def fixed_window(operators: Sequence[OperatorCost], ranks: int, window: int) -> SparseSchedule:
    """The schedule of ``ceil(operators / window)`` operators per snapshot in Algorithm 1's
    order: ``window`` snapshots per window wherever equal slices allow (else the nearest
    fewer), for a W forced or measured rather than sized by the byte budget."""
    require(isinstance(window, int) and window >= 1, f"window W={window!r} must be an integer >= 1")
    order = order_operators(operators)
    per_snapshot = max(1, math.ceil(len(order) / window))
    master = np.array([op.master_state_bytes for op in order]) / ranks
    compute = np.array([op.compute_bytes for op in order]) / ranks
    sizes = _snapshot_sizes(master, compute, per_snapshot)
    return SparseSchedule(order, per_snapshot, tuple(float(s) for s in sizes))
