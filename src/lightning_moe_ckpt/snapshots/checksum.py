"""CRC32C checksums of snapshot pieces: one pass, or split over threads.

Every piece gets a CRC32C (the SSE4.2/ARMv8 instruction through the ``crc32c`` package):
every single-bit flip and every burst of up to 32 bits changes it. One core checksums at
10-26 GB/s, slower than a GPU's pinned device-to-host copy (55 GB/s on an H200), so a large
snapshot would be checksummed more slowly than it is copied. :class:`ChecksumThreads` splits
large buffers into chunks checksummed on several threads at once (``crc32c`` releases the
GIL) and folds the chunks' values in order with :func:`reseed_checksum` (CRC32C is affine
in its starting value): the same value as one pass, faster as far as the threads' cores
and memory bandwidth allow (2 threads: 1.6x on this project's 2-core CPU machine).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch

from lightning_moe_ckpt.errors import fmt, require
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, lower_priority


def bytes_checksum(data: bytes | memoryview, crc: int = 0) -> int:
    """CRC32C of ``data`` continuing from ``crc``; reads in place and releases the GIL."""
    value: int = crc32c.crc32c(data, crc)
    return value


_CASTAGNOLI = 0x82F63B78  # CRC32C's polynomial, bit-reflected


def _multiply_mod_polynomial(a: int, b: int) -> int:
    """``a * b`` modulo CRC32C's polynomial, both bit-reflected (zlib's ``multmodp``)."""
    product, mask = 0, 1 << 31
    while mask and a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _CASTAGNOLI if b & 1 else b >> 1
    return product


# x^(2^k) modulo the polynomial for k = 0..63, bit-reflected (x^1 is bit 30).
_POWERS_OF_TWO: list[int] = [1 << 30]
for _ in range(63):
    _POWERS_OF_TWO.append(_multiply_mod_polynomial(_POWERS_OF_TWO[-1], _POWERS_OF_TWO[-1]))


@functools.lru_cache(maxsize=4096)
def _zeros_operator(length: int) -> int:
    """x^(8 * length) modulo the polynomial: what ``length`` zero bytes multiply CRC32C's
    register by. O(log length) products, cached by length (a layout's lengths recur)."""
    power, bits, k = 1 << 31, 8 * length, 0
    while bits:
        if bits & 1:
            power = _multiply_mod_polynomial(_POWERS_OF_TWO[k], power)
        bits >>= 1
        k += 1
    return power


def _shift_over(value: int, length: int) -> int:
    """What CRC32C's register ``value`` becomes after ``length`` zero bytes: one product
    once the length's operator is known."""
    return _multiply_mod_polynomial(_zeros_operator(length), value)


def reseed_checksum(crc: int, seed: int, new_seed: int, length: int) -> int:
    """``bytes_checksum(data, new_seed)`` from ``crc == bytes_checksum(data, seed)`` and
    ``length == len(data)``, without reading ``data``.

    CRC32C is affine in its starting value: two runs over the same bytes from different
    starting values differ by their starting values' difference carried through ``length``
    zero bytes. So a piece's checksum (the tensor bytes after the names' checksum) gives
    the checksum of the same bytes behind any other prefix (an encoded blob's layout)
    without a second pass over them.
    """
    return crc ^ _shift_over(seed ^ new_seed, length)


def names_checksum(names: Iterable[str]) -> int:
    """CRC32C of tensor names in name order: the start of :func:`tensor_checksum`."""
    return bytes_checksum(b"\0".join(name.encode() for name in sorted(names)))


def tensor_checksum(tensors: Mapping[str, torch.Tensor]) -> int:
    """CRC32C over the names of ``tensors`` (CPU), then their raw bytes, in name order.

    CRC32C rather than zlib's CRC32: the same guarantee (every single-bit flip and every
    burst of up to 32 bits changes the value, unlike a hash such as xxh3 that only makes a
    miss unlikely) at about 3x the speed here, since it runs on the CPU's CRC instruction.
    Names first and bytes back to back: a piece whose buffers are one contiguous block is
    checksummed in one call (:class:`~lightning_moe_ckpt.snapshots.snapshot.PieceBuffers`).
    """
    return views_checksum(*tensor_views(tensors))


def tensor_views(tensors: Mapping[str, torch.Tensor]) -> tuple[list[memoryview], int]:
    """What :func:`tensor_checksum` reads: the raw bytes in name order, and the names'
    checksum they continue from."""
    return ([raw_bytes(tensors[name].contiguous()) for name in sorted(tensors)],
            names_checksum(tensors))


def views_checksum(views: Iterable[memoryview], crc: int = 0) -> int:
    """CRC32C of ``views`` back to back, continuing from ``crc``, on this thread."""
    for data in views:
        crc = bytes_checksum(data, crc)
    return crc


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, in place."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


# Every chunk's hand-off takes the GIL, which the training thread then waits for: on an
# H200 (a 4 GB snapshot per iteration, 8 threads) 8 MiB chunks cost the training thread
# 583 voluntary context switches per iteration, 32 MiB chunks 81. A chunk of 32 MiB
# takes a few ms on one thread, so pieces of 64 MiB and more are still split.
CHUNK_BYTES = 32 * 2**20
MAX_THREADS = 8  # enough to outrun a PCIe Gen5 copy; more would take cores from training


def require_checksum_threads(threads: object) -> None:
    """Refuse a ``checkpoint.checksum_threads`` that is neither None (automatic) nor an
    integer >= 1."""
    require(threads is None or (isinstance(threads, int) and not isinstance(threads, bool)
                                and threads >= 1),
            f"{fmt('checkpoint.checksum_threads', threads)} must be an integer >= 1 "
            "(or null: the rank's share of the cores, at most 8)")


def default_threads(ranks_per_node: int) -> int:
    """Checksum threads for one rank: its share of the cores this process may run on,
    at most :data:`MAX_THREADS` (1 where ranks outnumber cores: no extra contention)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_THREADS, (cores or 1) // max(1, ranks_per_node)))


class ChecksumThreads:
    """CRC32C of buffers back to back, large ones split over ``threads`` pool threads (the
    calling thread only folds their values: with one thread it does the work itself)."""

    def __init__(self, threads: int, chunk_bytes: int = CHUNK_BYTES,
                 helper_nice: int = DEFAULT_HELPER_NICE) -> None:
        if threads < 1 or chunk_bytes < 1:
            raise ValueError(f"checksum threads={threads} and chunk_bytes={chunk_bytes} "
                             "must be >= 1")
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._pool = (ThreadPoolExecutor(threads, thread_name_prefix="checksum",
                                         initializer=lower_priority, initargs=(helper_nice,))
                      if threads > 1 else None)
        self.pool_cpu_s = 0.0  # the pool threads' CPU time (the caller's is its own)

    def checksum(self, views: Sequence[memoryview], crc: int = 0) -> int:
        """:func:`views_checksum` of ``views``, continuing from ``crc``."""
        return self.checksum_many([(views, crc)])[0]

    def checksum_many(self, jobs: Sequence[tuple[Sequence[memoryview], int]]) -> list[int]:
        """:meth:`checksum` of every ``(views, crc)`` job; all their chunks run at once."""
        if self._pool is None:
            return [views_checksum(views, crc) for views, crc in jobs]
        size = self.chunk_bytes
        # Jobs of at least two chunks go to the pool, chunk by chunk, each from 0; smaller
        # ones (a router, a norm) are checksummed here meanwhile, where a hand-off to a
        # thread would cost more than the checksum.
        pending = {index: [(len(chunk), self._pool.submit(_timed_checksum, chunk))
                           for chunk in _chunks(views, size)]
                   for index, (views, _) in enumerate(jobs)
                   if sum(len(view) for view in views) >= 2 * size}
        results = []
        for index, (views, crc) in enumerate(jobs):
            if index not in pending:
                results.append(views_checksum(views, crc))
                continue
            for length, future in pending[index]:  # folded in order
                chunk_crc, cpu_s = future.result()
                self.pool_cpu_s += cpu_s
                crc = reseed_checksum(chunk_crc, 0, crc, length)
            results.append(crc)
        return results

    def measure(self, nbytes: int) -> float:
        """This checksum's rate in bytes/s over a host buffer of ``nbytes`` (best of 3)."""
        data = raw_bytes(torch.ones(nbytes, dtype=torch.uint8))
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            self.checksum([data])
            best = min(best, time.perf_counter() - started)
        return nbytes / max(best, 1e-9)

    def close(self) -> None:
        """Stop the pool's threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _chunks(views: Iterable[memoryview], size: int) -> Iterator[memoryview]:
    """``views`` cut into consecutive pieces of at most ``size`` bytes (views, no copies)."""
    for view in views:
        for offset in range(0, len(view), size):
            yield view[offset:offset + size]


def _timed_checksum(data: memoryview) -> tuple[int, float]:
    """CRC32C of ``data`` from 0, and the CPU time this thread spent on it."""
    started = time.thread_time()
    crc = bytes_checksum(data)
    return crc, time.thread_time() - started
