"""Byte encoding of snapshots for replication and disk, piece by piece.

An encoded snapshot is ``MAGIC`` (which names the format's version), then one blob per
piece, then a header (step, rank, window, metadata and, per piece, its kind, checksum and
byte range, as :mod:`.wire` values), then the trailer: the header's CRC32C (4 bytes) and
its length (8 bytes), little-endian. A header that fails its checksum, or that decodes to
anything but a snapshot header whose byte ranges lie inside the encoding, is refused with
:class:`~lightning_moe_ckpt.errors.CorruptCheckpointError` before any piece is read, and
so is every piece whose bytes do not decode, whatever the damage: a replica holder that
hands out such bytes is passed over for the next one. A
piece's blob is its layout (tensor names, dtypes and shapes, a :mod:`.wire` value behind
its length) and then the tensors' raw bytes back to back in name order
(:mod:`.piece_blob`): encoding is one copy of the bytes. Nothing is unpickled: bytes from
another process are decoded by :mod:`.wire` alone, and bytes of any other format (another
magic) are refused with :class:`SnapshotFormatError` before anything is read. Because the
pieces are separate blobs and the header comes with byte ranges, a replica peer can list
the operators a snapshot holds (:func:`snapshot_header`) and cut pieces out of it
(:func:`extract_pieces`, :func:`split_pieces`) without deserialising any tensor: that is
what lets the partial baselines keep each operator's newest save after its snapshot's
window was dropped. Each piece carries two checksums: ``checksum``, over its tensors
(computed where the copy was made, it travels with the piece through every encoding), and
``frame_checksum``, over its encoded bytes (so a flipped bit outside the tensor data, in a
name, a shape or the container, is caught as well). :func:`decode_snapshot` verifies both
and names rank, operator and iteration of a corrupt piece.

:func:`encode_snapshot_into` writes the same bytes into memory the caller provides (a
shared-memory slot that same-node replica peers map, :mod:`.shared_slots`): the piece
bytes are copied by torch, which releases the GIL, so the training thread keeps running.
:func:`encode_around_pieces` writes no piece bytes at all: the snapshot was copied into
the slot at the places :func:`~.piece_blob.aligned_layout_head` leaves for them, and only
the framing goes around them.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from lightning_moe_ckpt.core.wire import dumps, loads
from lightning_moe_ckpt.errors import CorruptCheckpointError, SnapshotFormatError, WireFormatError
from lightning_moe_ckpt.snapshots.checksum import (
    bytes_checksum,
    raw_bytes,
    tensor_checksum,
)
from lightning_moe_ckpt.snapshots.piece_blob import (
    frame_checksum,
    layout_head,
    pooled_layout_head,
    read_piece,
)
from lightning_moe_ckpt.snapshots.snapshot import Snapshot

MAGIC = b"MOESNAP5"  # the format's version: any other is refused, never read
_TRAILER = struct.Struct("<IQ")  # the header's CRC32C and length, the encoding's last bytes
TRAILER_BYTES = _TRAILER.size
_HEADER_GUESS = 1 << 16  # room left for the header when encoding into given memory


def _snapshot_fields(snapshot: Snapshot) -> dict[str, Any]:
    """The header's fields other than its piece index."""
    return {"step": snapshot.step, "rank": snapshot.rank,
            "window_start": snapshot.plan.window_start, "window": snapshot.plan.window,
            "metadata": snapshot.metadata}


def _snapshot_payload(snapshot: Snapshot) -> dict[str, Any]:
    return {
        **_snapshot_fields(snapshot),
        "pieces": {name: {"kind": piece.kind, "checksum": piece.checksum,
                          "tensors": piece.tensors,
                          "raw": None if piece.buffers is None else piece.buffers.raw,
                          "block": None if piece.buffers is None else piece.buffers.block,
                          "names_crc": None if piece.buffers is None else piece.buffers.names_crc,
                          "head": (layout_head(piece.tensors) if piece.buffers is None
                                   else pooled_layout_head(piece.buffers.key))}
                   for name, piece in snapshot.pieces.items()},
    }


