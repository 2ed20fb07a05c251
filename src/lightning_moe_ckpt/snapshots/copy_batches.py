"""Device-to-host snapshot copies cut into batches, so that they need not hold up the
training stream's own copies.

Every device-to-host copy of a GPU goes through its copy engine, whichever stream issued
it. Issued at once, a 4 GB snapshot queues ahead of any small device-to-host copy the
training stream makes before it ends: a MoE layer's routing counts (``.tolist()``, one per
layer and micro-batch), a loss read for logging. On an H200 the first such read then
waited for the rest of the snapshot: a 4 GiB copy added 71 ms to a stand-in iteration of
87 ms (``recipes/copy_queue_probe.py``), in batches of 8-64 MiB with two queued 0.4-2.1 ms.
In batches the copy itself ran at about half the speed, though, and on the sized GPT-MoE
one run with 8 MiB batches was no faster than one without. So the engine issues a
snapshot at once by default (:data:`COPY_BATCH_BYTES` None); batches of about that many
bytes, at most :data:`COPY_BATCHES_IN_FLIGHT` queued, are there to be measured.

Batches are cut once per copy list (the plan repeats every W iterations); a tensor larger
than a batch is split into contiguous slices. Per iteration the copy thread only slices
the host targets of split tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

COPY_BATCH_BYTES: int | None = None  # None: a snapshot's copies in one batch
COPY_BATCHES_IN_FLIGHT = 2


@dataclass(frozen=True)
class CopySegment:
    """A copy's share of a batch: tensor ``index`` of the copy list whole (``stop`` is
    None), or the elements ``[start, stop)`` of it flattened."""

    index: int
    start: int = 0
    stop: int | None = None

    def of(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """This segment of ``tensors[index]``."""
        tensor = tensors[self.index]
        return tensor if self.stop is None else tensor.view(-1)[self.start:self.stop]


@dataclass(frozen=True, eq=False)
class CopyBatches:
    """A copy list's sources cut into batches of about ``batch_bytes`` each, in order."""

    segments: tuple[tuple[CopySegment, ...], ...]
    sources: tuple[list[torch.Tensor], ...]  # each batch's source views, made once

    @classmethod
    def of(cls, sources: Sequence[torch.Tensor], batch_bytes: int | None) -> CopyBatches:
        """Batches of ``sources``: whole tensors fill a batch up to ``batch_bytes``; a
        contiguous tensor that does not fit the rest of one is split into slices (a
        non-contiguous one, which cannot be flattened without a copy, goes whole).
        ``batch_bytes`` None: one batch of every tensor whole."""
        if batch_bytes is None:
            whole = tuple(CopySegment(index) for index in range(len(sources)))
            return cls((whole,) if whole else (), ([*sources],) if whole else ())
        if batch_bytes <= 0:
            raise ValueError(f"copy batch bytes must be positive, got {batch_bytes}")
        batches: list[tuple[CopySegment, ...]] = []
        current: list[CopySegment] = []
        room = batch_bytes
        for index, source in enumerate(sources):
            size = source.element_size()
            numel = source.numel()
            if numel * size <= room or not source.is_contiguous():
                current.append(CopySegment(index))
                room -= numel * size
            else:
                start = 0
                while start < numel:
                    if room < size and current:
                        batches.append(tuple(current))
                        current, room = [], batch_bytes
                    # At least one element: a batch may be smaller than an element.
                    stop = min(numel, start + max(1, room // size))
                    current.append(CopySegment(index, start, stop))
                    room -= (stop - start) * size
                    start = stop
            if room <= 0:
                batches.append(tuple(current))
                current, room = [], batch_bytes
        if current:
            batches.append(tuple(current))
        segments = tuple(batches)
        return cls(segments, tuple([s.of(sources) for s in batch] for batch in segments))

    def targets(self, targets: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
        """Each batch's target views of ``targets`` (contiguous host buffers, in the
        sources' order)."""
        for batch in self.segments:
            yield [segment.of(targets) for segment in batch]

    def issue(self, targets: Sequence[torch.Tensor], ring: Sequence[torch.cuda.Event]) -> None:
        """Issue the copies into ``targets`` on the current CUDA stream, batch by batch,
        at most ``len(ring)`` queued: before each batch, wait (a blocking event sleeps) for
        the one ``len(ring)`` batches before it. Returns once the last batch is queued."""
        pairs = zip(self.targets(targets), self.sources, strict=True)
        for number, (views, sources) in enumerate(pairs):
            slot = ring[number % len(ring)]
            if number >= len(ring):
                slot.synchronize()  # that batch is done: room in the queue
            # One call per batch: the launches are made in C++, not per tensor here.
            torch._foreach_copy_(views, sources, non_blocking=True)
            slot.record()
