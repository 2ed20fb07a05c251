"""Shared-memory slots: what a same-node replica peer maps instead of receiving a copy.

A snapshot encoded into a slot is byte for byte the replication encoding (pooled buffers
and plain tensors alike, a header that needs a second, larger slot too); a slot's bytes are
not rewritten until the peers let go of them; a peer's mapping keeps the bytes after the
source process is SIGKILLed; mapped snapshots are never reused as receive buffers.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import pytest
import torch

from lightning_moe_ckpt.replication.replica_store import ReplicaStore
from lightning_moe_ckpt.replication.shared_slots import (
    MappedSlots,
    SharedSlot,
    SlotHandle,
    SlotMapper,
    SlotRing,
    slot_key,
)
from lightning_moe_ckpt.snapshots import codec
from lightning_moe_ckpt.snapshots.checksum import tensor_checksum
from lightning_moe_ckpt.snapshots.codec import decode_snapshot, encode_snapshot
from lightning_moe_ckpt.snapshots.snapshot import (
    HostBufferPool,
    PieceLayout,
    Snapshot,
    SnapshotPiece,
)

BOUNDED_S = 60.0  # the source process starts (imports torch) and dies within this


@dataclass(frozen=True)
class Plan:
    iteration: int = 9
    window_start: int = 8
    window: int = 2


def _snapshot() -> Snapshot:
    """One piece in pooled buffers (a packed block), one of plain tensors, and metadata."""
    pool = HostBufferPool(pin_memory=False)
    sources = {"w/master": torch.randn(5, 3), "w/exp_avg": torch.randn(5, 3),
               "w/step": torch.tensor(4.0)}
    buffers = pool.acquire(PieceLayout.of("layers.0.moe.experts.2", "master", sources))
    for name, tensor in sources.items():
        buffers.tensors[name].copy_(tensor)
    assert buffers.block is not None  # the case the slot copy reads as one tensor
    pooled = SnapshotPiece("layers.0.moe.experts.2", "master", buffers.tensors,
                           buffers.checksum(), buffers)
    plain = {"head.weight": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)}
    return Snapshot(9, 1, Plan(), {  # type: ignore[arg-type]
        "layers.0.moe.experts.2": pooled,
        "head": SnapshotPiece("head", "compute", plain, tensor_checksum(plain))},
        {"step": 9, "rng": torch.get_rng_state()}, threading.Event(), threading.Event())


def _into_ring(snapshot: Snapshot, ring: SlotRing) -> tuple[torch.Tensor, SharedSlot]:
    used: list[SharedSlot] = []

    def memory(nbytes: int) -> torch.Tensor:
        used.append(ring.acquire(nbytes))
        return used[-1].view(used[-1].capacity)

    target, length = codec.encode_snapshot_into(snapshot, memory)
    return target[:length], used[-1]


def test_slot_encoding_is_the_replication_encoding_byte_for_byte() -> None:
    snapshot = _snapshot()
    encoded, _ = _into_ring(snapshot, SlotRing())
    assert torch.equal(encoded, encode_snapshot(snapshot))
    decoded = decode_snapshot(encoded.clone())
    for name, piece in snapshot.pieces.items():
        for key, tensor in piece.tensors.items():
            assert torch.equal(decoded["pieces"][name]["tensors"][key], tensor)


def test_a_header_larger_than_guessed_gets_more_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_HEADER_GUESS", 8)  # far too small for any header
    snapshot = _snapshot()
    asked: list[int] = []

    def exact(nbytes: int) -> torch.Tensor:
        asked.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    target, length = codec.encode_snapshot_into(snapshot, exact)
    assert len(asked) == 2 and asked[1] > asked[0] and target.numel() == asked[1]
    assert torch.equal(target[:length], encode_snapshot(snapshot))


def _sent(ring: SlotRing, window_start: int, nbytes: int) -> SharedSlot:
    """A slot as the replication thread uses it: encoded into, then sent to the peers."""
    ring.advance(window_start)
    slot = ring.acquire(nbytes)
    ring.sent(slot)
    return slot


def test_slots_are_rewritten_only_after_four_window_changes() -> None:
    ring = SlotRing()
    first = _sent(ring, 0, 1000)
    held = [first] + [_sent(ring, start, 1000) for start in (1, 2, 3)]
    assert len({s.serial for s in held}) == 4  # peers may still read every one of these
    assert _sent(ring, 3, 1000) is not first  # same window: still no reuse
    assert _sent(ring, 4, 1000) is first  # four window changes later it is free
    assert ring.allocations == 5 and ring.nbytes() == ring.peak_bytes == 5 * first.capacity
    ring.abandon()  # a recovery superseded them: the next snapshot goes to a new slot
    assert ring.nbytes() == 0
    assert _sent(ring, 5, 1000).serial == 6


def test_a_slot_is_acknowledged_once_per_generation_on_both_sides() -> None:
    # Source and peer each track what the peer acknowledged, fed the same handles: they
    # agree on which handles need a message back without exchanging one.
    ring = SlotRing()
    first, second = _sent(ring, 0, 1000), _sent(ring, 1, 1000)
    source_side, peer_side = MappedSlots(), MappedSlots()

    def needs(slot: SharedSlot) -> bool:
        handle = SlotHandle.from_tensor(slot.handle(100, ring.generation).as_tensor())
        wanted = source_side.needs_acknowledgement(handle)
        assert peer_side.needs_acknowledgement(handle) == wanted
        if wanted:
            source_side.acknowledged(handle)
            peer_side.acknowledged(handle)
        return wanted

    assert [needs(first), needs(second), needs(first), needs(second)] == [
        True, True, False, False]
    assert peer_side.keys() == {(os.getpid(), ring.token, s.serial) for s in (first, second)}
    ring.abandon()  # closed slots: a new generation, in which nothing is acknowledged yet
    assert ring.generation == 1 and peer_side.keys()
    third = _sent(ring, 2, 1000)
    assert needs(third) and peer_side.keys() == {(os.getpid(), ring.token, third.serial)}
    assert not needs(third)


def test_closing_a_spare_slot_starts_a_new_generation() -> None:
    ring = SlotRing()
    for start, size in enumerate((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)):
        _sent(ring, start, size << 17)  # each larger than every free one
    assert len(ring.free) <= 4 and ring.generation >= 1
    assert ring.generation == ring.allocations - len(ring.free) - len(ring.in_use)


def test_a_larger_snapshot_gets_a_slot_that_fits() -> None:
    ring = SlotRing()
    small = _sent(ring, 0, 10)
    for start in (1, 2, 3, 4):
        _sent(ring, start, 10)
    large = _sent(ring, 5, 3 * small.capacity)  # the free one is too small
    assert large is not small and large.capacity >= 3 * small.capacity


_SOURCE = r"""
import sys, torch
from lightning_moe_ckpt.replication.shared_slots import SlotRing
slot = SlotRing().acquire(4096)
slot.view(4096).copy_(torch.arange(4096) % 251)
print(*slot.handle(4096, 0).as_tensor().tolist(), flush=True)
sys.stdin.read()  # until killed
"""


def test_a_mapped_slot_outlives_its_process() -> None:
    source = subprocess.Popen([sys.executable, "-c", _SOURCE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert source.stdout is not None
        ready, _, _ = select.select([source.stdout], [], [], BOUNDED_S)
        assert ready, "the source process printed no handle"
        line = source.stdout.readline()
        handle = SlotHandle.from_tensor(torch.tensor([int(v) for v in line.split()]))
        assert handle.pid == source.pid
        view = SlotMapper().view(handle)  # the mapper's cache may go: the view keeps it
        os.kill(source.pid, signal.SIGKILL)
        assert source.wait(timeout=BOUNDED_S) == -signal.SIGKILL
        assert not os.path.exists(f"/proc/{source.pid}")  # really gone
        assert torch.equal(view, (torch.arange(4096) % 251).to(torch.uint8))
    finally:
        if source.poll() is None:
            source.kill()
            source.wait(timeout=BOUNDED_S)


def test_a_slot_whose_descriptor_names_another_file_now_is_not_mapped() -> None:
    """A source closed a slot and its descriptor number went to another file: a peer
    mapping the old handle gets an OSError (as if the source died), not those bytes."""
    slot = SharedSlot(serial=7, capacity=4096, token=1)
    handle = slot.handle(100, 0)
    slot.close()
    other = os.memfd_create("another-file", os.MFD_CLOEXEC)
    try:
        os.ftruncate(other, 4096)
        if other != handle.fd:  # the number is normally reused at once
            os.dup2(other, handle.fd)
        with pytest.raises(OSError, match=r"slot 7 of process \d+ is gone: its descriptor"):
            SlotMapper().view(handle)
        fitting = SharedSlot(serial=8, capacity=4096, token=1)
        try:  # a live slot maps
            assert SlotMapper().view(fitting.handle(100, 0)).numel() == 100
        finally:
            fitting.close()
    finally:
        os.close(handle.fd)
        if other != handle.fd:
            os.close(other)


def test_mapped_snapshots_are_never_reused_as_receive_buffers() -> None:
    store = ReplicaStore()
    ring = SlotRing()
    mapper = SlotMapper()
    mapped_bytes = 0
    for start in range(4):
        slot = _sent(ring, start, 64)
        slot.view(64).fill_(start)
        handle = slot.handle(64, ring.generation)
        store.put(1, start, start, mapper.view(handle), slot=slot_key(handle))
        store.put(2, start, start, torch.full((64,), start, dtype=torch.uint8))
        mapped_bytes = 64 * min(start + 1, 2)
    # Windows 0 and 1 of both sources were dropped: only source 2's copies are spares.
    assert store.spare[64] and all(int(b[0]) in (0, 1) for b in store.spare[64])
    assert len(store.spare[64]) == 2
    assert store.mapped_nbytes() == mapped_bytes
    assert store.nbytes() == 2 * 64 + 2 * 64  # own copies held and spares, not mappings
    assert len(store.mapped_slots()) == 2
    store.clear()
    assert store.mapped_nbytes() == 0 and not store.mapped
