"""What a snapshot holds: its pieces, their layouts and host buffers, and the buffer pool.

A snapshot SS_t of one rank is a set of pieces, one per captured operator: its master
state (master weights and optimizer state) or its compute weights. A :class:`PieceLayout`
says what a piece copies (live sources in name order, the pool key), :class:`PieceBuffers`
are the host buffers it is copied into (views into one block where the dtypes allow, so
that a piece is checksummed in one call), and :class:`HostBufferPool` hands the buffers of
a freed snapshot to the next one of the same layout, so steady-state training allocates
nothing. The capture that fills snapshots is :mod:`.capture`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from lightning_moe_ckpt.snapshots.checksum import (
    names_checksum,
    raw_bytes,
    tensor_checksum,
    views_checksum,
)

if TYPE_CHECKING:
    from lightning_moe_ckpt.planning.planner import CapturePlan

__all__ = ["HostBufferPool", "PieceBuffers", "PieceKind", "PieceLayout", "PlacedMemory",
           "Snapshot", "SnapshotPiece", "wait_checksummed"]

PieceKind = Literal["master", "compute"]


@dataclass(frozen=True)
class PieceLayout:
    """What a piece of one operator copies: its live sources in name order (the order the
    checksum reads them) and the names, shapes and dtypes its host buffers must have."""

    operator: str
    kind: PieceKind
    names: tuple[str, ...]
    sources: tuple[torch.Tensor, ...]
    key: tuple[Any, ...]  # pool key: (name, shape, dtype) per tensor
    nbytes: int
    # Sources a forward may change before the next optimizer step (module buffers):
    # copied at issue, not behind the next iteration.
    at_issue: frozenset[str] = frozenset()

    @classmethod
    def of(cls, operator: str, kind: PieceKind, sources: Mapping[str, torch.Tensor],
           at_issue: Iterable[str] = ()) -> PieceLayout:
        """The layout of ``sources`` (any order) for ``operator``; ``at_issue`` names the
        sources to copy at issue."""
        names = tuple(sorted(sources))
        ordered = tuple(sources[name] for name in names)
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in zip(names, ordered, strict=True))
        return cls(operator, kind, names, ordered, key,
                   sum(t.numel() * t.element_size() for t in ordered), frozenset(at_issue))

    @property
    def behind_sources(self) -> tuple[torch.Tensor, ...]:
        """The sources copied behind the next iteration, in name order."""
        return tuple(t for n, t in zip(self.names, self.sources, strict=True)
                     if n not in self.at_issue)

    @property
    def at_issue_sources(self) -> tuple[torch.Tensor, ...]:
        """The sources copied at issue, in name order."""
        return tuple(t for n, t in zip(self.names, self.sources, strict=True)
                     if n in self.at_issue)

    @cached_property
    def behind_spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """The behind sources as runs of neighbours in name order, each ``(first index,
        end index, first byte, end byte)``, bytes as in the packed block
        (:meth:`PieceBuffers.packed_size`); sources copied at issue split the runs."""
        spans: list[tuple[int, int, int, int]] = []
        first: tuple[int, int] | None = None  # index and byte where the open run starts
        offset = 0
        for index, (name, source) in enumerate(zip(self.names, self.sources, strict=True)):
            if name in self.at_issue:
                if first is not None:
                    spans.append((first[0], index, first[1], offset))
                    first = None
            elif first is None:
                first = (index, offset)
            offset += source.numel() * source.element_size()
        if first is not None:
            spans.append((first[0], len(self.names), first[1], offset))
        return tuple(spans)

    @cached_property
    def byte_runs(self) -> tuple[tuple[torch.Tensor, ...], ...] | None:
        """Each span's sources as flat byte views, for one ``torch.cat`` per span into the
        packed block (a copy per tensor costs about 0.45 us more per tensor, and a piece
        holds dozens); None where a behind source is not contiguous (no such view)."""
        if not all(source.is_contiguous() for source in self.behind_sources):
            return None
        return tuple(tuple(source.reshape(-1).view(torch.uint8) for source in self.sources[i:j])
                     for i, j, _, _ in self.behind_spans)


@dataclass(frozen=True)
class PieceBuffers:
    """Host buffers for one piece layout, allocated once and reused through the pool.

    The buffers are views into one block, back to back in name order, whenever each
    tensor's offset is a multiple of its element size (mixed dtypes may forbid it): the
    block's bytes are then exactly what :func:`tensor_checksum` reads after the names, so
    checksumming the piece is one C call that releases the GIL, instead of a Python loop
    over tensors that would hold it against the training thread.
    """

    key: tuple[Any, ...]
    tensors: dict[str, torch.Tensor]
    raw: tuple[memoryview, ...]  # what the checksum reads after the names, in order
    names_crc: int
    behind: tuple[torch.Tensor, ...]  # targets of the layout's behind_sources, in order
    at_issue: tuple[torch.Tensor, ...]  # targets of its at_issue_sources, in order
    block: torch.Tensor | None = None  # the one uint8 block ``raw`` reads, when packed
    # When packed: the block's bytes of each of the layout's behind_spans.
    behind_blocks: tuple[torch.Tensor, ...] | None = None

    @staticmethod
    def packed_size(layout: PieceLayout) -> int | None:
        """Bytes of one block holding ``layout``'s tensors back to back in name order, or
        None when some tensor's offset in it would not be a multiple of its element size."""
        offset = 0
        for source in layout.sources:
            if offset % source.element_size():
                return None
            offset += source.numel() * source.element_size()
        return offset

    @classmethod
    def allocate(cls, layout: PieceLayout, pin_memory: bool) -> PieceBuffers:
        """Fresh buffers shaped like ``layout``'s sources."""
        size = cls.packed_size(layout)
        if size is not None:
            return cls.over(layout, torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory))
        tensors = {name: torch.empty(s.shape, dtype=s.dtype, pin_memory=pin_memory)
                   for name, s in zip(layout.names, layout.sources, strict=True)}
        return cls._of(layout, tensors, tuple(raw_bytes(t) for t in tensors.values()), None)

    @classmethod
    def over(cls, layout: PieceLayout, block: torch.Tensor) -> PieceBuffers:
        """Buffers of a packable ``layout`` (:meth:`packed_size`) as views into ``block``
        (uint8, that many bytes, 64-byte aligned: memory someone else provides)."""
        tensors, offset = {}, 0
        for name, source in zip(layout.names, layout.sources, strict=True):
            end = offset + source.numel() * source.element_size()
            tensors[name] = block[offset:end].view(source.dtype).view(source.shape)
            offset = end
        return cls._of(layout, tensors, (raw_bytes(block),), block)

    @classmethod
    def _of(cls, layout: PieceLayout, tensors: dict[str, torch.Tensor],
            raw: tuple[memoryview, ...], block: torch.Tensor | None) -> PieceBuffers:
        return cls(layout.key, tensors, raw, names_checksum(layout.names),
                   tuple(tensors[n] for n in layout.names if n not in layout.at_issue),
                   tuple(tensors[n] for n in layout.names if n in layout.at_issue), block,
                   None if block is None
                   else tuple(block[start:end] for _, _, start, end in layout.behind_spans))

    @property
    def checksum_views(self) -> tuple[tuple[memoryview, ...], int]:
        """What :func:`tensor_checksum` of :attr:`tensors` reads: the prepared views, and
        the names' checksum they continue from (the shape of :func:`tensor_views`)."""
        return self.raw, self.names_crc

    def checksum(self) -> int:
        """:func:`tensor_checksum` of :attr:`tensors`, from the prepared views."""
        return views_checksum(*self.checksum_views)


