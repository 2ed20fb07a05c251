"""Disk snapshots: the CheckFreq baseline's second phase (not the durable tier).

CheckFreq snapshots the dense state in memory and then persists it to storage in the
background. :class:`DiskWriter` does the second phase for the snapshot capture: a worker
thread gets a snapshot once its copies are checksummed, writes it in the one snapshot
format replication uses (checksums included) through the library's one write path
(:func:`~lightning_moe_ckpt.core.files.write_atomically`: a temporary file in the same
directory, ``fsync``, rename, ``fsync`` of the directory) and acknowledges it, so the store
treats the snapshot as persisted only once it is on disk. Only the two newest files are
kept, the older deleted only after the newer one is on disk. A write that fails (a full
disk) is logged with its path, step and error, once per kind of error, and leaves the
snapshot unpersisted: the newest file written stays the one a recovery reads, the thread
goes on with the next snapshot, and :meth:`DiskWriter.drain` never waits on it (its wait
is bounded). The directory is the rank's own
(``<durable_dir>/checkfreq/rank<NNNNN>``): files left there by an earlier run are removed
when the writer starts, and after a failure the rank finds its persisted snapshots by
listing the directory (:meth:`DiskWriter.persisted_steps`, :meth:`DiskWriter.read`),
since the worker's host memory (and with it the list of what it wrote) is gone.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_moe_ckpt.core.files import remove_temporaries, write_atomically
from lightning_moe_ckpt.snapshots.codec import encode_snapshot
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, HelperThread
from lightning_moe_ckpt.snapshots.snapshot import Snapshot, wait_checksummed

log = logging.getLogger("lightning_moe_ckpt")

DRAIN_TIMEOUT_S = 600.0  # how long drain() waits for the writes submitted before it


class DiskWriter:
    """Background writer of snapshots to ``directory``."""

    def __init__(self, directory: str, on_persisted: Callable[[int, int], None],
                 keep: int = 2, helper_nice: int = DEFAULT_HELPER_NICE,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        remove_temporaries(self.directory)  # writes an earlier run's end cut short
        for stale in self.directory.glob("step=*.snapshot"):
            stale.unlink()  # an earlier run's: never to be mistaken for this run's
        self.on_persisted = on_persisted
        self.keep = keep
        self.drain_timeout_s = drain_timeout_s
        self.written: list[str] = []
        # Writes that failed: (step, path, the error's text), oldest first.
        self.failures: list[tuple[int, str, str]] = []
        self._kinds_logged: set[tuple[str, int | None]] = set()
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._unfinished = 0  # submitted snapshots not written (or failed) yet
        self._done = threading.Condition()
        self._newest_submitted: Snapshot | None = None
        self._thread = HelperThread(self._run, "snapshot-persist", helper_nice)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` once its copies are checksummed (it is queued then, by the
        thread that checksums it: :meth:`~.snapshot.Snapshot.when_checksummed`)."""
        self._newest_submitted = snapshot
        with self._done:
            self._unfinished += 1
        snapshot.when_checksummed(self._queue.put)

    def close(self) -> None:
        """Finish pending writes and stop the thread."""
        wait_checksummed(self._newest_submitted)  # every submitted one queued
        self._queue.put(None)
        self._thread.join()

    def drain(self) -> None:
        """Wait until every submitted snapshot is on disk or failed to be written (the
        thread keeps running).

        Raises:
            TimeoutError: The writes did not end within ``drain_timeout_s``.
        """
        deadline = time.monotonic() + self.drain_timeout_s
        with self._done:
            while self._unfinished and self._done.wait(max(0.0, deadline - time.monotonic())):
                pass
            if self._unfinished:
                raise TimeoutError(f"{self._unfinished} disk snapshot write(s) into "
                                   f"{self.directory} did not end within "
                                   f"{self.drain_timeout_s:g} s")

    def path(self, step: int) -> Path:
        """Where SS_``step`` is written."""
        return self.directory / f"step={step}.snapshot"

    def persisted_steps(self) -> list[int]:
        """Steps whose snapshot is on disk, found by listing the directory."""
        return sorted(int(path.name[len("step="):-len(".snapshot")])
                      for path in self.directory.glob("step=*.snapshot"))

    def read(self, step: int) -> torch.Tensor:
        """The encoded SS_``step`` as written (decode it to verify its checksums)."""
        return torch.frombuffer(bytearray(self.path(step).read_bytes()), dtype=torch.uint8)

    def _run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            try:
                self._write(snapshot)
            except BaseException as error:  # the thread goes on: never dies silently
                self._failed(snapshot.step, error)
            finally:
                with self._done:
                    self._unfinished -= 1
                    self._done.notify_all()

    def _write(self, snapshot: Snapshot) -> None:
        target = self.path(snapshot.step)
        encoded = encode_snapshot(snapshot).numpy().data  # no extra copy
        write_atomically(target, lambda file: file.write(encoded))
        self.written.append(str(target))
        for old in self.written[:-self.keep]:  # only once the newer one is on disk
            Path(old).unlink(missing_ok=True)
        self.written = self.written[-self.keep:]
        self.on_persisted(snapshot.plan.window_start, snapshot.step)

    def _failed(self, step: int, error: BaseException) -> None:
        """Log a failed write (the first of each kind at error level) and record it."""
        path = str(self.path(step))
        self.failures.append((step, path, f"{type(error).__name__}: {error}"))
        kind = (type(error).__name__, getattr(error, "errno", None))
        first = kind not in self._kinds_logged
        self._kinds_logged.add(kind)
        log.log(logging.ERROR if first else logging.DEBUG,
                "disk snapshot of step %d not written (%s: %s): the newest written, %s, "
                "stays the one a recovery reads", step, type(error).__name__, error,
                self.written[-1] if self.written else "none yet")
