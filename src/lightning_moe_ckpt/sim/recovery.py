"""Recovery-time models: global rollback of dense checkpoints vs localized sparse replay.

A failure strikes at a uniformly random point ``u`` of the checkpoint cycle (paper §3.6).
Recovery then costs a fixed part (fetching state, restarting) plus re-execution that grows
linearly in ``u``: :class:`RecoveryPath` holds both in seconds and in iterations.

* Dense checkpoints (CheckFreq, Gemini, MoC, MoEtion) roll *every* rank back to the last
  usable checkpoint, ``lag + u x interval`` iterations ago, and re-run full iterations,
  pipeline bubbles included: ``0 <= R <= interval`` iterations, on average half of it
  when the checkpoint is usable at once (lag 0).
* MoEvement rolls back only the failed stage's ``dp x ep`` group to the start of the last
  persisted sparse window: ``W`` iterations of sparse-to-dense conversion (frozen operators
  are cheaper) plus ``u x W`` iterations back up to the failure, replayed from logs with no
  bubble: ``W <= R <= 2W`` iterations, ``1.5 W`` on average. Each stage is a path of its
  own, equally likely, since every stage has the same number of GPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class RecoveryPath:
    """Recovery from a failure at cycle position ``u`` in [0, 1): ``fixed + base + u*span``."""

    fixed_s: float  # state fetch/load and restart, independent of u
    base_s: float  # re-execution when the failure hits right after a checkpoint
    span_s: float  # additional re-execution at the end of the cycle
    base_iterations: float
    span_iterations: float

    def seconds(self, u: float | np.ndarray) -> float | np.ndarray:
        return self.fixed_s + self.base_s + u * self.span_s

    def iterations(self, u: float | np.ndarray) -> float | np.ndarray:
        return self.base_iterations + u * self.span_iterations

    @property
    def expected_s(self) -> float:
        return self.fixed_s + self.base_s + 0.5 * self.span_s


@dataclass(frozen=True)
class RecoveryModel:
    """Equally likely recovery paths (one per failure site) and who rolls back."""

    scope: Literal["global", "stage"]
    paths: tuple[RecoveryPath, ...]

    @property
    def expected_s(self) -> float:
        return float(np.mean([path.expected_s for path in self.paths]))

    @property
    def expected_iterations(self) -> float:
        return float(np.mean([p.base_iterations + 0.5 * p.span_iterations for p in self.paths]))

    @property
    def iteration_bounds(self) -> tuple[float, float]:
        """Smallest and largest rolled-back iteration count over all paths and positions."""
        low = min(p.base_iterations for p in self.paths)
        high = max(p.base_iterations + p.span_iterations for p in self.paths)
        return low, high

    @functools.cached_property
    def _columns(self) -> np.ndarray:
        """Rows: seconds at u=0, seconds span, iterations at u=0, iterations span."""
        return np.array([[p.fixed_s + p.base_s, p.span_s, p.base_iterations, p.span_iterations]
                         for p in self.paths]).T

    def sample(self, rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
        """``size`` draws of (seconds, iterations rolled back)."""
        which = rng.integers(len(self.paths), size=size)
        u = rng.uniform(size=size)
        start, span, start_it, span_it = self._columns[:, which]
        return start + u * span, start_it + u * span_it

    def sample_one(self, rng: np.random.Generator) -> float:
        """One draw of the recovery time in seconds (fast path for event loops)."""
        u, pick = rng.random(2)
        path = self.paths[min(int(pick * len(self.paths)), len(self.paths) - 1)]
        return path.fixed_s + path.base_s + u * path.span_s


def global_rollback_model(iteration_s: float, interval: int, load_s: float, restart_s: float,
                    lag_s: float = 0.0) -> RecoveryModel:
    """Every rank rolls back to the last checkpoint usable after ``lag_s`` (e.g. persisting
    to storage) and re-runs full iterations; the checkpoint cycle is ``interval`` iterations."""
    path = RecoveryPath(fixed_s=load_s + restart_s, base_s=lag_s,
                        span_s=interval * iteration_s, base_iterations=lag_s / iteration_s,
                        span_iterations=float(interval))
    return RecoveryModel("global", (path,))


def localized_replay_model(windows: Sequence[int], conversion_s: Sequence[float],
                     full_replay_s: Sequence[float], fetch_s: Sequence[float],
                     restart_s: float) -> RecoveryModel:
    """MoEvement, one path per stage: fetch the window's snapshots (``fetch_s``), replay the
    ``W`` iterations that turn the sparse checkpoint dense (``conversion_s`` in total), then
    ``u x W`` all-active iterations of ``full_replay_s`` each up to the failure."""
    paths = tuple(
        RecoveryPath(fixed_s=fetch + restart_s, base_s=conversion, span_s=window * full,
                     base_iterations=float(window), span_iterations=float(window))
        for window, conversion, full, fetch
        in zip(windows, conversion_s, full_replay_s, fetch_s, strict=True))
    return RecoveryModel("stage", paths)
