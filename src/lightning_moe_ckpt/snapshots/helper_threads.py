"""The checkpointing's background threads, at a lower scheduling priority than training.

A snapshot's copy, checksums, replication and (CheckFreq) disk writes run on helper threads
while the training thread goes on. Where cores are shared (more ranks and threads than
cores, as on a CPU run of several ranks), a helper woken after an optimizer step competes
with the training threads of every rank, and the scheduler lets it preempt them. Run with
a higher nice value (``checkpoint.helper_nice``, added to the process's own, as ``nice -n``
adds it, at most 19), a helper takes more of the time a core would otherwise idle: a
pipeline bubble, a rank waiting on a collective. Its work is the same; the training
threads are interrupted less. Under pp2 x ep2 on two shared cores this took the paired
with/without-snapshot ratio of direct runs from 1.023-1.027 to 1.005-1.015, and the bench's
from 1.033 to 1.026 (benchmarks/overhead_pp2xep2_cpu_2026-11-29.md). On a machine with a
core to spare for each helper it changes nothing.

A lower priority cannot leave the copy behind by more than a step: the training thread
waits for it before the next optimizer step, and sleeps meanwhile, leaving it the core
(the wait is the stall ``metrics.json`` reports). Replication that falls behind shows as
``max_replication_lag``. A helper preempted while it holds the interpreter lock keeps its
process's training thread waiting for the lock until it runs again; the step times of
the measurement above showed no such tail. Heartbeat threads
(:mod:`~lightning_moe_ckpt.failures.rendezvous`) are not helpers: a late heartbeat reads as
a hung worker.

Linux keeps a nice value per thread; elsewhere ``setpriority`` applies to the whole
process, so the setting is not applied there and :func:`lower_priority` warns once.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable

from typing_extensions import override

from lightning_moe_ckpt.errors import fmt, require

# Added to the process's nice value for every helper thread: the lowest priority a nice
# value gives (measured against 0 and 10, benchmarks/overhead_pp2xep2_cpu_2026-11-29.md).
DEFAULT_HELPER_NICE = 19
MAX_NICE = 19  # the largest nice value the kernel accepts
_PER_THREAD = sys.platform.startswith("linux")
_warned = False


def require_helper_nice(value: object) -> None:
    """Refuse a ``checkpoint.helper_nice`` that is not an integer from 0 to 19."""
    require(isinstance(value, int) and not isinstance(value, bool)
            and 0 <= value <= MAX_NICE,
            f"{fmt('checkpoint.helper_nice', value)} must be an integer from 0 (helper "
            f"threads at the training thread's priority) to {MAX_NICE} (the lowest)")


def lower_priority(nice: int) -> int | None:
    """Set the calling thread's nice value to the process's plus ``nice`` (at most
    :data:`MAX_NICE`): the process's, not the thread's own, since a thread inherits its
    creator's, and a pool thread a helper started would otherwise add ``nice`` twice.
    Returns the new value, or None where nothing was changed (``nice`` 0, or a platform
    without per-thread nice values, or the kernel refused: both warned of once)."""
    if nice == 0:
        return None
    if not _PER_THREAD:
        _warn_once(f"{fmt('checkpoint.helper_nice', nice)} applies on Linux only, where "
                   f"nice values are per thread; on {sys.platform} helper threads run at "
                   "the training thread's priority")
        return None
    thread = threading.get_native_id()
    try:
        # (On Linux the process's value is its main thread's.)
        value = min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        os.setpriority(os.PRIO_PROCESS, thread, value)
    except OSError as error:
        _warn_once(f"{fmt('checkpoint.helper_nice', nice)} could not be applied ({error}); "
                   "helper threads run at the training thread's priority")
        return None
    return value


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


class HelperThread(threading.Thread):
    """A daemon thread that runs ``target`` at ``nice`` below the process's priority."""

    def __init__(self, target: Callable[[], None], name: str, nice: int) -> None:
        require_helper_nice(nice)
        super().__init__(target=target, name=name, daemon=True)
        self.nice = nice

    @override
    def run(self) -> None:
        lower_priority(self.nice)
        super().run()
