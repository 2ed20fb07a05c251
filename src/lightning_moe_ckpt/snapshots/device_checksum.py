"""A checksum computed where the data is: a weighted sum of a piece's 32-bit words.

A piece's bytes are read as 32-bit words in the machine's byte order (little-endian on x86,
Arm and CUDA devices) ``w_0 .. w_{n-1}`` (zero-padded to
a multiple of four bytes) and summed with odd weights, modulo ``2**64``::

    checksum = sum((2 * i + 1) * w_i for i in range(n))  mod 2**64

It detects every single-bit flip: flipping bit ``b`` of word ``i`` changes the sum by
``(2i + 1) * 2**b``, which is not a multiple of ``2**64`` because ``2i + 1`` is odd and
``b < 32``. Unlike CRC32C it is a handful of elementwise operations and one reduction, so
it runs on the device that holds the data (a CUDA side stream, next to the snapshot's copy)
with no host round trip; it is not meant against deliberate tampering, only against damage.

:func:`device_checksum` is the one implementation: the same torch operations on any
device, in 64-bit integers, whose multiplication and sum wrap modulo ``2**64`` on the CPU
and on CUDA alike (two's complement), so the CPU result is the device result by
construction. Words are processed in chunks of :data:`CHUNK_WORDS` so that the temporary
weights stay small whatever the piece's size. :func:`reference_checksum` is the formula in
plain Python integers, for tests.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CHUNK_WORDS", "as_unsigned", "device_checksum", "reference_checksum",
           "tensors_checksum"]

CHUNK_WORDS = 1 << 22  # 16 MiB of words per reduction: bounded temporaries
_MASK = (1 << 64) - 1


def _words(data: torch.Tensor) -> torch.Tensor:
    """``data``'s bytes as 32-bit words (int64 holding 0 .. 2**32 - 1), zero-padded."""
    raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
    padding = -raw.numel() % 4
    if padding:
        raw = torch.cat([raw, raw.new_zeros(padding)])
    # int32 words, as unsigned values: the low 32 bits of an int64.
    return raw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def device_checksum(data: torch.Tensor, start_word: int = 0) -> torch.Tensor:
    """The weighted word sum of ``data``'s bytes as a 0-d int64 tensor on ``data``'s device
    (the checksum's two's-complement bits; no host sync). ``start_word`` offsets the word
    positions, so that consecutive tensors can be summed as one byte string."""
    words = _words(data)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for first in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[first:first + CHUNK_WORDS]
        position = torch.arange(start_word + first, start_word + first + chunk.numel(),
                                dtype=torch.int64, device=words.device)
        total = total + ((2 * position + 1) * chunk).sum()
    return total


def tensors_checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """:func:`device_checksum` of tensors back to back (each padded to whole words), in
    the order given, as one 0-d int64 tensor on their device."""
    total: torch.Tensor | None = None
    word = 0
    for tensor in tensors:
        part = device_checksum(tensor, word)
        total = part if total is None else total + part
        word += -(-tensor.numel() * tensor.element_size() // 4)
    return torch.zeros((), dtype=torch.int64) if total is None else total


def reference_checksum(data: bytes, start_word: int = 0) -> int:
    """The same checksum in plain Python integers, as an unsigned 64-bit value."""
    padded = data + bytes(-len(data) % 4)
    total = 0
    for index in range(len(padded) // 4):
        word = int.from_bytes(padded[4 * index:4 * index + 4], "little")
        total += (2 * (start_word + index) + 1) * word
    return total & _MASK


def as_unsigned(checksum: torch.Tensor) -> int:
    """A checksum tensor's value as an unsigned 64-bit integer (reads it on the host)."""
    return int(checksum.item()) & _MASK
