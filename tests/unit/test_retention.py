"""Retention for the partial baselines: two windows plus at most one save per operator, and
every operator's newest save stays available (own store and replica peers alike)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe_ckpt.callbacks.sparse_checkpointing import SparseCheckpointing
from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.planning.planner import CapturePlan
from lightning_moe_ckpt.replication.retention import RetainingReplicaStore, RetainingSnapshotStore
from lightning_moe_ckpt.snapshots.checksum import tensor_checksum
from lightning_moe_ckpt.snapshots.codec import decode_snapshot, encode_snapshot
from lightning_moe_ckpt.snapshots.snapshot import (
    HostBufferPool,
    PieceLayout,
    Snapshot,
    SnapshotPiece,
)
from lightning_moe_ckpt.snapshots.store import SnapshotStore

EXPERTS = [f"layers.0.moe.experts.{e}" for e in range(4)]
NON_EXPERTS = ["embed", "layers.0.moe.gate"]


def _saved_experts(step: int) -> list[str]:
    """MoEtion-like choice: expert 3 is saved only at step 0, expert 2 every 5th step,
    experts 0 and 1 alternate."""
    if step == 0:
        return list(EXPERTS)
    return [EXPERTS[step % 2]] + ([EXPERTS[2]] if step % 5 == 0 else [])


def _snapshot(pool: HostBufferPool, step: int) -> Snapshot:
    names = NON_EXPERTS + _saved_experts(step)
    plan = CapturePlan(step, tuple(names), (), step, 0, 1, None)
    pieces = {}
    for name in names:
        buffers = pool.acquire(PieceLayout.of(name, "master",
                                              {f"{name}.w/master": torch.empty(8, 4)}))
        tensors = buffers.tensors
        tensors[f"{name}.w/master"].fill_(float(step))  # the value says when it was saved
        pieces[name] = SnapshotPiece(name, "master", tensors, tensor_checksum(tensors),
                                     buffers)
    snapshot = Snapshot(step, 0, plan, pieces, {"step": step})
    snapshot.copied.set()
    snapshot.checksummed.set()
    return snapshot


def _newest_saves(upto: int) -> dict[str, int]:
    newest: dict[str, int] = {}
    for step in range(upto + 1):
        for name in NON_EXPERTS + _saved_experts(step):
            newest[name] = step
    return newest


def test_local_store_keeps_each_operators_newest_save_and_no_more() -> None:
    pool = HostBufferPool(pin_memory=False)
    store = RetainingSnapshotStore(pool, replicas=1)
    piece_bytes = 8 * 4 * 4
    for step in range(23):
        snapshot = _snapshot(pool, step)
        store.add(snapshot)
        store.mark_replicated(step, step)
        store.refresh()
        assert len(store.windows) <= 2
        assert len(store.saves) <= len(EXPERTS + NON_EXPERTS)
        held: dict[str, int] = {}
        for record in store.windows.values():
            for s, snap in record.snapshots.items():
                for name in snap.pieces:
                    held[name] = max(held.get(name, s), s)
        for name, kept in store.saves.items():
            assert held.get(name, -1) < kept.step  # a retained save is never redundant
            held[name] = max(held.get(name, kept.step), kept.step)
            piece = kept.pieces[name]
            assert piece.verify() and bool((piece.tensors[f"{name}.w/master"] == kept.step).all())
        assert held == _newest_saves(step)  # every operator's newest save is still here
        window_bytes = sum(r.nbytes for r in store.windows.values())
        assert store.host_bytes() <= window_bytes + len(EXPERTS + NON_EXPERTS) * piece_bytes
    assert store.saves["layers.0.moe.experts.3"].step == 0  # saved once, kept throughout
    store.clear_saves()
    assert store.saves == {} and store.host_bytes() == sum(
        r.nbytes for r in store.windows.values())


def test_plain_store_forgets_old_saves() -> None:
    """The contrast the retaining store exists for: windows of one lose old experts."""
    pool = HostBufferPool(pin_memory=False)
    store = SnapshotStore(pool, replicas=1)
    for step in range(6):
        store.add(_snapshot(pool, step))
        store.mark_replicated(step, step)
        store.refresh()
    held = {name for record in store.windows.values() for snap in record.snapshots.values()
            for name in snap.pieces}
    assert "layers.0.moe.experts.3" not in held


def test_replica_store_keeps_each_operators_newest_save_and_no_more() -> None:
    pool = HostBufferPool(pin_memory=False)
    replicas = RetainingReplicaStore()
    for step in range(23):
        data = encode_snapshot(_snapshot(pool, step))
        replicas.put(source=3, window_start=step, step=step, data=data)
        windows = replicas.windows[3]
        assert len(windows) <= 2
        saves = replicas.held_saves(3)
        assert len(saves) <= len(EXPERTS + NON_EXPERTS)
        held: dict[str, int] = {}
        for steps in windows.values():
            for s, encoded in steps.items():
                for name in decode_snapshot(encoded)["pieces"]:
                    held[name] = max(held.get(name, s), s)
        for name, (saved_at, encoded) in saves.items():
            assert held.get(name, -1) < saved_at
            decoded = decode_snapshot(encoded)  # checksums verified
            assert list(decoded["pieces"]) == [name] and decoded["step"] == saved_at
            assert bool((decoded["pieces"][name]["tensors"][f"{name}.w/master"]
                         == saved_at).all())
            held[name] = max(held.get(name, saved_at), saved_at)
        assert held == _newest_saves(step)
    assert replicas.held_saves(3)["layers.0.moe.experts.3"][0] == 0
    replicas.clear()
    assert replicas.nbytes() == 0 and replicas.held_saves(3) == {}


@pytest.mark.parametrize("keep", [0, -1, 1.5, True])
def test_durable_keep_must_be_a_positive_integer(keep: object) -> None:
    with pytest.raises(ConfigError, match=rf"checkpoint\.durable_keep={keep!r}"):
        SparseCheckpointing("moevement", durable_every=1, durable_dir="d",
                            durable_keep=keep)  # type: ignore[arg-type]
