"""The device checksum: every single-bit flip of a piece is detected, and the torch
implementation (the one every device runs) equals the formula in plain integers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.snapshots import device_checksum as dc
from lightning_moe_ckpt.snapshots.device_checksum import (
    as_unsigned,
    device_checksum,
    reference_checksum,
    tensors_checksum,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


@st.composite
def pieces(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of random dtype, shape (0-d included) and bytes."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=0, max_size=3)))
    itemsize = torch.empty((), dtype=dtype).element_size()
    seed = draw(st.integers(0, 2**31 - 1))
    raw = torch.randint(0, 256, (*shape, itemsize), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        return (raw.reshape(shape) & 1).to(torch.bool) if shape else torch.tensor(True)
    return raw.view(dtype).reshape(shape)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=200, deadline=None)
@given(piece=pieces(), start=st.integers(0, 2**40))
def test_the_torch_checksum_is_the_formula(piece: torch.Tensor, start: int) -> None:
    assert as_unsigned(device_checksum(piece, start)) == reference_checksum(_bytes(piece), start)


@settings(max_examples=300, deadline=None)
@given(piece=pieces(), bit=st.integers(0, 2**20))
def test_every_single_bit_flip_is_detected(piece: torch.Tensor, bit: int) -> None:
    flat = piece.clone().contiguous().reshape(-1).view(torch.uint8)
    bit %= flat.numel() * 8
    before = device_checksum(flat)
    flat[bit // 8] ^= 1 << (bit % 8)
    assert not torch.equal(device_checksum(flat), before)


def test_every_bit_of_a_piece_flipped_in_turn_changes_it() -> None:
    data = torch.arange(37, dtype=torch.uint8)  # not a whole number of words
    before = reference_checksum(_bytes(data))
    for bit in range(data.numel() * 8):
        flipped = data.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert as_unsigned(device_checksum(flipped)) != before, bit


def test_chunks_and_consecutive_tensors_sum_as_one_byte_string(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dc, "CHUNK_WORDS", 3)  # many chunks for a small piece
    first = torch.randn(5, 3)
    second = torch.arange(7, dtype=torch.int64)
    whole = _bytes(first) + _bytes(second)
    assert as_unsigned(tensors_checksum([first, second])) == reference_checksum(whole)
    assert as_unsigned(device_checksum(first)) == reference_checksum(_bytes(first))


def test_large_positions_wrap_modulo_two_to_the_64() -> None:
    words = torch.full((4,), 0xFFFFFFFF, dtype=torch.int64).to(torch.int32)
    start = 2**40  # weights near 2**41, products past 2**63: the sum wraps
    assert as_unsigned(device_checksum(words, start)) == reference_checksum(_bytes(words), start)
