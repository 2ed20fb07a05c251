"""Run history: per-step scalars and routing telemetry, kept on the device until the end.

Recording a step appends device tensors and adds the expert load into a running
``[layers, experts]`` total, so the hot loop never waits on the host; everything is
converted to Python numbers once, when the metrics file and plots are written. Per-step
scalars are stacked into one tensor every :data:`STEPS_PER_CHUNK` steps, so a long run
holds a few bytes per step rather than a tensor object per step and series (about
800 bytes of host memory each, which grew the process by megabytes per thousand steps).
"""

from __future__ import annotations

import os
import statistics
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_moe_ckpt.training.iteration import IterationResult

STEPS_PER_CHUNK = 256  # scalars stacked together: one small tensor per chunk of steps


class ScalarSeries:
    """One scalar per step, on the device: the newest steps as they came, older ones
    stacked into chunks (``torch.stack`` is a device op: no host sync)."""

    def __init__(self) -> None:
        self._chunks: list[torch.Tensor] = []
        self._recent: list[torch.Tensor] = []

    def append(self, value: torch.Tensor) -> None:
        """Record one step's value (a 0-dim tensor)."""
        self._recent.append(value)
        if len(self._recent) == STEPS_PER_CHUNK:
            self._chunks.append(torch.stack(self._recent))
            self._recent.clear()

    def __len__(self) -> int:
        return STEPS_PER_CHUNK * len(self._chunks) + len(self._recent)

    def tensor(self) -> torch.Tensor | None:
        """Every recorded value in order, as one 1-D tensor (``None`` when empty)."""
        parts = self._chunks + ([torch.stack(self._recent)] if self._recent else [])
        return torch.cat(parts) if parts else None

    def tolist(self) -> list[float]:
        """Every recorded value as Python numbers (one host transfer)."""
        values = self.tensor()
        return [] if values is None else values.tolist()


@dataclass
class ValidationRecord:
    """Validation loss and perplexity after ``step`` optimizer steps."""

    step: int
    loss: float
    perplexity: float


MEMORY_EVERY = 100  # steps between samples of host memory (a /proc read: negligible)


def resident_bytes() -> int:
    """This process's resident set size now (0 where ``/proc`` is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


@dataclass
class TrainingHistory:
    """Everything the end-of-run report needs."""

    losses: ScalarSeries = field(default_factory=ScalarSeries)
    aux_losses: ScalarSeries = field(default_factory=ScalarSeries)
    clip_coefs: ScalarSeries = field(default_factory=ScalarSeries)
    dropped_total: torch.Tensor | None = None  # routed assignments dropped, summed
    iteration_seconds: array[float] = field(default_factory=lambda: array("d"))
    validation: list[ValidationRecord] = field(default_factory=list)
    expert_load_total: torch.Tensor | None = None
    memory: list[dict[str, int]] = field(default_factory=list)  # host memory samples
    # CPU seconds this process (every thread: the copy and replication threads, gloo's)
    # spent from one iteration's start to the next's: what a policy costs where cores are
    # shared, a steadier measure than wall time when ranks outnumber them.
    iteration_cpu_seconds: array[float] = field(default_factory=lambda: array("d"))
    # ... and of those, the training thread's own (the thread that starts iterations): its
    # host work slows down when checkpoint threads beside it take cores or caches, which
    # the process total cannot tell from the checkpoint threads' own work.
    iteration_thread_cpu_seconds: array[float] = field(default_factory=lambda: array("d"))
    _started: float | None = None
    _cpu_started: tuple[float, float] | None = None  # process, training thread

    def start_iteration(self) -> None:
        """Mark the start of an iteration (host clocks only)."""
        self._started = time.perf_counter()
        cpu = time.process_time(), time.thread_time()
        if self._cpu_started is not None:
            self.iteration_cpu_seconds.append(cpu[0] - self._cpu_started[0])
            self.iteration_thread_cpu_seconds.append(cpu[1] - self._cpu_started[1])
        self._cpu_started = cpu

    @staticmethod
    def memory_due(step: int, max_steps: int) -> bool:
        """Whether to sample host memory after ``step`` (every :data:`MEMORY_EVERY` steps
        and at the end)."""
        return step % MEMORY_EVERY == 0 or step == max_steps

    def sample_memory(self, step: int, checkpoint_host_bytes: int) -> None:
        """Record this process's RSS and the host bytes checkpointing holds after ``step``."""
        self.memory.append({"step": step, "rss_bytes": resident_bytes(),
                            "checkpoint_host_bytes": checkpoint_host_bytes})

    def median_cpu_ms(self) -> tuple[float, float] | None:
        """This process's median CPU milliseconds per iteration, all threads and the
        training thread's own (None: under two iterations)."""
        if not self.iteration_cpu_seconds:
            return None
        return (statistics.median(self.iteration_cpu_seconds) * 1e3,
                statistics.median(self.iteration_thread_cpu_seconds) * 1e3)

    def record(self, result: IterationResult) -> None:
        """Append one iteration's results."""
        self._stop_clock()
        self.losses.append(result.loss)
        self.aux_losses.append(result.aux_loss)
        self.clip_coefs.append(result.clip_coef)
        if self.dropped_total is None:  # float64: counts stay exact past 2**24
            self.dropped_total = torch.zeros((), dtype=torch.float64,
                                             device=result.dropped.device)
        self.dropped_total.add_(result.dropped)
        load = result.expert_load
        self.expert_load_total = load.clone() if self.expert_load_total is None \
            else self.expert_load_total.add_(load)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Append one iteration of a model without routing statistics (a user's model)."""
        self._stop_clock()
        self.losses.append(loss)

    def loss_values(self) -> list[float]:
        """Per-step training loss as Python floats (one host transfer)."""
        return self.losses.tolist()

    def _stop_clock(self) -> None:
        if self._started is not None:
            self.iteration_seconds.append(time.perf_counter() - self._started)
            self._started = None