def encode_snapshot(snapshot: Snapshot) -> torch.Tensor:
    """Serialise a snapshot (pieces, checksums, metadata) into a byte tensor."""
    return encode_payload(_snapshot_payload(snapshot))


class _MemoryWriter:
    """``write``/``tell`` over caller-provided memory, as :class:`io.BytesIO` offers them."""

    def __init__(self, memory: torch.Tensor) -> None:
        self.memory = memory  # uint8
        self.data = raw_bytes(memory)
        self.offset = 0

    def write(self, data: bytes | memoryview) -> None:
        end = self.offset + len(data)
        self.data[self.offset:end] = data
        self.offset = end

    def write_tensor(self, block: torch.Tensor) -> None:
        """Append a contiguous tensor's bytes (a torch copy: the GIL is released)."""
        end = self.offset + block.numel() * block.element_size()
        self.memory[self.offset:end].copy_(block.reshape(-1).view(torch.uint8))
        self.offset = end

    def tell(self) -> int:
        return self.offset


def encode_snapshot_into(snapshot: Snapshot,
                         memory: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Encode ``snapshot`` as :func:`encode_snapshot` does, into ``memory(nbytes)`` (a uint8
    tensor of at least ``nbytes``). The header's size is known only once the pieces are
    written, so ``memory`` is asked again, for more, if the first one is too small for it
    (then the pieces are written again). Returns the memory used and the encoded length."""
    payload = _snapshot_payload(snapshot)
    blobs = sum(len(entry["head"]) + piece.nbytes
                for entry, piece in zip(payload["pieces"].values(), snapshot.pieces.values(),
                                        strict=True))
    header_bytes = _HEADER_GUESS
    while True:
        target = memory(len(MAGIC) + blobs + header_bytes + TRAILER_BYTES)
        writer = _MemoryWriter(target)
        header = _write_pieces(writer, payload)
        encoded = _header_bytes(header)
        if writer.tell() + len(encoded) + TRAILER_BYTES <= target.numel():
            writer.write(encoded)
            writer.write(_trailer(encoded))
            return target, writer.tell()
        header_bytes = 2 * len(encoded)


def encode_payload(payload: dict[str, Any]) -> torch.Tensor:
    """Encode a payload shaped like :func:`decode_snapshot`'s result (checksums as given)."""
    buffer = io.BytesIO()
    return _finish(buffer, _write_pieces(buffer, payload))


def _write_pieces(writer: io.BytesIO | _MemoryWriter, payload: dict[str, Any]) -> dict[str, Any]:
    """Write ``MAGIC`` and every piece's blob; returns the header that indexes them."""
    writer.write(MAGIC)
    index: dict[str, dict[str, Any]] = {}
    for name, piece in payload["pieces"].items():
        offset = writer.tell()
        frame = _write_piece(writer, piece.get("head") or layout_head(piece["tensors"]), piece)
        index[name] = {"kind": piece["kind"], "checksum": piece["checksum"],
                       "frame_checksum": frame, "offset": offset,
                       "length": writer.tell() - offset}
    return {**{k: v for k, v in payload.items() if k != "pieces"}, "pieces": index}


def encode_around_pieces(snapshot: Snapshot, memory: torch.Tensor,
                         heads: Sequence[tuple[int, bytes]], end: int) -> int | None:
    """Frame a snapshot whose pieces already lie in ``memory`` (uint8): each piece's tensor
    bytes right after the place of its head, ``heads`` giving (offset, head from
    :func:`~.piece_blob.aligned_layout_head`) per piece in the snapshot's order, the last
    piece ending at ``end``. Writes ``MAGIC``, the heads, the header and its length; no
    piece byte is written, nor read where a piece has its checksum (its frame checksum
    follows from it; a piece whose copy was cut short has none, and its bytes are read).
    Returns the encoded length, the same bytes :func:`encode_snapshot` would give but for
    the heads' padding, or None when the header does not fit behind ``end`` or the
    snapshot's pieces are not (or no longer, a store let go of them) those ``heads``
    frame."""
    pieces = snapshot.pieces  # read once: a store letting go swaps in an empty dict
    if len(pieces) != len(heads):
        return None
    data = raw_bytes(memory)
    data[:len(MAGIC)] = MAGIC
    index: dict[str, dict[str, Any]] = {}
    for (offset, head), (name, piece) in zip(heads, pieces.items(), strict=True):
        data[offset:offset + len(head)] = head
        buffers = piece.buffers
        assert buffers is not None  # placed pieces are views into ``memory``
        index[name] = {"kind": piece.kind, "checksum": piece.checksum,
                       "frame_checksum": frame_checksum(head, buffers.raw, piece.checksum,
                                                         buffers.names_crc),
                       "offset": offset, "length": len(head) + piece.nbytes}
    encoded = _header_bytes({**_snapshot_fields(snapshot), "pieces": index})
    length = end + len(encoded) + TRAILER_BYTES
    if length > memory.numel():
        return None
    data[end:end + len(encoded)] = encoded
    data[length - TRAILER_BYTES:length] = _trailer(encoded)
    return length


def _write_piece(writer: io.BytesIO | _MemoryWriter, head: bytes, piece: dict[str, Any]) -> int:
    """Append one piece's blob (its layout ``head``, then the tensors' bytes in name order)
    to ``writer``; returns the blob's CRC32C.

    The piece may come with those bytes in place (``raw``; ``block``: the same as one
    tensor). A pooled piece also comes with its names' checksum (``names_crc``), the start
    of its tensor checksum: the blob's CRC32C then follows from the tensor checksum
    (:func:`reseed_checksum`) instead of a second pass over the bytes on the replication
    thread. It is the checksum of the bytes as they should be, so a bit flipped while
    they were written is caught on decode as well.
    """
    writer.write(head)
    raw, block = piece.get("raw"), piece.get("block")
    if raw is None:
        tensors = piece["tensors"]
        raw = tuple(raw_bytes(tensors[name].contiguous()) for name in sorted(tensors))
    if block is not None and isinstance(writer, _MemoryWriter):
        writer.write_tensor(block)
    else:
        for data in raw:
            writer.write(data)
    return frame_checksum(head, raw, piece["checksum"], piece.get("names_crc"))


def _header_bytes(header: dict[str, Any]) -> bytes:
    return dumps(header, "the snapshot header")


def _trailer(encoded_header: bytes) -> bytes:
    return _TRAILER.pack(bytes_checksum(encoded_header), len(encoded_header))


def _finish(buffer: io.BytesIO, header: dict[str, Any]) -> torch.Tensor:
    encoded = _header_bytes(header)
    buffer.write(encoded)
    buffer.write(_trailer(encoded))
    # Zero-copy: the tensor keeps the BytesIO's memory alive (torch.frombuffer holds a
    # reference to the exporting buffer).
    return torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)


