"""Gemini: a dense snapshot in the peers' host memory every ``k`` iterations.

Gemini uses a fixed ``k`` (``checkpoint.interval``) or the *oracle* ``k`` for an MTBF
(``checkpoint.mtbf_s``): the interval maximising the paper's §2.4 ETTR formula
``1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)`` with ``E[R] = fixed recovery +
k T_iter / 2``, swept with :mod:`lightning_moe_ckpt.planning.intervals` (the leaf module
the simulator uses too). Until a snapshot cost is known (given, or measured through
:meth:`GeminiPlanner.record_overhead`) it snapshots every iteration, which is how the
first cost gets measured. Its restore rule is ``dense_rollback``: every rank rolls back to
the last dense snapshot, from its replicas, and recomputes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lightning_moe_ckpt.errors import ConfigError, fmt, require
from lightning_moe_ckpt.planning.intervals import ettr_formula
from lightning_moe_ckpt.planning.intervals import oracle_interval as sweep
from lightning_moe_ckpt.planning.schedule import OperatorSpec
from lightning_moe_ckpt.policies.dense import DensePlanner, IntervalAgreement

__all__ = ["GeminiPlanner", "gemini_interval"]

_SWEEP_LIMIT = 1_000_000  # intervals beyond this many iterations are never useful


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


class GeminiPlanner(DensePlanner):
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
