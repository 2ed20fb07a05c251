"""Snapshot store: the in-flight window, the persisted window, and nothing older.

Snapshots are grouped by the window (sparse checkpoint) they belong to. A window is
*complete* when all of its W snapshots were taken and their copies checksummed, and
*persisted* when, in addition, every snapshot is held by its replica peers (the replicator
reports that). The store keeps the newest persisted window and the windows after it;
as soon as a newer window persists, older ones are released to the buffer pool, and the
registered release listeners (the upstream log) are told from which step on state must be
kept: the start of the previous persisted window, the fallback recovery point whose
snapshots the replica peers still hold. So host memory stays bounded by two windows of
snapshots plus the logs since the older one's start (invariant 5).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_moe_ckpt.snapshots.snapshot import HostBufferPool, Snapshot


@dataclass
class WindowRecord:
    """The snapshots of one window of one rank."""

    start: int
    window: int
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    replicated: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        """All W snapshots taken and checksummed."""
        return (len(self.snapshots) == self.window
                and all(s.checksummed.is_set() for s in self.snapshots.values()))

    @property
    def persisted(self) -> bool:
        """Complete and every snapshot replicated."""
        return self.complete and self.replicated >= set(self.snapshots)

    @property
    def nbytes(self) -> int:
        """Host bytes held by the window's snapshots."""
        return sum(s.nbytes for s in self.snapshots.values())


class SnapshotStore:
    """Windows of one rank, from the newest persisted one on."""

    # Whether pieces of a released snapshot may stay held (by a subclass): such a store's
    # snapshots cannot share memory that is reused once the snapshot is released.
    keeps_released_pieces = False

    def __init__(self, pool: HostBufferPool, replicas: int) -> None:
        self.pool = pool
        self.replicas = replicas
        self.windows: dict[int, WindowRecord] = {}
        self.persisted_start: int | None = None
        self.release_listeners: list[Callable[[int], None]] = []
        self._kept_from: int | None = None
        self.peak_bytes = 0
        self._held_bytes = 0  # kept as windows come and go: summing pieces every step costs
        # Of those, the bytes of snapshots placed in shared slots (counted with the slots),
        # and the peak of the rest: what the store holds in host buffers of its own.
        self._placed_bytes = 0
        self.peak_own_bytes = 0

    def add(self, snapshot: Snapshot) -> WindowRecord:
        """File a newly issued snapshot under its window."""
        plan = snapshot.plan
        record = self.windows.setdefault(plan.window_start,
                                         WindowRecord(plan.window_start, plan.window))
        replaced = record.snapshots.get(snapshot.step)
        record.snapshots[snapshot.step] = snapshot
        self._count(snapshot, 1)
        if replaced is not None:
            self._count(replaced, -1)
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        self.peak_own_bytes = max(self.peak_own_bytes, self._held_bytes - self._placed_bytes)
        return record

    def _count(self, snapshot: Snapshot, sign: int) -> None:
        self._held_bytes += sign * snapshot.nbytes
        if snapshot.backing is not None:
            self._placed_bytes += sign * snapshot.nbytes

    def _pop(self, start: int) -> WindowRecord:
        """Take the window at ``start`` out of the store (its snapshots still intact)."""
        record = self.windows.pop(start)
        for snapshot in record.snapshots.values():
            self._count(snapshot, -1)
        return record

    def mark_replicated(self, window_start: int, step: int) -> None:
        """The replicator confirmed that SS_step reached all its peers."""
        record = self.windows.get(window_start)
        if record is not None:
            record.replicated.add(step)

    def refresh(self) -> int | None:
        """Promote the newest persisted window and free older ones; returns its start."""
        if self.replicas == 0:  # nothing to wait for: complete means persisted
            for record in self.windows.values():
                if record.complete:
                    record.replicated.update(record.snapshots)
        persisted = [start for start, record in self.windows.items() if record.persisted]
        if not persisted:
            return self.persisted_start
        newest = max(persisted)
        if newest != self.persisted_start:
            for start in [s for s in self.windows if s < newest]:
                for snapshot in self._pop(start).snapshots.values():
                    self._free(snapshot)
            # Logs are kept from the start of the previous persisted window on: a recovery
            # that finds the newest window unusable falls back to it (its snapshots survive
            # on the replica peers), and replaying from there needs those logs.
            keep_from = newest if self.persisted_start is None else self.persisted_start
            self.persisted_start = newest
            if keep_from != self._kept_from:
                self._kept_from = keep_from
                for listener in self.release_listeners:
                    listener(keep_from)
        return self.persisted_start

    def _free(self, snapshot: Snapshot) -> None:
        """Release a snapshot of a superseded window (subclasses may keep parts of it)."""
        self.pool.release(snapshot)

    def discard_all(self) -> None:
        """Drop every window (a failed worker's host memory, or windows a recovery
        superseded); their buffers go back to the pool."""
        for start in list(self.windows):
            for snapshot in self._pop(start).snapshots.values():
                self.pool.release(snapshot)
        self.persisted_start = None

    def discard_except(self, start: int) -> None:
        """Drop every window but the one starting at ``start`` (a single process keeps
        the window it recovers from; the in-flight one died with the failure)."""
        for other in [s for s in self.windows if s != start]:
            for snapshot in self._pop(other).snapshots.values():
                self.pool.release(snapshot)

    def persisted(self) -> WindowRecord | None:
        """The newest persisted window, if any."""
        return None if self.persisted_start is None else self.windows[self.persisted_start]

    def host_bytes(self) -> int:
        """Bytes of snapshot data currently held."""
        return self._held_bytes

    def own_bytes(self) -> int:
        """Bytes of snapshot data currently held in host buffers of the store's own (not
        placed in shared slots, whose bytes the slot ring counts)."""
        return self._held_bytes - self._placed_bytes
