"""What one rank's checkpointing measured: :class:`CheckpointMetrics`, which the
coordinator reports to as it works, for ``metrics.json``, the logger and the bench.

Per step: the bytes issued and the stall before the optimizer step (typed arrays, 8 bytes
a step). Per snapshot: how many were taken and confirmed (replicated, or written to
disk). Per window: whether every local operator's master state was captured exactly once
(invariant 2, counted as it happens). And the training thread's CPU time in the step
hooks, the replication lag at its worst.
"""

from __future__ import annotations

import statistics
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import Any

from lightning_moe_ckpt.planning.planner import CapturePlan


class CheckpointMetrics:
    """Counters one rank's checkpoint coordinator reports to."""

    def __init__(self, operators: Iterable[str]) -> None:
        self.bytes_per_step: array[int] = array("q")
        self.stall_per_step: array[float] = array("d")
        self.windows_seen: set[int] = set()
        self.current_window: int | None = None
        self.max_replication_lag = 0
        self.snapshots_taken = 0
        self.snapshots_confirmed = 0  # replicated to every peer (or written to disk)
        self.windows_covered = 0
        self.windows_not_covered = 0  # by design for the partial baselines
        # The training thread's CPU time in the two step hooks (planning, issuing, the
        # store): with the copy and replication threads', a snapshot's whole CPU cost.
        self.hooks_cpu_s = 0.0
        self._window_masters: Counter[str] = Counter()
        self._local_names = tuple(operators)

    def snapshot_taken(self, plan: CapturePlan) -> None:
        """A snapshot of ``plan`` was issued: count it and the window's coverage."""
        self.snapshots_taken += 1
        self.current_window = plan.window
        self.windows_seen.add(plan.window_start)
        if plan.window_index == 0:
            self._window_masters.clear()
        self._window_masters.update(plan.master)
        if plan.window_index == plan.window - 1:  # once per window
            counts = self._window_masters  # C-level loops: no bytecode per operator
            if all(map((1).__eq__, map(counts.__getitem__, self._local_names))):
                self.windows_covered += 1
            else:
                self.windows_not_covered += 1

    def replication_lag(self, lag: int) -> None:
        """Replication was ``lag`` snapshots behind the capture."""
        self.max_replication_lag = max(self.max_replication_lag, lag)

    def report(self, train_seconds: float) -> dict[str, Any]:
        """The counters' part of ``metrics.json``."""
        stall_s = sum(self.stall_per_step)
        steps = self.steps
        return {
            "checkpoint_overhead_pct": 100.0 * stall_s / train_seconds if train_seconds else 0.0,
            "stall_ms": 1e3 * stall_s,
            "stall_ms_per_step": [1e3 * s for s in self.stall_per_step],
            "snapshot_bytes_per_iter": sum(self.bytes_per_step) / steps,
            "snapshot_bytes_median": statistics.median(self.bytes_per_step or [0]),
            "window": self.current_window,
            "windows_taken": len(self.windows_seen),
            "replication_lag_max": self.max_replication_lag,
            "snapshots_taken": self.snapshots_taken,
            "snapshots_replicated": self.snapshots_confirmed,
            "windows_covered": self.windows_covered,
            "windows_not_covered": self.windows_not_covered,
            # Which steps took a snapshot (a window filter leaves some out).
            "snapshot_taken_per_step": [int(b > 0) for b in self.bytes_per_step],
        }

    @property
    def steps(self) -> int:
        """Steps recorded (at least 1, for per-step averages)."""
        return max(1, len(self.bytes_per_step))
