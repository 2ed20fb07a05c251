"""One piece's blob in an encoded snapshot: layout head, raw bytes, frame checksum.

A piece's blob is its layout (tensor names, dtypes and shapes in name order, a
:mod:`.wire` value behind its length as 4 little-endian bytes), the length of the padding
that follows (4 bytes, then as many zero bytes) and then the tensors' raw bytes back to
back. The padding lets the tensor bytes start at a multiple of :data:`PIECE_ALIGNMENT`
(:func:`aligned_layout_head`: snapshots copied straight into shared memory). The blob's
CRC32C, its *frame checksum*, follows from the piece's tensor checksum where the piece has
one (:func:`frame_checksum`: CRC32C is affine in its starting value), so the replication
thread does not read the bytes a second time. Heads and the terms that turn a tensor
checksum into a frame checksum are cached per layout: a piece of the same layout recurs
every window. :mod:`.codec` frames blobs into snapshots."""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping

import torch

from lightning_moe_ckpt.core.wire import DTYPES, WireFormatError, dumps, loads
from lightning_moe_ckpt.snapshots.checksum import bytes_checksum, reseed_checksum

__all__ = ["PIECE_ALIGNMENT", "aligned_layout_head", "frame_checksum", "layout_head",
           "pooled_layout_head", "read_piece"]

_LAYOUT_LENGTH = struct.Struct("<I")
_PADDING_LENGTH = struct.Struct("<I")  # after the layout: zero bytes up to the tensor data


@functools.lru_cache(maxsize=4096)
def _layout_head_of(layout: tuple[tuple[str, str, tuple[int, ...]], ...]) -> bytes:
    encoded = dumps([list(entry) for entry in layout], "a piece layout")
    return _LAYOUT_LENGTH.pack(len(encoded)) + encoded + _PADDING_LENGTH.pack(0)


def layout_head(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """A piece blob's start: its layout (names, dtypes, shapes in name order), a
    :mod:`.wire` value behind its length, and no padding (cached: a piece of the same
    layout recurs every window)."""
    return _layout_head_of(tuple((name, str(tensors[name].dtype).removeprefix("torch."),
                                  tuple(tensors[name].shape)) for name in sorted(tensors)))


@functools.lru_cache(maxsize=4096)
def pooled_layout_head(key: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]) -> bytes:
    """:func:`layout_head` of pooled buffers, from their pool key ((name, shape, dtype) in
    name order): looked up, not rebuilt tensor by tensor, for every snapshot."""
    return _layout_head_of(tuple((name, str(dtype).removeprefix("torch."), shape)
                                 for name, shape, dtype in key))


PIECE_ALIGNMENT = 64  # where :func:`aligned_layout_head` lets a piece's tensor bytes begin


@functools.lru_cache(maxsize=4096)
def aligned_layout_head(key: tuple[tuple[str, tuple[int, ...], torch.dtype], ...],
                        offset: int) -> bytes:
    """The layout head of a pooled piece (:func:`pooled_layout_head`) whose blob starts at
    ``offset``, padded so that its tensor bytes start at a multiple of
    :data:`PIECE_ALIGNMENT`: the padding is zero bytes after the layout, which the length
    prefix does not cover and :func:`read_piece` skips, so
    :func:`~.codec.decode_snapshot` reads it unchanged."""
    head = pooled_layout_head(key)[:-_PADDING_LENGTH.size]  # the layout, before its padding
    padding = -(offset + len(head) + _PADDING_LENGTH.size) % PIECE_ALIGNMENT
    return head + _PADDING_LENGTH.pack(padding) + bytes(padding)


def frame_checksum(head: bytes, raw: tuple[memoryview, ...], checksum: int | None,
                    names_crc: int | None) -> int:
    """CRC32C of a piece's blob: ``head``, then the tensor bytes ``raw``; derived from the
    piece's tensor checksum (which starts at ``names_crc``) when it has one."""
    if checksum is not None and names_crc is not None:
        return checksum ^ _reseed_term(names_crc, head, sum(map(len, raw)))
    crc = bytes_checksum(head)
    for data in raw:
        crc = bytes_checksum(data, crc)
    return crc


@functools.lru_cache(maxsize=4096)
def _reseed_term(names_crc: int, head: bytes, length: int) -> int:
    """What a piece's tensor checksum (from ``names_crc``, over ``length`` bytes) is XORed
    with to become its blob's checksum behind ``head``: :func:`reseed_checksum` of a zero
    checksum, since CRC32C is affine in its starting value. The same for every snapshot of
    a piece layout at the same offset, so it is computed once (a Python polynomial product
    per piece and snapshot would cost the replication thread about 0.1 ms per snapshot)."""
    return reseed_checksum(0, names_crc, bytes_checksum(head), length)


_MAX_DIM = 1 << 62  # a tensor dimension beyond this is damage, not a tensor


def _layout_entry(entry: object) -> tuple[str, torch.dtype, list[int]]:
    """One (name, dtype, shape) of a piece's layout, checked."""
    if not isinstance(entry, list | tuple) or len(entry) != 3:
        raise WireFormatError(f"a piece's layout entry {entry!r} is not (name, dtype, shape)")
    name, dtype_name, shape = entry
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if not isinstance(name, str) or dtype is None:
        raise WireFormatError(f"piece tensor {name!r} has unknown dtype {dtype_name!r}")
    if not isinstance(shape, list | tuple) or len(shape) > 64 or not all(
            type(size) is int and 0 <= size < _MAX_DIM for size in shape):
        raise WireFormatError(f"piece tensor {name!r} has shape {shape!r}")
    return name, dtype, list(shape)


def read_piece(blob: memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a raw piece blob (own memory; the blob's checksum was verified).

    Raises:
        WireFormatError: The blob is no piece: cut short, a layout that is not a list of
            (name, dtype, shape), or tensors that do not fill it exactly.
    """
    if len(blob) < _LAYOUT_LENGTH.size:
        raise WireFormatError(f"a piece blob of {len(blob)} bytes has no layout")
    (length,) = _LAYOUT_LENGTH.unpack(blob[:_LAYOUT_LENGTH.size])
    start = _LAYOUT_LENGTH.size
    offset = start + length
    if offset + _PADDING_LENGTH.size > len(blob):
        raise WireFormatError(f"a piece blob of {len(blob)} bytes announces a layout of "
                              f"{length} bytes")
    layout = loads(blob[start:offset])
    (padding,) = _PADDING_LENGTH.unpack(blob[offset:offset + _PADDING_LENGTH.size])
    offset += _PADDING_LENGTH.size + padding
    if not isinstance(layout, list | tuple):
        raise WireFormatError(f"a piece's layout is a {type(layout).__name__}, not a list")
    tensors: dict[str, torch.Tensor] = {}
    for entry in layout:
        name, dtype, shape = _layout_entry(entry)
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > len(blob):
            raise WireFormatError(f"piece tensor {name!r} runs past its blob")
        if nbytes:
            data = torch.frombuffer(blob[offset:offset + nbytes], dtype=torch.uint8)
            tensors[name] = data.clone().view(dtype).reshape(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dtype)
        offset += nbytes
    if offset != len(blob):
        raise WireFormatError(f"{len(blob) - offset} bytes follow a piece's tensors")
    return tensors
