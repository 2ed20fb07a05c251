"""Profiling the two inputs of the schedule: iteration time and device-to-host bandwidth.

:class:`IterationProfiler` times the first training iterations with the host wall clock:
it skips ``skip`` start-up iterations (allocator and kernel warm-up) and reports the
median of the next ``warmup_iterations``. On CUDA it synchronizes the device at the edges
of the measured iterations only, so that the wall clock covers the device work; after the
measurement it does nothing. :func:`measure_bandwidth` times copies of a buffer of a given
size into a host buffer: pinned memory and CUDA events on CUDA (the path the snapshot
engine uses), a plain memcpy timed with the wall clock on CPU; the best of ``repeats``
is reported since slower repeats only measure interference.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from lightning_moe_ckpt.errors import fmt, require

# The copy size the planner's bandwidth is measured with (and the stage profile's).
BANDWIDTH_PROBE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Profile:
    """What :func:`~lightning_moe_ckpt.planning.schedule.plan_window` needs."""

    iteration_time_s: float
    bandwidth_bytes_per_s: float

    @property
    def budget_bytes(self) -> float:
        """Bytes one snapshot may move per iteration without stalling."""
        return self.iteration_time_s * self.bandwidth_bytes_per_s


class IterationProfiler:
    """Median wall-clock time of iterations ``skip .. skip + warmup_iterations - 1``."""

    def __init__(self, warmup_iterations: int = 5, skip: int = 1,
                 device: torch.device | str = "cpu") -> None:
        require(isinstance(warmup_iterations, int) and warmup_iterations >= 1,
                f"{fmt('checkpoint.warmup_iterations', warmup_iterations)} must be >= 1")
        require(isinstance(skip, int) and skip >= 0, f"{fmt('checkpoint.warmup_skip', skip)} "
                                                     "must be >= 0")
        self.warmup_iterations = warmup_iterations
        self.skip = skip
        self.device = torch.device(device)
        self.samples: list[float] = []
        self._seen = 0
        self._started: float | None = None

    @property
    def done(self) -> bool:
        """Whether enough iterations were measured."""
        return len(self.samples) >= self.warmup_iterations

    @property
    def iteration_time_s(self) -> float | None:
        """Median measured iteration time, once :attr:`done`."""
        return statistics.median(self.samples) if self.done else None

    def _measuring(self) -> bool:
        return not self.done and self._seen >= self.skip

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def begin(self) -> None:
        """Call at the start of an iteration."""
        if self._measuring():
            self._sync()
            self._started = time.perf_counter()

    def end(self) -> None:
        """Call at the end of the iteration (after the optimizer step)."""
        if self._measuring() and self._started is not None:
            self._sync()
            self.samples.append(time.perf_counter() - self._started)
        self._started = None
        self._seen += 1


def measure_bandwidth(nbytes: int, device: torch.device | str = "cpu", repeats: int = 3) -> float:
    """Device-to-host copy bandwidth in bytes/s for a buffer of ``nbytes``."""
    require(nbytes > 0, f"{fmt('checkpoint.bandwidth_probe_bytes', nbytes)} must be > 0")
    require(repeats >= 1, f"bandwidth repeats={repeats} must be >= 1")
    device = torch.device(device)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    target = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=cuda)
    source.fill_(1)  # touch every page so the first repeat does not time page faults
    target.fill_(0)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, _timed_cuda_copy(source, target) if cuda else _timed_copy(source, target))
    return nbytes / max(best, 1e-9)


def _timed_copy(source: torch.Tensor, target: torch.Tensor) -> float:
    started = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - started


def _timed_cuda_copy(source: torch.Tensor, target: torch.Tensor) -> float:
    with torch.cuda.device(source.device):  # events belong to the source's device
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1000.0
