"""Liveness of a long operation: the thread doing it marks progress, a watchdog reads how
long ago it last did.

A recovery waits on peers, fetches windows and replays iterations for as long as it
takes, and its rank's heartbeat must go on meanwhile, or the supervisor would take the
rank for hung. But a recovery can hang too (a fetch that never returns, a peer frozen in
the middle of it): then its heartbeat must stop. :data:`RECOVERY` is marked at every step
of a recovery (each poll of a wait for the other ranks, each window fetched, each
iteration replayed); the recovery's heartbeat beats only while the last mark is recent
(:meth:`~lightning_moe_ckpt.failures.rendezvous.JobStore.busy`).
"""

from __future__ import annotations

import time

__all__ = ["RECOVERY", "Progress"]


class Progress:
    """When an operation last made progress (monotonic clock)."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def mark(self) -> None:
        """The operation made progress now (an attribute write: cheap on any thread)."""
        self._last = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last :meth:`mark`."""
        return time.monotonic() - self._last


RECOVERY = Progress()  # this process's recoveries (one runs at a time)
