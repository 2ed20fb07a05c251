"""Disk snapshots: the CheckFreq baseline's second phase (not the durable tier).

CheckFreq snapshots the dense state in memory and then persists it to storage in the
background. :class:`DiskWriter` does the second phase for the snapshot capture: a worker
thread gets a snapshot once its copies are checksummed, writes it in the one snapshot
format replication uses (checksums included) to a temporary file, renames it into
place and acknowledges it, so the store treats the snapshot as persisted only once it is
on disk. Only the two newest files are kept. The directory is the rank's own
(``<durable_dir>/checkfreq/rank<NNNNN>``): files left there by an earlier run are removed
when the writer starts, and after a failure the rank finds its persisted snapshots by
listing the directory (:meth:`DiskWriter.persisted_steps`, :meth:`DiskWriter.read`),
since the worker's host memory (and with it the list of what it wrote) is gone.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_moe_ckpt.snapshots.codec import encode_snapshot
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, HelperThread
from lightning_moe_ckpt.snapshots.snapshot import Snapshot, wait_checksummed


class DiskWriter:
    """Background writer of snapshots to ``directory``."""

    def __init__(self, directory: str, on_persisted: Callable[[int, int], None],
                 keep: int = 2, helper_nice: int = DEFAULT_HELPER_NICE) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("step=*.snapshot"),
                      *self.directory.glob("step=*.partial")]:
            stale.unlink()  # an earlier run's: never to be mistaken for this run's
        self.on_persisted = on_persisted
        self.keep = keep
        self.written: list[str] = []
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._newest_submitted: Snapshot | None = None
        self._thread = HelperThread(self._run, "snapshot-persist", helper_nice)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` once its copies are checksummed (it is queued then, by the
        thread that checksums it: :meth:`~.snapshot.Snapshot.when_checksummed`)."""
        self._newest_submitted = snapshot
        snapshot.when_checksummed(self._queue.put)

    def close(self) -> None:
        """Finish pending writes and stop the thread."""
        wait_checksummed(self._newest_submitted)  # every submitted one queued
        self._queue.put(None)
        self._thread.join()

    def drain(self) -> None:
        """Wait until every submitted snapshot is on disk (the thread keeps running)."""
        wait_checksummed(self._newest_submitted)  # every submitted one queued
        self._queue.join()

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
            target = self.path(snapshot.step)
            partial = target.with_suffix(".partial")
            partial.write_bytes(encode_snapshot(snapshot).numpy().data)  # no extra copy
            os.replace(partial, target)  # never a half-written file under the final name
            self.written.append(str(target))
            for old in self.written[:-self.keep]:
                Path(old).unlink(missing_ok=True)
            self.written = self.written[-self.keep:]
            self.on_persisted(snapshot.plan.window_start, snapshot.step)
            self._queue.task_done()
        self._queue.task_done()
