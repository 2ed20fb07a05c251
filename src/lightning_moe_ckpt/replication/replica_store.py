"""What a rank holds of its source ranks' snapshots: two windows each, encoded.

A replica peer keeps each source's serialized snapshots (:mod:`.codec`) of the two newest
windows, received as bytes or held as a mapping of the source's shared memory
(:mod:`.shared_slots`). The replication thread fills it (:mod:`.replication`); a recovery
reads the window it needs from it. Payloads of dropped windows are kept as receive buffers
for the next ones, so steady-state replication allocates no host memory.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["ReplicaStore"]


_SPARE_BUFFERS = 4  # receive buffers kept per payload size for reuse


@dataclass
class ReplicaStore:
    """Serialized snapshots this rank holds for its source ranks, two windows each.

    Payloads of dropped windows become receive buffers for the next ones (by size): a
    snapshot of the same plan shape has the same size, so steady-state replication
    allocates, and faults in, no new host memory."""

    windows: dict[int, dict[int, dict[int, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(dict))  # source -> window start -> step -> bytes
    spare: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    # Snapshots held as a mapping of the source's shared memory, by (source, start, step):
    # the slot they lie in. Never written to, never reused as a receive buffer.
    mapped: dict[tuple[int, int, int], tuple[int, int, int]] = field(default_factory=dict)

    def put(self, source: int, window_start: int, step: int, data: torch.Tensor,
            slot: tuple[int, int, int] | None = None) -> None:
        """Keep a received snapshot (``slot``: a mapping of the source's slot, not a copy);
        drop that source's windows older than the previous."""
        held = self.windows[source]
        held.setdefault(window_start, {})[step] = data
        if slot is not None:
            self.mapped[(source, window_start, step)] = slot
        else:
            self.mapped.pop((source, window_start, step), None)
        starts = sorted(held)
        for start in starts[:-2]:
            for dropped_step, payload in held.pop(start).items():
                if self.mapped.pop((source, start, dropped_step), None) is not None:
                    continue
                spare = self.spare[payload.numel()]
                if len(spare) < _SPARE_BUFFERS:
                    spare.append(payload)

    def mapped_slots(self) -> set[tuple[int, int, int]]:
        """The source slots the held snapshots lie in."""
        return set(self.mapped.values())

    def clear(self) -> None:
        """Drop everything held for every source (a dead worker's host memory)."""
        self.windows.clear()
        self.spare.clear()
        self.mapped.clear()

    def buffer(self, size: int) -> torch.Tensor:
        """A host buffer of ``size`` bytes to receive a payload into."""
        spare = self.spare.get(size)
        return spare.pop() if spare else torch.empty(size, dtype=torch.uint8)

    def window(self, source: int, window_start: int) -> dict[int, torch.Tensor]:
        """The serialized snapshots of one window of ``source`` (empty when not held)."""
        return dict(self.windows.get(source, {}).get(window_start, {}))

    def nbytes(self) -> int:
        """Bytes this rank holds for all sources, spare receive buffers included (mapped
        snapshots are the sources' memory: :meth:`mapped_nbytes`)."""
        return (sum(t.numel() for source, held in self.windows.items()
                    for start, steps in held.items() for step, t in steps.items()
                    if (source, start, step) not in self.mapped)
                + sum(t.numel() for spare in self.spare.values() for t in spare))

    def mapped_nbytes(self) -> int:
        """Bytes of snapshots held as mappings of the sources' shared memory."""
        return sum(self.windows[source][start][step].numel()
                   for source, start, step in self.mapped)
