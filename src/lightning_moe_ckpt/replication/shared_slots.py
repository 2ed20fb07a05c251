"""Shared-memory slots: a replica peer on the same node holds a snapshot without a copy.

A replica exists to outlive its source. A peer on another node outlives a node failure and
must hold a copy; a peer on the same node dies with the node like the source, so all it
can outlive is the source *process* — and for that a copy is not needed: memory that
another process maps outlives the process that wrote it. So each rank encodes a snapshot
once, into a :class:`SharedSlot` (anonymous shared memory from ``memfd_create``), and a
same-node peer maps that slot (``/proc/<pid>/fd/<fd>``, :class:`SlotMapper`) instead of
receiving the bytes over the network: replication tells it a handle of seven integers
(:class:`SlotHandle`), not the payload, through the source's announcement page
(:mod:`.announcements`). The mapping keeps the bytes alive after the source dies, SIGKILL
included, for as long as the peer holds them; nothing is named in a file system, so
nothing is left behind when processes die. Remote peers receive the slot's bytes as
before, so encoding into a slot costs them nothing extra.

Slots are reused (:class:`SlotRing`): a peer keeps a source's two newest windows, so a slot
is rewritten only once every mapping peer filed a snapshot two windows past the one in it
(the peers say how far they filed in the source's page), and no sooner than four windows
after the replication thread sent it (counted in the order it sends them, which may lag
the order snapshots are taken in). A slot may also hold a snapshot from the moment it is
taken (:mod:`.slot_placement`): then the rank's own store holds it as well, and the slot
is rewritten only once the store let go too. A rank whose snapshots a recovery
superseded, or whose host memory a simulated failure took, abandons its slots
(:meth:`SlotRing.abandon`) instead: the peers' mappings keep the old bytes for as long as
they need them, and new snapshots go to new slots.

A peer maps a slot once, when it files the first snapshot in it (:class:`MappedSlots`):
from then on it keeps the mapping while the slot lives, so a snapshot in a slot the peer
already maps counts replicated as soon as it is announced, and only one in a new slot
waits until the peer filed it. Source and peer know alike which is which, without
telling each other: both track the slots acknowledged (mapped) in the source ring's
current *generation*, which the handle carries and which changes whenever the source
closes a slot (both then forget, and the peer lets go of mappings it holds nothing in).

Whether a peer can map a source's memory (same node and PID namespace, an OS that allows
it) is tested once per replication group with a random token (:func:`mappable_sources`);
where it cannot, the bytes are copied as to a remote node.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_moe_ckpt.core.collectives import all_gather_values
from lightning_moe_ckpt.errors import CorruptCheckpointError

if TYPE_CHECKING:
    from lightning_moe_ckpt.snapshots.capture import CopyList
    from lightning_moe_ckpt.snapshots.snapshot import PieceBuffers

# ``checkpoint.same_node_replicas``: a same-node peer maps the snapshot, or copies it.
SAME_NODE_REPLICAS = ("shared", "copied")

# Anonymous shared memory a peer can map by path: Linux's memfd_create and /proc.
SHARED_MEMORY = hasattr(os, "memfd_create")

_PAGE = 1 << 16  # slot capacities are rounded up to this
_KEEP_EPOCHS = 4  # window changes a slot's bytes must survive (see the module docstring)
_NEVER_SENT = -(1 << 62)  # the epoch of a slot whose snapshot no peer was sent
_FREE_SLOTS = 4  # unused slots kept for reuse
_RECENT_SLOTS = 16  # slots a peer keeps mapped after use: a source's ring, over its sources
_PROBE_BYTES = 16


@dataclass(frozen=True)
class SlotHandle:
    """Where a snapshot's encoded bytes lie: ``length`` bytes at the start of slot
    ``serial`` of process ``pid`` (file descriptor ``fd``, ``capacity`` bytes), whose
    random ``token`` tells this process's slots from an earlier one's with the same pid;
    ``generation`` counts the slots its ring closed before (see :class:`MappedSlots`)."""

    length: int
    pid: int
    fd: int
    serial: int
    capacity: int
    token: int
    generation: int = 0

    FIELDS = 7

    def as_tensor(self) -> torch.Tensor:
        """The handle as the int64 tensor replication sends."""
        return torch.tensor([self.length, self.pid, self.fd, self.serial, self.capacity,
                             self.token, self.generation], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> SlotHandle:
        """Inverse of :meth:`as_tensor`."""
        return cls(*(int(v) for v in values.tolist()))


def _process_token() -> int:
    return secrets.randbits(62)


class SharedSlot:
    """One block of anonymous shared memory this process encodes snapshots into."""

    def __init__(self, serial: int, capacity: int, token: int) -> None:
        self.serial = serial
        self.capacity = capacity
        self.token = token
        self.fd = os.memfd_create(_slot_name(serial), os.MFD_CLOEXEC)
        os.ftruncate(self.fd, capacity)
        self.memory = mmap.mmap(self.fd, capacity)
        self.data = memoryview(self.memory)  # writes go through here
        self.bytes = torch.frombuffer(self.memory, dtype=torch.uint8)  # the same, as a tensor
        # The replication epoch its snapshot was sent in (None: not yet handled by the
        # replication thread), and whether the rank's own store still holds it.
        self.epoch: int | None = None
        self.store_held = False
        # Buffers of snapshots placed here before (:mod:`.slot_placement`), by copy list
        # (weakly: a rebuilt copy list's entry goes with it): a slot that comes back for the
        # same plan shape reuses its views.
        self.placements: weakref.WeakKeyDictionary[CopyList, tuple[PieceBuffers, ...]] = (
            weakref.WeakKeyDictionary())

    def handle(self, length: int, generation: int) -> SlotHandle:
        """The handle of this slot's first ``length`` bytes, sent in its ring's
        ``generation``."""
        return SlotHandle(length, os.getpid(), self.fd, self.serial, self.capacity, self.token,
                          generation)

    def view(self, length: int) -> torch.Tensor:
        """The first ``length`` bytes as a uint8 tensor (no copy)."""
        return self.bytes[:length]

    def close(self) -> None:
        """Give up the file descriptor; the memory lives on while anyone maps it."""
        self.data.release()
        os.close(self.fd)


class SlotRing:
    """The slots one rank encodes its snapshots into, reused once peers (and, for a
    snapshot placed at issue, the rank's own store) let go of them.

    The training thread (placing a snapshot, its store releasing one) and the replication
    thread (encoding, sending) both use the ring: its bookkeeping runs under a lock."""

    def __init__(self, filed_epoch: Callable[[], int] | None = None) -> None:
        """``filed_epoch``: the epoch of the newest snapshot the slowest mapping peer filed
        (None: peers file each snapshot before the next is sent)."""
        self.token = _process_token()
        self._filed_epoch = filed_epoch
        self._serial = 0
        self._epoch = 0
        self._window_start: int | None = None
        self._lock = threading.Lock()
        # Slots closed so far: a peer's acknowledgements of mapping the others stay valid.
        self.generation = 0
        self.in_use: list[SharedSlot] = []
        self.free: list[SharedSlot] = []
        self.allocations = 0
        self.peak_bytes = 0

    def advance(self, window_start: int) -> None:
        """The replication thread is about to send a snapshot of the window at
        ``window_start``: a new window is a new epoch, and slots sent four epochs ago that
        nothing else holds (and the peers filed past) become free."""
        with self._lock:
            if window_start == self._window_start:
                return
            self._window_start = window_start
            self._epoch += 1
            self._reclaim()

    def acquire(self, nbytes: int, store_held: bool = False) -> SharedSlot:
        """A slot of at least ``nbytes``: for the replication thread to encode a snapshot
        into (``store_held`` False), or for a snapshot placed at issue, which the rank's
        store then holds until :meth:`release_store`."""
        with self._lock:
            self._reclaim()
            fitting = [s for s in self.free if s.capacity >= nbytes]
            if fitting:
                slot = min(fitting, key=lambda s: s.capacity)
                self.free.remove(slot)
            else:
                capacity = -(-(nbytes + nbytes // 16) // _PAGE) * _PAGE
                self._serial += 1
                self.allocations += 1
                slot = SharedSlot(self._serial, capacity, self.token)
                self.peak_bytes = max(self.peak_bytes, self._nbytes() + capacity)
            while len(self.free) > _FREE_SLOTS:  # the smallest are the least likely to fit
                smallest = min(self.free, key=lambda s: s.capacity)
                self.free.remove(smallest)
                smallest.close()
                self.generation += 1
            slot.epoch, slot.store_held = None, store_held
            self.in_use.append(slot)
            return slot

    def sent(self, slot: SharedSlot, to_peers: bool = True) -> None:
        """The replication thread is done with ``slot``'s snapshot: it went to the peers in
        the current epoch, or (``to_peers`` False) to none, which leaves nothing to wait
        for."""
        with self._lock:
            slot.epoch = self._epoch if to_peers else _NEVER_SENT

    def release_store(self, slot: SharedSlot) -> None:
        """The rank's store let go of the snapshot placed in ``slot``."""
        with self._lock:
            slot.store_held = False

    @property
    def epoch(self) -> int:
        """The current epoch: windows the replication thread began sending so far."""
        return self._epoch

    def _reclaim(self) -> None:
        oldest = self._epoch - _KEEP_EPOCHS
        if self._filed_epoch is not None:  # a peer drops a window two windows on
            oldest = min(oldest, self._filed_epoch() - 2)
        reusable = [s for s in self.in_use
                    if not s.store_held and s.epoch is not None and s.epoch <= oldest]
        if reusable:
            self.in_use = [s for s in self.in_use if s not in reusable]
            self.free.extend(reusable)

    def abandon(self) -> None:
        """Stop writing into every slot: peers may still read them (a recovery fetches from
        them), so new snapshots go to new slots. Snapshots placed in them stay readable."""
        with self._lock:
            for slot in [*self.in_use, *self.free]:
                slot.close()
            self.in_use, self.free = [], []
            self.generation += 1
            self._window_start = None

    def nbytes(self) -> int:
        """Bytes of shared memory this rank holds for its snapshots."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(s.capacity for s in [*self.in_use, *self.free])


class SlotMapper:
    """A peer's mappings of its same-node sources' slots, opened once per slot.

    A mapping is kept while a held snapshot lies in its slot or the slot was among the
    last few a source used: a source cycles through a handful of slots, so a slot comes
    back a few snapshots after the peer dropped the window in it, and mapping it afresh
    each time would cost an ``open`` and an ``mmap`` per snapshot. Older mappings are let
    go, so a slot the source closed does not stay alive here."""

    def __init__(self) -> None:
        self._mapped: dict[tuple[int, int, int], mmap.mmap] = {}  # (pid, token, serial)
        self._recent: list[tuple[int, int, int]] = []

    def view(self, handle: SlotHandle) -> torch.Tensor:
        """The bytes ``handle`` names, as a uint8 tensor over the source's memory; the
        mapping lives as long as the tensor (and its views). A length beyond the slot is
        refused (:class:`~lightning_moe_ckpt.errors.CorruptCheckpointError`)."""
        if not 0 <= handle.length <= handle.capacity:
            raise CorruptCheckpointError(f"process {handle.pid} announced {handle.length} "
                                         f"bytes in a slot of {handle.capacity}")
        key = slot_key(handle)
        memory = self._mapped.get(key)
        if memory is None:
            memory = _map(handle.pid, handle.fd, handle.capacity, handle.serial)
            self._mapped[key] = memory
        if key in self._recent:
            self._recent.remove(key)
        self._recent.append(key)
        del self._recent[:-_RECENT_SLOTS]
        return torch.frombuffer(memory, dtype=torch.uint8, count=handle.length)

    def keep_only(self, held: set[tuple[int, int, int]]) -> None:
        """Forget mappings of slots neither ``held`` nor recently used (their views, if
        any, keep them mapped)."""
        for key in [k for k in self._mapped if k not in held and k not in self._recent]:
            del self._mapped[key]


class MappedSlots:
    """The slots of one source that one mapping peer acknowledged mapping, in the source
    ring's current generation. The source keeps one per mapping peer, the peer one per
    mapped source, and both feed each handle sent between them to it in the same order:
    so both agree, without a message, on which handles need an acknowledgement (a slot the
    peer did not acknowledge yet in this generation) and which need none (a slot the peer
    maps already, and keeps mapped, :meth:`keys`)."""

    def __init__(self) -> None:
        self._generation: tuple[int, int] | None = None  # (ring token, generation)
        self._keys: set[tuple[int, int, int]] = set()

    def needs_acknowledgement(self, handle: SlotHandle) -> bool:
        """Whether the peer acknowledges ``handle``'s slot (call once per handle sent):
        a new generation forgets every slot acknowledged before."""
        generation = (handle.token, handle.generation)
        if generation != self._generation:
            self._generation = generation
            self._keys.clear()
        return slot_key(handle) not in self._keys

    def acknowledged(self, handle: SlotHandle) -> None:
        """The peer acknowledged mapping ``handle``'s slot."""
        self._keys.add(slot_key(handle))

    def keys(self) -> set[tuple[int, int, int]]:
        """The slots acknowledged in the current generation: the peer keeps them mapped."""
        return set(self._keys)


def slot_key(handle: SlotHandle) -> tuple[int, int, int]:
    """The key :class:`SlotMapper` files ``handle``'s slot under."""
    return (handle.pid, handle.token, handle.serial)


def _slot_name(serial: int) -> str:
    return f"moe-snapshot-{serial}"


def _map(pid: int, fd: int, capacity: int, serial: int | None = None) -> mmap.mmap:
    """Map ``capacity`` bytes of process ``pid``'s descriptor ``fd``; with ``serial``, only
    while it still is that slot: a source that closed the slot may have reused the number
    for another file, and mapping that would file the wrong bytes (or fail in ``mmap``).
    Raises OSError when it is gone, as when the source died."""
    descriptor = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        if serial is not None:
            # What this process opened, so no later reuse of the number can change it.
            name = os.readlink(f"/proc/self/fd/{descriptor}").split(" ", 1)[0]
            if name != f"/memfd:{_slot_name(serial)}" or os.fstat(descriptor).st_size < capacity:
                raise OSError(f"slot {serial} of process {pid} is gone: its descriptor {fd} "
                              f"names {name!r} now")
        return mmap.mmap(descriptor, capacity)
    finally:
        os.close(descriptor)  # the mapping holds the memory from here on


@dataclass
class SameNodePartners:
    """What :func:`mappable_sources` found: the sources whose slots this rank maps
    (``mapped``) and the peers that map this rank's (``mapping``); this rank's page, which
    the mapping peers mapped (None without any), the mapped sources' pages, as mapped
    here, and every partner's pid."""

    mapped: set[int]
    mapping: set[int]
    page: SharedSlot | None = None
    source_pages: dict[int, mmap.mmap] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)


