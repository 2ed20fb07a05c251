"""The ETTR formula and the checkpoint-interval rules shared by the runtime and the simulator.

A leaf module (numpy and the library's error type only, nothing from the runtime or
:mod:`lightning_moe_ckpt.sim`): the
runtime's Gemini planner and the simulator's policies score and choose intervals with the
same two functions. :func:`ettr_formula` is the paper's §2.4 / Appendix C approximation
``1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)``; :func:`oracle_interval` is
Gemini's hindsight choice, the interval with the highest ETTR (MoEvement §5.2).
"""

from __future__ import annotations

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
