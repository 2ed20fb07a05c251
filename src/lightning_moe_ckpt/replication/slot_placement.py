"""Snapshots copied straight into the shared slot that same-node peers map.

Where every peer of a rank maps its shared memory (:mod:`.shared_slots`), a snapshot's
bytes would otherwise be written twice: by the copy into pooled host buffers, and by the
replication thread's encoding into a slot. Placed, a snapshot's pieces *are* views into a
slot, at the offsets the encoding gives them (:class:`SlotLayout`): the copy thread writes
each byte once, and the replication thread writes only the framing around the pieces
(:func:`~lightning_moe_ckpt.snapshots.codec.encode_around_pieces`). That also halves the
host memory snapshots take on such a rank: the store's snapshots and the peers' replicas
are the same bytes.

A placed slot is held twice: by the rank's store, until the snapshot's window is superseded
(:meth:`SlotBacking.release`, through the buffer pool), and by the peers, until the
replication thread has sent four later windows (:class:`~.shared_slots.SlotRing`). Placement
is only for host copies (a CUDA copy needs pinned buffers, which slots are not) into a
store that lets go of whole snapshots (the partial baselines' stores keep pieces of
released ones indefinitely): the coordinator decides (``CheckpointCoordinator``). A copy
list whose pieces cannot be packed into one block (mixed dtypes at odd offsets) takes the
pooled buffers instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import cast

import torch

from lightning_moe_ckpt.replication.shared_slots import SharedSlot, SlotRing
from lightning_moe_ckpt.snapshots.capture import CopyList
from lightning_moe_ckpt.snapshots.codec import (
    MAGIC,
    TRAILER_BYTES,
    encode_around_pieces,
    encode_snapshot_into,
)
from lightning_moe_ckpt.snapshots.piece_blob import aligned_layout_head
from lightning_moe_ckpt.snapshots.snapshot import PieceBuffers, Snapshot

# Room kept behind the pieces for the header (metadata, RNG states, the piece index: about
# 16 KiB for the built-in model); a larger one is encoded by a copy into another slot, and
# the room grows for the next snapshots.
_HEADER_ROOM = 1 << 16


@dataclass(frozen=True)
class SlotLayout:
    """Where one copy list's snapshot lies in a slot: per piece (in the copy list's order)
    the offset and bytes of its head, and the offset of its tensor bytes right behind;
    ``end`` is where the last piece ends and the header begins."""

    heads: tuple[tuple[int, bytes], ...]
    data_offsets: tuple[int, ...]
    end: int

    @classmethod
    def of(cls, copies: CopyList) -> SlotLayout | None:
        """The layout of ``copies``, or None when it has no pieces or a piece cannot be
        one packed block."""
        if not copies.pieces:
            return None
        heads, data_offsets, offset = [], [], len(MAGIC)
        for layout in copies.pieces:
            if PieceBuffers.packed_size(layout) is None:
                return None
            head = aligned_layout_head(layout.key, offset)
            heads.append((offset, head))
            data_offsets.append(offset + len(head))
            offset = data_offsets[-1] + layout.nbytes
        return cls(tuple(heads), tuple(data_offsets), offset)


@dataclass(frozen=True)
class SlotBacking:
    """The slot a snapshot's pieces were placed in, and their buffers there."""

    ring: SlotRing
    slot: SharedSlot
    layout: SlotLayout
    buffers: tuple[PieceBuffers, ...]  # in the copy list's order

    def release(self) -> None:
        """The store let go of the snapshot."""
        self.ring.release_store(self.slot)


class SlotPlacement:
    """Places snapshots into one rank's slot ring (see the module docstring)."""

    def __init__(self, ring: SlotRing) -> None:
        self.ring = ring
        self.header_room = _HEADER_ROOM  # grown by the replication thread when short
        self._layouts: weakref.WeakKeyDictionary[CopyList, SlotLayout | None] = (
            weakref.WeakKeyDictionary())

    def place(self, copies: CopyList) -> SlotBacking | None:
        """A slot holding buffers for ``copies``' pieces (held for the store), or None when
        its pieces cannot be placed."""
        if copies not in self._layouts:
            self._layouts[copies] = SlotLayout.of(copies)
        layout = self._layouts[copies]
        if layout is None:
            return None
        slot = self.ring.acquire(layout.end + self.header_room + TRAILER_BYTES,
                                 store_held=True)
        # Views of a slot are built once per copy list (a slot comes back for the same plan
        # shape every few windows): no per-tensor work on the training thread after that.
        buffers = slot.placements.get(copies)
        if buffers is None:
            buffers = tuple(PieceBuffers.over(piece, slot.bytes[offset:offset + piece.nbytes])
                            for piece, offset in zip(copies.pieces, layout.data_offsets,
                                                     strict=True))
            slot.placements[copies] = buffers
        return SlotBacking(self.ring, slot, layout, buffers)


def encode_in_slot(snapshot: Snapshot, placement: SlotPlacement) -> tuple[torch.Tensor, SharedSlot]:
    """The replication thread's encoding of ``snapshot`` into ``placement``'s ring: framed
    around its pieces where they were placed in one of its slots, or else copied into a
    slot. Returns the encoded bytes and their slot; the caller reports the slot
    :meth:`~.shared_slots.SlotRing.sent` once the peers were told of it."""
    ring = placement.ring
    ring.advance(snapshot.plan.window_start)
    backing = cast(SlotBacking | None, snapshot.backing)  # placed by a placement's place()
    if backing is not None:
        if backing.ring is ring:
            slot, layout = backing.slot, backing.layout
            length = encode_around_pieces(snapshot, slot.bytes, layout.heads, layout.end)
            if length is not None:
                return slot.view(length), slot
            # The header outgrew the room behind the pieces (or the store let go of them):
            # copied into another slot, with more room for the next snapshots.
            if len(snapshot.pieces) == len(layout.heads):
                placement.header_room *= 2
        backing.ring.sent(backing.slot, to_peers=False)  # (a replaced ring's: abandoned)
    used: list[SharedSlot] = []

    def memory(nbytes: int) -> torch.Tensor:
        used.append(ring.acquire(nbytes))
        return used[-1].view(used[-1].capacity)

    target, length = encode_snapshot_into(snapshot, memory)
    for unused in used[:-1]:  # too small for the header: nothing of it is sent
        ring.sent(unused, to_peers=False)
    return target[:length], used[-1]
