"""What the dense baselines share: every operator's master state every ``k`` iterations.

A dense snapshot captures every operator's master state at once (window 1). Gemini
(:mod:`.gemini`) and CheckFreq (:mod:`.checkfreq`) snapshot at the first iteration they see
and then whenever ``k`` iterations have passed since the last snapshot (or since the
checkpoint a recovery restored); they differ in how they choose ``k``, and where the
snapshot persists. A ``k`` computed from measurements differs between ranks; with several
ranks ``interval_agreement`` (the largest ``k`` of all ranks, a collective) keeps every
rank snapshotting at the same iterations, which replication and recovery rely on. It runs
only when ``k`` is re-derived, i.e. right after a snapshot, which all ranks take together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

from lightning_moe_ckpt.planning.planner import BasePlanner, CapturePlan
from lightning_moe_ckpt.planning.schedule import OperatorSpec

__all__ = ["DensePlanner", "IntervalAgreement"]

IntervalAgreement = Callable[[int], int]  # this rank's k -> the k all ranks use


class DensePlanner(BasePlanner):
    """Every operator's master state every ``interval`` iterations."""

    restore_rule = "dense_rollback"  # every rank back to the last dense snapshot
    interval: int

    def __init__(self, specs: Sequence[OperatorSpec], interval: int,
                 interval_agreement: IntervalAgreement | None = None) -> None:
        self.operators = tuple(spec.name for spec in specs)
        self.interval = interval
        self.interval_agreement = interval_agreement
        self.last_snapshot: int | None = None

    def _agreed(self, interval: int) -> int:
        return interval if self.interval_agreement is None else self.interval_agreement(interval)

    @override
    def plan(self, iteration: int) -> CapturePlan | None:
        last = self.last_snapshot
        # iteration <= last: training went back without on_recovery; snapshot to be safe.
        if last is not None and last < iteration < last + self.interval:
            return None
        self.last_snapshot = iteration
        return CapturePlan(iteration, self.operators, (), iteration, 0, 1, None)

    @override
    def on_recovery(self, iteration: int) -> None:
        self.last_snapshot = iteration  # the restored checkpoint counts as the last one

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"interval": self.interval, "last_snapshot": self.last_snapshot}

    @override
    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.interval, self.last_snapshot = int(d["interval"]), d["last_snapshot"]
