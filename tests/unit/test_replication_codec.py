"""Snapshot serialisation for replication: round trip and corruption detection."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from lightning_moe_ckpt.replication.replicator import (
    CorruptCheckpointError,
    decode_snapshot,
    encode_snapshot,
)
from lightning_moe_ckpt.snapshots.checksum import tensor_checksum
from lightning_moe_ckpt.snapshots.snapshot import Snapshot, SnapshotPiece


@dataclass(frozen=True)
class Plan:
    iteration: int = 7
    window_start: int = 6
    window: int = 3


def _snapshot() -> Snapshot:
    tensors = {"layers.0.moe.experts.1.w1.weight/master": torch.randn(4, 3),
               "layers.0.moe.experts.1.w1.weight/step": torch.tensor(3.0)}
    piece = SnapshotPiece("layers.0.moe.experts.1", "master", tensors, tensor_checksum(tensors))
    snapshot = Snapshot(7, 2, Plan(), {"layers.0.moe.experts.1": piece},  # type: ignore[arg-type]
                        {"step": 7}, threading.Event(), threading.Event())
    return snapshot


def test_round_trip_is_bitwise() -> None:
    snapshot = _snapshot()
    decoded = decode_snapshot(encode_snapshot(snapshot))
    assert decoded["rank"] == 2 and decoded["step"] == 7 and decoded["window_start"] == 6
    piece = decoded["pieces"]["layers.0.moe.experts.1"]
    for name, tensor in snapshot.pieces["layers.0.moe.experts.1"].tensors.items():
        assert torch.equal(piece["tensors"][name], tensor)


def test_corrupted_piece_names_rank_operator_and_iteration() -> None:
    snapshot = _snapshot()
    piece = snapshot.pieces["layers.0.moe.experts.1"]
    piece.tensors["layers.0.moe.experts.1.w1.weight/master"][1, 1] += 1.0  # after checksumming
    with pytest.raises(CorruptCheckpointError,
                       match=r"rank 2, operator 'layers\.0\.moe\.experts\.1', iteration 7"):
        decode_snapshot(encode_snapshot(snapshot))


def test_metadata_tensors_and_rng_states_survive_the_header_bitwise() -> None:
    from lightning_moe_ckpt.core.rng import rng_state

    snapshot = _snapshot()
    metadata = {"rng": rng_state(), "clip_coef": torch.tensor(0.25),
                "mixed": [torch.ones(2, 3, dtype=torch.bfloat16), torch.tensor([True, False]),
                          torch.empty(0, 4), torch.arange(6).reshape(2, 3)[:, 1]]}
    snapshot.metadata = metadata
    decoded = decode_snapshot(encode_snapshot(snapshot))["metadata"]
    assert decoded["rng"]["cpu"] == metadata["rng"]["cpu"]
    assert decoded["rng"]["python"] == metadata["rng"]["python"]
    assert decoded["rng"]["numpy"] == metadata["rng"]["numpy"]
    assert decoded["clip_coef"].dtype == torch.float32 and float(decoded["clip_coef"]) == 0.25
    for got, want in zip(decoded["mixed"], metadata["mixed"], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