@dataclass
class SnapshotPiece:
    """One operator's captured state in one snapshot."""

    operator: str
    kind: PieceKind
    tensors: dict[str, torch.Tensor]  # "<param>" (compute) or "<param>/<field>" (master)
    checksum: int | None = None
    buffers: PieceBuffers | None = None  # pooled host buffers (the engine's pieces)

    @cached_property
    def nbytes(self) -> int:
        """Bytes held by this piece (its tensors never change: computed once, since the
        store sums them every iteration)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def verify(self) -> bool:
        """Whether the stored checksum matches the bytes."""
        return self.checksum is not None and tensor_checksum(self.tensors) == self.checksum


class PlacedMemory(Protocol):
    """Memory a consumer of snapshots placed a snapshot's pieces in (replication's shared
    slots, :mod:`~lightning_moe_ckpt.replication.slot_placement`): the pieces' buffers in
    copy-list order, and a release once the store lets go of the snapshot."""

    @property
    def buffers(self) -> tuple[PieceBuffers, ...]: ...

    def release(self) -> None: ...


@dataclass
class Snapshot:
    """SS_t of one rank: its pieces plus the metadata replay needs."""

    step: int
    rank: int
    plan: CapturePlan
    pieces: dict[str, SnapshotPiece]
    metadata: dict[str, Any]
    copied: threading.Event = field(default_factory=threading.Event)
    # Set by :meth:`set_checksummed` (its pieces have their checksums, or it was found
    # unusable), once every hand-off registered by then ran.
    checksummed: threading.Event = field(default_factory=threading.Event)
    backing: PlacedMemory | None = None  # the shared slot its pieces lie in, when placed
    _nbytes: int | None = field(default=None, repr=False)
    # Consumers waiting for the checksums; None once they are there.
    _hand_offs: list[Callable[[Snapshot], object]] | None = field(default_factory=list,
                                                                  repr=False)
    _hand_off_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in this snapshot (summed once: the store and the engine
        read it every iteration)."""
        if self._nbytes is None:
            self._nbytes = sum(piece.nbytes for piece in self.pieces.values())
        return self._nbytes

    def when_checksummed(self, hand_off: Callable[[Snapshot], object]) -> None:
        """Call ``hand_off(self)`` once its pieces are checksummed (or it was found
        unusable): at once if they are, else on the thread that checksums them, before
        :attr:`checksummed` is set. A consumer's thread (replication, persistence) is so
        woken once, with a snapshot it can work on; woken at the issue, it would take the
        interpreter lock from the training thread only to wait for the checksums. The
        engine checksums snapshots in the order it issued them, so hand-offs registered
        in that order run in it."""
        with self._hand_off_lock:
            if self._hand_offs is not None:
                self._hand_offs.append(hand_off)
                return
        hand_off(self)

    def set_checksummed(self) -> None:
        """Its pieces are checksummed (or it was found unusable): run the hand-offs, then
        set :attr:`checksummed`, so whoever waited for that knows they ran."""
        with self._hand_off_lock:
            hand_offs, self._hand_offs = self._hand_offs, None
        try:
            for hand_off in hand_offs or ():
                hand_off(self)
        finally:  # a waiter must not hang on a consumer that failed
            self.checksummed.set()

    def take_pieces(self) -> dict[str, SnapshotPiece]:
        """Hand the pieces over; the snapshot holds none from then on."""
        pieces, self.pieces, self._nbytes = self.pieces, {}, 0
        return pieces