def _bytes(data: torch.Tensor) -> memoryview:
    """The bytes of an encoded snapshot, without a copy."""
    return raw_bytes(data)


def _check_format(raw: memoryview) -> None:
    """Refuse bytes of any other format before reading anything of them."""
    magic = bytes(raw[:len(MAGIC)])
    if magic != MAGIC:
        raise SnapshotFormatError(
            f"an encoded snapshot starts with {magic!r}, not this version's {MAGIC!r}: "
            "snapshots of another format are refused, nothing of them is read")


def _header(raw: memoryview) -> dict[str, Any]:
    _check_format(raw)
    if len(raw) < len(MAGIC) + TRAILER_BYTES:
        raise SnapshotFormatError(f"an encoded snapshot of {len(raw)} bytes has no header")
    crc, length = _TRAILER.unpack(raw[-TRAILER_BYTES:])
    start = len(raw) - TRAILER_BYTES - length
    if start < len(MAGIC):
        raise SnapshotFormatError(f"an encoded snapshot of {len(raw)} bytes announces a "
                                  f"header of {length} bytes")
    encoded = raw[start:start + length]
    if bytes_checksum(encoded) != crc:
        raise CorruptCheckpointError(f"an encoded snapshot's header ({length} bytes) fails "
                                     "its checksum")
    try:
        header = loads(encoded)
    except WireFormatError as error:
        raise SnapshotFormatError(f"an encoded snapshot's header does not decode: {error}") \
            from error
    problem = _header_problem(header, start)
    if problem is not None:
        raise SnapshotFormatError(f"an encoded snapshot's header is not a snapshot header: "
                                  f"{problem}")
    return header


