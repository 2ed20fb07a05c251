"""Integrity of stored pieces: one flipped bit anywhere is caught before anything loads.

Properties over random pieces (dtypes, shapes, several tensors per piece): a bit flipped in
a host piece's tensor makes :meth:`SnapshotPiece.verify` fail, and a bit flipped anywhere
in a piece's bytes inside an encoded snapshot (tensor data, names, container) makes
:func:`decode_snapshot` raise :class:`CorruptCheckpointError` naming the piece.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.snapshots.checksum import (
    bytes_checksum,
    raw_bytes,
    reseed_checksum,
    tensor_checksum,
)
from lightning_moe_ckpt.snapshots.codec import (
    CorruptCheckpointError,
    decode_snapshot,
    encode_snapshot,
    encode_snapshot_into,
    snapshot_header,
)
from lightning_moe_ckpt.snapshots.snapshot import PieceBuffers, PieceLayout, Snapshot, SnapshotPiece

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Plan:
    iteration: int = 5
    window_start: int = 4
    window: int = 2


@st.composite
def pieces(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """1-3 tensors of random dtype and shape (a 0-d one included, like AdamW's step)."""
    count = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        raw = torch.randint(0, 256, (*shape, torch.empty((), dtype=dtype).element_size()),
                            dtype=torch.uint8, generator=generator)
        tensors[f"layers.0.moe.experts.{i}.w/field{i}"] = raw.view(dtype).reshape(shape)
    return tensors


def _snapshot(tensors: dict[str, torch.Tensor], pooled: bool = False) -> Snapshot:
    """A snapshot of ``tensors`` and a small second piece; ``pooled``: in host buffers as the
    snapshot capture's copy thread fills and checksums them."""
    piece = (_pooled_piece("layers.0.moe.experts.1", tensors) if pooled else
             SnapshotPiece("layers.0.moe.experts.1", "master", tensors, tensor_checksum(tensors)))
    other = {"head.weight": torch.ones(2, 2)}
    return Snapshot(5, 3, Plan(), {  # type: ignore[arg-type]
        "layers.0.moe.experts.1": piece,
        "head": SnapshotPiece("head", "compute", other, tensor_checksum(other))},
        {"step": 5}, threading.Event(), threading.Event())


def _pooled_piece(operator: str, tensors: dict[str, torch.Tensor]) -> SnapshotPiece:
    buffers = PieceBuffers.allocate(PieceLayout.of(operator, "master", tensors), pin_memory=False)
    for name, tensor in tensors.items():
        buffers.tensors[name].copy_(tensor)
    return SnapshotPiece(operator, "master", buffers.tensors, buffers.checksum(), buffers=buffers)


def _encoded_into_memory(snapshot: Snapshot) -> torch.Tensor:
    """``snapshot`` encoded as replication encodes it into a shared slot."""
    target, length = encode_snapshot_into(
        snapshot, lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    return target[:length]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _flip(tensor: torch.Tensor, bit: int) -> None:
    """Flip bit ``bit`` (modulo the tensor's size in bits) of ``tensor`` in place."""
    flat = _bits(tensor)
    bit %= flat.numel() * 8
    flat[bit // 8] ^= 1 << (bit % 8)


@settings(max_examples=200, deadline=None)
@given(tensors=pieces(), which=st.integers(0, 2), bit=st.integers(0, 2**20))
def test_a_flipped_bit_in_a_host_piece_fails_verification(
        tensors: dict[str, torch.Tensor], which: int, bit: int) -> None:
    piece = SnapshotPiece("op", "master", tensors, tensor_checksum(tensors))
    assert piece.verify()
    _flip(tensors[sorted(tensors)[which % len(tensors)]], bit)
    assert not piece.verify()


@settings(max_examples=150, deadline=None)
@given(tensors=pieces(), position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_anywhere_in_an_encoded_piece_is_refused(
        tensors: dict[str, torch.Tensor], position: float, bit: int) -> None:
    encoded = encode_snapshot(_snapshot(tensors))
    decoded = decode_snapshot(encoded)["pieces"]["layers.0.moe.experts.1"]["tensors"]
    for name, tensor in tensors.items():  # bitwise, NaN payloads included
        assert torch.equal(_bits(decoded[name]), _bits(tensor))
    entry = snapshot_header(encoded)["pieces"]["layers.0.moe.experts.1"]
    damaged = encoded.clone()
    damaged[entry["offset"] + int(position * entry["length"])] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError,
                       match=r"rank 3, operator 'layers\.0\.moe\.experts\.1', iteration 5"):
        decode_snapshot(damaged)


@settings(max_examples=150, deadline=None)
@given(tensors=pieces(), which=st.integers(0, 2), bit=st.integers(0, 2**20))
def test_a_flipped_bit_in_tensor_data_is_refused_by_the_tensor_checksum_alone(
        tensors: dict[str, torch.Tensor], which: int, bit: int) -> None:
    """Encodings from before the frame checksum still refuse damaged tensor data."""
    snapshot = _snapshot({k: v.clone() for k, v in tensors.items()})
    _flip(snapshot.pieces["layers.0.moe.experts.1"].tensors[sorted(tensors)[which % len(tensors)]],
          bit)  # after checksumming: the bytes were damaged while stored
    encoded = encode_snapshot(snapshot)
    # The frame checksum is computed at encoding, after the damage: only the tensor
    # checksum (computed when the copy was made) can catch it.
    with pytest.raises(CorruptCheckpointError, match=r"operator 'layers\.0\.moe\.experts\.1'"):
        decode_snapshot(encoded)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=4096), seed=st.integers(0, 2**32 - 1),
       new_seed=st.integers(0, 2**32 - 1))
def test_a_reseeded_checksum_equals_the_checksum_from_the_new_seed(
        data: bytes, seed: int, new_seed: int) -> None:
    assert (reseed_checksum(bytes_checksum(data, seed), seed, new_seed, len(data))
            == bytes_checksum(data, new_seed))


@settings(max_examples=150, deadline=None)
@given(tensors=pieces(), position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7),
       into_memory=st.booleans())
