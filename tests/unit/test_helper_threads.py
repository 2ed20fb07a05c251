"""Helper threads run at a higher nice value than the process (Linux keeps one per
thread), capped at the kernel's 19, also where a helper starts one; the setting is checked
and named when bad; the snapshot capture's copy thread and the checksum pool's threads are
such helpers, and the training thread keeps its priority."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from lightning_moe_ckpt.errors import ConfigError
from lightning_moe_ckpt.snapshots.capture import SnapshotCapture
from lightning_moe_ckpt.snapshots.checksum import ChecksumThreads, raw_bytes, views_checksum
from lightning_moe_ckpt.snapshots.helper_threads import (
    DEFAULT_HELPER_NICE,
    MAX_NICE,
    HelperThread,
    require_helper_nice,
)
from tests.unit.capture_plans import Plan
from tests.unit.test_snapshot import _batch, _engine

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="nice values are per thread on Linux only")


def _nice(thread_id: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()
                          if thread_id is None else thread_id)


def _nice_in_helper(nice: int, inner: int | None = None) -> int:
    """The nice value a helper thread of ``nice`` runs at (of a helper of ``inner`` that
    one starts, where given)."""
    seen: list[int] = []

    def body() -> None:
        if inner is None:
            seen.append(_nice())
        else:
            seen.append(_nice_in_helper(inner))

    thread = HelperThread(body, "test-helper", nice)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive() and len(seen) == 1
    return seen[0]


@linux_only
def test_a_helper_runs_below_its_creator_and_the_creator_keeps_its_priority() -> None:
    before = _nice()
    assert _nice_in_helper(5) == min(MAX_NICE, before + 5)
    assert _nice_in_helper(0) == before
    assert _nice() == before  # the training thread's own value is untouched


@linux_only
def test_a_helper_started_by_a_helper_adds_to_the_process_not_to_its_creator() -> None:
    before = _nice()
    assert _nice_in_helper(3, inner=3) == min(MAX_NICE, before + 3)
    assert _nice_in_helper(3, inner=4) == min(MAX_NICE, before + 4)
    assert _nice_in_helper(15, inner=DEFAULT_HELPER_NICE) == MAX_NICE


@pytest.mark.parametrize("value", [-1, 20, True, "19", 1.5, None])
def test_a_bad_helper_nice_names_the_setting(value: object) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint\.helper_nice=.* must be an integer "
                                          r"from 0 .* to 19"):
        require_helper_nice(value)
    with pytest.raises(ConfigError, match=r"checkpoint\.helper_nice="):
        HelperThread(lambda: None, "test-helper", value)  # type: ignore[arg-type]


def _threads_named(prefix: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(prefix)}


def _wait_for_nice(threads: set[threading.Thread], expected: int) -> list[int]:
    """The nice values of ``threads``, once all are ``expected`` or after 30 s (a helper
    lowers its own priority as it starts)."""
    deadline = time.monotonic() + 30
    while True:
        values = [_nice(t.native_id) for t in threads if t.native_id is not None]
        if (values and all(v == expected for v in values)) or time.monotonic() > deadline:
            return values
        time.sleep(0.01)


@linux_only
def test_the_copy_thread_and_the_checksum_pool_are_helpers() -> None:
    before = _nice()
    engine = _engine("32")
    others = _threads_named("snapshot-copy")  # other tests' engines, still open
    snapshots = SnapshotCapture(engine.registry, engine.state, 0, torch.device("cpu"),
                               helper_nice=6)
    try:
        engine.train_iteration(*_batch(0))
        snapshots.issue(Plan(0, tuple(engine.registry.names), (), 0, 0, 1), {})
        snapshots.wait_copies()
        copy_threads = _threads_named("snapshot-copy") - others
        assert _wait_for_nice(copy_threads, before + 6) == [before + 6]
    finally:
        snapshots.close()
    others = _threads_named("checksum")
    checksums = ChecksumThreads(2, chunk_bytes=2**16, helper_nice=4)
    try:
        data = raw_bytes(torch.arange(2**18, dtype=torch.uint8))
        assert checksums.checksum([data]) == views_checksum([data])  # the pool ran
        values = _wait_for_nice(_threads_named("checksum") - others, before + 4)
        assert values and all(v == before + 4 for v in values), values
    finally:
        checksums.close()
    assert _nice() == before
