"""The RNG states a replay needs, taken with every snapshot and restored with it.

A user's step may draw from torch's generator (CPU, and CUDA where present), Python's
``random`` and NumPy's global generator, the three ``seed_everything`` seeds (a random
crop, a dropout mask), so :func:`rng_state` takes all of them. It runs on the training
thread after every optimizer step that takes a snapshot, and the replication thread
encodes its result into the snapshot's header, so both costs recur every iteration.

* The word arrays are kept as raw bytes (torch's CPU state, Python's 625 Mersenne Twister
  words, NumPy's 624-word key; native byte order): encoded as one byte string each instead
  of 625 Python ints or a tensor, and still loaded by ``torch.load(weights_only=True)``.
* NumPy's legacy global generator copies its key word by word when asked for its state
  (``np.random.get_state``: 33 us on this project's CPU machine, about 0.1 ms per
  iteration on ranks sharing cores). :class:`NumpyGlobalState` reads the key and position
  straight from the bit generator's state struct (its documented ``ctypes`` interface,
  checked against ``get_state`` once per generator) in under a microsecond and gives the
  previous capture again while they are unchanged. Only key and position are in that
  struct; the legacy Gaussian cache (``has_gauss``, ``gauss``) is not. A capture holding a
  cached Gaussian is therefore never reused, and one without stays valid, because the
  cache fills only by drawing words, which changes the key or the position. The one way
  around that is ``np.random.set_state``: :func:`restore_rng` forgets the capture, and a
  step that itself restores, unchanged in key and position, a state saved before the
  previous snapshot but with a cached Gaussian would be missed; no other change escapes.

:func:`restore_rng` also reads the tensor forms that durable checkpoints of earlier
versions hold.
"""

from __future__ import annotations

import ctypes
import random
import sys
from array import array
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

# CPython's Mersenne Twister words are 32-bit; "I" is 4 bytes on every supported platform.
_WORDS = "I"
assert array(_WORDS).itemsize == 4
_MT19937_STATE_BYTES = 624 * 4 + 4  # NumPy's mt19937_state: uint32 key[624]; int pos


class NumpyGlobalState:
    """NumPy's legacy global generator state, read again only where it may have changed
    (see the module docstring)."""

    def __init__(self) -> None:
        self._generator: object | None = None  # the bit generator the struct was checked for
        self._address = 0  # its state struct, 0 where reading it is not safe
        self._words: bytes | None = None  # key and position at the reusable capture
        self._captured: tuple[Any, ...] | None = None

    def capture(self) -> tuple[Any, ...]:
        """``(kind, key bytes, position, has_gauss, gauss)``, as of now."""
        generator = np.random.mtrand._rand._bit_generator
        if generator is not self._generator:
            self._adopt(generator)
        words = ctypes.string_at(self._address, _MT19937_STATE_BYTES) if self._address else None
        if words is not None and words == self._words:
            assert self._captured is not None  # set together with the words
            return self._captured
        kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
        captured = (kind, np.ascontiguousarray(keys, dtype=np.uint32).tobytes(), position,
                    has_gauss, gauss)
        # A cached Gaussian can be consumed without moving key or position: not reusable.
        reusable = words is not None and not has_gauss
        self._words, self._captured = (words, captured) if reusable else (None, None)
        return captured

    def forget(self) -> None:
        """The state was set from outside the generator's own draws: read it anew."""
        self._words = self._captured = None

    def _adopt(self, generator: object) -> None:
        """Use ``generator``'s state struct where it holds exactly what ``get_state``
        reports (a Mersenne Twister laid out as NumPy lays it out)."""
        self._generator, self._address = generator, 0
        self.forget()
        if not isinstance(generator, np.random.MT19937):
            return
        address = int(generator.ctypes.state_address)
        _, keys, position, _, _ = np.random.get_state(legacy=True)
        expected = (np.ascontiguousarray(keys, dtype=np.uint32).tobytes()
                    + int(position).to_bytes(4, sys.byteorder, signed=True))
        if ctypes.string_at(address, _MT19937_STATE_BYTES) == expected:
            self._address = address


NUMPY_GLOBAL_STATE = NumpyGlobalState()


def rng_state() -> dict[str, Any]:
    """The RNG states a replay needs, as bytes, plain values and (CUDA) tensors, so a
    checkpoint holding them loads with ``weights_only=True``."""
    version, words, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state().numpy().tobytes(),
        "python": (version, array(_WORDS, words).tobytes(), gauss_next),
        "numpy": NUMPY_GLOBAL_STATE.capture()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`rng_state` (also for the tensor forms of earlier versions)."""
    cpu = state["cpu"]
    torch.set_rng_state(cpu if isinstance(cpu, torch.Tensor)
                        else torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
    if "python" in state:  # durable checkpoints of earlier versions hold torch's alone
        version, words, gauss_next = state["python"]
        if isinstance(words, bytes):
            words = tuple(array(_WORDS, words))
        random.setstate((version, words, gauss_next))
    if "numpy" in state:
        kind, keys, position, has_gauss, gauss = state["numpy"]
        keys = (np.frombuffer(keys, dtype=np.uint32) if isinstance(keys, bytes)
                else keys.numpy().astype(np.uint32))
        np.random.set_state((kind, keys, position, has_gauss, gauss))
        NUMPY_GLOBAL_STATE.forget()
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
