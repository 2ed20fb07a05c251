"""CheckFreq: a dense snapshot every ``k`` iterations, persisted to each rank's disk.

CheckFreq adapts ``k`` from the measured per-snapshot overhead so that the runtime
overhead ``T_ckpt / (k T_iter)`` stays within ``checkpoint.max_overhead`` (3% as in the
paper): the smallest such ``k``. Its snapshots persist by a write to the rank's own disk
(:class:`~lightning_moe_ckpt.snapshots.disk.DiskWriter`), not to replica peers; its
restore rule is ``dense_rollback`` from those files.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.planning.intervals import smallest_interval_within
from lightning_moe_ckpt.planning.schedule import OperatorSpec
from lightning_moe_ckpt.policies.dense import DensePlanner, IntervalAgreement

__all__ = ["CheckFreqPlanner", "checkfreq_interval"]


def checkfreq_interval(iteration_time_s: float, snapshot_time_s: float,
                       max_overhead: float = 0.03, max_interval: int | None = None) -> int:
    """The smallest ``k >= 1`` with ``snapshot_time / (k x iteration_time) <= max_overhead``
    (capped at ``max_interval``): the leaf's :func:`smallest_interval_within`, the rule the
    simulator's CheckFreq uses too."""
    require(iteration_time_s > 0, f"iteration time {iteration_time_s} s must be > 0")
    require(snapshot_time_s >= 0, f"snapshot time {snapshot_time_s} s must be >= 0")
    return smallest_interval_within(lambda k: snapshot_time_s / (k * iteration_time_s),
                                    max_overhead, max_interval)


class CheckFreqPlanner(DensePlanner):
    """``checkpoint=checkfreq``: dense snapshot persisted to disk, ``k`` kept at <= 3%
    overhead."""

    name = "checkfreq"

    def __init__(self, specs: Sequence[OperatorSpec], *, max_overhead: float = 0.03,
                 initial_interval: int = 1, max_interval: int | None = None,
                 interval_agreement: IntervalAgreement | None = None) -> None:
        require(0 < max_overhead < 1,
                f"{fmt('checkpoint.max_overhead', max_overhead)} must be in (0, 1)")
        require(isinstance(initial_interval, int) and initial_interval >= 1,
                f"{fmt('checkpoint.initial_interval', initial_interval)} must be an integer "
                ">= 1")
        if max_interval is not None:
            require(max_interval >= 1,
                    f"{fmt('checkpoint.max_interval', max_interval)} must be >= 1")
        super().__init__(specs, initial_interval, interval_agreement)
        self.max_overhead = max_overhead
        self.max_interval = max_interval

    def record_overhead(self, iteration_time_s: float, snapshot_time_s: float) -> None:
        """Adapt ``k`` to the latest measured snapshot cost (the time it added to training,
        i.e. its stall), effective from the next snapshot on."""
        self.interval = self._agreed(checkfreq_interval(iteration_time_s, snapshot_time_s,
                                                        self.max_overhead, self.max_interval))
