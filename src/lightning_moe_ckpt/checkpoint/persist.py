"""Disk persistence of snapshots (the CheckFreq baseline's second phase).

CheckFreq snapshots the dense state in memory and then persists it to storage in the
background. :class:`DiskPersister` does the second phase for the snapshot engine: a worker
thread waits until a snapshot's copies are checksummed, writes it with ``torch.save`` (the
same encoding replication uses, checksums included) to a temporary file, renames it into
place and acknowledges it, so the store treats the snapshot as persisted only once it is
on disk. Only the two newest files are kept.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from lightning_moe_ckpt.checkpoint.replication import encode_snapshot
from lightning_moe_ckpt.checkpoint.snapshot import Snapshot


class DiskPersister:
    """Background writer of snapshots to ``directory``."""

    def __init__(self, directory: str, on_persisted: Callable[[int, int], None],
                 keep: int = 2) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.on_persisted = on_persisted
        self.keep = keep
        self.written: list[str] = []
        self._queue: queue.Queue[Snapshot | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="snapshot-persist", daemon=True)
        self._thread.start()

    def submit(self, snapshot: Snapshot) -> None:
        """Persist ``snapshot`` once its copies are checksummed."""
        self._queue.put(snapshot)

    def close(self) -> None:
        """Finish pending writes and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (snapshot := self._queue.get()) is not None:
            snapshot.checksummed.wait()
            target = self.directory / f"step={snapshot.step}.snapshot"
            partial = target.with_suffix(".partial")
            partial.write_bytes(encode_snapshot(snapshot).numpy().tobytes())
            os.replace(partial, target)  # never a half-written file under the final name
            self.written.append(str(target))
            for old in self.written[:-self.keep]:
                Path(old).unlink(missing_ok=True)
            self.written = self.written[-self.keep:]
            self.on_persisted(snapshot.plan.window_start, snapshot.step)
