"""The ETTR formula and the checkpoint-interval rules shared by the runtime and the simulator.

A leaf module (numpy and the library's error type only, nothing from the runtime or
:mod:`lightning_moe_ckpt.sim`): the
runtime's Gemini and CheckFreq planners and the simulator's policies choose their
intervals with the same three functions. :func:`ettr_formula` is the paper's §2.4 /
Appendix C approximation ``1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)``;
:func:`oracle_interval` is Gemini's hindsight choice, the interval with the highest ETTR
(MoEvement §5.2); :func:`overhead_capped_interval` is CheckFreq's policy, the shortest
interval whose runtime overhead stays within a cap (3% in MoEvement §5.2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from lightning_moe_ckpt.errors import require


def ettr_formula(stall_s: float, iteration_s: float, interval: Any, expected_recovery_s: Any,
                 mtbf_s: float) -> Any:
    """Paper §2.4: runtime-overhead factor times recovery-overhead factor. ``interval`` and
    ``expected_recovery_s`` may be arrays (one ETTR per candidate interval)."""
    require(mtbf_s > 0, f"MTBF must be > 0 seconds, got {mtbf_s}")
    runtime = 1.0 / (1.0 + stall_s / (iteration_s * interval))
    return runtime / (1.0 + expected_recovery_s / mtbf_s)


def oracle_interval(ettr_of: Callable[[np.ndarray], np.ndarray],
                    max_interval: int) -> tuple[int, float]:
    """The interval in ``1..max_interval`` with the highest ETTR (hindsight: Gemini's oracle,
    paper §5.2), and that ETTR; ties go to the shorter interval. ``ettr_of`` maps an array
    of intervals to their ETTRs."""
    require(max_interval >= 1, f"max_interval={max_interval} must be >= 1")
    intervals = np.arange(1, max_interval + 1)
    values = np.asarray(ettr_of(intervals), dtype=float)
    best = int(np.argmax(values))  # first maximum: the shortest interval
    return int(intervals[best]), float(values[best])


def overhead_capped_interval(stall_s: float, iteration_s: float, max_overhead: float,
                             max_interval: int | None = None) -> int:
    """CheckFreq's rule: the smallest ``k >= 1`` with ``stall / (k x iteration) <= cap``
    (at most ``max_interval``)."""
    require(iteration_s > 0 and stall_s >= 0 and max_overhead > 0,
            f"need iteration time > 0 (got {iteration_s}), stall >= 0 (got {stall_s}) and an "
            f"overhead cap > 0 (got {max_overhead})")
    k = max(1, math.ceil(stall_s / (max_overhead * iteration_s)))
    # ceil of a float ratio can land one off either way; settle on the exact smallest k.
    while k > 1 and stall_s / ((k - 1) * iteration_s) <= max_overhead:
        k -= 1
    while stall_s / (k * iteration_s) > max_overhead:
        k += 1
    return k if max_interval is None else min(k, max_interval)
