"""The durable tier's writing side: a committed dense checkpoint every N steps.

Sparse snapshots live in host memory and its replicas; a failure that takes every copy of
some piece (or every rank at once, or the whole job) needs a checkpoint that outlives host
memory. :class:`DurableCheckpoints` takes one after every ``checkpoint.durable_every``-th
optimizer step: at global steps N, 2N, 3N, ... A function of the step alone, so every rank
(a replacement, a rank that replayed, a resumed job) takes the same ones: taking one is
collective.

Taking one is quick on the training thread: the strategy's ``save_checkpoint`` hands each
file to :class:`~lightning_moe_ckpt.callbacks.committed_io.CommittedCheckpointIO`, which
clones its tensors; a helper thread then writes them (temporary file, fsync, rename, fsync
of the directory) and the rank's part, and the last rank to finish commits the checkpoint
with its manifest (:mod:`~lightning_moe_ckpt.recovery.manifest`). Each rank has at most one
checkpoint in flight: a rank whose previous one is still being written when the next is
due waits for it (logged, with the time waited), up to ``wait_timeout_s``, after which the
new one is skipped (logged as an error). A write that fails (a full disk: the path, the
step and the error are logged) leaves that checkpoint uncommitted and training goes on,
protected by the previous committed one and the in-memory tier; the next due step tries
again. Retention keeps the newest ``checkpoint.durable_keep`` committed checkpoints and
removes an older one only once a newer one is committed, so once one was written a
committed checkpoint exists at every moment.

Reading them back (the automatic resume, ``ckpt_path``, recovery's last resort) is
:mod:`~lightning_moe_ckpt.recovery.durable`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_moe_ckpt.callbacks.committed_io import (
    CommittedCheckpointIO,
    PendingFile,
    checkpoint_io_replaceable,
    durable_file,
    in_durable_directory,
)
from lightning_moe_ckpt.core.files import FileRecord, file_record, fsync_directory, save_atomically
from lightning_moe_ckpt.errors import ConfigError, CorruptCheckpointError, fmt, require
from lightning_moe_ckpt.recovery.durable import DurableSource, check_layout, verify_collectively
from lightning_moe_ckpt.recovery.manifest import (
    Manifest,
    checkpoint_path,
    clean_directory,
    committed_steps,
    manifest_path,
    parts_directory,
    read_manifest,
    retain,
    try_commit,
    uncommit,
    verify_bytes,
    write_part,
)
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, HelperThread
from lightning_moe_ckpt.strategies.fabric import MoEParallelStrategy as FabricMoEParallel
from lightning_moe_ckpt.strategies.trainer import MoEParallelStrategy

__all__ = ["DurableCheckpoints", "check_durable_settings", "checkpoint_layout",
           "install_committed_io", "verify_resumed"]

log = logging.getLogger("lightning_moe_ckpt")

WAIT_TIMEOUT_S = 600.0  # how long a due checkpoint waits for the previous one's write
_SLOW_WAIT_S = 0.05  # a wait for the previous write longer than this is logged


def checkpoint_layout(strategy: Any, world_size: int) -> dict[str, Any]:
    """The layout a checkpoint written by ``strategy`` records, which a resume must match
    where its files are per rank."""
    if isinstance(strategy, MoEParallelStrategy | FabricMoEParallel):
        return strategy.core.layout_record(world_size)
    return {"world_size": world_size}


def install_committed_io(trainer: L.Trainer) -> CommittedCheckpointIO:
    """Give the Trainer's strategy the committed checkpoint IO (replacing Lightning's
    default one); the one already installed is kept.

    Raises:
        ConfigError: The strategy has a checkpoint IO of its own (not Lightning's default).
    """
    strategy = trainer.strategy
    current: CheckpointIO = strategy.checkpoint_io
    if isinstance(current, CommittedCheckpointIO):
        return current
    if not checkpoint_io_replaceable(current):
        raise ConfigError(
            f"SparseCheckpointing(durable_every=...) commits durable checkpoints through its "
            f"own checkpoint IO; the Trainer's is {type(current).__name__}: leave the "
            "plugins' checkpoint IO at Lightning's default (TorchCheckpointIO or "
            "AsyncCheckpointIO), or set durable_every=None")
    committed = CommittedCheckpointIO()
    strategy.checkpoint_io = committed
    return committed


def verify_resumed(ckpt_path: str | Path, layout: Mapping[str, Any]) -> None:
    """Before a resumed run trains: the durable checkpoint it loaded from ``ckpt_path`` is
    committed, of this run's layout, and every file verifies (each rank reads a share;
    collective). A checkpoint from elsewhere (no durable directory) is not checked.

    Raises:
        CorruptCheckpointError: One line naming the file and what failed.
        ConfigError: It was written by another layout.
    """
    found = durable_file(Path(ckpt_path))
    if found is None or not in_durable_directory(found[0]):
        return
    checkpoint = found[0]
    if not manifest_path(checkpoint).exists():
        raise CorruptCheckpointError(
            f"ckpt_path={str(ckpt_path)!r} is not a committed durable checkpoint (no "
            f"{manifest_path(checkpoint).name}: its write did not finish)")
    check_layout(checkpoint, read_manifest(checkpoint), layout)
    problem = verify_collectively(checkpoint)
    if problem is not None:
        raise CorruptCheckpointError(f"ckpt_path={str(ckpt_path)!r}: {problem}")


def check_durable_settings(every: int | None, directory: str | None, keep: int) -> None:
    """Refuse bad durable-tier settings, naming the setting and its value.

    Args:
        every: ``checkpoint.durable_every``: steps between durable checkpoints (None: none).
        directory: ``checkpoint.durable_dir``: where they are written.
        keep: ``checkpoint.durable_keep``: the newest committed ones kept.

    Raises:
        ConfigError: A setting out of range, or a cadence without a directory.
    """
    require(every is None or (isinstance(every, int) and not isinstance(every, bool)
                              and every >= 1),
            f"{fmt('checkpoint.durable_every', every)} must be an integer >= 1 (steps "
            "between durable checkpoints; or null: no durable checkpoints)")
    require(every is None or directory is not None,
            f"checkpoint.durable_every={every} needs checkpoint.durable_dir")
    require(isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1,
            f"{fmt('checkpoint.durable_keep', keep)} must be an integer >= 1 (an older "
            "checkpoint is removed only once a newer one is committed)")


class DurableCheckpoints:
    """When durable checkpoints are taken, their background writer, and their commits.

    Args:
        every: Take a durable checkpoint after every this many optimizer steps (at global
            steps ``every``, ``2 * every``, ...); ``None``: none.
        directory: Where durable checkpoints go; required when ``every`` is set.
        keep: Newest committed durable checkpoints kept (older ones are removed once a
            newer one is committed, so 1 still always leaves one).
        wait_timeout_s: How long a due checkpoint waits for this rank's previous one to be
            written before it is skipped.
        helper_nice: Nice value added to the writer thread's.

    Raises:
        ConfigError: A bad value, naming its ``checkpoint.durable_*`` key.
    """

    def __init__(self, every: int | None, directory: str | None, keep: int,
                 wait_timeout_s: float = WAIT_TIMEOUT_S,
                 helper_nice: int = DEFAULT_HELPER_NICE) -> None:
        check_durable_settings(every, directory, keep)
        self.every = every
        self.directory = directory
        self.keep = keep
        self.wait_timeout_s = wait_timeout_s
        self.helper_nice = helper_nice
        self.taken: list[str] = []  # the checkpoints this rank took (written or not)
        # This rank's writes that failed: {"step", "path", "error"}, oldest first.
        self.failures: list[dict[str, Any]] = []
        self.waits_s: list[float] = []  # each wait for the previous write, when one was due
        self.io: CommittedCheckpointIO | None = None
        self.rank = 0
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._busy = 0  # checkpoints submitted and not written (or failed) yet
        self._done = threading.Condition()
        self._thread: HelperThread | None = None
        self._kinds_logged: set[tuple[str, int | None]] = set()

    @property
    def enabled(self) -> bool:
        """Whether durable checkpoints are taken."""
        return self.every is not None

    def due(self, step: int) -> bool:
        """Whether a durable checkpoint is taken once ``step`` optimizer steps are done."""
        return self.every is not None and step > 0 and step % self.every == 0

    def start(self, rank: int, start_step: int, fresh: bool) -> None:
        """Training (re)starts on ``rank`` at ``start_step``; a ``fresh`` start (the job's,
        not a replacement's) of rank 0 first clears what earlier writes cut short (see
        :func:`~lightning_moe_ckpt.recovery.manifest.clean_directory`).

        Raises:
            ConfigError: A fresh start at step 0 over committed checkpoints (every rank
                refuses it: a run started again without its ``ckpt_path`` would
                otherwise train from scratch over the checkpoints of the one it follows).
        """
        self.rank = rank
        if self.directory is None or self.every is None or not fresh:
            return
        committed = committed_steps(self.directory)
        require(start_step > 0 or not committed,
                f"checkpoint.durable_dir={self.directory!r} holds committed durable "
                f"checkpoints (the newest: step={committed[-1] if committed else 0}) and this "
                "run starts afresh at step 0: resume with "
                "ckpt_path=newest_committed_durable(durable_dir) (the recipe does by "
                "itself), or give another checkpoint.durable_dir to start afresh")
        if rank == 0:
            clean_directory(self.directory, start_step)

    def source(self, trainer: L.Trainer | None) -> DurableSource | None:
        """Where a recovery finds this tier's checkpoints (``trainer`` loads them);
        ``None`` without a durable tier or a Trainer."""
        if trainer is None or self.directory is None or self.every is None:
            return None
        return DurableSource(trainer, self.directory, lambda: self._drain_or_log())

    def _drain_or_log(self) -> None:
        if not self.drain():
            log.error("durable tier: rank %d's writes did not end within %g s; recovery "
                      "takes the newest committed checkpoint", self.rank, self.wait_timeout_s)

    def committed(self) -> list[str]:
        """The committed checkpoints in the durable directory now, oldest first."""
        if self.directory is None:
            return []
        return [str(checkpoint_path(self.directory, s))
                for s in committed_steps(self.directory)]

    def write(self, trainer: L.Trainer) -> None:
        """Take the durable checkpoint of the live state at ``trainer.global_step``
        (collective: the strategy's ``save_checkpoint``); it is written in the background
        and committed once every rank's files are."""
        assert self.directory is not None  # checked at construction when every is set
        step = trainer.global_step
        path = checkpoint_path(self.directory, step)
        if not self._wait_for_previous(step):
            return
        io_plugin = self.io if self.io is not None else install_committed_io(trainer)
        self.io = io_plugin
        uncommit(path)  # a step taken again: never committed with a mix of files
        io_plugin.collecting = []
        error: BaseException | None = None
        try:
            trainer.save_checkpoint(str(path), weights_only=False)
        except Exception as failed:  # a strategy's own write (DCP) failed on this rank
            error = failed
        finally:
            pending, io_plugin.collecting = io_plugin.collecting, None
        layout = checkpoint_layout(trainer.strategy, trainer.world_size)
        self._submit(path, trainer.global_rank, trainer.world_size, layout, pending, error)

    def write_rank_state(self, step: int, rank: int, world_size: int,
                         layout: Mapping[str, Any], state: Mapping[str, Any]) -> None:
        """Take a durable checkpoint of ``state`` (a Fabric loop's: one file per rank,
        ``step=N.ckpt/rank<NNNNN>.ckpt``); collective in the sense that every rank must
        take it at the same step for it to be committed."""
        assert self.directory is not None
        path = checkpoint_path(self.directory, step)
        if not self._wait_for_previous(step):
            return
        self.rank = rank
        uncommit(path)
        content = apply_to_collection(dict(state), torch.Tensor,
                                      lambda t: t.detach().clone())
        self._submit(path, rank, world_size, layout,
                     [(path / f"rank{rank:05d}.ckpt", content)], None)

    @staticmethod
    def load_rank_state(checkpoint: str | Path, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s file of a committed checkpoint :meth:`write_rank_state` wrote,
        verified against the manifest before it is unpickled.

        Raises:
            CorruptCheckpointError: It is not committed, missing or damaged.
        """
        path = Path(checkpoint)
        name = f"{path.name}/rank{rank:05d}.ckpt"
        data = (path / f"rank{rank:05d}.ckpt").read_bytes()
        verify_bytes(path, name, data)
        loaded: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=False)
        return loaded

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until this rank's durable writes ended (committed, or failed); whether they
        did within ``timeout_s`` (default ``wait_timeout_s``)."""
        deadline = time.monotonic() + (self.wait_timeout_s if timeout_s is None else timeout_s)
        with self._done:
            while self._busy and self._done.wait(max(0.0, deadline - time.monotonic())):
                pass
            return self._busy == 0

    def close(self) -> None:
        """Finish the writes in flight (bounded) and stop the writer thread."""
        if self._thread is None:
            return
        if not self.drain():
            log.error("durable tier: rank %d's writes did not end within %g s; the newest "
                      "committed checkpoint stays the one a resume takes", self.rank,
                      self.wait_timeout_s)
        self._jobs.put(None)
        self._thread.join(timeout=1.0)
        self._thread = None

    def _wait_for_previous(self, step: int) -> bool:
        """At most one checkpoint in flight: wait for the previous one's write; whether
        this one is taken."""
        waited = time.perf_counter()
        if not self.drain():
            message = (f"durable checkpoint of step {step} skipped: rank {self.rank}'s "
                       f"previous one is still being written after {self.wait_timeout_s:g} s")
            log.error("durable tier: %s", message)
            self.failures.append({"step": step, "path": None, "error": message})
            return False
        seconds = time.perf_counter() - waited
        if seconds > _SLOW_WAIT_S:
            self.waits_s.append(seconds)
            log.warning("durable tier: the checkpoint of step %d waited %.2f s for rank %d's "
                        "previous one to be written (at most one in flight per rank; a "
                        "larger checkpoint.durable_every avoids the wait)", step, seconds,
                        self.rank)
        return True

    def _submit(self, path: Path, rank: int, world_size: int, layout: Mapping[str, Any],
                pending: list[PendingFile], error: BaseException | None) -> None:
        self.taken.append(str(path))
        with self._done:
            self._busy += 1
        if self._thread is None:
            self._thread = HelperThread(self._run, "durable-writer", self.helper_nice)
            self._thread.start()
        self._jobs.put(lambda: self._write(path, rank, world_size, dict(layout), pending,
                                           error))

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                with self._done:
                    self._busy -= 1
                    self._done.notify_all()

    def _write(self, path: Path, rank: int, world_size: int, layout: dict[str, Any],
               pending: list[PendingFile], error: BaseException | None) -> None:
        """The writer thread's part of one checkpoint: this rank's files, its part, and
        the commit when this rank's part is the last one."""
        root = path.parent
        step = int(path.name[len("step="):-len(".ckpt")])
        records: dict[str, FileRecord] = {}
        failed_path = str(path)
        try:
            if error is not None:
                raise error
            for target, content in pending:
                failed_path = str(target)
                records[str(target.relative_to(root))] = save_atomically(content, target)
            if not pending and path.is_dir():  # the strategy wrote it itself (DCP)
                records.update(_own_files(path, rank))
            if path.is_dir():
                fsync_directory(path)
            failed_path = str(path)
            write_part(path, rank, world_size, layout, records)
        except BaseException as failure:  # the writer goes on: never dies silently
            self._failed(step, failed_path, failure)
            try:
                write_part(path, rank, world_size, layout, {},
                           error=f"{type(failure).__name__}: {failure}")
            except BaseException:  # the disk refuses even the part: remove what is ours
                _remove_own(path, [target for target, _ in pending], rank)
            else:
                try_commit(path, world_size)  # as the last part, it removes the files
            return
        try:
            result = try_commit(path, world_size)
        except BaseException as failure:
            self._failed(step, str(path), failure)
            return
        if isinstance(result, Manifest):
            removed = retain(root, step, self.keep)
            log.info("durable tier: committed %s (%d files); removed step(s) %s", path,
                     len(result.files), removed or "none")
        elif isinstance(result, str):
            log.error("durable tier: %s not committed: %s; the previous committed "
                      "checkpoint stays the newest", path, result)

    def _failed(self, step: int, path: str, error: BaseException) -> None:
        """Record a failed write; log the first of each kind at error level."""
        self.failures.append({"step": step, "path": path,
                              "error": f"{type(error).__name__}: {error}"})
        kind = (type(error).__name__, getattr(error, "errno", None))
        first = kind not in self._kinds_logged
        self._kinds_logged.add(kind)
        log.log(logging.ERROR if first else logging.DEBUG,
                "durable tier: rank %d could not write the checkpoint of step %d (%s: %s); "
                "it is not committed, the previous committed checkpoint stays the newest "
                "and training goes on", self.rank, step, type(error).__name__, error)


def _remove_own(checkpoint: Path, files: list[Path], rank: int) -> None:
    """What ``rank`` left of a checkpoint it could not write (its files, its part, the
    directories left empty); the other ranks' files go with the next commit's retention
    or the next start's clean-up, since this one can never be committed."""
    for file in [*files, parts_directory(checkpoint) / f"rank{rank:05d}.json"]:
        file.unlink(missing_ok=True)
    for directory in (parts_directory(checkpoint), checkpoint):
        with contextlib.suppress(OSError):  # not empty, or not there
            directory.rmdir()
    if checkpoint.is_file() and checkpoint in files:
        checkpoint.unlink(missing_ok=True)


def _own_files(checkpoint: Path, rank: int) -> dict[str, FileRecord]:
    """The files of a DCP directory ``rank`` wrote (``__<rank>_*``; rank 0 also the
    metadata files), with their records (read back once)."""
    root = checkpoint.parent
    mine = []
    for entry in sorted(checkpoint.iterdir()):
        if not entry.is_file():
            continue
        if entry.name.startswith(f"__{rank}_") or (rank == 0 and not entry.name.startswith("__")):
            mine.append(entry)
    return {str(entry.relative_to(root)): file_record(entry) for entry in mine}
