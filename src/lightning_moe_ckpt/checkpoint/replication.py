"""Replication of each rank's snapshots to ``r`` peers, and verified fetch of a window.

Placement is deterministic and recorded: rank ``i`` replicates to the next ranks in ring
order, ranks on other nodes first (a node failure takes its local replicas with it), at
most ``world - 1`` peers. Transfers use point-to-point sends and receives on a dedicated
gloo process group (host tensors; never interleaved with training collectives) from a
background thread. Every rank takes snapshots at the same steps, so every rank's thread
processes the same sequence and sends match receives. A snapshot counts as replicated
once all its sends completed; the store persists a window when all its snapshots are.

A peer on the same node (``share_same_node``, tested with a probe at set-up) maps the
snapshot's shared-memory slot instead of receiving a copy (:mod:`.shared_slots`): it is
sent the slot's handle, and holds the source's bytes for as long as it keeps them, after
the source's death too. Each snapshot goes out as a handle to every peer first (the
payload's length, and for a mapping peer where to find it); then the copying peers receive
the bytes while a mapping peer that maps the slot for the first time acknowledges it. A
slot comes back every few windows, and a peer keeps the slots it acknowledged mapped
(:class:`~.shared_slots.MappedSlots`), so in steady state a snapshot of a rank whose peers
all map its memory takes one exchange of handles, and no second one.

Peers keep the serialized snapshots of each source rank in a
:class:`~.replica_store.ReplicaStore` (encoded piece by piece, see
:mod:`~lightning_moe_ckpt.checkpoint.codec`); :func:`decode_snapshot` restores one and
checks every piece's checksum, and :func:`verify_window` refuses a window with a
missing or corrupt piece, naming rank, operator and iteration.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_moe_ckpt.checkpoint.codec import (
    CorruptCheckpointError,
    decode_snapshot,
    encode_snapshot,
)
from lightning_moe_ckpt.checkpoint.pieces import Snapshot
from lightning_moe_ckpt.checkpoint.replica_store import ReplicaStore
from lightning_moe_ckpt.checkpoint.shared_slots import (
    MappedSlots,
    SharedSlot,
    SlotHandle,
    SlotMapper,
    SlotRing,
    mappable_sources,
    slot_key,
)
from lightning_moe_ckpt.checkpoint.slot_placement import SlotPlacement, encode_in_slot

__all__ = ["CorruptCheckpointError", "Replicator", "decode_snapshot",
           "encode_snapshot", "replica_peers", "verify_window"]


def replica_peers(rank: int, world_size: int, replicas: int, ranks_per_node: int) -> list[int]:
    """Peers that hold copies of ``rank``'s snapshots: other nodes first, ring order."""
    ring = [(rank + k) % world_size for k in range(1, world_size)]
    node = rank // ranks_per_node
    remote = [p for p in ring if p // ranks_per_node != node]
    local = [p for p in ring if p // ranks_per_node == node]
    return (remote + local)[:max(0, min(replicas, world_size - 1))]


def verify_window(snapshots: dict[int, dict[str, Any]], rank: int, window_start: int,
                  window: int, expected: Callable[[int], list[str]]) -> None:
    """Refuse a window with a missing snapshot or piece; ``expected(step)`` lists the
    operators whose pieces SS_step must hold."""
    for step in range(window_start, window_start + window):
        if step not in snapshots:
            raise CorruptCheckpointError(
                f"checkpoint of rank {rank}, iteration {step} (window starting at "
                f"{window_start}) is missing")
        for operator in expected(step):
            if operator not in snapshots[step]["pieces"]:
                raise CorruptCheckpointError(
                    f"checkpoint piece of rank {rank}, operator {operator!r}, iteration "
                    f"{step} is missing")


class Replicator:
    """Background replication of this rank's snapshots to its peers (and of theirs to it)."""

    def __init__(self, replicas: int, ranks_per_node: int,
                 on_replicated: Callable[[int, int], None],
                 replica_store: ReplicaStore | None = None,
                 share_same_node: bool = True) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.replica_count, self.ranks_per_node = replicas, ranks_per_node
        group = dist.new_group(backend="gloo")  # collective: every rank creates it
        # None once destroyed (after a transfer error, or once the thread stopped).
        self.group: dist.ProcessGroup | None = group
        self.peers = replica_peers(self.rank, self.world_size, replicas, ranks_per_node)
        self.sources = [s for s in range(self.world_size)
                        if self.rank in replica_peers(s, self.world_size, replicas,
                                                      ranks_per_node)]
        self.replicas = replica_store if replica_store is not None else ReplicaStore()
        node = self.rank // ranks_per_node
        same_node = ({s for s in self.sources if s // ranks_per_node == node}
                     if share_same_node else set())
        # Sources whose slots this rank maps, and peers that map this rank's slots.
        self.mapped_sources, self.mapping_peers = mappable_sources(group, self.sources,
                                                                   same_node)
        self.slots = SlotRing() if self.mapping_peers else None
        # Where snapshots may be copied straight into the slots (host copies, a store that
        # lets go of whole snapshots: the coordinator decides).
        self.placement = None if self.slots is None else SlotPlacement(self.slots)
        # Receive buffers of the small messages, reused: the sources' slot handles and the
        # mapping peers' acknowledgements (read before the next exchange overwrites them).
        self._handle_buffers = {s: torch.zeros(SlotHandle.FIELDS, dtype=torch.int64)
                                for s in self.sources}
        self._ack_buffers = {p: torch.zeros(1, dtype=torch.int64) for p in self.mapping_peers}
        # Which slots each mapping peer acknowledged, as this rank and that peer both track
        # it: the peers' of this rank's slots, and this rank's of each mapped source's.
        self._acknowledged_by = {p: MappedSlots() for p in self.mapping_peers}
        self._acknowledged_to = {s: MappedSlots() for s in self.mapped_sources}
        self.acknowledgements = 0  # received: the slots a mapping peer mapped afresh
        self.mapper = SlotMapper()
        self.on_replicated = on_replicated
        # Called in the replication thread with a snapshot's step once the sizes went out
        # and before its payload does: where a real fault "during replication" strikes.
        self.before_payload: Callable[[int], None] | None = None
        self.submitted = 0
        self.completed = 0
        self.thread_cpu_s = 0.0  # the thread's CPU time replicating (written by it only)
        # A transfer that failed (a peer died): the thread stops and drain() returns.
        self.error: BaseException | None = None
        # Set by a close() that gave up on the thread: the recovery's teardown of every
        # group destroys this one, and the thread must not destroy it at the same time.
        self._abandoned = False
        self._group_lock = threading.Lock()
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="snapshot-replication",
                                        daemon=True)
        self._thread.start()

    @property
    def lag(self) -> int:
        """Snapshots submitted and not yet replicated (each count has one writer)."""
        return self.submitted - self.completed

    def submit(self, snapshot: Snapshot) -> None:
        """Replicate ``snapshot`` once its copies are checksummed."""
        self.submitted += 1
        self._queue.put(snapshot)

    def close(self, timeout_s: float | None = None) -> bool:
        """Drain outstanding transfers and stop the thread; returns whether it stopped.

        Once the thread has stopped the group is destroyed, so a peer's thread blocked on
        this rank fails then instead of at its collective timeout. After ``timeout_s``
        it gives up: the thread (a daemon) is left stuck on its broken group, which stays
        for the recovery's teardown of every group to destroy, and every later call
        returns False at once. Idempotent."""
        if self._abandoned:
            return False
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        with self._group_lock:
            if self._thread.is_alive():
                self._abandoned = True
                return False
            self._destroy_group()
        return True

    def drain(self) -> None:
        """Wait until every submitted snapshot is replicated (the thread keeps running)."""
        self._queue.join()

    def fetch_window(self, source: int, window_start: int,
                     exclude: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
        """``source``'s window as held by its replica peers not in ``exclude``.

        Collective over the replication group: every rank calls it with the same arguments
        (after :meth:`drain`). The live holders are tried in placement order until one
        holds the whole window intact; every rank decodes the same bytes, so all of them
        see the same outcome. Returns the decoded snapshots by step, each piece's checksum
        verified; when no holder has it intact, raises :class:`CorruptCheckpointError`
        naming rank, operator and iteration for every holder.
        """
        holders = [p for p in replica_peers(source, self.world_size, self.replica_count,
                                            self.ranks_per_node) if p not in exclude]
        problems = []
        for holder in holders:
            try:
                return self._fetch_from(holder, source, window_start)
            except CorruptCheckpointError as error:
                problems.append(f"replica on rank {holder}: {error}")
        if not holders:
            problems.append("no live replica peer")
        raise CorruptCheckpointError(f"no intact copy of the checkpoint of rank {source} "
                                     f"(window starting at {window_start}): "
                                     + "; ".join(problems))

    def _fetch_from(self, holder: int, source: int,
                    window_start: int) -> dict[int, dict[str, Any]]:
        box: list[Any] = [self.replicas.window(source, window_start)
                          if self.rank == holder else None]
        dist.broadcast_object_list(box, src=holder, group=self.live_group())
        held: dict[int, torch.Tensor] = box[0]
        snapshots = {step: decode_snapshot(data) for step, data in sorted(held.items())}
        if not snapshots:
            raise CorruptCheckpointError(f"checkpoint of rank {source}, window starting at "
                                         f"{window_start} is missing")
        window = next(iter(snapshots.values()))["window"]
        verify_window(snapshots, source, window_start, window, expected=lambda step: [])
        return snapshots

    def held_window_starts(self) -> set[int]:
        """Window starts of which this rank holds a replica of some source."""
        return {start for held in self.replicas.windows.values() for start in held}

    def live_group(self) -> dist.ProcessGroup:
        """The replication group, for a collective over it; an error naming the cause once
        it was destroyed."""
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: the snapshot replication group was "
                               f"destroyed after a transfer failed ({self.error})")
        return self.group

    def _run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            started = time.thread_time()
            try:
                if self.error is None:  # else the group is broken: nothing is replicated
                    self._replicate(snapshot)
                elif snapshot.backing is not None:  # no peer will hold it
                    snapshot.backing.ring.sent(snapshot.backing.slot, to_peers=False)
            except (RuntimeError, dist.DistBackendError, OSError) as error:
                # OSError: a source died before this rank could map its slot. Kept without
                # its traceback, whose frames would keep the transfer, and so the group,
                # alive after close().
                self.error = error.with_traceback(None)
                # A partner's thread may be blocked on this rank in the same exchange (a
                # gloo send waits for its receive): destroyed now, the group fails it at
                # once. Left to the recovery, it would wait until this rank's training
                # learned of the failure, which can wait on that partner.
                with self._group_lock:
                    if not self._abandoned:
                        self._destroy_group()
            finally:
                self.thread_cpu_s += time.thread_time() - started
                self._queue.task_done()
        self._queue.task_done()

    def _destroy_group(self) -> None:
        """Destroy the replication group and drop this replicator's reference: a gloo
        group's connections close only when it is destroyed and nothing references it."""
        group, self.group = self.group, None
        if group is not None:
            dist.destroy_process_group(group)

    def _replicate(self, snapshot: Snapshot) -> None:
        """Send ``snapshot`` to the peers and receive the sources' of the same step."""
        snapshot.checksummed.wait()
        data, handle, slot = self._encode(snapshot)
        try:
            self._send(snapshot, data, handle)
        finally:  # also after a failed exchange: some peer may have mapped it
            if slot is not None and self.slots is not None:
                self.slots.sent(slot)

    def _send(self, snapshot: Snapshot, data: torch.Tensor, handle: SlotHandle) -> None:
        """Exchange ``snapshot`` (encoded as ``data``, found through ``handle``) with the
        peers, and the sources' of the same step."""
        group = self.live_group()
        handles = self._handle_buffers
        sent = handle.as_tensor()
        _exchange(group, [(handles[s], s) for s in self.sources], [(sent, p) for p in self.peers])
        announced = {s: SlotHandle.from_tensor(handles[s]) for s in self.sources}
        # Mapped before the acknowledgement goes back: from then on the source may let go
        # of the slot's file descriptor (its memory lives on in the mapping). A slot
        # acknowledged before is mapped already (kept so below): nothing goes back.
        mapped = {s: self.mapper.view(announced[s]) for s in self.mapped_sources}
        acknowledging = [s for s in self.mapped_sources
                         if self._acknowledged_to[s].needs_acknowledgement(announced[s])]
        acknowledged = [p for p in self.mapping_peers
                        if self._acknowledged_by[p].needs_acknowledgement(handle)]
        if self.before_payload is not None:
            self.before_payload(snapshot.step)
        received = {s: self.replicas.buffer(announced[s].length) for s in self.sources
                    if s not in self.mapped_sources}
        _exchange(group,
                  [*((buffer, s) for s, buffer in received.items()),
                   *((self._ack_buffers[p], p) for p in acknowledged)],
                  [*((_MAPPED, s) for s in acknowledging),
                   *((data, p) for p in self.peers if p not in self.mapping_peers)])
        for source in acknowledging:
            self._acknowledged_to[source].acknowledged(announced[source])
        for peer in acknowledged:
            self._acknowledged_by[peer].acknowledged(handle)
        self.acknowledgements += len(acknowledged)
        start = snapshot.plan.window_start
        for source, payload in received.items():
            self.replicas.put(source, start, snapshot.step, payload)
        for source, view in mapped.items():
            self.replicas.put(source, start, snapshot.step, view,
                              slot=slot_key(announced[source]))
        if mapped:
            self.mapper.keep_only(self.replicas.mapped_slots().union(
                *(known.keys() for known in self._acknowledged_to.values())))
        self.completed += 1
        self.on_replicated(start, snapshot.step)

    def _encode(self, snapshot: Snapshot
                ) -> tuple[torch.Tensor, SlotHandle, SharedSlot | None]:
        """The encoded snapshot, in a shared slot when some peer maps this rank's: framed
        in the slot its pieces were placed in, or else copied into one."""
        if self.slots is None:
            data = encode_snapshot(snapshot)
            return data, SlotHandle(data.numel(), 0, 0, 0, 0, 0), None
        assert self.placement is not None  # it comes with the slots
        data, slot = encode_in_slot(snapshot, self.placement)
        return data, slot.handle(data.numel(), self.slots.generation), slot

    def abandon_slots(self) -> None:
        """Encode the next snapshots into new slots: peers may still need the bytes in the
        current ones (a recovery superseded them, or took this rank's memory)."""
        if self.slots is not None:
            self.slots.abandon()

    def slot_bytes(self) -> int:
        """Shared memory this rank's encoded snapshots occupy now."""
        return 0 if self.slots is None else self.slots.nbytes()

    def slot_bytes_peak(self) -> int:
        """Most shared memory this rank's snapshots occupied at once (for the peers that
        map them)."""
        return 0 if self.slots is None else self.slots.peak_bytes


_MAPPED = torch.ones(1, dtype=torch.int64)  # a peer's acknowledgement: it maps the slot


def _exchange(group: dist.ProcessGroup, receives: list[tuple[torch.Tensor, int]],
              sends: list[tuple[torch.Tensor, int]]) -> None:
    """Post every receive, then every send, of one exchange on ``group`` and wait for all.

    The group's own point-to-point calls rather than ``dist.batch_isend_irecv``: gloo does
    not coalesce anyway, and the wrapper's per-op checks and coalescing context cost about
    a third of the CPU time of these small messages (a two-rank gloo ping-pong here: 120
    against 80 us per round trip). The replication group spans every rank in order
    (``new_group()`` without ranks), so its ranks are the global ones.
    """
    works = [group.recv([tensor], source, 0) for tensor, source in receives]
    works += [group.send([tensor], peer, 0) for tensor, peer in sends]
    for work in works:
        work.wait()
