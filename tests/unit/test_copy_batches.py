"""The batches the copy thread issues a snapshot's device copies in: every element of
every source exactly once, in order, no batch over its size unless one tensor that cannot
be split is, and copying batch by batch reproduces the sources bitwise."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_moe_ckpt.snapshots.copy_batches import CopyBatches, CopySegment


def _sources() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=generator),  # 4000 bytes: split
            torch.randn(3, generator=generator).to(torch.float64),
            torch.randn(0),
            torch.randint(0, 100, (7, 50), generator=generator, dtype=torch.int16),
            torch.randn(40, 30, generator=generator).t(),  # not contiguous: whole
            torch.randn(1, generator=generator).to(torch.bfloat16)]


@pytest.mark.parametrize("batch_bytes", [1, 6, 700, 1024, 4000, 10**6])
def test_batches_cover_every_element_once_in_order(batch_bytes: int) -> None:
    sources = _sources()
    batches = CopyBatches.of(sources, batch_bytes)
    covered: dict[int, list[tuple[int, int]]] = {}
    for batch in batches.segments:
        assert batch, "no empty batch"
        size = 0
        for segment in batch:
            part = segment.of(sources)
            size += part.numel() * part.element_size()
            numel = sources[segment.index].numel()
            stop = numel if segment.stop is None else segment.stop
            covered.setdefault(segment.index, []).append((segment.start, stop))
        splittable = all(sources[s.index].is_contiguous() for s in batch)
        element = max(sources[s.index].element_size() for s in batch)
        if splittable:  # at most one element over: a batch smaller than an element
            assert size <= max(batch_bytes, element), (batch, size)
    order = [s.index for batch in batches.segments for s in batch]
    assert order == sorted(order)
    for index, source in enumerate(sources):
        ranges = covered[index]
        assert ranges[0][0] == 0 and ranges[-1][1] == source.numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


@pytest.mark.parametrize("batch_bytes", [1, 700, 4000, 10**6, None])
def test_copying_batch_by_batch_is_exact(batch_bytes: int | None) -> None:
    sources = _sources()
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    batches = CopyBatches.of(sources, batch_bytes)
    for views, parts in zip(batches.targets(targets), batches.sources, strict=True):
        torch._foreach_copy_(views, parts)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(source, target)
    if batch_bytes is not None and batch_bytes < 4000:
        assert len(batches.segments) > 1


def test_no_batch_size_is_one_batch_of_every_tensor_whole() -> None:
    sources = _sources()
    batches = CopyBatches.of(sources, None)
    assert batches.segments == (tuple(CopySegment(i) for i in range(len(sources))),)
    assert all(a is b for a, b in zip(batches.sources[0], sources, strict=True))
    assert CopyBatches.of([], None).segments == ()


def test_the_batch_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="copy batch bytes must be positive, got 0"):
        CopyBatches.of(_sources(), 0)


class _RecordingEvent:
    """Stands in for a blocking CUDA event: logs when it is waited for and recorded."""

    def __init__(self, name: int, log: list[tuple[str, int]]) -> None:
        self.name, self.log = name, log

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))

    def record(self) -> None:
        self.log.append(("record", self.name))


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_issue_keeps_at_most_the_ring_queued(in_flight: int) -> None:
    """Before batch n is issued, batch n - len(ring) was waited for; each batch records
    its event once issued; the copies are exact."""
    sources = _sources()
    targets = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    batches = CopyBatches.of(sources, 700)
    log: list[tuple[str, int]] = []
    ring = [_RecordingEvent(i, log) for i in range(in_flight)]
    batches.issue(targets, ring)  # type: ignore[arg-type]  # CPU copies, stand-in events
    expected: list[tuple[str, int]] = []
    for number in range(len(batches.segments)):
        if number >= in_flight:
            expected.append(("wait", number % in_flight))
        expected.append(("record", number % in_flight))
    assert log == expected
    assert len(batches.segments) > in_flight  # the ring did wrap
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(source, target)
