"""RNG states taken with every snapshot: exact round trips, the NumPy capture reused only
while the generator cannot have moved, and the forms of earlier versions still restored."""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lightning_moe_ckpt.core import rng
from lightning_moe_ckpt.core.rng import NumpyGlobalState, restore_rng, rng_state


@pytest.fixture(autouse=True)
def _isolated_generators() -> Iterator[None]:
    """Each test starts from fixed seeds and leaves the process's generators as found."""
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    rng.NUMPY_GLOBAL_STATE.forget()
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    np.random.set_state(saved[2])
    rng.NUMPY_GLOBAL_STATE.forget()


def _draws() -> tuple[Any, ...]:
    """One draw from every generator, the legacy Gaussian included (it caches a second)."""
    return (torch.rand(3), random.random(), random.gauss(0.0, 1.0), np.random.random(2),
            np.random.normal(size=3))


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (torch.equal(a[0], b[0]) and a[1:3] == b[1:3] and np.array_equal(a[3], b[3])
            and np.array_equal(a[4], b[4]))


def _counting_get_state(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    original = np.random.get_state

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(np.random, "get_state", counted)
    return calls


def test_restore_replays_every_generator_bitwise() -> None:
    _draws()  # a Gaussian is cached in both legacy generators now
    state = rng_state()
    expected = _draws()
    _draws()
    restore_rng(state)
    assert _same(_draws(), expected)


def test_state_loads_with_weights_only() -> None:
    _draws()
    buffer = io.BytesIO()
    torch.save(rng_state(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    expected = _draws()
    restore_rng(state)
    assert _same(_draws(), expected)


def test_numpy_capture_is_reused_only_while_key_and_position_stay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = rng_state()["numpy"]
    calls = _counting_get_state(monkeypatch)
    assert rng_state()["numpy"] is first and calls[0] == 0  # read from the struct alone
    np.random.random()
    moved = rng_state()["numpy"]
    assert moved != first and calls[0] == 1
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    assert moved == (kind, keys.tobytes(), position, has_gauss, gauss)


def test_a_cached_gaussian_is_never_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Consuming the cached Gaussian moves neither key nor position: the capture that
    held it must be read again."""
    np.random.normal()  # draws a pair, caches the second
    cached = rng_state()["numpy"]
    assert cached[3] == 1
    np.random.normal()  # consumes the cache: no word drawn
    consumed = rng_state()["numpy"]
    assert consumed[1:3] == cached[1:3] and consumed[3] == 0
    expected = np.random.normal(size=2)
    np.random.normal(size=5)
    restore_rng({"cpu": torch.get_rng_state(), "numpy": consumed})
    assert np.array_equal(np.random.normal(size=2), expected)


def test_restore_forgets_the_reused_capture() -> None:
    """A restored state with a cached Gaussian and the same key and position as the
    reusable capture (nothing the generator's draws could make) is read anew."""
    np.random.normal()
    with_cache = rng_state()
    np.random.normal()
    without = rng_state()["numpy"]
    assert without[3] == 0 and rng_state()["numpy"] is without  # reusable now
    restore_rng(with_cache)
    assert rng_state()["numpy"] == with_cache["numpy"]


def test_struct_read_falls_back_where_it_does_not_match_get_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rng.ctypes, "string_at", lambda address, size: b"\0" * size)
    state = NumpyGlobalState()
    calls = _counting_get_state(monkeypatch)
    first = state.capture()
    assert state.capture() == first and calls[0] == 3  # one check, then every capture
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    assert first == (kind, keys.tobytes(), position, has_gauss, gauss)


def test_tensor_forms_of_earlier_versions_restore() -> None:
    _draws()
    version, words, gauss_next = random.getstate()
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    earlier = {"cpu": torch.get_rng_state(), "python": (version, words, gauss_next),
               "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss,
                         gauss)}
    expected = _draws()
    restore_rng(earlier)
    assert _same(_draws(), expected)