def test_a_flipped_bit_anywhere_in_an_encoded_pooled_piece_is_refused(
        tensors: dict[str, torch.Tensor], position: float, bit: int, into_memory: bool) -> None:
    """Pooled pieces (the copy thread's) get their frame checksum from the tensor
    checksum, without a pass over the bytes: it must equal the encoded blob's CRC32C."""
    snapshot = _snapshot(tensors, pooled=True)
    encoded = _encoded_into_memory(snapshot) if into_memory else encode_snapshot(snapshot)
    entry = snapshot_header(encoded)["pieces"]["layers.0.moe.experts.1"]
    blob = raw_bytes(encoded)[entry["offset"]:entry["offset"] + entry["length"]]
    assert entry["frame_checksum"] == bytes_checksum(blob)
    decoded = decode_snapshot(encoded)["pieces"]["layers.0.moe.experts.1"]["tensors"]
    for name, tensor in tensors.items():
        assert torch.equal(_bits(decoded[name]), _bits(tensor))
    damaged = encoded.clone()
    damaged[entry["offset"] + int(position * entry["length"])] ^= 1 << bit
    with pytest.raises(CorruptCheckpointError, match=r"operator 'layers\.0\.moe\.experts\.1'"):
        decode_snapshot(damaged)


@settings(max_examples=100, deadline=None)
@given(tensors=pieces(), which=st.integers(0, 2), bit=st.integers(0, 2**20))
def test_a_pooled_piece_damaged_after_its_checksum_is_refused_by_both_checksums(
        tensors: dict[str, torch.Tensor], which: int, bit: int) -> None:
    """Damage to a host buffer between its checksum and its encoding: the derived frame
    checksum is that of the bytes as they should be, so the frame fails as well."""
    snapshot = _snapshot(tensors, pooled=True)
    piece = snapshot.pieces["layers.0.moe.experts.1"]
    _flip(piece.tensors[sorted(tensors)[which % len(tensors)]], bit)
    encoded = _encoded_into_memory(snapshot)
    entry = snapshot_header(encoded)["pieces"]["layers.0.moe.experts.1"]
    blob = raw_bytes(encoded)[entry["offset"]:entry["offset"] + entry["length"]]
    assert entry["frame_checksum"] != bytes_checksum(blob)
    with pytest.raises(CorruptCheckpointError, match=r"operator 'layers\.0\.moe\.experts\.1'"):
        decode_snapshot(encoded)
