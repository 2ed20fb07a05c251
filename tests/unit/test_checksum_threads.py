"""CRC32C split over threads: the same value as one pass over the same bytes, for any split,
so a flipped bit is caught just the same; the snapshot capture's pieces checksummed this way
verify; the thread count follows the cores a rank may use."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.snapshots.checksum import (
    MAX_THREADS,
    ChecksumThreads,
    default_threads,
    raw_bytes,
    views_checksum,
)
from tests.unit.capture_plans import Plan
from tests.unit.test_snapshot import _batch, _engine


@pytest.fixture(scope="module")
def threads() -> ChecksumThreads:
    checksums = ChecksumThreads(4, chunk_bytes=97)  # odd chunks: splits fall anywhere
    yield checksums  # type: ignore[misc]
    checksums.close()


@settings(max_examples=150, deadline=None)
@given(jobs=st.lists(st.tuples(st.lists(st.binary(max_size=700), max_size=4),
                               st.integers(0, 2**32 - 1)), min_size=1, max_size=5))
def test_split_checksums_equal_one_pass(threads: ChecksumThreads,
                                        jobs: list[tuple[list[bytes], int]]) -> None:
    views = [([memoryview(data) for data in buffers], crc) for buffers, crc in jobs]
    assert threads.checksum_many(views) == [views_checksum(v, crc) for v, crc in views]


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=1, max_size=2000), position=st.floats(0, 1, exclude_max=True),
       bit=st.integers(0, 7))
def test_a_flipped_bit_changes_the_split_checksum(threads: ChecksumThreads, data: bytes,
                                                  position: float, bit: int) -> None:
    before = threads.checksum([memoryview(data)], 7)
    damaged = bytearray(data)
    damaged[int(position * len(data))] ^= 1 << bit
    assert threads.checksum([memoryview(bytes(damaged))], 7) != before


def test_pool_threads_report_their_cpu_time() -> None:
    checksums = ChecksumThreads(3, chunk_bytes=2**20)
    data = raw_bytes(torch.randint(0, 255, (16 * 2**20,), dtype=torch.uint8))
    assert checksums.checksum([data]) == views_checksum([data])
    assert checksums.pool_cpu_s > 0  # 15 of the 16 chunks ran on the pool
    assert checksums.measure(4 * 2**20) > 0
    checksums.close()


def test_one_thread_uses_no_pool() -> None:
    checksums = ChecksumThreads(1, chunk_bytes=8)
    data = memoryview(bytes(range(100)))
    assert checksums.checksum([data], 3) == views_checksum([data], 3)
    assert checksums.pool_cpu_s == 0.0
    with pytest.raises(ValueError, match="threads=0"):
        ChecksumThreads(0)


def test_threads_follow_the_cores_of_a_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_threads(1) == MAX_THREADS
    assert default_threads(4) == 4
    assert default_threads(32) == 1  # ranks outnumber cores: checksum on the copy thread


def test_engine_pieces_checksummed_on_threads_verify() -> None:
    engine = _engine("bf16-master")
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"),
                               checksum_threads=3)
    snapshots.checksums = ChecksumThreads(3, chunk_bytes=512)  # split even tiny pieces
    names = engine.registry.names
    engine.train_iteration(*_batch(0))
    taken = snapshots.issue(Plan(0, tuple(names[::2]), tuple(names[1::2]), 0, 0, 2), {})
    snapshots.close()
    assert taken.checksummed.is_set() and taken.pieces
    assert all(piece.verify() for piece in taken.pieces.values())
    assert snapshots.checksums.pool_cpu_s > 0
