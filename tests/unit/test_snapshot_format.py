"""One snapshot format, decoded without pickle: anything else is refused unread.

Bytes from another process (a replica peer, a shared slot) are decoded by the wire format
alone. A frame of an earlier format (a pickled or ``torch.save`` header, or no magic at
all) is refused with a clear error, and the objects it carries are never built: each test
plants a pickle whose unpickling would record that it ran.
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_moe_ckpt.core.wire import WireFormatError, dumps, loads
from lightning_moe_ckpt.snapshots.checksum import tensor_checksum
from lightning_moe_ckpt.snapshots.codec import (
    MAGIC,
    CorruptCheckpointError,
    SnapshotFormatError,
    decode_snapshot,
    encode_snapshot,
    extract_pieces,
    snapshot_header,
    split_pieces,
)
from lightning_moe_ckpt.snapshots.snapshot import Snapshot, SnapshotPiece

UNPICKLED: list[str] = []


class _Planted:
    """Unpickling this records it: the proof that a decoder ran pickle."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return UNPICKLED.append, ("unpickled",)


@dataclass(frozen=True)
class _Plan:
    iteration: int = 5
    window_start: int = 4
    window: int = 2


def _snapshot() -> Snapshot:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "step": torch.tensor(3.0)}
    piece = SnapshotPiece("head", "master", tensors, tensor_checksum(tensors))
    metadata = {"step": 5, "rng": {"torch": torch.arange(4, dtype=torch.uint8),
                                   "python": (3, tuple(range(5)), None)},
                "lr": 0.1, "seed": 2**64 - 1, "clip_coef": None, "flags": [True, False]}
    return Snapshot(5, 1, _Plan(), {"head": piece}, metadata,  # type: ignore[arg-type]
                    threading.Event(), threading.Event())


@pytest.fixture(autouse=True)
def _nothing_unpickled() -> object:
    UNPICKLED.clear()
    yield
    assert UNPICKLED == [], "a decoder unpickled bytes it was given"


def test_the_current_format_round_trips_without_pickle() -> None:
    encoded = encode_snapshot(_snapshot())
    assert bytes(encoded[:len(MAGIC)].numpy()) == MAGIC
    decoded = decode_snapshot(encoded)
    assert decoded["metadata"]["seed"] == 2**64 - 1
    assert decoded["metadata"]["rng"]["python"] == (3, tuple(range(5)), None)
    assert torch.equal(decoded["metadata"]["rng"]["torch"], torch.arange(4, dtype=torch.uint8))
    assert torch.equal(decoded["pieces"]["head"]["tensors"]["w"],
                       torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert snapshot_header(encoded)["pieces"]["head"]["kind"] == "master"
    assert torch.equal(split_pieces(encoded, ["head"])["head"], extract_pieces(encoded, ["head"]))


def _framed(magic: bytes, header: bytes) -> torch.Tensor:
    data = magic + header + struct.pack("<Q", len(header))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("decode", [decode_snapshot, snapshot_header,
                                    lambda data: extract_pieces(data, ["head"])])
def test_an_earlier_format_is_refused_and_nothing_is_unpickled(decode: object) -> None:
    header = pickle.dumps({"pieces": {}, "planted": _Planted()})
    buffer = io.BytesIO()
    torch.save({"planted": _Planted()}, buffer)
    frames = {"pickled header (MOESNAP3)": _framed(b"MOESNAP3", header),
              "torch.save header (MOESNAP2)": _framed(b"MOESNAP2", buffer.getvalue()),
              "torch.save without a magic": torch.frombuffer(bytearray(buffer.getvalue()),
                                                             dtype=torch.uint8)}
    for what, frame in frames.items():
        with pytest.raises(SnapshotFormatError, match="not this version's") as raised:
            decode(frame)  # type: ignore[operator]
        assert isinstance(raised.value, CorruptCheckpointError), what


def test_a_pickled_header_behind_the_current_magic_is_refused_unread() -> None:
    frame = _framed(MAGIC, pickle.dumps({"pieces": {}, "planted": _Planted()}))
    with pytest.raises(SnapshotFormatError, match="header does not decode"):
        decode_snapshot(frame)


def test_a_value_without_an_encoding_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"metadata\['sched'\]\[0\] is a builtins.set"):
        dumps({"sched": [{1, 2}]}, "metadata")
    with pytest.raises(TypeError, match="dense CPU tensors"):
        dumps(torch.ones(2).to_sparse())


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8) | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=3)
    | st.lists(children, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=4) | st.integers(-5, 5), children, max_size=3),
    max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(value=values)
def test_plain_values_round_trip(value: object) -> None:
    assert loads(dumps(value)) == value


@settings(max_examples=200, deadline=None)
@given(value=values, cut=st.integers(1, 64))
def test_truncated_bytes_fail_to_decode_cleanly(value: object, cut: int) -> None:
    encoded = dumps(value)
    with pytest.raises(WireFormatError):
        loads(encoded[:max(0, len(encoded) - cut)])
