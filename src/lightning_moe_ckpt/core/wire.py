"""Plain values as bytes without pickle: what a snapshot's header and layouts are made of.

Bytes that arrive from another process (a replica peer, a shared-memory slot) are decoded
by this module alone: it builds ``None``, booleans, integers, floats, strings, bytes,
lists, tuples, dicts and CPU tensors, and nothing else, so a damaged or hostile frame can
at worst fail to decode; it can never run code the way unpickling can. Encoding refuses
any other type, naming where it sits in the value.

Each value is a one-byte tag and its body; lengths and counts are 8 little-endian bytes,
integers are 8 bytes, or carry their byte length beyond (seeds are unsigned 64-bit), floats are IEEE
doubles, tensors are their dtype's name, shape and raw bytes (native byte order).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from lightning_moe_ckpt.errors import WireFormatError

__all__ = ["DTYPES", "WireFormatError", "dumps", "loads"]

_COUNT = struct.Struct("<Q")
_INT64 = struct.Struct("<q")
_SMALL = 1 << 63
_MAX_DIM = 1 << 62  # a tensor dimension beyond this is damage, not a tensor
_FLOAT = struct.Struct("<d")
_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _SMALL_INT, _FLOAT_TAG, _STR, _BYTES = b"i", b"q", b"f", b"s", b"b"
_LIST, _TUPLE, _DICT, _TENSOR = b"l", b"t", b"d", b"x"
DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def dumps(value: Any, where: str = "value") -> bytes:
    """``value`` as bytes; ``where`` names it in the error for a type that has no encoding."""
    out: list[bytes] = []
    try:
        _dump(value, out)
    except _Unencodable:
        raise TypeError(_unencodable_message(value, where)) from None
    return b"".join(out)


class _Unencodable(Exception):
    """A value without an encoding (found again, with its path, for the message)."""


def _dump(value: Any, out: list[bytes]) -> None:
    kind = type(value)
    if kind is int:
        if -_SMALL <= value < _SMALL:
            out += (_SMALL_INT, _INT64.pack(value))
        else:
            body = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            out += (_INT, _COUNT.pack(len(body)), body)
    elif kind is str:
        body = value.encode("utf-8", "surrogatepass")
        out += (_STR, _COUNT.pack(len(body)), body)
    elif kind is dict:
        out += (_DICT, _COUNT.pack(len(value)))
        for key, item in value.items():
            _dump(key, out)
            _dump(item, out)
    elif value is None:
        out.append(_NONE)
    elif kind is bool:
        out.append(_TRUE if value else _FALSE)
    elif kind is float:
        out += (_FLOAT_TAG, _FLOAT.pack(value))
    elif kind is list or kind is tuple:
        out += (_LIST if kind is list else _TUPLE, _COUNT.pack(len(value)))
        for item in value:
            _dump(item, out)
    elif kind is bytes or kind is bytearray or kind is memoryview:
        body = bytes(value)
        out += (_BYTES, _COUNT.pack(len(body)), body)
    elif isinstance(value, torch.Tensor) and _encodable_tensor(value):
        _dump_tensor(value, out)
    else:
        _dump(_plain(value), out)


def _plain(value: Any) -> Any:
    """The plain value a subclass or a NumPy scalar stands for (an ``OrderedDict``, a
    ``torch.Size``, an ``IntEnum``, ``np.float64``): decoded as that plain type."""
    plain: type[Any]
    for plain in (bool, int, float, str, bytes, dict, list, tuple):
        if isinstance(value, plain):
            return plain(value)
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # a NumPy scalar: its Python value
    raise _Unencodable


def _encodable_tensor(tensor: torch.Tensor) -> bool:
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided
            and str(tensor.dtype).removeprefix("torch.") in DTYPES)


def _unencodable_message(value: Any, where: str) -> str:
    """Name the first value under ``value`` that has no encoding, by its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            for part, inner in ((f"{where} key {key!r}", key), (f"{where}[{key!r}]", item)):
                if _has_unencodable(inner):
                    return _unencodable_message(inner, part)
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if _has_unencodable(item):
                return _unencodable_message(item, f"{where}[{index}]")
    if isinstance(value, torch.Tensor):
        return (f"{where} is a {value.dtype} tensor on {value.device} ({value.layout}); a "
                f"snapshot holds dense CPU tensors of the dtypes {', '.join(sorted(DTYPES))}")
    return (f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a snapshot "
            "holds None, bool, int, float, str, bytes, lists, tuples, dicts and CPU tensors "
            "(convert it in the state_dict you hand over, e.g. to a list or a tensor)")


def _has_unencodable(value: Any) -> bool:
    try:
        _dump(value, [])
    except _Unencodable:
        return True
    return False


def _dump_tensor(tensor: torch.Tensor, out: list[bytes]) -> None:
    data = tensor.detach().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
    dtype = str(data.dtype).removeprefix("torch.").encode()
    out += (_TENSOR, _COUNT.pack(len(dtype)), dtype, _COUNT.pack(data.dim()),
            *(_COUNT.pack(size) for size in data.shape), _COUNT.pack(len(raw)), raw)


