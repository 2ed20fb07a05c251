"""Byte encoding of snapshots for replication and disk, piece by piece.

An encoded snapshot is ``MAGIC``, then one blob per piece, then a header (``torch.save``
of step, rank, window, metadata and, per piece, its kind, checksum and byte range), then
the header's length as 8 little-endian bytes. A piece's blob is its layout (tensor names,
dtypes and shapes, pickled, behind its length) and then the tensors' raw bytes back to
back in name order: encoding is one copy of the bytes, where a ``torch.save`` per piece
(still read, from older encodings: the header says which) cost a zip archive each and
dominated the replication thread's time. Because the
pieces are separate blobs and the header comes with byte ranges, a replica peer can list
the operators a snapshot holds (:func:`snapshot_header`) and cut pieces out of it
(:func:`extract_pieces`, :func:`split_pieces`) without deserialising any tensor: that is
what lets the partial baselines keep each operator's newest save after its snapshot's
window was dropped.
Each piece carries two checksums: ``checksum``, over its tensors (computed where the copy
was made, it travels with the piece through every encoding), and ``frame_checksum``, over
its encoded bytes (so a flipped bit outside the tensor data, in a name, a shape or the
container, is caught as well). :func:`decode_snapshot` verifies both and names rank,
operator and iteration of a corrupt piece. Bytes without the magic prefix are read as the earlier
single-``torch.save`` encoding.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_moe_ckpt.checkpoint.snapshot import (
    Snapshot,
    bytes_checksum,
    raw_bytes,
    tensor_checksum,
)

MAGIC = b"MOESNAP2"
_LENGTH = struct.Struct("<Q")
_LAYOUT_LENGTH = struct.Struct("<I")
RAW_PIECES = "raw"  # the header's ``piece_format``: layout + raw bytes (absent: torch.save)


class CorruptCheckpointError(RuntimeError):
    """A checkpoint piece is missing or fails its checksum."""


def encode_snapshot(snapshot: Snapshot) -> torch.Tensor:
    """Serialise a snapshot (pieces, checksums, metadata) into a byte tensor."""
    return encode_payload({
        "step": snapshot.step, "rank": snapshot.rank,
        "window_start": snapshot.plan.window_start, "window": snapshot.plan.window,
        "metadata": snapshot.metadata,
        "pieces": {name: {"kind": piece.kind, "checksum": piece.checksum,
                          "tensors": piece.tensors,
                          "raw": None if piece.buffers is None else piece.buffers.raw}
                   for name, piece in snapshot.pieces.items()},
    })


def encode_payload(payload: dict[str, Any]) -> torch.Tensor:
    """Encode a payload shaped like :func:`decode_snapshot`'s result (checksums as given)."""
    buffer = io.BytesIO()
    buffer.write(MAGIC)
    index: dict[str, dict[str, Any]] = {}
    for name, piece in payload["pieces"].items():
        offset = buffer.tell()
        frame = _write_piece(buffer, piece["tensors"], piece.get("raw"))
        index[name] = {"kind": piece["kind"], "checksum": piece["checksum"],
                       "frame_checksum": frame, "offset": offset,
                       "length": buffer.tell() - offset}
    return _finish(buffer, {**{k: v for k, v in payload.items() if k != "pieces"},
                            "piece_format": RAW_PIECES, "pieces": index})


def _write_piece(buffer: io.BytesIO, tensors: Mapping[str, torch.Tensor],
                 raw: tuple[memoryview, ...] | None) -> int:
    """Append one piece's blob (layout, then the tensors' bytes in name order; ``raw``:
    those bytes already in place) to ``buffer``; returns the blob's CRC32C."""
    names = sorted(tensors)
    layout = pickle.dumps([(name, str(tensors[name].dtype).removeprefix("torch."),
                            tuple(tensors[name].shape)) for name in names], protocol=5)
    head = _LAYOUT_LENGTH.pack(len(layout)) + layout
    buffer.write(head)
    crc = bytes_checksum(head)
    for data in raw if raw is not None else (raw_bytes(tensors[n].contiguous()) for n in names):
        buffer.write(data)
        crc = bytes_checksum(data, crc)
    return crc


