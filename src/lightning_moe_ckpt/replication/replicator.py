"""Replication of each rank's snapshots to ``r`` peers, and verified fetch of a window.

Placement is deterministic and recorded: rank ``i`` replicates to the next ranks in ring
order, ranks on other nodes first (a node failure takes its local replicas with it), at
most ``world - 1`` peers. Transfers use point-to-point sends and receives on a dedicated
gloo process group (host tensors; never interleaved with training collectives) from a
background thread. Every rank takes snapshots at the same steps, so every rank's thread
processes the same sequence and sends match receives. A snapshot counts as replicated
once all its sends completed; the store persists a window when all its snapshots are.

A peer on the same node (``share_same_node``, tested with a probe at set-up) maps the
snapshot's shared-memory slot instead of receiving a copy (:mod:`.shared_slots`), and is
told of it without a message (:mod:`.announcements`): the source writes the slot's handle
into its announcement page, which the peer mapped at set-up, and goes on; the peer files
what its sources announced whenever its own replication thread runs. A snapshot in a slot
every mapping peer already maps (and keeps mapped, :class:`~.shared_slots.MappedSlots`)
counts replicated once announced: the peer holds the slot and the page, so it can file
the snapshot even after the source died. One in a new slot (the first windows, a new plan
size) counts once every mapping peer filed it, and so mapped the slot: the thread waits
for that, filing its own sources' announcements meanwhile (two ranks may wait on each
other's), as it would wait for an exchange. Either way it counts only once this rank
also filed its mapped sources' snapshots of the same step (until then it is counted
later, without waiting): the lock-step exchange tied the two directions together the same
way, and a window must not persist on a rank (which then frees its older one) while a
partner that died before announcing that step's snapshot left its window incomplete here.
Only copying partners exchange messages, over gloo as above; a rank whose partners all map
its memory sends none. When the thread is asked to drain (a recovery, the end of a run) it waits
until it filed as many snapshots of each mapped source as it took itself, and its own
new slots are filed, so every rank holds then what the lock-step exchange would have
given it. A partner that stopped (an error, or it closed) or died ends replication here
as a failed exchange does.

Peers keep the serialized snapshots of each source rank in a
:class:`~.replica_store.ReplicaStore` (encoded piece by piece, see
:mod:`~lightning_moe_ckpt.snapshots.codec`); :func:`decode_snapshot` restores one and
checks every piece's checksum, and :func:`verify_window` refuses a window with a
missing or corrupt piece, naming rank, operator and iteration.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_moe_ckpt.core.progress import RECOVERY
from lightning_moe_ckpt.replication.announcements import (
    RECORDS,
    Announcement,
    AnnouncementPage,
    Liveness,
    PartnerState,
    page_bytes,
)
from lightning_moe_ckpt.replication.replica_store import ReplicaStore
from lightning_moe_ckpt.replication.shared_slots import (
    MappedSlots,
    SharedSlot,
    SlotHandle,
    SlotMapper,
    SlotRing,
    mappable_sources,
    slot_key,
)
from lightning_moe_ckpt.replication.slot_placement import SlotBacking, SlotPlacement, encode_in_slot
from lightning_moe_ckpt.snapshots.codec import (
    CorruptCheckpointError,
    decode_snapshot,
    encode_snapshot,
)
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, HelperThread
from lightning_moe_ckpt.snapshots.snapshot import Snapshot, wait_checksummed

__all__ = ["CorruptCheckpointError", "Replicator", "decode_snapshot",
           "encode_snapshot", "replica_peers", "verify_window"]


def replica_peers(rank: int, world_size: int, replicas: int, ranks_per_node: int,
                  shard_group: Callable[[int], int] | None = None) -> list[int]:
    """Peers that hold copies of ``rank``'s snapshots: other nodes first, ring order.

    Args:
        rank: The rank whose snapshots are copied.
        world_size: Ranks in the job.
        replicas: Copies wanted (capped by ``world_size - 1``).
        ranks_per_node: Ranks each node runs (node ``n``: ranks ``n*R`` to ``n*R+R-1``).
        shard_group: The shard group of a rank (sharded data parallelism); on either side
            of the node rule, peers outside ``rank``'s own shard group come first.
            ``None``: no shard groups.

    Returns:
        The peers, in the order they are asked for a window.
    """
    ring = [(rank + k) % world_size for k in range(1, world_size)]
    node = rank // ranks_per_node

    def other_fate(peer: int) -> bool:
        return shard_group is None or shard_group(peer) != shard_group(rank)

    order = sorted(ring, key=lambda p: (p // ranks_per_node == node, not other_fate(p)))
    return order[:max(0, min(replicas, world_size - 1))]


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
                 share_same_node: bool = True,
                 helper_nice: int = DEFAULT_HELPER_NICE,
                 shard_group: Callable[[int], int] | None = None,
                 largest_snapshot: int | None = None) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.replica_count, self.ranks_per_node = replicas, ranks_per_node
        self.shard_group = shard_group  # peers outside a rank's shard group come first
        self.last_holder: int | None = None  # the replica peer the last fetch came from
        group = dist.new_group(backend="gloo")  # collective: every rank creates it
        # None once destroyed (after a transfer error, or once the thread stopped).
        self.group: dist.ProcessGroup | None = group
        # Every rank's largest encoded snapshot (-1: not bounded), the same on every rank:
        # an announced length beyond its source's is refused before anything is allocated.
        self.largest = _gather_largest(group, largest_snapshot)
        self.peers = self.holders(self.rank)
        self.sources = [s for s in range(self.world_size) if self.rank in self.holders(s)]
        self.replicas = replica_store if replica_store is not None else ReplicaStore()
        node = self.rank // ranks_per_node
        same_node = ({s for s in self.sources if s // ranks_per_node == node}
                     if share_same_node else set())
        partners = mappable_sources(group, self.sources, same_node, page_bytes(self.world_size))
        # Sources whose slots this rank maps, and peers that map this rank's slots.
        self.mapped_sources, self.mapping_peers = partners.mapped, partners.mapping
        # This rank's announcement page, which its mapping peers mapped, and its mapped
        # sources' pages, with how many announcements of each it filed.
        self._page = (None if partners.page is None
                      else AnnouncementPage(partners.page.memory, self.world_size))
        self._source_pages = {s: AnnouncementPage(memory, self.world_size)
                              for s, memory in sorted(partners.source_pages.items())}
        self._filed = dict.fromkeys(self._source_pages, 0)
        self._liveness = {r: Liveness(pid) for r, pid in partners.pids.items()}
        self._announced = 0
        self._processed = 0  # snapshots this thread handled: each source announces as many
        # Sent and announced, counted replicated once this rank filed its mapped sources'
        # snapshots of the same sequence number: (sequence number, window start, step).
        self._unconfirmed: deque[tuple[int, int, int]] = deque()
        # Drained, and nothing taken since: a source waits for nothing this rank files.
        self._quiet = False
        self.slots = SlotRing(self._slowest_filed_epoch) if self.mapping_peers else None
        # Where snapshots may be copied straight into the slots (host copies, a store that
        # lets go of whole snapshots: the coordinator decides).
        self.placement = None if self.slots is None else SlotPlacement(self.slots)
        # Partners that copy: they exchange the payload's length, then the payload.
        self._copy_sources = [s for s in self.sources if s not in self.mapped_sources]
        self._copy_peers = [p for p in self.peers if p not in self.mapping_peers]
        self._length_buffers = {s: torch.zeros(1, dtype=torch.int64)
                                for s in self._copy_sources}
        self._length = torch.zeros(1, dtype=torch.int64)
        # Which slots each mapping peer acknowledged (filed), as this rank and that peer
        # both track it: the peers' of this rank's slots, and this rank's of each source's.
        self._acknowledged_by = {p: MappedSlots() for p in self.mapping_peers}
        self._acknowledged_to = {s: MappedSlots() for s in self.mapped_sources}
        self.acknowledgements = 0  # the slots a mapping peer mapped afresh
        self.exchanges = 0  # gloo exchanges with copying partners (two per snapshot)
        self.mapper = SlotMapper()
        self.on_replicated = on_replicated
        # Called in the replication thread with a snapshot's step once its size went out
        # to the copying peers and before its payload (or announcement) does: where a real
        # fault "during replication" strikes.
        self.before_payload: Callable[[int], None] | None = None
        self.submitted = 0
        self.completed = 0
        # The thread's CPU time replicating and filing (written by it only).
        self.thread_cpu_s = 0.0
        # A transfer that failed (a peer died): the thread stops and drain() returns.
        self.error: BaseException | None = None
        # Set by a close() that gave up on the thread: the recovery's teardown of every
        # group destroys this one, and the thread must not destroy it at the same time.
        # Nor may it file, receive or count anything from then on: the replicas it holds
        # went to the next replicator, whose thread fills them now.
        self._abandoned = False
        self._group_lock = threading.Lock()
        self._queue: queue.Queue[Snapshot | _Drain | None] = queue.Queue()
        self._newest_submitted: Snapshot | None = None
        self._thread = HelperThread(self._run, "snapshot-replication", helper_nice)
        self._thread.start()

    @property
    def lag(self) -> int:
        """Snapshots submitted and not yet replicated (each count has one writer)."""
        return self.submitted - self.completed

    def submit(self, snapshot: Snapshot) -> None:
        """Replicate ``snapshot`` once its copies are checksummed (it is queued then, by
        the thread that checksums it: :meth:`~.snapshot.Snapshot.when_checksummed`)."""
        self.submitted += 1
        self._quiet = False
        self._newest_submitted = snapshot
        snapshot.when_checksummed(self._queue.put)

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
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            wait_checksummed(self._newest_submitted, timeout_s)  # all queued
            self._queue.put(None)
            self._thread.join(None if deadline is None
                              else max(0.0, deadline - time.monotonic()))
        with self._group_lock:
            if self._thread.is_alive():
                self._abandoned = True
                return False
            self._destroy_group()
        for liveness in self._liveness.values():
            liveness.close()
        return True

    def drain(self) -> None:
        """Wait until every submitted snapshot is replicated, and this rank filed as many
        snapshots of each source as it took (the thread keeps running)."""
        wait_checksummed(self._newest_submitted)  # every submitted one queued
        self._queue.put(_DRAIN)
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
        holders = [p for p in self.holders(source) if p not in exclude]
        problems = []
        for holder in holders:
            try:
                fetched = self._fetch_from(holder, source, window_start)
            except CorruptCheckpointError as error:
                problems.append(f"replica on rank {holder}: {error}")
                continue
            finally:
                RECOVERY.mark()
            self.last_holder = holder
            return fetched
        if not holders:
            problems.append("no live replica peer")
        raise CorruptCheckpointError(f"no intact copy of the checkpoint of rank {source} "
                                     f"(window starting at {window_start}): "
                                     + "; ".join(problems))

    def _fetch_from(self, holder: int, source: int,
                    window_start: int) -> dict[int, dict[str, Any]]:
        held = self._broadcast_window(holder, source, window_start)
        snapshots = {step: decode_snapshot(data) for step, data in sorted(held.items())}
        if not snapshots:
            raise CorruptCheckpointError(f"checkpoint of rank {source}, window starting at "
                                         f"{window_start} is missing")
        window = next(iter(snapshots.values()))["window"]
        verify_window(snapshots, source, window_start, window, expected=lambda step: [])
        return snapshots

    def _broadcast_window(self, holder: int, source: int,
                          window_start: int) -> dict[int, torch.Tensor]:
        """``holder``'s encoded snapshots of ``source``'s window, on every rank: as plain
        tensors (how many, each one's step and length, then the bytes), never pickled."""
        group = self.live_group()
        held = self.replicas.window(source, window_start) if self.rank == holder else {}
        count = torch.tensor([len(held)], dtype=torch.int64)
        dist.broadcast(count, src=holder, group=group)
        if not int(count):
            return {}
        if not 0 < int(count) <= _MAX_WINDOW_SNAPSHOTS:
            raise CorruptCheckpointError(f"replica holder {holder} announced {int(count)} "
                                         f"snapshots of rank {source}'s window starting at "
                                         f"{window_start}; refused unread")
        index = torch.tensor([[step, data.numel()] for step, data in sorted(held.items())]
                             if held else [[0, 0]] * int(count), dtype=torch.int64)
        dist.broadcast(index, src=holder, group=group)
        steps, lengths = index[:, 0].tolist(), index[:, 1].tolist()
        for length in lengths:  # the same decision on every rank: the same index
            self.check_length(source, length, f"replica holder {holder}")
        payload = (torch.cat([held[step].reshape(-1) for step in steps]) if held
                   else torch.empty(sum(lengths), dtype=torch.uint8))
        dist.broadcast(payload, src=holder, group=group)
        return dict(zip(steps, payload.split(lengths), strict=True))

    def check_length(self, source: int, length: int, announcer: str) -> None:
        """Refuse an encoded snapshot of ``source`` announced (by ``announcer``) at
        ``length`` bytes when no snapshot of that rank can be so long, before a buffer for
        it is allocated."""
        largest = self.largest[source]
        if length < 0 or (largest >= 0 and length > largest):
            raise CorruptCheckpointError(
                f"{announcer} announced a snapshot of rank {source} of {length} bytes; rank "
                f"{source}'s snapshots take at most {largest} bytes: refused before "
                "allocating it")

    def held_window_starts(self) -> set[int]:
        """Window starts of which this rank holds a replica of some source."""
        return {start for held in self.replicas.windows.values() for start in held}

    def holders(self, source: int) -> list[int]:
        """The replica peers of ``source``'s snapshots (:func:`replica_peers`)."""
        return replica_peers(source, self.world_size, self.replica_count, self.ranks_per_node,
                             self.shard_group)

    def live_group(self) -> dist.ProcessGroup:
        """The replication group, for a collective over it; an error naming the cause once
        it was destroyed."""
        if self.group is None:
            raise RuntimeError(f"rank {self.rank}: the snapshot replication group was "
                               f"destroyed after a transfer failed ({self.error})")
        return self.group

    def _run(self) -> None:
        while True:
            try:  # idle, it files now and then (see _idle_timeout)
                item = self._queue.get(timeout=self._idle_timeout())
            except queue.Empty:
                self._file_idle()
                continue
            if item is None:
                break
            started = time.thread_time()
            try:
                if isinstance(item, _Drain):
                    if self.error is None:
                        self._guarded(self._settle)
                elif self.error is None:  # else the group is broken: nothing is replicated
                    self._guarded(self._replicate, item)
                elif item.backing is not None:  # no peer will hold it
                    backing = cast(SlotBacking, item.backing)  # placed by self.placement
                    backing.ring.sent(backing.slot, to_peers=False)
            finally:
                self.thread_cpu_s += time.thread_time() - started
                self._queue.task_done()
        if self.error is None and self._guarded(self._settle):
            self._stop(PartnerState.CLOSED)
        self._queue.task_done()

    def _file_idle(self) -> None:
        """File the sources' announcements between snapshots, its CPU time counted with
        the rest of the thread's: it is the snapshots' work too (a confirmation polled
        for every 2 ms, about once or twice an iteration under pp2 x ep2)."""
        started = time.thread_time()
        self._guarded(self._file_sources)
        self.thread_cpu_s += time.thread_time() - started

    def _idle_timeout(self) -> float | None:
        """How long the idle thread waits for work before it files its sources: briefly
        while a sent snapshot waits for a source's of the same step (it counts as soon as
        the source announced that, as it would have once an exchange completed), now and
        then while a source may wait on a new slot, not at all once drained."""
        if not self._source_pages or self._quiet or self.error is not None:
            return None
        return _CONFIRM_POLL_S if self._unconfirmed else _IDLE_FILING_S

    def _guarded(self, work: Callable[..., None], *args: Any) -> bool:
        """Run ``work``; on a failed transfer or partner, stop replicating. Returns whether
        it succeeded."""
        try:
            work(*args)
        except (RuntimeError, dist.DistBackendError, OSError) as error:
            # OSError: a source died before this rank could map its slot. Kept without
            # its traceback, whose frames would keep the transfer, and so the group,
            # alive after close().
            self.error = error.with_traceback(None)
            self._stop(PartnerState.FAILED)
            # A partner's thread may be blocked on this rank in the same exchange (a
            # gloo send waits for its receive): destroyed now, the group fails it at
            # once. Left to the recovery, it would wait until this rank's training
            # learned of the failure, which can wait on that partner.
            with self._group_lock:
                if not self._abandoned:
                    self._destroy_group()
            return False
        return True

    def _stop(self, state: PartnerState) -> None:
        """Tell the same-node partners this rank stopped, then file what its sources
        announced: one that announced before it saw the state may count on that."""
        if self._page is not None:
            self._page.set_state(state)
        for page in self._source_pages.values():
            page.set_peer_state(self.rank, state)
        # OSError: a source died before its new slot was mapped here (not replicated).
        with contextlib.suppress(OSError):
            self._file_sources()

    def _destroy_group(self) -> None:
        """Destroy the replication group and drop this replicator's reference: a gloo
        group's connections close only when it is destroyed and nothing references it."""
        group, self.group = self.group, None
        if group is not None:
            dist.destroy_process_group(group)

    def _replicate(self, snapshot: Snapshot) -> None:
        """Send ``snapshot`` (queued once checksummed) to the peers and receive the
        sources' of the same step."""
        self._processed += 1
        self._quiet = False  # (submit() said so too, but a drain may have come between)
        data, handle, slot = self._encode(snapshot)
        try:
            self._send(snapshot, data, handle)
        finally:  # also after a failed exchange: some peer may have mapped it
            if slot is not None and self.slots is not None:
                self.slots.sent(slot)

    def _send(self, snapshot: Snapshot, data: torch.Tensor, handle: SlotHandle) -> None:
        """Announce ``snapshot`` (encoded as ``data``, found through ``handle``) to the
        mapping peers, exchange it with the copying ones, and file the sources' of the
        same step."""
        start = snapshot.plan.window_start
        copying = bool(self._copy_sources or self._copy_peers)
        if copying:
            group = self.live_group()
            self._length[0] = data.numel()
            lengths = self._length_buffers
            _exchange(group, [(lengths[s], s) for s in self._copy_sources],
                      [(self._length, p) for p in self._copy_peers])
            self.exchanges += 1
        if self.before_payload is not None:
            self.before_payload(snapshot.step)
        # The announcement is a mapping peer's payload: it goes out here.
        waiting = self._announce(handle, start, snapshot.step) if self._page is not None else ()
        self._file_sources()
        if copying:
            for source in self._copy_sources:
                self.check_length(source, int(lengths[source][0]), f"rank {source}")
            received = {s: self.replicas.buffer(int(lengths[s][0])) for s in self._copy_sources}
            _exchange(group, [(buffer, s) for s, buffer in received.items()],
                      [(data, p) for p in self._copy_peers])
            self.exchanges += 1
            if self._abandoned:
                return
            for source, payload in received.items():
                self.replicas.put(source, start, snapshot.step, payload)
        if waiting:  # peers that do not map the slot yet: replicated once they filed it
            seq = self._announced
            self._wait(lambda: all(self._filed_by(peer, seq, check_alive=True)
                                   for peer in waiting),
                       "waited for a replica peer to map a new slot")
            self.acknowledgements += len(waiting)
        self._unconfirmed.append((self._processed, start, snapshot.step))
        self._confirm()

    def _confirm(self) -> None:
        """Count replicated, in order, the sent snapshots whose step this rank also filed
        every mapped source's snapshot of (copying sources came with the exchange)."""
        while not self._abandoned and self._unconfirmed and all(
                filed >= self._unconfirmed[0][0] for filed in self._filed.values()):
            _, start, step = self._unconfirmed.popleft()
            self.completed += 1
            self.on_replicated(start, step)

    def _announce(self, handle: SlotHandle, window_start: int, step: int) -> tuple[int, ...]:
        """Write ``handle`` into this rank's page; returns the mapping peers that must
        file it before it counts replicated (those that do not map its slot yet)."""
        assert self._page is not None and self.slots is not None  # they come together
        page, epoch = self._page, self.slots.epoch
        seq = self._announced + 1
        self._wait(lambda: all(not self._lags(peer, seq, epoch) for peer in self.mapping_peers),
                   "waited for a replica peer to file its snapshots")
        page.announce(Announcement(seq, handle, window_start, step, epoch))
        self._announced = seq
        waiting = []
        for peer in sorted(self.mapping_peers):
            if self._acknowledged_by[peer].needs_acknowledgement(handle):
                # Counted now: the snapshot counts replicated only once the peer filed it,
                # and from then on the peer keeps the slot mapped.
                self._acknowledged_by[peer].acknowledged(handle)
                waiting.append(peer)
            else:  # read after the announcement: a peer that stops files first
                self._filed_by(peer, seq)
        return tuple(waiting)

    def _lags(self, peer: int, seq: int, epoch: int) -> bool:
        """Whether ``peer`` filed too little for announcement ``seq`` of ``epoch`` to go
        out: its record in the ring is not free, or slots the source would reuse are
        held back. Raises if the peer can no longer catch up."""
        assert self._page is not None
        filed, filed_epoch = self._page.filed(peer)
        if seq - filed < RECORDS and filed_epoch >= epoch - _LAG_EPOCHS:
            return False
        return not self._filed_by(peer, seq - 1, check_alive=True)  # raises if it never will

    def _filed_by(self, peer: int, seq: int, check_alive: bool = False) -> bool:
        """Whether ``peer`` filed announcement ``seq``; raises if it has not and never will
        (it stopped, or, where ``check_alive``, died)."""
        assert self._page is not None
        if self._page.filed(peer)[0] >= seq:
            return True
        state = self._page.peer_state(peer)
        if state is not PartnerState.RUNNING:
            raise RuntimeError(f"rank {self.rank}: replica peer {peer} stopped replicating "
                               f"({state.name.lower()})")
        if check_alive and not self._liveness[peer].alive():
            raise RuntimeError(f"rank {self.rank}: replica peer {peer} died")
        return False

    def _file_sources(self) -> None:
        """File what the mapped sources announced so far (nothing once abandoned)."""
        if self._abandoned:
            return
        filed = False
        for source, page in self._source_pages.items():
            filed |= self._file(source, page)
        if filed:
            self.mapper.keep_only(self.replicas.mapped_slots().union(
                *(known.keys() for known in self._acknowledged_to.values())))
            if self.error is None:  # after a failure nothing more counts replicated
                self._confirm()

    def _file(self, source: int, page: AnnouncementPage) -> bool:
        """File ``source``'s announcements after those filed before; returns whether there
        were any. The cell is written once they are filed (and their slots mapped)."""
        seq = self._filed[source]
        newest: Announcement | None = None
        while (announced := page.read(seq + 1)) is not None:
            view = self.mapper.view(announced.handle)  # OSError: the source died first
            known = self._acknowledged_to[source]
            if known.needs_acknowledgement(announced.handle):
                known.acknowledged(announced.handle)
            self.replicas.put(source, announced.window_start, announced.step, view,
                              slot=slot_key(announced.handle))
            seq, newest = announced.seq, announced
        if newest is None:
            return False
        self._filed[source] = seq
        page.file(self.rank, seq, newest.epoch)
        return True

    def _settle(self) -> None:
        """Drain: wait until this rank's snapshots are replicated and it filed as many of
        each source's as it took; then quiet until the next snapshot."""
        self._wait(self._settled, "waited for its replication partners to catch up")
        self._confirm()  # filed as many of each source as it took: all of them count
        self._quiet = True

    def _settled(self) -> bool:
        """Whether the drain is done; raises where a partner failed (as a failed exchange
        fails its partners), or stopped or died with snapshots still to announce."""
        self._file_sources()
        behind = [s for s, filed in self._filed.items() if filed < self._processed]
        for source, page in self._source_pages.items():
            state = page.source_state()
            if state is PartnerState.FAILED or (source in behind
                                                and state is not PartnerState.RUNNING):
                raise RuntimeError(f"rank {self.rank}: replica source {source} stopped "
                                   f"replicating ({state.name.lower()})")
            if source in behind and not self._liveness[source].alive():
                raise RuntimeError(f"rank {self.rank}: replica source {source} died")
        for peer in self.mapping_peers:
            assert self._page is not None  # it comes with mapping peers
            if self._page.peer_state(peer) is PartnerState.FAILED:
                raise RuntimeError(f"rank {self.rank}: replica peer {peer} stopped "
                                   "replicating (failed)")
        return not behind

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Wait until ``done()``, filing the sources' announcements meanwhile (two ranks
        may wait on each other); raises after :data:`_PARTNER_TIMEOUT_S`."""
        deadline = time.monotonic() + _PARTNER_TIMEOUT_S
        pause = _FIRST_POLL_S
        while not done():
            if self._abandoned:
                raise RuntimeError(f"rank {self.rank}: replication was given up while it "
                                   f"{what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank}: {what} for {_PARTNER_TIMEOUT_S:.0f} s")
            time.sleep(pause)
            # Longer and longer: a partner a step behind keeps the cores the ranks share
            # for its training, rather than for this thread's looks.
            pause = min(2 * pause, _LAST_POLL_S)
            self._file_sources()

    def _slowest_filed_epoch(self) -> int:
        """The epoch of the newest snapshot the slowest mapping peer filed."""
        assert self._page is not None
        return min(self._page.filed(peer)[1] for peer in self.mapping_peers)

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


_IDLE_FILING_S = 0.5  # how often an idle replication thread files its sources' snapshots
_CONFIRM_POLL_S = 0.002  # ... while a snapshot of its own waits for the sources' of its step
# A waiting thread's sleeps between looks at its partners' pages, doubling from the first.
_FIRST_POLL_S = 0.0005
_LAST_POLL_S = 0.016
_PARTNER_TIMEOUT_S = 120.0  # the longest wait on a live same-node partner
# How many epochs (windows) a mapping peer may lag in filing before the source waits: the
# slots of older windows stay unreusable meanwhile, so this bounds the shared memory.
_LAG_EPOCHS = 3


class _Drain:
    """The replication thread's cue to catch up with its partners (:meth:`Replicator.drain`)."""


_DRAIN = _Drain()
# More snapshots than this in one window announced by a replica holder: damage.
_MAX_WINDOW_SNAPSHOTS = 1 << 20


def _gather_largest(group: dist.ProcessGroup, largest: int | None) -> list[int]:
    """Every rank's largest encoded snapshot in bytes (-1: not bounded), over ``group``
    (collective)."""
    mine = torch.tensor([-1 if largest is None else largest], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [int(value) for value in every]


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
