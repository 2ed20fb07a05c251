"""Announcement pages: a rank tells its same-node peers of each snapshot without a message.

A peer on the same node maps a source's shared-memory slots (:mod:`.shared_slots`), so to
hold a snapshot it needs only to know where it lies. Each rank keeps one small page of
shared memory, which the peers that map its slots map once, at set-up, and writes each
snapshot's handle into it (:meth:`AnnouncementPage.announce`): no message, no wait on a
peer. A peer files what its sources announced whenever its replication thread runs
(:mod:`.replication`), and writes back, into a cell of the source's page that only it
writes, how far it filed and in which window (:meth:`AnnouncementPage.file`); the source
reads those cells to know which slots it may reuse, and whether a peer mapped a new slot.
Since the peer maps the page and the slots, the announcements and the bytes outlive a
source that dies: the peer files them then.

Every record carries its sequence number and a CRC32C of its fields, written in one copy:
a reader that meets a record half-written (or one of an earlier lap of the ring) sees
that it is not the one it wants yet. Each cell has one writer, and a word each value.

Each side also says when it stops replicating (:class:`PartnerState`): a source in its
page's header, a peer in its cell. A partner that failed, closed or died must not be
counted on to file what is announced after.
"""

from __future__ import annotations

import enum
import mmap
import os
import select
import struct
from dataclasses import dataclass

from lightning_moe_ckpt.replication.shared_slots import SlotHandle
from lightning_moe_ckpt.snapshots.checksum import bytes_checksum

RECORDS = 512  # announcements a page holds: a peer may lag this many before its source waits
_WORD = 8
_HEADER_WORDS = 8  # word 0: the source's state
_CELL_WORDS = 4  # per peer rank: filed sequence number, its window's epoch, the peer's state
_FIELDS = 5 + SlotHandle.FIELDS  # sequence number, handle, window start, step, epoch, check
_RECORD = struct.Struct(f"<{_FIELDS}q")
_CHECKED = struct.Struct(f"<{_FIELDS - 1}q")


class PartnerState(enum.IntEnum):
    """How far a rank's replication thread is: its page's or its cell's state word."""

    RUNNING = 0
    CLOSED = 1  # stopped after filing everything announced to it
    FAILED = 2  # stopped on an error: what it did not file yet it never will


@dataclass(frozen=True)
class Announcement:
    """A snapshot a source announced: sequence number ``seq`` (from 1), where its bytes
    lie, its window and step, and the source's replication epoch (its window count)."""

    seq: int
    handle: SlotHandle
    window_start: int
    step: int
    epoch: int

    def fields(self) -> tuple[int, ...]:
        """The record's fields but its check."""
        h = self.handle
        return (self.seq, h.length, h.pid, h.fd, h.serial, h.capacity, h.token, h.generation,
                self.window_start, self.step, self.epoch)


def page_bytes(world_size: int) -> int:
    """Bytes of a page with a cell for every rank of a ``world_size`` job."""
    return _WORD * (_HEADER_WORDS + _CELL_WORDS * world_size) + RECORDS * _RECORD.size


class AnnouncementPage:
    """One rank's page, as its source writes it or a peer maps it: ``memory`` holds
    :func:`page_bytes` of ``world_size`` at its start (zeroed when created)."""

    def __init__(self, memory: mmap.mmap, world_size: int) -> None:
        self.memory = memory
        self.words = memoryview(memory).cast("B")[:page_bytes(world_size)].cast("q")
        self._records = _WORD * (_HEADER_WORDS + _CELL_WORDS * world_size)

    # The source's side.

    def announce(self, announcement: Announcement) -> None:
        """Write ``announcement`` into its place in the ring (one copy, check included)."""
        fields = announcement.fields()
        check = bytes_checksum(_CHECKED.pack(*fields))
        _RECORD.pack_into(self.memory, self._offset(announcement.seq), *fields, check)

    def filed(self, peer: int) -> tuple[int, int]:
        """How far ``peer`` filed: the sequence number and the epoch of its newest filed
        announcement (0, 0: nothing yet)."""
        cell = _HEADER_WORDS + _CELL_WORDS * peer
        return self.words[cell], self.words[cell + 1]

    def peer_state(self, peer: int) -> PartnerState:
        """Whether ``peer`` still files this page's announcements."""
        return PartnerState(self.words[_HEADER_WORDS + _CELL_WORDS * peer + 2])

    def set_state(self, state: PartnerState) -> None:
        """Tell the peers whether this rank still announces."""
        self.words[0] = state

    # A peer's side.

    def read(self, seq: int) -> Announcement | None:
        """Announcement ``seq``, or None while it is not (wholly) written."""
        fields = _RECORD.unpack_from(self.memory, self._offset(seq))
        if fields[0] != seq or bytes_checksum(_CHECKED.pack(*fields[:-1])) != fields[-1]:
            return None
        return Announcement(seq, SlotHandle(*fields[1:1 + SlotHandle.FIELDS]),
                            *fields[1 + SlotHandle.FIELDS:-1])

    def file(self, peer: int, seq: int, epoch: int) -> None:
        """``peer`` filed the announcements up to ``seq``, of window ``epoch``."""
        cell = _HEADER_WORDS + _CELL_WORDS * peer
        self.words[cell + 1] = epoch  # read after the sequence number by the source
        self.words[cell] = seq

    def source_state(self) -> PartnerState:
        """Whether the source still announces."""
        return PartnerState(self.words[0])

    def set_peer_state(self, peer: int, state: PartnerState) -> None:
        """Tell the source whether ``peer`` still files."""
        self.words[_HEADER_WORDS + _CELL_WORDS * peer + 2] = state

    def _offset(self, seq: int) -> int:
        return self._records + (seq % RECORDS) * _RECORD.size

    def release(self) -> None:
        """Let go of the page's views (the mapping stays while its owner keeps it)."""
        self.words.release()


class Liveness:
    """Whether a partner process still runs, from a ``pidfd`` (which a reused pid cannot
    fool); without ``pidfd_open`` it is taken to run, and waits end at their timeout."""

    def __init__(self, pid: int) -> None:
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except (AttributeError, OSError):  # not Linux >= 5.3
            pass

    def alive(self) -> bool:
        """False once the process exited (its pidfd turns readable)."""
        if self._fd is None:
            return not self._gone
        readable, _, _ = select.select([self._fd], [], [], 0)
        return not readable

    def close(self) -> None:
        """Give up the pidfd."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
