"""Upstream log: host copies of everything a rank sends across pipeline boundaries.

:class:`UpstreamLog` is a :data:`~lightning_moe_ckpt.parallel.pipeline.BoundaryHook`: appended
to ``MoEParallelCore.boundary_hooks`` before the engine is built, it keeps a host copy of
every activation the rank sends downstream and every gradient it sends upstream, tagged
``(iteration, micro-batch, stage)``, plus stage 0's input batch, the last stage's labels
and the per-iteration scalars replay cannot recompute locally (clip coefficient, loss
scale, learning rate). Iterations are 0-based optimizer-step indices; negative ones are
evaluation and are never logged. Copies go into host buffers from a reusable pool, so that
steady-state logging allocates nothing: CPU tensors are copied on the spot (a
non-contiguous one is cloned, keeping its strides); CUDA tensors are copied on a dedicated
side stream into pinned buffers, ordered after an event recorded on the producing stream,
so the main thread never blocks (the sender only reads a tensor it sent, so nothing
overwrites it before the copy ran);
:meth:`UpstreamLog.wait` (and every lookup) completes outstanding copies. Entries are freed
by :meth:`UpstreamLog.release_before` when a newer window persists, and :meth:`UpstreamLog.drop`
models what a failed rank loses. Logging an entry again (replay regenerating a lost log)
replaces it.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_moe_ckpt.parallel.pipeline import BoundaryEvent, BoundaryHook

Kind = Literal["activation", "gradient"]
Tensors = tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class LoggedBatch:
    """Stage 0's input tokens and/or the last stage's labels for one iteration.

    Attributes:
        inputs: Stage 0's input tokens (host copy); ``None``: not logged on this rank.
        targets: The last stage's labels (host copy); ``None``: not logged on this rank.
    """

    inputs: torch.Tensor | None
    targets: torch.Tensor | None


@dataclass(frozen=True)
class IterationScalars:
    """Per-iteration values replay must reuse rather than recompute (host copies).

    Attributes:
        clip_coef: The gradient-clipping coefficient the iteration applied.
        loss_scale: The loss scale of the iteration.
        lr: The learning rate of the iteration's optimizer step.
    """

    clip_coef: torch.Tensor | float
    loss_scale: torch.Tensor | float
    lr: float


class LogBufferPool:
    """The log's reusable host buffers, keyed by shape and dtype (pinned on CUDA machines).

    Snapshots have their own pool, :class:`~lightning_moe_ckpt.snapshots.snapshot.HostBufferPool`,
    which hands out a set of buffers per piece layout.

    Every iteration logs tensors of the same shapes, and an allocation per send would be a
    hot-path allocation (a large one a fresh mapping the kernel faults in page by page;
    a pinned one slow and fragmenting host memory), so buffers freed by
    :meth:`UpstreamLog.release_before` are kept for the next iterations' identical shapes.

    Args:
        pin_memory: Whether new buffers are pinned host memory.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = (
            defaultdict(list))
        self.allocated_bytes = 0
        self.spare_bytes = 0  # of the free buffers, kept for reuse

    def acquire(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer shaped like ``like`` (reused when one is free)."""
        free = self._free[(tuple(like.shape), like.dtype)]
        if free:
            self.spare_bytes -= _nbytes(like)
            return free.pop()
        self.allocated_bytes += _nbytes(like)
        return torch.empty(like.shape, dtype=like.dtype, device="cpu",
                           pin_memory=self.pin_memory)

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`acquire`."""
        self._free[(tuple(buffer.shape), buffer.dtype)].append(buffer)
        self.spare_bytes += _nbytes(buffer)


@dataclass
class _Entry:
    tensors: Tensors
    pooled: tuple[bool, ...]  # which host tensors came from the pool
    nbytes: int


@dataclass
class _Scalars:
    entry: _Entry  # host copies of the values given as tensors
    floats: tuple[float | None, ...]  # the values given as Python numbers
    lr: float


class UpstreamLog:
    """Host-side log of one rank's boundary sends, inputs/labels and scalars.

    Args:
        pin_memory: Whether its host buffers are pinned; ``None``: pinned when CUDA is
            available.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        cuda = torch.cuda.is_available()
        self.pool = LogBufferPool(cuda if pin_memory is None else pin_memory)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # (kind, iteration, stage, microbatch) -> entry
        self._boundary: dict[tuple[Kind, int, int, int], _Entry] = {}
        self._inputs: dict[int, tuple[_Entry, _Entry]] = {}
        self._scalars: dict[int, _Scalars] = {}
        self._pending: dict[int, list[torch.cuda.Event]] = defaultdict(list)
        # Release listeners may run on a background thread while hooks fire on the main one.
        self._lock = threading.RLock()

    # -- recording ---------------------------------------------------------------------

    def __call__(self, event: BoundaryEvent) -> None:
        """The boundary hook: log ``event`` (evaluation events are ignored)."""
        if event.iteration < 0:
            return
        entry = self._copy(event.iteration, event.tensors)
        with self._lock:
            key = (event.kind, event.iteration, event.stage, event.microbatch)
            self._replace(self._boundary, key, entry)

    def attach(self, hooks: list[BoundaryHook]) -> None:
        """Append this log to a hook list (e.g. ``MoEParallelCore.boundary_hooks``)."""
        hooks.append(self)

    def log_inputs(self, iteration: int, inputs: torch.Tensor | None,
                   targets: torch.Tensor | None) -> None:
        """Log stage 0's input batch and/or the last stage's labels for ``iteration``."""
        if iteration < 0:
            return
        new_inputs = self._copy(iteration, (inputs,))
        new_targets = self._copy(iteration, (targets,))
        with self._lock:
            old = self._inputs.pop(iteration, None)
            if old is not None:
                self.wait(before=iteration + 1)  # no copy may still write into old buffers
                self._free(old[0])
                self._free(old[1])
            self._inputs[iteration] = (new_inputs, new_targets)

    def log_scalars(self, iteration: int, clip_coef: torch.Tensor | float,
                    loss_scale: torch.Tensor | float, lr: float) -> None:
        """Log the scalars replay of ``iteration`` must reuse. Tensors are copied to the
        host asynchronously, so a device-side clip coefficient costs no sync here."""
        if iteration < 0:
            return
        values = (clip_coef, loss_scale)
        entry = self._copy(iteration, tuple(v if isinstance(v, torch.Tensor) else None
                                            for v in values))
        floats = tuple(None if isinstance(v, torch.Tensor) else float(v) for v in values)
        with self._lock:
            old = self._scalars.pop(iteration, None)
            if old is not None:
                self.wait(before=iteration + 1)  # no copy may still write into old buffers
                self._free(old.entry)
            self._scalars[iteration] = _Scalars(entry, floats, float(lr))

    def _copy(self, iteration: int, tensors: Tensors) -> _Entry:
        copies: list[torch.Tensor | None] = []
        pooled: list[bool] = []
        on_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        with torch.no_grad():
            for tensor in tensors:
                if tensor is None:
                    copies.append(None)
                    pooled.append(False)
                    continue
                source = tensor.detach()
                cuda = source.device.type == "cuda"
                host_contiguous = source.device.type == "cpu" and source.is_contiguous()
                if not (cuda or host_contiguous):
                    copies.append(source.clone())  # keeps its strides (pooled: contiguous)
                    pooled.append(False)
                    continue
                with self._lock:
                    buffer = self.pool.acquire(source)
                if cuda:
                    on_device.setdefault(source.device, []).append((source, buffer))
                else:
                    buffer.copy_(source)
                copies.append(buffer)
                pooled.append(True)
        for device, pairs in on_device.items():
            self._issue_device_copies(iteration, device, pairs)
        nbytes = sum(_nbytes(c) for c in copies if c is not None)
        return _Entry(tuple(copies), tuple(pooled), nbytes)

    def _issue_device_copies(self, iteration: int, device: torch.device,
                             pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        # The copy must see the tensor as the producing stream leaves it: order the side
        # stream after an event recorded there instead of synchronising the host.
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            stream.wait_event(produced)
            for source, buffer in pairs:
                buffer.copy_(source, non_blocking=True)
                # Keep the caching allocator from reusing the memory before the copy ran,
                # even if the pipeline frees the tensor as soon as it is sent.
                source.record_stream(stream)
            done = torch.cuda.Event()
            done.record(stream)
        with self._lock:
            self._reap()
            self._pending[iteration].append(done)

    def _reap(self) -> None:
        """Forget completed copies, so the pending list stays short."""
        for iteration in list(self._pending):
            still = [done for done in self._pending[iteration] if not done.query()]
            if still:
                self._pending[iteration] = still
            else:
                del self._pending[iteration]

    # -- completion and freeing --------------------------------------------------------

    def wait(self, before: int | None = None) -> None:
        """Block until outstanding copies are in host memory (only those of iterations
        older than ``before`` when given)."""
        # Synchronised under the lock: another thread's wait must not return while a copy
        # this one took off the pending list is still running.
        with self._lock:
            for iteration in [i for i in self._pending if before is None or i < before]:
                for done in self._pending.pop(iteration):
                    done.synchronize()

    def release_before(self, iteration: int) -> None:
        """Free every entry of iterations older than ``iteration`` (a newer window starting
        at ``iteration`` has persisted; ``SnapshotStore.release_listeners`` calls this)."""
        with self._lock:
            # A buffer may go back to the pool only once no copy still writes into it.
            self.wait(before=iteration)
            for key in [k for k in self._boundary if k[1] < iteration]:
                self._free(self._boundary.pop(key))
            for it in [i for i in self._inputs if i < iteration]:
                inputs, targets = self._inputs.pop(it)
                self._free(inputs)
                self._free(targets)
            for it in [i for i in self._scalars if i < iteration]:
                self._free(self._scalars.pop(it).entry)

    def drop(self) -> None:
        """Lose everything, as a failed rank does (pooled buffers go too)."""
        with self._lock:
            self.wait()
            self._boundary.clear()
            self._inputs.clear()
            self._scalars.clear()
            self.pool = LogBufferPool(self.pool.pin_memory)

    def _free(self, entry: _Entry) -> None:
        for tensor, pooled in zip(entry.tensors, entry.pooled, strict=True):
            if pooled and tensor is not None:
                self.pool.release(tensor)

    def _replace(self, table: dict[tuple[Kind, int, int, int], _Entry],
                 key: tuple[Kind, int, int, int], entry: _Entry) -> None:
        old = table.pop(key, None)
        if old is not None:
            self.wait(before=key[1] + 1)  # no copy may still write into old buffers
            self._free(old)
        table[key] = entry

    # -- lookups -----------------------------------------------------------------------
    # Lookups return the log's own host tensors (no copy): they stay valid until
    # release_before() or drop() frees their iteration, whose buffers may then be reused.

    def activations(self, iteration: int, stage: int) -> dict[int, Tensors]:
        """Activations ``stage`` sent downstream in ``iteration``, by micro-batch."""
        return self._lookup("activation", iteration, stage)

    def gradients(self, iteration: int, stage: int) -> dict[int, Tensors]:
        """Input gradients ``stage`` sent upstream in ``iteration``, by micro-batch."""
        return self._lookup("gradient", iteration, stage)

    def _lookup(self, kind: Kind, iteration: int, stage: int) -> dict[int, Tensors]:
        self.wait(before=iteration + 1)
        with self._lock:
            found = {k[3]: e.tensors for k, e in self._boundary.items()
                     if k[0] == kind and k[1] == iteration and k[2] == stage}
        return dict(sorted(found.items()))

    def inputs(self, iteration: int) -> LoggedBatch | None:
        """The logged input batch and labels of ``iteration``, if any."""
        self.wait(before=iteration + 1)
        with self._lock:
            found = self._inputs.get(iteration)
        if found is None:
            return None
        return LoggedBatch(found[0].tensors[0], found[1].tensors[0])

    def scalars(self, iteration: int) -> IterationScalars | None:
        """The logged scalars of ``iteration``, if any."""
        self.wait(before=iteration + 1)
        with self._lock:
            found = self._scalars.get(iteration)
        if found is None:
            return None
        clip, scale = (t if t is not None else f
                       for t, f in zip(found.entry.tensors, found.floats, strict=True))
        assert clip is not None and scale is not None
        return IterationScalars(clip, scale, found.lr)

    def iterations(self) -> list[int]:
        """Iterations with at least one logged entry, ascending."""
        with self._lock:
            seen = {k[1] for k in self._boundary} | set(self._inputs) | set(self._scalars)
        return sorted(seen)

    def nbytes(self) -> int:
        """Host bytes held by logged entries (for metrics; pool spares not counted)."""
        with self._lock:
            total = sum(e.nbytes for e in self._boundary.values())
            total += sum(a.nbytes + b.nbytes for a, b in self._inputs.values())
            total += sum(s.entry.nbytes for s in self._scalars.values())
        return total

    def host_bytes(self) -> int:
        """Host bytes the log occupies: its entries and the pool's spare buffers, which
        released iterations left for the next ones to reuse."""
        with self._lock:
            return self.nbytes() + self.pool.spare_bytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
