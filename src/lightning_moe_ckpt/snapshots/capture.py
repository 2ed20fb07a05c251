"""Snapshot engine: copies SS_t to host memory while iteration t+1 computes.

After optimizer step ``t`` the engine issues the copies a :class:`CapturePlan` asks for:
master state (master weights and optimizer state, read through
:class:`~lightning_moe_ckpt.core.optimizer_state.OptimizerStateAccess`) of the plan's
``master`` operators and compute weights of its ``compute`` operators. The copies overlap
the next iteration's forward/backward, which only reads those tensors; right before
optimizer step ``t+1`` mutates them the engine waits for the copies to finish and counts
any wait as stall time (invariant 3: the wait is measured, never hidden).

* CUDA: copies run on a dedicated stream, ordered after step ``t`` by an event, into
  pinned host buffers. The copy thread issues them, not the training thread: a
  ``cudaMemcpyAsync`` blocks once the copy queue is full, which on an H200 held the
  training thread about 50 ms per iteration of a 4 GB snapshot. It can issue them in
  batches, a few queued at a time (:mod:`~lightning_moe_ckpt.snapshots.copy_batches`),
  so that the training stream's own device-to-host reads need not wait behind a whole
  snapshot (by default in one). The main thread never blocks except in that measured
  wait.
* CPU: the copy thread performs the copies, piece by piece: one ``torch.cat`` of the
  piece's sources (flat byte views) into its packed block, or a copy per tensor where the
  piece has no such block.

On CUDA a second thread checksums each snapshot once its copies are done, so the next
snapshot's copies never wait behind a checksum. On CPU the copy thread checksums each
piece itself right after copying it, while the bytes are still in its core's cache: the
next snapshot is an iteration away, and CRC32C runs at a few times the speed of the copy,
while a hand-off to another thread costs a wake-up on cores that the ranks share.

Persistent module buffers (a balancing bias, normalisation statistics) are the exception:
a forward may change them in place before optimizer step ``t+1``, so they are copied at
issue, in order with the training thread (on CPU there, on CUDA on its current stream,
before the side stream starts). They are small (a vector per router or norm), so this
costs the training thread next to nothing.

Host buffers come from a pool (:class:`~.snapshot.HostBufferPool`) keyed by (tensor name,
shape, dtype): buffers of a freed snapshot are reused by the next one with the same
layout, so steady-state training allocates nothing. Every piece gets a CRC32C checksum
(the SSE4.2/ARMv8 instruction through the ``crc32c`` package), computed after its copy
completed (off the critical path: by the checksum thread, large pieces in chunks on
several threads, :class:`ChecksumThreads`) and verified on restore.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lightning_moe_ckpt.core.optimizer_state import OptimizerStateAccess, StateFingerprint
from lightning_moe_ckpt.core.registry import OperatorRegistry
from lightning_moe_ckpt.snapshots import copy_batches
from lightning_moe_ckpt.snapshots.checksum import ChecksumThreads, tensor_views
from lightning_moe_ckpt.snapshots.helper_threads import DEFAULT_HELPER_NICE, HelperThread
from lightning_moe_ckpt.snapshots.snapshot import (
    HostBufferPool,
    PieceKind,
    PieceLayout,
    PlacedMemory,
    Snapshot,
    SnapshotPiece,
    wait_checksummed,
)

if TYPE_CHECKING:
    from lightning_moe_ckpt.planning.planner import CapturePlan



class Placement(Protocol):
    """Where a consumer of snapshots wants their pieces copied to, when it can hold them
    (replication's shared slots): memory for a copy list's pieces, or None."""

    def place(self, copies: CopyList) -> PlacedMemory | None: ...

# One piece's host copies: runs of its sources concatenated into its block (byte views,
# block bytes), and the tensors copied one by one where it has no such runs (its dtypes
# cannot share a block, or a source is not contiguous) with their sources.
_HostPieceCopy = tuple[SnapshotPiece, tuple[tuple[tuple[torch.Tensor, ...], torch.Tensor], ...],
                       tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class _CopyJob:
    """One snapshot's copies, from the training thread to the copy thread: the copy list
    of its plan's shape (the sources, their bytes, on CUDA their batches) and the host
    targets, on CUDA all of them in the sources' order, on the host piece by piece."""

    snapshot: Snapshot
    copies: CopyList
    targets: list[torch.Tensor]  # CUDA
    host: list[_HostPieceCopy]
    ready: torch.cuda.Event | None = None  # CUDA: recorded on the training stream after step t


@dataclass(frozen=True, eq=False)
class CopyList:
    """Everything :meth:`SnapshotCapture.issue` needs for one plan shape, built once: the
    plan repeats every W iterations, so steady-state issuing is a few operations per piece
    and none per tensor. Valid while the engine's fingerprint of the live state matches.
    Equal only to itself (it is a cache key of its buffers' views, by identity)."""

    pieces: tuple[PieceLayout, ...]
    sources: tuple[torch.Tensor, ...]  # copied behind the next iteration
    at_issue_sources: tuple[torch.Tensor, ...]  # module buffers, copied at issue
    batches: copy_batches.CopyBatches | None = None  # CUDA: :attr:`sources` in batches

    @cached_property
    def behind_bytes(self) -> int:
        """Bytes of :attr:`sources`, the copies timed behind compute."""
        return sum(source.nbytes for source in self.sources)


def _sources(registry: OperatorRegistry, state: OptimizerStateAccess, operator: str,
             kind: PieceKind) -> dict[str, torch.Tensor]:
    """The live tensors a snapshot piece of ``operator`` copies: its pieces' compute
    weights or master state, and in either kind its persistent buffers."""
    sources: dict[str, torch.Tensor] = {}
    read = state.compute_sources if kind == "compute" else state.master_sources
    op = registry[operator]
    for part in op.parts:
        sources.update(read(part))
    for buffer in op.buffers:
        sources[buffer.snapshot_key] = buffer.tensor.detach()
    return sources


class SnapshotCapture:
    """Issues, overlaps and waits for the per-iteration snapshot copies of one rank."""

    def __init__(self, registry: OperatorRegistry, state: OptimizerStateAccess, rank: int,
                 device: torch.device, pool: HostBufferPool | None = None,
                 copy_delay_s: float = 0.0, checksum_threads: int = 1,
                 checksum_thread: bool | None = None,
                 helper_nice: int = DEFAULT_HELPER_NICE) -> None:
        """``checksum_thread``: whether a thread of its own checksums the copied snapshots
        (None: on CUDA only, see the module docstring); ``helper_nice``: added to the nice
        value of the copy and checksum threads (:mod:`.helper_threads`)."""
        self.registry = registry
        self.state = state
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.pool = pool if pool is not None else HostBufferPool(pin_memory=self.cuda)
        self.copy_delay_s = copy_delay_s  # tests slow the copy down to provoke races
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.pending: list[Snapshot] = []
        self._newest: Snapshot | None = None  # the last one issued
        self.interrupted_steps: set[int] = set()  # copies a simulated failure cuts short
        self.stall_s = 0.0
        self.bytes_issued = 0
        self.pieces_issued = 0
        self.checksum_thread = self.cuda if checksum_thread is None else checksum_thread
        # Each written by one thread only: the copy thread, and the checksum thread (else
        # the copy thread checksums too).
        self.pieces_checksummed = 0
        self.copy_cpu_s = 0.0  # the copy thread's CPU time
        self.checksum_cpu_s = 0.0  # checksumming's (its pool threads' not counted)
        # Time the bulk copies took (CUDA: between events on the side stream), so the
        # snapshot bandwidth achieved can be set against the measured pinned bandwidth.
        self.copy_s = 0.0
        self.bytes_copied = 0  # behind-compute bytes of the timed copies
        # Large pieces are checksummed on several threads, to keep up with a GPU's copies.
        self.checksums = ChecksumThreads(checksum_threads, helper_nice=helper_nice)
        self.copy_lists: dict[tuple[tuple[str, ...], tuple[str, ...]], CopyList] = {}
        self.copy_batch_bytes: int | None = copy_batches.COPY_BATCH_BYTES
        # CUDA: the copy thread's ring of events, one per batch it may have queued.
        self._queued = [torch.cuda.Event(blocking=True)
                        for _ in range(copy_batches.COPY_BATCHES_IN_FLIGHT if self.cuda else 0)]
        self.copy_list_builds = 0
        # Each operator's piece layouts, valid while :attr:`_layouts_fingerprint` matches:
        # a popularity reorder makes new plan shapes of the same operators (on a 16-expert
        # GPT-MoE at W = 2, seven windows in eight), so a new shape's copy list is put
        # together from these instead of reading every source tensor again.
        self._layouts: dict[tuple[str, PieceKind], PieceLayout] = {}
        self._layouts_fingerprint: StateFingerprint | None = None
        self.layout_builds = 0
        # The first error of the copy or checksum thread (both go on): the training thread
        # raises it in its next wait, rather than training on with snapshots never taken.
        self.failure: BaseException | None = None
        self._copies: queue.Queue[_CopyJob | None] = queue.Queue()
        # For the checksum thread (None without one): a copied snapshot, and whether to
        # checksum it (its copy completed, uncut).
        self._to_checksum: queue.Queue[tuple[Snapshot, bool] | None] | None = (
            queue.Queue() if self.checksum_thread else None)
        self._threads = (
            HelperThread(self._copy_loop, "snapshot-copy", helper_nice),
            *([HelperThread(self._checksum_loop, "snapshot-checksum", helper_nice)]
              if self.checksum_thread else []))
        for thread in self._threads:
            thread.start()

    @property
    def worker_cpu_s(self) -> float:
        """CPU time of the copy and checksum threads (not their checksum pool's)."""
        return self.copy_cpu_s + self.checksum_cpu_s

    def copy_list(self, plan: CapturePlan) -> CopyList:
        """The copy list of ``plan``'s shape: cached, and put together from cached
        per-operator layouts for a new shape; all are rebuilt when the live tensors behind
        them were replaced (a restore, the optimizer's first step)."""
        shape = (plan.master, plan.compute)
        fingerprint = self._layouts_fingerprint
        if fingerprint is None or not fingerprint.matches():
            self._forget_layouts()
        else:
            cached = self.copy_lists.get(shape)
            if cached is not None:
                return cached
        # Shapes of superseded orders (after a reorder) are never asked for again: keep
        # the two windows' worth that can be, so the cache stays bounded.
        while len(self.copy_lists) > 2 * plan.window:
            del self.copy_lists[next(iter(self.copy_lists))]
        kinds: tuple[tuple[PieceKind, tuple[str, ...]], ...] = (
            ("master", plan.master), ("compute", plan.compute))
        pieces = tuple(self._layout(operator, kind)
                       for kind, operators in kinds for operator in operators
                       if operator in self.registry)  # others are held by other ranks
        sources = tuple(t for layout in pieces for t in layout.behind_sources)
        built = CopyList(pieces, sources,
                         tuple(t for layout in pieces for t in layout.at_issue_sources),
                         copy_batches.CopyBatches.of(sources, self.copy_batch_bytes)
                         if self.cuda else None)
        self.copy_lists[shape] = built
        self.copy_list_builds += 1
        return built

    def _forget_layouts(self) -> None:
        """Drop every cached layout and copy list; fingerprint the live state anew."""
        self._layouts.clear()
        self.copy_lists.clear()
        self._layouts_fingerprint = StateFingerprint(
            self.state, (part for op in self.registry for part in op.parts),
            (buffer for op in self.registry for buffer in op.buffers))

    def _layout(self, operator: str, kind: PieceKind) -> PieceLayout:
        """``operator``'s piece layout of ``kind``, built once per fingerprint."""
        layout = self._layouts.get((operator, kind))
        if layout is None:
            layout = PieceLayout.of(operator, kind,
                                    _sources(self.registry, self.state, operator, kind),
                                    (b.snapshot_key for b in self.registry[operator].buffers))
            self._layouts[operator, kind] = layout
            self.layout_builds += 1
        return layout

    def issue(self, plan: CapturePlan, metadata: dict[str, Any],
              placement: Placement | None = None) -> Snapshot:
        """Start copying SS_{plan.iteration}; returns immediately. With a ``placement``
        (host copies only) the pieces go straight into a shared slot where they fit."""
        copies = self.copy_list(plan)
        pieces: dict[str, SnapshotPiece] = {}
        targets: list[torch.Tensor] = []
        host: list[_HostPieceCopy] = []
        at_issue: list[torch.Tensor] = []
        backing = None if placement is None or self.cuda else placement.place(copies)
        for index, layout in enumerate(copies.pieces):
            buffers = (self.pool.acquire(layout) if backing is None
                       else backing.buffers[index])
            piece = SnapshotPiece(layout.operator, layout.kind, buffers.tensors,
                                  buffers=buffers)
            piece.nbytes = layout.nbytes  # known: spares a sum over the tensors
            pieces[layout.operator] = piece
            if self.cuda:
                targets.extend(buffers.behind)  # name order, as the sources
            elif buffers.behind_blocks is not None and layout.byte_runs is not None:
                host.append((piece, tuple(zip(layout.byte_runs, buffers.behind_blocks,
                                              strict=True)), (), ()))
            else:
                host.append((piece, (), buffers.behind, layout.behind_sources))
            at_issue.extend(buffers.at_issue)
        snapshot = Snapshot(plan.iteration, self.rank, plan, pieces, metadata, backing=backing)
        self.bytes_issued += snapshot.nbytes
        self.pieces_issued += len(pieces)
        # Before the next forward can change them; on CUDA on the training stream, in order
        # with it (small: module buffers and the clip coefficient).
        if at_issue:
            torch._foreach_copy_(at_issue, list(copies.at_issue_sources),
                                 non_blocking=self.cuda)
        ready = None
        if self.cuda:
            _metadata_to_host(metadata)
            ready = torch.cuda.Event()
            ready.record()  # the side stream's copies start after step t, and after these
        self.pending.append(snapshot)
        self._newest = snapshot
        self._copies.put(_CopyJob(snapshot, copies, targets, host, ready))
        return snapshot

    def interrupt_copy(self, step: int) -> None:
        """Failure injection: this rank's worker dies while SS_``step`` is being copied.
        The copy never completes, so its pieces get no checksum: the snapshot (and any
        window it belongs to) is unusable here and on the replica peers. Call before the
        snapshot is issued."""
        self.interrupted_steps.add(step)

    def wait_copies(self) -> float:
        """Block until every issued copy finished; returns (and accumulates) the stall."""
        if not self.pending:
            return 0.0
        started = time.perf_counter()
        for snapshot in self.pending:
            snapshot.copied.wait()
        stall = time.perf_counter() - started
        self.pending = []
        self.stall_s += stall
        if self.failure is not None:
            raise RuntimeError(f"rank {self.rank}: taking snapshots failed") from self.failure
        return stall

    def wait_checksums(self) -> None:
        """Block until every issued snapshot is checksummed and handed off."""
        wait_checksummed(self._newest)

    def close(self) -> None:
        """Finish outstanding work and stop the copy and checksum threads."""
        self.wait_copies()
        self._copies.put(None)
        for thread in self._threads:
            thread.join()
        self.checksums.close()

    def _copy_loop(self) -> None:
        """The copy thread: each snapshot's copies, then its hand-off to the checksum
        thread, or its checksum where there is none (on the host, piece by piece right
        after each piece's copy, while its bytes are still in this core's cache: read back
        from memory after the whole snapshot, they cost 15% more of this thread's time)."""
        while (job := self._copies.get()) is not None:
            started = time.thread_time()
            # Decided before the copy counts as done: once the training thread's wait
            # returns, a failure injector clears the interrupted steps.
            usable = job.snapshot.step not in self.interrupted_steps
            here = usable and job.ready is None and self._to_checksum is None
            checksums: list[int] | None = None
            try:
                checksums = self._copy(job, checksum=here)
                self.bytes_copied += job.copies.behind_bytes
            except Exception as error:  # the snapshot stays unchecksummed, so unusable
                self.failure = self.failure or error
                usable = False
            if usable and checksums is not None:
                self._record_checksums([piece for piece, *_ in job.host], checksums)
            job.snapshot.copied.set()
            self.copy_cpu_s += time.thread_time() - started
            if self._to_checksum is not None:
                self._to_checksum.put((job.snapshot, usable))
            elif checksums is not None and usable:
                job.snapshot.set_checksummed()
            else:
                self._checksum_copied(job.snapshot, usable)
        if self._to_checksum is not None:
            self._to_checksum.put(None)

    def _copy(self, job: _CopyJob, checksum: bool) -> list[int] | None:
        """``job``'s copies: on the side stream (CUDA), else here, piece by piece; on the
        host with ``checksum`` also each piece's checksum (returned, in piece order)."""
        if job.ready is not None:
            self._copy_on_stream(job)
            return None
        if self.copy_delay_s:
            time.sleep(self.copy_delay_s)
        checksums: list[int] | None = [] if checksum else None
        copy_s = 0.0
        # Calls per piece, none per tensor: a Python loop would contend for the GIL.
        for piece, runs, targets, sources in job.host:
            copy_started = time.perf_counter()
            for run, block in runs:
                torch.cat(run, out=block)
            if targets:
                torch._foreach_copy_(targets, sources)
            copy_s += time.perf_counter() - copy_started
            if checksums is not None:
                checksums.append(self.checksums.checksum(*_checksum_views(piece)))
        self.copy_s += copy_s
        return checksums

    def _copy_on_stream(self, job: _CopyJob) -> None:
        """Issue ``job``'s copies on the side stream after its ready event, in batches
        with at most one per event of the ring queued, and wait for them, sleeping
        (blocking events) instead of spinning a core."""
        batches = job.copies.batches
        assert self.stream is not None and job.ready is not None and batches is not None
        started = torch.cuda.Event(enable_timing=True)
        done = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(job.ready)
            started.record(self.stream)
            batches.issue(job.targets, self._queued)
            done.record(self.stream)
        done.synchronize()
        self.copy_s += started.elapsed_time(done) / 1e3

    def _checksum_loop(self) -> None:
        """The checksum thread: every piece of each copied snapshot (except one whose
        copy a simulated failure cut short), large ones split over :attr:`checksums`."""
        assert self._to_checksum is not None  # the thread runs only with its queue
        while (item := self._to_checksum.get()) is not None:
            self._checksum_copied(*item)

    def _checksum_copied(self, snapshot: Snapshot, usable: bool) -> None:
        """Checksum ``snapshot`` if ``usable``, then tell the replication it is ready."""
        started = time.thread_time()
        if usable:
            try:
                self._checksum(snapshot)
            except Exception as error:  # pieces left without checksums are refused
                self.failure = self.failure or error
        self.checksum_cpu_s += time.thread_time() - started
        snapshot.set_checksummed()

    def _checksum(self, snapshot: Snapshot) -> None:
        """Checksum every piece of ``snapshot``."""
        pieces = list(snapshot.pieces.values())
        self._record_checksums(pieces, self.checksums.checksum_many(
            [_checksum_views(piece) for piece in pieces]))

    def _record_checksums(self, pieces: list[SnapshotPiece], checksums: list[int]) -> None:
        """Give each piece its checksum, all of a snapshot's at once (none if any failed)."""
        for piece, checksum in zip(pieces, checksums, strict=True):
            piece.checksum = checksum
        self.pieces_checksummed += len(pieces)


def _checksum_views(piece: SnapshotPiece) -> tuple[list[memoryview] | tuple[memoryview, ...], int]:
    """What ``piece``'s checksum reads (its buffers' prepared views where it has them) and
    the names' checksum that comes first."""
    return tensor_views(piece.tensors) if piece.buffers is None else piece.buffers.checksum_views


def _metadata_to_host(metadata: dict[str, Any]) -> None:
    """Replace device tensors in ``metadata`` (the clip coefficient) by pinned host copies
    issued on the current stream: a ``.cpu()`` on the training thread would wait for the
    device every iteration. Readers wait for the snapshot's copies, which start after them."""
    for key, value in metadata.items():
        if isinstance(value, torch.Tensor) and value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
            metadata[key] = host
