"""Keep each operator's newest save for the partial-expert baselines (MoC, MoEtion).

A partial restore brings every operator back from its newest persisted save: non-experts
from the newest snapshot, each expert from the last snapshot that captured it. MoC's
windows are rounds that cover every expert, but MoEtion plans windows of one snapshot and
an unpopular expert may go unsaved for many iterations, long after the two windows the
store and the replica peers keep were freed. These stores keep, in addition, the newest
master piece of every operator that no kept window holds any more:

* :class:`RetainingSnapshotStore` (a rank's own host store): when a superseded window is
  freed, its master pieces that are newer than the operator's retained save are kept (as
  one-piece snapshots, so their buffers go back to the pool like any snapshot's); a
  retained save is released as soon as a persisted window holds a save of that operator
  at least as new;
* :class:`RetainingReplicaStore` (what a peer holds for its sources): when a source's
  window is dropped, the pieces it needs are cut out of the serialized snapshots byte for
  byte (:func:`~lightning_moe_ckpt.snapshots.codec.split_pieces`, guided by the
  snapshot header, no tensor deserialised); a retained save is released as soon as a held
  snapshot saves that operator at least as recently.

Memory stays bounded: at most one retained piece per operator beyond the two windows
(invariant 5 with a one-dense-state margin). Only the partial policies use these stores;
the others keep the plain two-window stores.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_moe_ckpt.replication.replica_store import ReplicaStore
from lightning_moe_ckpt.snapshots.codec import snapshot_header, split_pieces
from lightning_moe_ckpt.snapshots.snapshot import HostBufferPool, Snapshot
from lightning_moe_ckpt.snapshots.store import SnapshotStore


class RetainingSnapshotStore(SnapshotStore):
    """Two windows plus, per operator, its newest master save from freed windows."""

    keeps_released_pieces = True

    def __init__(self, pool: HostBufferPool, replicas: int) -> None:
        super().__init__(pool, replicas)
        self.saves: dict[str, Snapshot] = {}  # operator -> one-piece snapshot of its save

    @override
    def _free(self, snapshot: Snapshot) -> None:
        for name, piece in list(snapshot.pieces.items()):
            kept = self.saves.get(name)
            if piece.kind != "master" or (kept is not None and kept.step >= snapshot.step):
                continue
            if kept is not None:
                self.pool.release(kept)
            del snapshot.pieces[name]
            self.saves[name] = Snapshot(snapshot.step, snapshot.rank, snapshot.plan,
                                        {name: piece}, {})
        self.pool.release(snapshot)

    @override
    def refresh(self) -> int | None:
        previous = self.persisted_start
        start = super().refresh()
        if start != previous and self.saves:
            newest = self.newest_persisted_saves()
            for name in [n for n, kept in self.saves.items()
                         if newest.get(n, kept.step - 1) >= kept.step]:
                self.pool.release(self.saves.pop(name))
        return start

    def newest_persisted_saves(self) -> dict[str, int]:
        """Per operator, the newest step a persisted window holds its master state of."""
        newest: dict[str, int] = {}
        for record in self.windows.values():
            if not record.persisted:
                continue
            for step, snapshot in record.snapshots.items():
                for name, piece in snapshot.pieces.items():
                    if piece.kind == "master" and newest.get(name, step - 1) < step:
                        newest[name] = step
        return newest

    def clear_saves(self) -> None:
        """Release every retained save (they are superseded, or the host memory is gone)."""
        for kept in self.saves.values():
            self.pool.release(kept)
        self.saves.clear()

    @override
    def host_bytes(self) -> int:
        return super().host_bytes() + sum(kept.nbytes for kept in self.saves.values())


@dataclass
class RetainingReplicaStore(ReplicaStore):
    """Two windows per source plus, per source and operator, its newest dropped save."""

    # source -> operator -> (step, one-piece encoded snapshot)
    saves: dict[int, dict[str, tuple[int, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(dict))
    # source -> (window start, step) -> operators whose master state that snapshot holds
    masters: dict[int, dict[tuple[int, int], tuple[str, ...]]] = field(
        default_factory=lambda: defaultdict(dict))

    @override
    def put(self, source: int, window_start: int, step: int, data: torch.Tensor,
            slot: tuple[int, int, int] | None = None) -> None:
        held = self.windows[source]
        before = {(start, s): d for start, steps in held.items() for s, d in steps.items()}
        super().put(source, window_start, step, data, slot)
        kept = {(start, s) for start, steps in held.items() for s in steps}
        masters = self.masters[source]
        masters[(window_start, step)] = tuple(
            name for name, entry in snapshot_header(data)["pieces"].items()
            if entry["kind"] == "master")
        dropped = {key: masters.get(key, ()) for key in before if key not in kept}
        for key in [k for k in masters if k not in kept]:
            del masters[key]
        newest: dict[str, int] = {}  # operator -> newest held save
        for (_, held_step), names in masters.items():
            for name in names:
                newest[name] = max(newest.get(name, held_step), held_step)
        saves = self.saves[source]
        for key in sorted(dropped, key=lambda k: -k[1]):  # newest dropped first
            dropped_step = key[1]
            wanted = [name for name in dropped[key]
                      if newest.get(name, dropped_step - 1) < dropped_step
                      and saves.get(name, (dropped_step - 1,))[0] < dropped_step]
            if wanted:
                for name, piece in split_pieces(before[key], wanted).items():
                    saves[name] = (dropped_step, piece)
        for name in [n for n, (s, _) in saves.items() if newest.get(n, s - 1) >= s]:
            del saves[name]

    def held_saves(self, source: int) -> dict[str, tuple[int, torch.Tensor]]:
        """The retained saves of ``source``: operator -> (step, one-piece snapshot)."""
        return dict(self.saves.get(source, {}))

    @override
    def clear(self) -> None:
        """Drop everything held (windows and retained saves) for every source."""
        super().clear()
        self.saves.clear()
        self.masters.clear()

    @override
    def nbytes(self) -> int:
        return super().nbytes() + sum(data.numel() for saves in self.saves.values()
                                      for _, data in saves.values())


@dataclass(frozen=True)
class RetainedSaves:
    """What a partial restore reads on one rank: its own store with each operator's
    newest save, the copies it holds for its sources (None without replicas), the replica
    peers of a source rank in placement order, and the group that carries the copies."""

    store: RetainingSnapshotStore
    replicas: RetainingReplicaStore | None
    holders: Callable[[int], list[int]]
    group: Callable[[], dist.ProcessGroup]