def loads(data: bytes | memoryview) -> Any:
    """The value :func:`dumps` encoded; raises :class:`WireFormatError` for anything else
    (including trailing bytes)."""
    view = memoryview(data).cast("B")
    value, end = _load(view, 0, 0)
    if end != len(view):
        raise WireFormatError(f"{len(view) - end} bytes follow the encoded value")
    return value


def _count(view: memoryview, offset: int) -> tuple[int, int]:
    end = offset + _COUNT.size
    if end > len(view):
        raise WireFormatError(f"truncated at byte {offset}: a length is cut off")
    return _COUNT.unpack_from(view, offset)[0], end


def _body(view: memoryview, offset: int) -> tuple[memoryview, int]:
    length, start = _count(view, offset)
    end = start + length
    if end > len(view):
        raise WireFormatError(f"truncated at byte {start}: {length} bytes announced, "
                              f"{len(view) - start} left")
    return view[start:end], end


_MAX_DEPTH = 64  # containers nested deeper are damage (or a crafted frame), not a value


def _items(view: memoryview, offset: int, per_item: int) -> tuple[int, int]:
    """A container's item count, refused when its items could not fit in what is left
    (each takes at least one byte, a dict entry two) before anything is built."""
    count, offset = _count(view, offset)
    if count * per_item > len(view) - offset:
        raise WireFormatError(f"{count} items announced at byte {offset}, "
                              f"{len(view) - offset} bytes left")
    return count, offset


def _load(view: memoryview, offset: int, depth: int) -> tuple[Any, int]:
    if offset >= len(view):
        raise WireFormatError(f"truncated at byte {offset}: a value is missing")
    if depth > _MAX_DEPTH:
        raise WireFormatError(f"values nested more than {_MAX_DEPTH} deep at byte {offset}")
    tag, offset = bytes(view[offset:offset + 1]), offset + 1
    if tag == _NONE:
        return None, offset
    if tag in (_TRUE, _FALSE):
        return tag == _TRUE, offset
    if tag == _SMALL_INT:
        if offset + _INT64.size > len(view):
            raise WireFormatError(f"truncated at byte {offset}: an integer is cut off")
        return _INT64.unpack_from(view, offset)[0], offset + _INT64.size
    if tag == _INT:
        body, offset = _body(view, offset)
        return int.from_bytes(body, "little", signed=True), offset
    if tag == _FLOAT_TAG:
        if offset + _FLOAT.size > len(view):
            raise WireFormatError(f"truncated at byte {offset}: a float is cut off")
        return _FLOAT.unpack_from(view, offset)[0], offset + _FLOAT.size
    if tag == _STR:
        body, offset = _body(view, offset)
        try:
            return str(body, "utf-8", "surrogatepass"), offset
        except UnicodeDecodeError as error:
            raise WireFormatError(f"a string before byte {offset} is not UTF-8") from error
    if tag == _BYTES:
        body, offset = _body(view, offset)
        return bytes(body), offset
    if tag in (_LIST, _TUPLE):
        count, offset = _items(view, offset, 1)
        items = []
        for _ in range(count):
            item, offset = _load(view, offset, depth + 1)
            items.append(item)
        return (items if tag == _LIST else tuple(items)), offset
    if tag == _DICT:
        count, offset = _items(view, offset, 2)
        mapping: dict[Any, Any] = {}
        for _ in range(count):
            key, offset = _load(view, offset, depth + 1)
            try:
                mapping[key], offset = _load(view, offset, depth + 1)
            except TypeError as error:  # an unhashable key (a list) from damaged bytes
                raise WireFormatError(f"a dict key before byte {offset} is unhashable") \
                    from error
        return mapping, offset
    if tag == _TENSOR:
        return _load_tensor(view, offset)
    raise WireFormatError(f"unknown tag {tag!r} at byte {offset - 1}")


def _load_tensor(view: memoryview, offset: int) -> tuple[torch.Tensor, int]:
    name, offset = _body(view, offset)
    dtype = DTYPES.get(str(name, "ascii", "replace"))
    if dtype is None:
        raise WireFormatError(f"unknown tensor dtype {bytes(name)!r} before byte {offset}")
    ndim, offset = _count(view, offset)
    if ndim > 64:
        raise WireFormatError(f"a tensor of {ndim} dimensions before byte {offset}")
    shape = []
    for _ in range(ndim):
        size, offset = _count(view, offset)
        if size >= _MAX_DIM:
            raise WireFormatError(f"a tensor dimension of {size} before byte {offset}")
        shape.append(size)
    raw, offset = _body(view, offset)
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise WireFormatError(f"a {dtype} tensor of shape {tuple(shape)} before byte "
                              f"{offset} has {len(raw)} bytes")
    if not len(raw):
        return torch.empty(shape, dtype=dtype), offset
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return tensor, offset