def wait_checksummed(newest: Snapshot | None, timeout_s: float | None = None) -> bool:
    """Wait until ``newest`` and every snapshot issued before it by the same engine are
    checksummed and handed off (:meth:`Snapshot.when_checksummed`): the engine checksums
    them in issue order, so the newest one's event says so for all. Returns whether they
    are (False: ``timeout_s`` ran out)."""
    return newest is None or newest.checksummed.wait(timeout_s)


class HostBufferPool:
    """Reusable host buffers (pinned on CUDA machines), a set per piece layout."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[tuple[Any, ...], list[PieceBuffers]] = defaultdict(list)
        self.allocated_bytes = 0
        self.allocations = 0

    def acquire(self, layout: PieceLayout) -> PieceBuffers:
        """Host buffers for ``layout`` (reused when a set is free)."""
        free = self._free.get(layout.key)
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += layout.nbytes
        return PieceBuffers.allocate(layout, self.pin_memory)

    def release(self, snapshot: Snapshot) -> None:
        """Return a snapshot's buffers to the pool (pieces made elsewhere, e.g. decoded
        from a peer, own no pooled buffers and are simply dropped; a snapshot placed in a
        shared slot hands the slot back instead)."""
        pieces = snapshot.take_pieces()
        if snapshot.backing is not None:
            if pieces:  # once: the slot may hold another snapshot after that
                snapshot.backing.release()
            return
        for piece in pieces.values():
            if piece.buffers is not None:
                self._free[piece.buffers.key].append(piece.buffers)
