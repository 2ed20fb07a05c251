"""The ETTR formula and the checkpoint-interval rules shared by the runtime and the simulator.

A leaf module (numpy and the library's error type only, nothing from the runtime or
:mod:`lightning_moe_ckpt.sim`): the
runtime's Gemini planner and the simulator's policies score and choose intervals with the
same functions. :func:`ettr_formula` is the paper's §2.4 / Appendix C approximation
``1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)``; :func:`oracle_interval` is
Gemini's hindsight choice, the interval with the highest ETTR (MoEvement §5.2);
:func:`smallest_interval_within` is CheckFreq's policy, the shortest interval whose
runtime overhead stays within a cap (3% in MoEvement §5.2), used by the runtime's
CheckFreq planner and the simulator's CheckFreq alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import require


def ettr_formula(stall_s: float, iteration_s: float, interval: Any, expected_recovery_s: Any,
                 mtbf_s: float) -> Any:
    """Paper §2.4: runtime-overhead factor times recovery-overhead factor.

    Args:
        stall_s: Runtime overhead of one checkpoint (``T_ckpt``), seconds.
        iteration_s: Fault-free iteration time (``T_iter``), seconds.
        interval: Iterations between checkpoints (``k``); may be an array (one ETTR per
            candidate interval).
        expected_recovery_s: Expected recovery time (``E[R]``), seconds; may be an array
            like ``interval``.
        mtbf_s: Mean time between failures, seconds (> 0).

    Returns:
        The ETTR, an array where an argument is one.

    Raises:
        ConfigError: ``mtbf_s`` is not > 0.
    """
    require(mtbf_s > 0, f"MTBF must be > 0 seconds, got {mtbf_s}")
    runtime = 1.0 / (1.0 + stall_s / (iteration_s * interval))
    return runtime / (1.0 + expected_recovery_s / mtbf_s)


def oracle_interval(ettr_of: Callable[[np.ndarray], np.ndarray],
                    max_interval: int) -> tuple[int, float]:
    """The interval in ``1..max_interval`` with the highest ETTR (hindsight: Gemini's oracle,
    paper §5.2), and that ETTR; ties go to the shorter interval.

    Args:
        ettr_of: Maps an array of intervals to their ETTRs.
        max_interval: The longest interval considered (>= 1).

    Returns:
        ``(interval, ettr)``.

    Raises:
        ConfigError: ``max_interval`` is below 1.
    """
    require(max_interval >= 1, f"max_interval={max_interval} must be >= 1")
    intervals = np.arange(1, max_interval + 1)
    values = np.asarray(ettr_of(intervals), dtype=float)
    best = int(np.argmax(values))  # first maximum: the shortest interval
    return int(intervals[best]), float(values[best])


def smallest_interval_within(overhead_of: Callable[[int], float], max_overhead: float,
                             max_interval: int | None = None) -> int:
    """CheckFreq's rule: the smallest interval ``k >= 1`` whose runtime overhead
    ``overhead_of(k)`` is at most ``max_overhead``, or ``max_interval`` when no interval up
    to it is. ``overhead_of`` must not increase with ``k`` (the search bisects); without
    ``max_interval`` it must reach ``max_overhead`` at some ``k``."""
    require(max_overhead > 0 or max_interval is not None,
            f"max_overhead={max_overhead} must be > 0 without a max_interval")
    require(max_interval is None or max_interval >= 1,
            f"max_interval={max_interval} must be >= 1")
    low, high = 1, 1  # every k < low is over the cap
    while overhead_of(high) > max_overhead:
        if max_interval is not None and high >= max_interval:
            return max_interval
        low = high + 1
        high = 2 * high if max_interval is None else min(2 * high, max_interval)
    while low < high:  # overhead_of(high) is within the cap
        middle = (low + high) // 2
        if overhead_of(middle) <= max_overhead:
            high = middle
        else:
            low = middle + 1
    return high