def _read_piece(blob: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a raw piece blob (own memory; the blob's checksum was verified)."""
    (length,) = _LAYOUT_LENGTH.unpack(blob[:_LAYOUT_LENGTH.size])
    start = _LAYOUT_LENGTH.size
    layout = pickle.loads(blob[start:start + length])
    offset = start + length
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype_name, shape in layout:
        dtype = getattr(torch, dtype_name)
        nbytes = math.prod(shape) * dtype.itemsize
        data = torch.frombuffer(blob[offset:offset + nbytes], dtype=torch.uint8)
        tensors[name] = data.clone().view(dtype).reshape(shape)
        offset += nbytes
    return tensors


def _finish(buffer: io.BytesIO, header: dict[str, Any]) -> torch.Tensor:
    start = buffer.tell()
    torch.save(header, buffer)
    buffer.write(_LENGTH.pack(buffer.tell() - start))
    # Zero-copy: the tensor keeps the BytesIO's memory alive (torch.frombuffer holds a
    # reference to the exporting buffer).
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def _bytes(data: torch.Tensor) -> memoryview:
    """The bytes of an encoded snapshot, without a copy."""
    return raw_bytes(data)


def _is_framed(raw: bytes | memoryview) -> bool:
    return bytes(raw[:len(MAGIC)]) == MAGIC


def _header(raw: memoryview) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(raw[-_LENGTH.size:])
    start = len(raw) - _LENGTH.size - length
    header: dict[str, Any] = torch.load(io.BytesIO(raw[start:start + length]),
                                        weights_only=False)
    return header


def snapshot_header(data: torch.Tensor) -> dict[str, Any]:
    """Step, rank, window, metadata and per-piece ``kind``/``checksum`` of an encoded
    snapshot, without loading any piece's tensors."""
    raw = _bytes(data)
    return _header(raw) if _is_framed(raw) else _legacy(raw)


def extract_pieces(data: torch.Tensor, names: Iterable[str]) -> torch.Tensor:
    """An encoded snapshot holding only the pieces ``names`` of ``data`` (no metadata),
    cut out byte for byte: checksums still cover exactly what they covered."""
    raw = _bytes(data)
    if not _is_framed(raw):  # earlier encoding: re-encode the selected pieces
        payload = _legacy(raw)
        return encode_payload({**payload, "metadata": None,
                               "pieces": {n: payload["pieces"][n] for n in names}})
    return _cut(raw, _header(raw), names)


def split_pieces(data: torch.Tensor, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """One single-piece encoded snapshot per name (the header is read once)."""
    raw = _bytes(data)
    if not _is_framed(raw):
        return {name: extract_pieces(data, [name]) for name in names}
    header = _header(raw)
    return {name: _cut(raw, header, [name]) for name in names}


def _cut(raw: memoryview, header: dict[str, Any], names: Iterable[str]) -> torch.Tensor:
    buffer = io.BytesIO()
    buffer.write(MAGIC)
    index = {}
    for name in names:
        entry = header["pieces"][name]
        offset = buffer.tell()
        buffer.write(raw[entry["offset"]:entry["offset"] + entry["length"]])
        index[name] = {**entry, "offset": offset}
    return _finish(buffer, {**header, "metadata": None, "pieces": index})


def decode_snapshot(data: torch.Tensor) -> dict[str, Any]:
    """Inverse of :func:`encode_snapshot`; raises if any piece fails its checksum."""
    raw = _bytes(data)
    if _is_framed(raw):
        payload = _header(raw)
        raw_pieces = payload.pop("piece_format", None) == RAW_PIECES
        payload["pieces"] = {name: _load_piece(raw, entry, payload, name, raw_pieces)
                             for name, entry in payload["pieces"].items()}
    else:
        payload = _legacy(raw)
    for name, piece in payload["pieces"].items():
        if piece["checksum"] is None or tensor_checksum(piece["tensors"]) != piece["checksum"]:
            raise _corrupt(payload, name)
    return payload


def _load_piece(raw: memoryview, entry: dict[str, Any], payload: dict[str, Any],
                name: str, raw_piece: bool) -> dict[str, Any]:
    blob = raw[entry["offset"]:entry["offset"] + entry["length"]]
    # Encodings from before the frame checksum have none: their tensor checksum remains.
    if "frame_checksum" in entry and bytes_checksum(blob) != entry["frame_checksum"]:
        raise _corrupt(payload, name)
    try:
        tensors = (_read_piece(blob) if raw_piece
                   else torch.load(io.BytesIO(blob), weights_only=False))
    except Exception as error:  # damaged bytes fail in any of unpickling's many ways
        raise _corrupt(payload, name) from error
    return {"kind": entry["kind"], "checksum": entry["checksum"], "tensors": tensors}


def _corrupt(payload: dict[str, Any], name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint piece of rank {payload['rank']}, operator {name!r}, iteration "
        f"{payload['step']} fails its checksum")


def _legacy(raw: memoryview) -> dict[str, Any]:
    payload: dict[str, Any] = torch.load(io.BytesIO(raw), weights_only=False)
    return payload
