"""Dense baselines: Gemini (in-memory, every k iterations) and CheckFreq (disk, adaptive k).

A dense snapshot captures every operator's master state at once (window 1). Both planners
snapshot at the first iteration they see and then whenever ``k`` iterations have passed
since the last snapshot (or since the checkpoint a recovery restored).

* **Gemini** uses a fixed ``k`` (``checkpoint.interval``) or the *oracle* ``k`` for an MTBF
  (``checkpoint.mtbf_s``): the interval maximising the paper's §2.4 ETTR formula
  ``1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)`` with ``E[R] = fixed recovery
  + k T_iter / 2``, swept with :mod:`lightning_moe_ckpt.planning.intervals` (the leaf module
  the simulator uses too). Until a snapshot cost is known (given, or measured through
  :meth:`GeminiPlanner.record_overhead`) it snapshots every iteration, which is how the
  first cost gets measured.
* **CheckFreq** adapts ``k`` from the measured per-snapshot overhead so that the
  runtime overhead ``T_ckpt / (k T_iter)`` stays within ``checkpoint.max_overhead``
  (3% as in the paper): the smallest such ``k``.

A ``k`` computed from measurements differs between ranks; with several ranks
``interval_agreement`` (the largest ``k`` of all ranks, a collective) keeps every rank
snapshotting at the same iterations, which replication and recovery rely on. It runs
only when ``k`` is re-derived, i.e. right after a snapshot, which all ranks take together.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from typing_extensions import override

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.planning.intervals import ettr_formula, smallest_interval_within
from lightning_moe_ckpt.planning.intervals import oracle_interval as sweep
from lightning_moe_ckpt.planning.planner import BasePlanner, CapturePlan
from lightning_moe_ckpt.planning.schedule import OperatorSpec

_SWEEP_LIMIT = 1_000_000  # intervals beyond this many iterations are never useful
IntervalAgreement = Callable[[int], int]  # this rank's k -> the k all ranks use


def gemini_interval(mtbf_s: float, iteration_time_s: float, snapshot_time_s: float,
                    recovery_fixed_s: float = 0.0, max_interval: int | None = None) -> int:
    """Gemini's oracle: the ``k`` in ``1..max_interval`` with the highest analytic ETTR
    (ties: the shorter). ``max_interval`` defaults to one MTBF's worth of iterations."""
    require(mtbf_s > 0, f"{fmt('checkpoint.mtbf_s', mtbf_s)} must be > 0")
    require(iteration_time_s > 0, f"iteration time {iteration_time_s} s must be > 0")
    require(snapshot_time_s >= 0, f"snapshot time {snapshot_time_s} s must be >= 0")
    if max_interval is None:
        max_interval = min(_SWEEP_LIMIT, max(1, math.ceil(mtbf_s / iteration_time_s)))
    require(max_interval >= 1, f"{fmt('checkpoint.max_interval', max_interval)} must be >= 1")

    def ettr_of(intervals: np.ndarray) -> np.ndarray:
        recovery = recovery_fixed_s + 0.5 * intervals * iteration_time_s
        return np.asarray(ettr_formula(snapshot_time_s, iteration_time_s, intervals,
                                       recovery, mtbf_s))

    interval, _ = sweep(ettr_of, max_interval)
    return interval


def checkfreq_interval(iteration_time_s: float, snapshot_time_s: float,
                       max_overhead: float = 0.03, max_interval: int | None = None) -> int:
    """The smallest ``k >= 1`` with ``snapshot_time / (k x iteration_time) <= max_overhead``
    (capped at ``max_interval``): the leaf's :func:`smallest_interval_within`, the rule the
    simulator's CheckFreq uses too."""
    require(iteration_time_s > 0, f"iteration time {iteration_time_s} s must be > 0")
    require(snapshot_time_s >= 0, f"snapshot time {snapshot_time_s} s must be >= 0")
    return smallest_interval_within(lambda k: snapshot_time_s / (k * iteration_time_s),
                                    max_overhead, max_interval)


class _DensePlanner(BasePlanner):
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


class GeminiPlanner(_DensePlanner):
    """``checkpoint=gemini``: dense in-memory snapshot every ``k`` iterations."""

    name = "gemini"

    def __init__(self, specs: Sequence[OperatorSpec], *, interval: int | None = None,
                 mtbf_s: float | None = None, iteration_time_s: float | None = None,
                 snapshot_time_s: float | None = None, recovery_fixed_s: float = 0.0,
                 max_interval: int | None = None,
                 interval_agreement: IntervalAgreement | None = None) -> None:
        if interval is not None and mtbf_s is not None:
            raise ConfigError(f"set only one of checkpoint.interval={interval} (fixed k) and "
                              f"checkpoint.mtbf_s={mtbf_s} (oracle k) for checkpoint=gemini")
        if interval is None and mtbf_s is None:
            raise ConfigError("checkpoint=gemini needs checkpoint.interval (fixed k) or "
                              "checkpoint.mtbf_s (oracle k for that MTBF)")
        if interval is not None:
            require(isinstance(interval, int) and interval >= 1,
                    f"{fmt('checkpoint.interval', interval)} must be an integer >= 1")
        if mtbf_s is not None:
            require(mtbf_s > 0, f"{fmt('checkpoint.mtbf_s', mtbf_s)} must be > 0")
        require(recovery_fixed_s >= 0,
                f"{fmt('checkpoint.recovery_fixed_s', recovery_fixed_s)} must be >= 0")
        super().__init__(specs, interval if interval is not None else 1, interval_agreement)
        self.mtbf_s = mtbf_s
        self.recovery_fixed_s = recovery_fixed_s
        self.max_interval = max_interval
        if mtbf_s is not None and iteration_time_s is not None and snapshot_time_s is not None:
            self.record_overhead(iteration_time_s, snapshot_time_s)

    def record_overhead(self, iteration_time_s: float, snapshot_time_s: float) -> None:
        """A measured snapshot cost (stall per snapshot); re-runs the oracle sweep when ``k``
        is chosen for an MTBF. A fixed ``k`` stays."""
        if self.mtbf_s is not None:
            self.interval = self._agreed(gemini_interval(
                self.mtbf_s, iteration_time_s, snapshot_time_s, self.recovery_fixed_s,
                self.max_interval))


class CheckFreqPlanner(_DensePlanner):
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
