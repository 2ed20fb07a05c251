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
from lightning_moe_ckpt.snapshots.checksum import bytes_checksum, tensor_checksum
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
    data = magic + header + struct.pack("<IQ", bytes_checksum(header), len(header))
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


def test_every_flipped_header_or_trailer_byte_is_refused_as_corrupt() -> None:
    """The header (step, rank, window, lr, clip coefficient, byte ranges) is covered by its
    checksum: no flipped byte decodes to other values."""
    encoded = encode_snapshot(_snapshot())
    length = struct.unpack("<Q", bytes(encoded[-8:].numpy()))[0]
    start = encoded.numel() - 12 - length
    for index in range(start, encoded.numel()):
        damaged = encoded.clone()
        damaged[index] ^= 0x10
        for decode in (decode_snapshot, snapshot_header):
            with pytest.raises(CorruptCheckpointError):
                decode(damaged)


def _crafted(layout: bytes | None = None, header: dict[str, object] | None = None,
             blob: bytes | None = None) -> torch.Tensor:
    """A frame whose every checksum is valid around a crafted piece ``layout`` (wire bytes)
    or a crafted ``header`` (a value, encoded here)."""
    if blob is None:
        layout = dumps([("w", "float32", (2,))]) if layout is None else layout
        blob = struct.pack("<I", len(layout)) + layout + struct.pack("<I", 0) + bytes(8)
    entry = {"kind": "master", "checksum": 0, "frame_checksum": bytes_checksum(blob),
             "offset": len(MAGIC), "length": len(blob)}
    fields = {"step": 5, "rank": 1, "window_start": 4, "window": 2, "metadata": None,
              "pieces": {"head": entry}}
    encoded = dumps(fields if header is None else header)
    data = MAGIC + blob + encoded + struct.pack("<IQ", bytes_checksum(encoded), len(encoded))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _nested(depth: int) -> bytes:
    """Wire bytes of lists nested ``depth`` deep (built without recursion)."""
    return (b"l" + struct.pack("<Q", 1)) * depth + b"N"


CRAFTED = {
    "negative shape": dumps([("w", "float32", (-1,))]),
    "entry of two": dumps([("w", "float32")]),
    "layout a string": dumps("www"),
    "shape of strings": dumps([("w", "float32", ("a",))]),
    "unhashable name": dumps([(["w"], "float32", (2,))]),
    "huge shape, no bytes": dumps([("w", "float32", (0, 2**63))]),
    "shape past the blob": dumps([("w", "float32", (2**40,))]),
    "nested 100000 deep": _nested(100_000),
    "a count of 2**60 items": b"l" + struct.pack("<Q", 2**60),
}


@pytest.mark.parametrize("layout", CRAFTED.values(), ids=CRAFTED.keys())
def test_a_crafted_checksum_valid_piece_is_refused_as_corrupt(layout: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"operator 'head', iteration 5 does not "
                                                     "decode"):
        decode_snapshot(_crafted(layout))


HEADERS = {
    "offset a string": {"step": 5, "rank": 1, "window_start": 4, "window": 2,
                        "pieces": {"head": {"kind": "master", "checksum": 0,
                                            "frame_checksum": 0, "offset": "8",
                                            "length": 16}}},
    "range past the pieces": {"step": 5, "rank": 1, "window_start": 4, "window": 2,
                              "pieces": {"head": {"kind": "master", "checksum": 0,
                                                  "frame_checksum": 0, "offset": 8,
                                                  "length": 2**40}}},
    "no step": {"rank": 1, "window_start": 4, "window": 2, "pieces": {}},
    "pieces a list": {"step": 5, "rank": 1, "window_start": 4, "window": 2, "pieces": []},
    "a list": [1, 2],
}


@pytest.mark.parametrize("header", HEADERS.values(), ids=HEADERS.keys())
def test_a_crafted_checksum_valid_header_is_refused_as_corrupt(header: object) -> None:
    for decode in (decode_snapshot, snapshot_header,
                   lambda data: split_pieces(data, [])):
        with pytest.raises(CorruptCheckpointError, match="is not a snapshot header"):
            decode(_crafted(header=header))  # type: ignore[arg-type]


def test_a_zero_element_tensor_round_trips() -> None:
    tensors = {"w": torch.empty(0, 3), "b": torch.ones(2)}
    snapshot = _snapshot()
    snapshot.pieces["head"] = SnapshotPiece("head", "master", tensors, tensor_checksum(tensors))
    decoded = decode_snapshot(encode_snapshot(snapshot))["pieces"]["head"]["tensors"]
    assert decoded["w"].shape == (0, 3) and torch.equal(decoded["b"], torch.ones(2))