_ENTRY_TYPES = {"kind": (str,), "checksum": (int, type(None)), "frame_checksum": (int,),
                "offset": (int,), "length": (int,)}


def _header_problem(header: Any, end: int) -> str | None:
    """What makes a checksum-valid ``header`` no header of a snapshot whose pieces end at
    byte ``end`` (None: nothing)."""
    if not isinstance(header, dict) or not isinstance(header.get("pieces"), dict):
        return "it has no piece index"
    for key in ("step", "rank", "window_start", "window"):
        if type(header.get(key)) is not int:
            return f"its {key} is {header.get(key)!r}"
    for name, entry in header["pieces"].items():
        if not isinstance(name, str) or not isinstance(entry, dict):
            return f"piece {name!r} has no index entry"
        for key, types in _ENTRY_TYPES.items():
            if type(entry.get(key)) not in types:
                return f"piece {name!r} has {key}={entry.get(key)!r}"
        if not (len(MAGIC) <= entry["offset"] and entry["length"] >= 0
                and entry["offset"] + entry["length"] <= end):
            return (f"piece {name!r} spans bytes {entry['offset']}.."
                    f"{entry['offset'] + entry['length']}, outside the pieces' {end}")
    return None


def snapshot_header(data: torch.Tensor) -> dict[str, Any]:
    """Step, rank, window, metadata and per-piece ``kind``/``checksum`` of an encoded
    snapshot, without loading any piece's tensors."""
    return _header(_bytes(data))


def extract_pieces(data: torch.Tensor, names: Iterable[str]) -> torch.Tensor:
    """An encoded snapshot holding only the pieces ``names`` of ``data`` (no metadata),
    cut out byte for byte: checksums still cover exactly what they covered."""
    raw = _bytes(data)
    return _cut(raw, _header(raw), names)


def split_pieces(data: torch.Tensor, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """One single-piece encoded snapshot per name (the header is read once)."""
    raw = _bytes(data)
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
    payload = _header(raw)
    payload["pieces"] = {name: _load_piece(raw, entry, payload, name)
                         for name, entry in payload["pieces"].items()}
    for name, piece in payload["pieces"].items():
        if piece["checksum"] is None or tensor_checksum(piece["tensors"]) != piece["checksum"]:
            raise _corrupt(payload, name)
    return payload


def _load_piece(raw: memoryview, entry: dict[str, Any], payload: dict[str, Any],
                name: str) -> dict[str, Any]:
    blob = raw[entry["offset"]:entry["offset"] + entry["length"]]
    if bytes_checksum(blob) != entry["frame_checksum"]:
        raise _corrupt(payload, name)
    try:
        tensors = read_piece(blob)
    except Exception as error:  # checksummed, yet not a layout: refuse, never guess
        raise _corrupt(payload, name, f"does not decode ({type(error).__name__}: "
                                      f"{error})") from error
    return {"kind": entry["kind"], "checksum": entry["checksum"], "tensors": tensors}


def _corrupt(payload: dict[str, Any], name: str,
             what: str = "fails its checksum") -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint piece of rank {payload['rank']}, operator {name!r}, iteration "
        f"{payload['step']} {what}")
