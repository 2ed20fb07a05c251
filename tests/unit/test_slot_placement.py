"""Snapshots copied straight into shared slots: the framing around placed pieces decodes
to the same bits as the replication encoding, a flipped bit in a placed piece is refused,
a slot is not rewritten while the store holds it or a peer may (replication lagging more
than four windows included), and memory stays bounded over 2,000 steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from lightning_moe_ckpt.replication import slot_placement
from lightning_moe_ckpt.replication.replica_store import ReplicaStore
from lightning_moe_ckpt.replication.shared_slots import SlotRing
from lightning_moe_ckpt.replication.slot_placement import SlotPlacement, encode_in_slot
from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.snapshots.checksum import bytes_checksum, raw_bytes
from lightning_moe_ckpt.snapshots.codec import (
    CorruptCheckpointError,
    decode_snapshot,
    encode_snapshot,
    snapshot_header,
)
from lightning_moe_ckpt.snapshots.piece_blob import PIECE_ALIGNMENT
from lightning_moe_ckpt.snapshots.snapshot import HostBufferPool, Snapshot
from lightning_moe_ckpt.snapshots.store import SnapshotStore
from lightning_moe_ckpt.training.engine import TrainingEngine
from moe_recipes.settings import settings_from_config
from tests.unit.capture_plans import Plan, round_robin


def _engine() -> TrainingEngine:
    settings = settings_from_config(OmegaConf.create({
        "model": {"max_seq_len": 16}, "data": {"seq_len": 16},
        "trainer": {"precision": "32", "global_batch": 8, "max_steps": 10}}))
    engine = TrainingEngine.local(settings)
    tokens = torch.randint(0, 256, (2, 4, 17), generator=torch.Generator().manual_seed(0))
    engine.train_iteration(tokens[..., :-1], tokens[..., 1:])  # optimizer state exists
    return engine


def _captured(engine: TrainingEngine) -> list[torch.Tensor]:
    """Every tensor a snapshot captures: parameters, master weights, optimizer state."""
    tensors = [p.detach() for p in engine.model.parameters()]
    for master, state in engine.optimizer.inner.state.items():
        tensors += [master.detach(), *(v for v in state.values() if v.is_floating_point())]
    return tensors


def _taken(snapshots: SnapshotCapture, plan: Plan, placement: SlotPlacement | None,
           metadata: dict | None = None) -> Snapshot:
    snapshot = snapshots.issue(plan, metadata or {"step": plan.iteration},  # type: ignore[arg-type]
                               placement)
    snapshots.wait_copies()
    snapshot.checksummed.wait()
    return snapshot


def test_a_placed_snapshot_decodes_to_the_bits_of_the_replication_encoding() -> None:
    engine = _engine()
    names = tuple(engine.registry.names)
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"))
    placement = SlotPlacement(SlotRing())
    metadata = {"step": 4, "rng": torch.get_rng_state()}
    snapshot = _taken(snapshots, round_robin(names, 4, 3), placement, metadata)
    assert snapshot.backing is not None and snapshots.pool.allocations == 0
    data, slot = encode_in_slot(snapshot, placement)
    assert slot is snapshot.backing.slot  # framed in place, not copied
    header = snapshot_header(data)["pieces"]
    for (offset, head), name in zip(snapshot.backing.layout.heads, snapshot.pieces, strict=True):
        assert header[name]["offset"] == offset
        assert (offset + len(head)) % PIECE_ALIGNMENT == 0  # tensor bytes 64-byte aligned
    placed, reference = decode_snapshot(data.clone()), decode_snapshot(encode_snapshot(snapshot))
    assert placed["pieces"].keys() == reference["pieces"].keys() == snapshot.pieces.keys()
    for name, piece in reference["pieces"].items():
        assert placed["pieces"][name]["checksum"] == piece["checksum"]
        for key, tensor in piece["tensors"].items():
            assert torch.equal(placed["pieces"][name]["tensors"][key], tensor)
    assert torch.equal(placed["metadata"]["rng"], metadata["rng"])
    # The same plan shape again: the slot's views are reused, nothing new is built.
    slot.epoch, slot.store_held = -(1 << 62), False  # as if long sent and released
    again = _taken(snapshots, round_robin(names, 4, 3), placement)
    assert again.backing is not None and again.backing.slot is slot
    assert again.backing.buffers is snapshot.backing.buffers
    snapshots.close()


@settings(max_examples=60, deadline=None)
@given(position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7),
       which=st.integers(0, 1 << 10))
def test_a_flipped_bit_anywhere_in_a_placed_piece_is_refused(position: float, bit: int,
                                                             which: int) -> None:
    engine = _ENGINE
    names = tuple(engine.registry.names)
    placement = SlotPlacement(SlotRing())
    snapshot = _taken(_SNAPSHOTS, round_robin(names, 7, 2), placement)
    data, _ = encode_in_slot(snapshot, placement)
    pieces = snapshot_header(data)["pieces"]
    name = sorted(pieces)[which % len(pieces)]
    entry = pieces[name]
    damaged = data.clone()
    damaged[entry["offset"] + int(position * entry["length"])] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError, match=f"operator '{name}', iteration 7"):
        decode_snapshot(damaged)


_ENGINE = _engine()
_SNAPSHOTS = SnapshotCapture(_ENGINE.registry, _ENGINE.state, 0, torch.device("cpu"))


def test_a_header_that_outgrows_its_room_is_copied_into_another_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slot_placement, "_HEADER_ROOM", 8)  # far too small for any header
    engine = _engine()
    names = tuple(engine.registry.names)
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"))
    ring = SlotRing()
    placement = SlotPlacement(ring)
    metadata = {"big": torch.zeros(1 << 23, dtype=torch.uint8)}  # an 8 MiB header
    snapshot = _taken(snapshots, round_robin(names, 0, 1), placement, metadata)
    assert snapshot.backing is not None
    data, slot = encode_in_slot(snapshot, placement)
    assert slot is not snapshot.backing.slot and placement.header_room == 16
    assert snapshot.backing.slot.epoch is not None  # nothing of it was sent: reusable
    decoded = decode_snapshot(data.clone())
    for name, piece in snapshot.pieces.items():
        for key, tensor in piece.tensors.items():
            assert torch.equal(decoded["pieces"][name]["tensors"][key], tensor)
    snapshots.close()


def test_a_placed_slot_waits_for_its_store_and_four_windows_after_it_was_sent() -> None:
    ring = SlotRing()
    placed = ring.acquire(1000, store_held=True)
    ring.advance(0)
    ring.sent(placed)
    for start in range(1, 9):  # the replication thread moves on; the store still holds it
        ring.advance(start)
        other = ring.acquire(1000)
        assert other is not placed
        ring.sent(other)
    ring.release_store(placed)
    assert ring.acquire(1000) is placed
    # Store released, replication not yet done with it: not rewritten either.
    lagging = ring.acquire(1000, store_held=True)
    ring.release_store(lagging)
    for start in range(9, 20):
        ring.advance(start)
        assert ring.acquire(1000) is not lagging
    ring.sent(lagging, to_peers=False)  # sent to no peer (replication stopped): free at once
    assert ring.acquire(1000) is lagging


@pytest.mark.parametrize(("lag_windows", "steps"), [(0, 800), (6, 1000)])
def test_no_slot_a_peer_holds_is_rewritten_and_memory_stays_bounded(lag_windows: int,
                                                                    steps: int) -> None:
    """Up to 1,000 steps: the store holds its windows, a replication thread lagging behind the
    snapshots (by more than four windows in one case) sends them, and a peer keeps its two
    newest windows as mappings. Every held snapshot keeps the bytes it was sent with."""
    engine = _engine()
    names = tuple(engine.registry.names)
    pool = HostBufferPool(pin_memory=False)
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"), pool)
    store = SnapshotStore(pool, replicas=1)
    ring = SlotRing()
    placement = SlotPlacement(ring)
    peer = ReplicaStore()
    sent_crc: dict[tuple[int, int], int] = {}  # of the bytes as they were sent
    queued: list[Snapshot] = []
    window = 2
    lag = lag_windows * window
    slot_bytes = []

    in_transit: list[tuple[int, int, torch.Tensor, int]] = []

    def replicate(snapshot: Snapshot) -> None:
        data, slot = encode_in_slot(snapshot, placement)
        ring.sent(slot)
        start = snapshot.plan.window_start
        sent_crc[(start, snapshot.step)] = bytes_checksum(raw_bytes(data))
        # The peer files a snapshot only by the time the next one is sent.
        for held in in_transit:
            peer.put(0, *held[:3], slot=(0, 0, held[3]))
        in_transit[:] = [(start, snapshot.step, data, slot.serial)]
        store.mark_replicated(start, snapshot.step)

    def check(step: int) -> None:
        """Whatever the peer holds or was sent still has the bytes it was sent with."""
        held = [(start, held_step, data) for start, steps_held in peer.windows[0].items()
                for held_step, data in steps_held.items()]
        for start, held_step, data in [*held, *(h[:3] for h in in_transit)]:
            assert bytes_checksum(raw_bytes(data)) == sent_crc[(start, held_step)], (
                step, held_step)

    captured = _captured(engine)
    for step in range(steps):
        torch._foreach_add_(captured, 1.0)  # new values every step (cheaper than training)
        snapshot = _taken(snapshots, round_robin(names, step, window), placement)
        check(step)  # the copy went to a slot nobody may read
        assert snapshot.backing is not None
        store.add(snapshot)
        queued.append(snapshot)
        while len(queued) > lag:
            replicate(queued.pop(0))
        store.refresh()
        check(step)
        if peer.windows[0]:  # what the peer dropped is of no more interest
            oldest = min(peer.windows[0])
            sent_crc = {key: value for key, value in sent_crc.items() if key[0] >= oldest}
        slot_bytes.append(ring.nbytes())
    for snapshot in queued:
        replicate(snapshot)
    for held in in_transit:
        peer.put(0, *held[:3], slot=(0, 0, held[3]))
    # The newest persisted window decodes to what the store holds, bit for bit.
    store.refresh()
    persisted = store.persisted()
    assert persisted is not None and persisted.start == steps - window
    for step, snapshot in persisted.snapshots.items():
        decoded = decode_snapshot(peer.windows[0][persisted.start][step].clone())
        for name, piece in snapshot.pieces.items():
            for key, tensor in piece.tensors.items():
                assert torch.equal(decoded["pieces"][name]["tensors"][key], tensor)
    assert pool.allocations == 0  # every snapshot went straight into a slot
    # The store's snapshots lie in the slots: none in host buffers of its own.
    assert store.peak_bytes > 0 and store.peak_own_bytes == 0 == store.own_bytes()
    assert max(slot_bytes[500:]) == max(slot_bytes[:500])  # no growth after warm-up
    # Slots: the store's windows (lag included), four sent windows, spares.
    per_slot = max(s.capacity for s in [*ring.in_use, *ring.free])
    assert ring.peak_bytes <= (window * (lag_windows + 6) + 4) * per_slot
    snapshots.close()