def mappable_sources(group: dist.ProcessGroup, sources: list[int], candidates: set[int],
                     page_bytes: int = 0) -> SameNodePartners:
    """Which replication partners can share memory with this rank (collective on
    ``group``: every rank calls it once, with its own ``sources`` and the
    ``candidates`` among them and its peers that are on its node).

    Each rank writes a random token into a probe slot of ``page_bytes`` (and room for the
    token behind them); every rank tries to map the probes of its candidate sources and
    compares the token. The probe is kept as the rank's page where some peer maps it, and
    so are the mappings of the sources' (:mod:`.announcements` uses them). Without
    ``memfd_create`` (not Linux) nothing is shared, on any rank alike, and nothing is
    exchanged."""
    if not SHARED_MEMORY:
        return SameNodePartners(set(), set())
    capacity = -(-(page_bytes + _PROBE_BYTES) // _PAGE) * _PAGE
    probe = SharedSlot(0, capacity, _process_token())
    token = secrets.token_bytes(_PROBE_BYTES)
    probe.data[capacity - _PROBE_BYTES:] = token  # behind the page, which starts zeroed
    offers: list[tuple[int, int, int, bytes] | None] = all_gather_values(
        (os.getpid(), probe.fd, capacity, token), group=group)
    pages = {}
    for source in sources:
        offer = offers[source]
        if source not in candidates or offer is None:
            continue
        pid, fd, size, expected = offer
        try:
            memory = _map(pid, fd, size)
        except OSError:  # another node, another PID namespace, or not allowed
            continue
        if memory[size - _PROBE_BYTES:size] == expected:
            pages[source] = memory
        else:
            memory.close()
    verdicts: list[list[int]] = all_gather_values(sorted(pages), group=group)
    me = dist.get_rank(group)
    mapping = {peer for peer, theirs in enumerate(verdicts) if theirs and me in theirs}
    pids = {rank: offer[0] for rank, offer in enumerate(offers)
            if offer is not None and (rank in pages or rank in mapping)}
    probe.close()  # the peers mapped it already: its memory lives on in the mapping
    return SameNodePartners(set(pages), mapping, probe if mapping else None, pages, pids)
