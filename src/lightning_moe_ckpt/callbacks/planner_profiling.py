"""Profiling a planner's inputs during the first iterations of training.

Algorithm 1 sizes the window from the iteration time and the rate at which snapshots can
be taken. :class:`PlannerProfiling` times the first iterations of training (again after a
recovery that came before the profile was complete), then measures the device-to-host copy
and the checksum rate once and hands the planner its profile. It runs as a step hook, so
every front end (Trainer, Fabric, a user's loop) profiles alike.
"""

from __future__ import annotations

import torch
from typing_extensions import override

from lightning_moe_ckpt.checkpointing.coordinator import CheckpointCoordinator
from lightning_moe_ckpt.core.target import StepHooks, StepResult
from lightning_moe_ckpt.planning.profiler import (
    BANDWIDTH_PROBE_BYTES,
    IterationProfiler,
    measure_bandwidth,
)

__all__ = ["PlannerProfiling"]


class PlannerProfiling(StepHooks):
    """Measures the iteration period and, once warm, hands the planner its profile."""

    def __init__(self, coordinator: CheckpointCoordinator, warmup: int,
                 device: torch.device) -> None:
        self.coordinator = coordinator
        self.warmup = warmup
        self.device = device
        self.profiler = self._fresh_profiler()
        coordinator.profiling_restarts.append(self.restart)

    def _fresh_profiler(self) -> IterationProfiler:
        profiler = IterationProfiler(warmup_iterations=self.warmup, skip=1, device=self.device)
        profiler.begin()
        return profiler

    def restart(self) -> None:
        """Warm up from the next iteration on again (see
        :meth:`CheckpointCoordinator.restart_profiling`)."""
        if not self.profiler.done:
            self.profiler = self._fresh_profiler()

    @override
    def after_optimizer_step(self, step: int, result: StepResult) -> None:
        if self.profiler.done:
            return
        self.profiler.end()
        self.profiler.begin()
        if self.profiler.done:
            copy = measure_bandwidth(BANDWIDTH_PROBE_BYTES, self.device)
            checksums = self.coordinator.capture.checksums
            checksum = checksums.measure(max(BANDWIDTH_PROBE_BYTES,
                                             2 * checksums.threads * checksums.chunk_bytes))
            # A snapshot is taken once copied and checksummed. On CUDA the copy engine and
            # the checksum threads overlap, so the slower bounds the rate; on CPU both are
            # work for the cores training shares, so their times add. That rate times the
            # iteration is Algorithm 1's budget.
            bandwidth = (min(copy, checksum) if self.device.type == "cuda"
                         else 1.0 / (1.0 / copy + 1.0 / checksum))
            iteration_s = self.profiler.iteration_time_s
            assert iteration_s is not None
            self.coordinator.planner.set_profile(iteration_s, bandwidth)
            self.coordinator.profile = {"iteration_time_s": iteration_s,
                                        "bandwidth_bytes_per_s": bandwidth,
                                        "copy_bytes_per_s": copy,
                                        "checksum_bytes_per_s": checksum}
